"""A JSON Schema made into one xgrammar enforces exactly, or refused: no keyword is silently ignored.

xgrammar's converter (0.2.9) compiles most of JSON Schema but quietly drops some keywords, so an
output that breaks them would come back as if it were valid (each checked by compiling a schema and
asking its matcher about a violating instance, tests/unit/test_json_schema.py). `prepare(schema)`
walks the whole schema ($defs, properties, items, every anyOf / oneOf / allOf branch) and returns
the schema xgrammar compiles, or raises a ValidationError naming the keyword and where it is.

    enforced as written   type, properties, required, additionalProperties, patternProperties,
                          minProperties, maxProperties, items, prefixItems, minItems, maxItems,
                          minLength, maxLength, pattern, format (FORMATS), minimum, maximum,
                          exclusiveMinimum, exclusiveMaximum, multipleOf (integers), anyOf,
                          $ref (within the schema: "#" or "#/..."), $defs, definitions
    rewritten             allOf and $ref with keywords beside it (merged into one schema where
                          that is exact, below), oneOf (as anyOf when no value can match two
                          branches: different types, or a required property whose const / enum
                          values differ), anyOf with keywords beside it (each branch takes them),
                          enum / const with keywords beside it (the values that break them left
                          out), a required property not in properties (added), unevaluatedItems /
                          unevaluatedProperties (as items / additionalProperties: every applicator
                          is merged first), pattern (JSON Schema searches; xgrammar matches whole
                          strings: an unanchored end gets `.*`), keywords without `type` (the type
                          they constrain is made explicit), draft 4-7 forms (items as a list,
                          additionalItems, boolean exclusiveMinimum / exclusiveMaximum)
    refused               not, if / then / else, contains / minContains / maxContains,
                          uniqueItems (true; with maxItems > 1), dependentRequired /
                          dependentSchemas / dependencies, $dynamicRef / $recursiveRef, a $ref
                          outside the schema, a oneOf whose branches may overlap, an allOf (or
                          $ref with keywords beside it) whose parts cannot be merged exactly,
                          multipleOf on numbers, pattern beside minLength / maxLength / format,
                          format beside minLength / maxLength, an unknown format, propertyNames
                          beside properties, a regex with lookaround or backreferences
    dropped               annotations (title, description, default, examples, ...) and keys
                          JSON Schema does not define (`x-...`, OpenAPI's `nullable`): no
                          validator reads them either

The output may be stricter than the schema (a type made explicit from its keywords), never looser.
Size bounds (SchemaLimits, json_schema_limits.py) are checked on the way, before anything compiles.
"""
from __future__ import annotations

import math
import re
from typing import Any
from urllib.parse import unquote

from backend.core import json_schema_merge as merge
from backend.core.json_schema_limits import SchemaLimits, check_repetitions
from backend.core.json_schema_merge import (ARRAY_KEYWORDS, FIELD, NUMBER_KEYWORDS, OBJECT_KEYWORDS, STRING_KEYWORDS,
                                            refuse)
from backend.core.json_schema_patterns import FORMAT_PATTERNS, FORMATS, UNSUPPORTED_REGEX, search_as_match
from backend.errors import ValidationError

STRICT_KEY = "x-strict"  # at a `json` schema's root: false reads it as JSON Schema does (grammar_compiler.py)
ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$comment", "deprecated", "readOnly", "writeOnly", "$schema",
    "$anchor", "$vocabulary", "contentEncoding", "contentMediaType", "contentSchema", "$id",
})
REFUSED = frozenset({"not", "if", "then", "else", "contains", "minContains", "maxContains", "dependentRequired",
                     "dependentSchemas", "dependencies", "$dynamicRef", "$dynamicAnchor", "$recursiveRef",
                     "$recursiveAnchor"})
KEYWORDS = ANNOTATIONS | REFUSED | frozenset(
    STRING_KEYWORDS + NUMBER_KEYWORDS + ARRAY_KEYWORDS + OBJECT_KEYWORDS
    + ("type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions"))
SCHEMA = (dict, bool)
SHAPES: dict[str, tuple[type | tuple[type, ...], str]] = {  # keyword -> (its value's types, in words)
    "type": ((str, list), "a type name or a list of them"), "format": (str, "a string"), "pattern": (str, "a string"),
    "$ref": (str, "a string"), "enum": (list, "a list"), "properties": (dict, "an object"),
    "patternProperties": (dict, "an object"), "required": (list, "a list of names"), "prefixItems": (list, "a list"),
    "items": ((dict, bool, list), "a schema"), "additionalProperties": (SCHEMA, "a schema"),
    "propertyNames": (SCHEMA, "a schema"), "unevaluatedProperties": (SCHEMA, "a schema"),
    "unevaluatedItems": (SCHEMA, "a schema"), "additionalItems": (SCHEMA, "a schema"),
    "anyOf": (list, "a list of schemas"), "oneOf": (list, "a list of schemas"),
    **{k: ((int, float), "a number") for k in NUMBER_KEYWORDS + ("minLength", "maxLength", "minItems", "maxItems",
                                                                "minProperties", "maxProperties")},
}
MAX_MULTIPLES = 256  # an integer's multipleOf between bounds becomes the enum of these at most
MAX_MERGE_DEPTH = 16  # allOf / $ref levels merged into one schema


def prepare(schema: Any, limits: SchemaLimits = SchemaLimits(), strict: bool = True) -> Any:
    """The schema xgrammar compiles for `schema` (a dict or a bool); ValidationError if a keyword
    it holds cannot be enforced or the schema is past `limits` (`strict`: compiled with no
    properties beyond the schema's unless it says so)."""
    walker = _Walker(schema, limits, strict)
    out = walker.prepare(schema, "#", 0)
    if walker.defs and isinstance(out, dict):
        out = {"$defs": walker.defs} | out
    return out


class _Walker:
    def __init__(self, root: Any, limits: SchemaLimits, strict: bool):
        self.root = root
        self.limits = limits
        self.strict = strict
        self.max_properties = limits.max_properties if strict else limits.max_free_properties
        self.properties = 0  # of every object so far
        self.defs: dict[str, Any] = {}  # output name -> prepared schema
        self.ref_names: dict[str, str] = {}  # JSON pointer in the input -> its name in defs
        self.nodes = 0
        self.repetition = 0  # the patterns' sizes so far (check_repetitions)

    def count(self, n: int, path: str) -> None:
        self.nodes += n
        if self.nodes > self.limits.max_nodes:
            raise ValidationError(FIELD, f"the schema is too large: more than {self.limits.max_nodes} subschemas, "
                                         f"properties and enum values (at {path})")

    def prepare(self, schema: Any, path: str, depth: int) -> Any:
        self.count(1, path)
        if depth > self.limits.max_depth:
            raise ValidationError(FIELD, f"the schema nests deeper than {self.limits.max_depth} levels (at {path})")
        if isinstance(schema, bool):
            return schema
        schema = self.flatten(schema, path)  # allOf and $ref-with-siblings merged, annotations gone
        if isinstance(schema, bool):
            return schema
        for keyword, value in schema.items():
            if keyword in REFUSED:
                raise refuse(keyword, path)
            if keyword in SHAPES and not isinstance(value, SHAPES[keyword][0]) \
                    or keyword in ("required", "type") and isinstance(value, list) \
                    and not all(isinstance(v, str) for v in value):
                raise ValidationError(FIELD, f"{keyword} must be {SHAPES[keyword][1]} (at {path})")
        if "enum" in schema or "const" in schema:
            return self.enum(schema, path)
        if "oneOf" in schema or "anyOf" in schema:
            return self.branches(schema, path, depth)
        if "$ref" in schema:
            return {"$ref": self.ref(schema["$ref"], path, depth)}
        schema = {k: v for k, v in schema.items() if k not in ("$defs", "definitions")}
        _infer_type(schema)
        _draft7_forms(schema, path)
        self.strings(schema, path)
        _numbers(schema, path)
        self.arrays(schema, path, depth)
        self.objects(schema, path, depth)
        return schema

    def flatten(self, schema: Any, path: str, depth: int = 0) -> Any:
        """`schema` without allOf, or a $ref beside other keywords: its parts merged into one, exactly
        (json_schema_merge.merge), its annotations and keys JSON Schema does not define dropped."""
        self.count(1, path)
        if isinstance(schema, bool):
            return schema
        if not isinstance(schema, dict):
            raise ValidationError(FIELD, f"a JSON Schema must be an object or a boolean, got {type(schema).__name__} "
                                         f"(at {path})")
        if depth > MAX_MERGE_DEPTH:
            raise ValidationError(FIELD, f"allOf and $ref nest more than {MAX_MERGE_DEPTH} levels deep where they "
                                         f"must be merged (at {path})")
        out = {k: v for k, v in schema.items() if k in KEYWORDS and k not in ANNOTATIONS}
        parts = []
        if "allOf" in out:
            branches = out.pop("allOf")
            if not isinstance(branches, list) or not branches:
                raise ValidationError(FIELD, f"allOf must be a non-empty list (at {path})")
            parts = [self.flatten(b, f"{path}/allOf/{i}", depth + 1) for i, b in enumerate(branches)]
        if "$ref" in out and (parts or set(out) - {"$ref", "$defs", "definitions"}):
            ref = out.pop("$ref")
            parts.append(self.flatten(self.resolve(ref, path), str(ref), depth + 1))
        for part in parts:
            out = merge.merge(out, part, path)
        return out

    def resolve(self, ref: Any, path: str) -> Any:
        """The schema a $ref points at, in the input."""
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise refuse("$ref", path, f"to {str(ref)[:80]!r}: only references within the schema (\"#/...\") are")
        target = self.root
        for token in ref[2:].split("/") if ref != "#" else []:
            token = unquote(token).replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and token in target:
                target = target[token]
            elif isinstance(target, list) and token.isdigit() and int(token) < len(target):
                target = target[int(token)]
            else:
                raise ValidationError(FIELD, f"$ref {ref!r} points at nothing (at {path})")
        return target

    def ref(self, ref: str, path: str, depth: int) -> str:
        """The output reference for an input one; its target is prepared once."""
        if ref not in self.ref_names:
            name = f"s{len(self.ref_names)}"
            self.ref_names[ref] = name
            self.defs[name] = True  # a placeholder while a recursive schema refers to itself
            self.defs[name] = self.prepare(self.resolve(ref, path), ref, depth + 1)
        return f"#/$defs/{self.ref_names[ref]}"

    def enum(self, schema: dict, path: str) -> dict:
        values = [schema["const"]] if "const" in schema else schema["enum"]
        if not isinstance(values, list) or not values:
            raise ValidationError(FIELD, f"enum must be a non-empty list (at {path})")
        if "const" in schema and "enum" in schema:
            values = [v for v in values if any(merge.same(v, e) for e in schema["enum"])]
        self.count(len(values), path)
        rest = {k: v for k, v in schema.items() if k not in ("enum", "const", "$defs", "definitions")}
        kept = [v for v in values if merge.satisfies(v, rest, path)]
        if not kept:
            raise ValidationError(FIELD, f"no value of enum / const satisfies the keywords beside it (at {path})")
        return {"enum": kept}

    def branches(self, schema: dict, path: str, depth: int) -> dict:
        """anyOf / oneOf, each branch merged with the keywords beside it."""
        if "oneOf" in schema and "anyOf" in schema:
            raise refuse("oneOf", path, "beside anyOf")
        keyword = "oneOf" if "oneOf" in schema else "anyOf"
        branches = schema[keyword]
        if not isinstance(branches, list) or not branches:
            raise ValidationError(FIELD, f"{keyword} must be a non-empty list (at {path})")
        rest = {k: v for k, v in schema.items() if k not in (keyword, "$defs", "definitions")}
        merged = [self.flatten({"allOf": [rest, b]} if rest else b, f"{path}/{keyword}/{i}")
                  for i, b in enumerate(branches)]
        if keyword == "oneOf":
            merge.check_exclusive(self.resolve, merged, path)
        return {"anyOf": [self.prepare(b, f"{path}/{keyword}/{i}", depth + 1) for i, b in enumerate(merged)]}

    def strings(self, schema: dict, path: str) -> None:
        lengths = [k for k in ("minLength", "maxLength") if k in schema]
        for k in lengths:
            self.bounded(schema[k], k, path)
        if "pattern" in schema:
            if lengths or "format" in schema:
                raise refuse(lengths[0] if lengths else "format", path, "beside 'pattern'")
            schema["pattern"] = self.pattern(schema["pattern"], path)
        if schema.get("format") in FORMAT_PATTERNS:
            if lengths:
                raise refuse(lengths[0], path, "beside 'format'")
            schema["pattern"] = search_as_match(FORMAT_PATTERNS[schema.pop("format")])
        if "format" in schema:
            if schema["format"] not in FORMATS:
                raise refuse("format", path, f"with the value {str(schema['format'])[:40]!r}; supported: "
                                             f"{', '.join(sorted(FORMATS))}")
            if lengths:
                raise refuse(lengths[0], path, "beside 'format'")

    def pattern(self, pattern: Any, path: str) -> str:
        if not isinstance(pattern, str):
            raise ValidationError(FIELD, f"pattern must be a string (at {path})")
        if UNSUPPORTED_REGEX.search(pattern):
            raise refuse("pattern", path, "with lookaround, backreferences, \\b or \\p{...}")
        self.repetition += check_repetitions(pattern, f"pattern at {path}", self.limits)
        if self.repetition > self.limits.max_total_repetition:
            raise ValidationError(FIELD, f"the schema's patterns repeat too much: their counted repetitions expand to "
                                         f"more than {self.limits.max_total_repetition} items (at {path})")
        return search_as_match(pattern)

    def bounded(self, value: Any, keyword: str, path: str) -> None:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > self.limits.max_repetition:
            raise ValidationError(FIELD, f"{keyword} {value} is above {self.limits.max_repetition}, the largest "
                                         f"supported (at {path})")

    def arrays(self, schema: dict, path: str, depth: int) -> None:
        for k in ("minItems", "maxItems"):
            self.bounded(schema.get(k), k, path)
        unique = schema.pop("uniqueItems", False)
        if unique is not False and not (isinstance(schema.get("maxItems"), int) and schema["maxItems"] <= 1):
            raise refuse("uniqueItems", path)
        if "unevaluatedItems" in schema:  # every applicator is merged already: the same as items
            uneval = schema.pop("unevaluatedItems")
            schema.setdefault("items", uneval)
        arrays = schema.get("type") == "array" or "array" in _list(schema.get("type"))
        if arrays and "items" not in schema and "prefixItems" not in schema:
            schema["items"] = True  # strict or not, when the schema says nothing of the items
        if "items" in schema:
            schema["items"] = self.prepare(schema["items"], f"{path}/items", depth + 1)
        if "prefixItems" in schema:
            if not isinstance(schema["prefixItems"], list):
                raise ValidationError(FIELD, f"prefixItems must be a list (at {path})")
            schema["prefixItems"] = [self.prepare(s, f"{path}/prefixItems/{i}", depth + 1)
                                     for i, s in enumerate(schema["prefixItems"])]

    def objects(self, schema: dict, path: str, depth: int) -> None:
        if "unevaluatedProperties" in schema:  # as unevaluatedItems
            uneval = schema.pop("unevaluatedProperties")
            schema.setdefault("additionalProperties", uneval)
        properties = schema.get("properties", {})
        patterns = schema.get("patternProperties", {})
        required = schema.get("required", [])
        if not isinstance(properties, dict) or not isinstance(patterns, dict) or not isinstance(required, list):
            raise ValidationError(FIELD, f"properties and patternProperties must be objects, required a list (at {path})")
        if "propertyNames" in schema and (properties or patterns):
            raise refuse("propertyNames", path, "beside properties or patternProperties")
        self.count(len(properties) + len(patterns), path)
        self.properties += len(properties) + len(patterns)
        if self.properties > self.max_properties:
            raise ValidationError(FIELD, f"the schema has more than {self.max_properties} properties in all, the most "
                                         f"supported when {'' if self.strict else 'not '}strict (at {path})")
        properties = dict(properties)
        for name in required:  # a required name the properties leave out: its value is whatever else is allowed
            if isinstance(name, str) and name not in properties:
                properties[name] = self.extra_property(schema, name, path)
        if properties:
            schema["properties"] = {name: self.prepare(s, f"{path}/properties/{_escape(name)}", depth + 1)
                                    for name, s in properties.items()}
        if patterns:
            schema["patternProperties"] = {self.pattern(p, path): self.prepare(s, f"{path}/patternProperties", depth + 1)
                                           for p, s in patterns.items()}
        least = schema.get("minProperties", 0)
        objects = schema.get("type") == "object" or "object" in _list(schema.get("type"))
        if objects and not patterns and (not properties or isinstance(least, int) and least > len(properties)):
            schema.setdefault("additionalProperties", True)  # strict or not, when the schema lists no keys or too few
        for k in ("additionalProperties", "propertyNames"):
            if k in schema:
                schema[k] = self.prepare(schema[k], f"{path}/{k}", depth + 1)

    def extra_property(self, schema: dict, name: str, path: str) -> Any:
        for pattern, sub in schema.get("patternProperties", {}).items():
            if isinstance(pattern, str) and re.search(pattern, name):
                return sub
        extra = schema.get("additionalProperties", True)
        if extra is False:
            raise ValidationError(FIELD, f"required property {name!r} is not in properties and additionalProperties "
                                         f"is false: no output matches (at {path})")
        return extra


def _infer_type(schema: dict) -> None:
    """Keywords without `type` constrain only their own type's values, and xgrammar ignores them
    then: the types they name become explicit (stricter: other types are no longer produced)."""
    families = merge.inferred_types(schema)
    if "type" not in schema and families:
        schema["type"] = families[0] if len(families) == 1 else families


def _draft7_forms(schema: dict, path: str) -> None:
    """Draft 4-7 spellings as 2020-12's."""
    if isinstance(schema.get("items"), list):
        schema["prefixItems"] = schema.pop("items")
        if "additionalItems" in schema:
            schema["items"] = schema.pop("additionalItems")
    schema.pop("additionalItems", None)  # without a list of items it constrains nothing
    for exclusive, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(schema.get(exclusive), bool):
            if schema.pop(exclusive) and bound in schema:
                schema[exclusive] = schema.pop(bound)


def _numbers(schema: dict, path: str) -> None:
    for k in NUMBER_KEYWORDS:
        value = schema.get(k)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value)):
            raise ValidationError(FIELD, f"{k} must be a number (at {path})")
    integers = schema.get("type") == "integer"
    if "multipleOf" in schema:
        step = schema["multipleOf"]
        if not integers or step <= 0 or not float(step).is_integer():
            raise refuse("multipleOf", path, "except a positive whole number on type integer")
        schema["multipleOf"] = int(step)
        if any(k in schema for k in NUMBER_KEYWORDS[:4]):  # xgrammar drops multipleOf beside a bound
            return _multiples(schema, path)
    if integers:  # xgrammar takes whole bounds only: 1.5 <= n is 2 <= n
        for k, whole in (("minimum", math.ceil), ("maximum", math.floor)):
            if isinstance(schema.get(k), float):
                schema[k] = whole(schema[k])


def _list(value: Any) -> list:
    return value if isinstance(value, list) else []


def _multiples(schema: dict, path: str) -> None:
    """An integer's multipleOf beside its bounds, as the enum of the multiples in range."""
    lows = [math.ceil(schema["minimum"])] if "minimum" in schema else []
    lows += [math.floor(schema["exclusiveMinimum"]) + 1] if "exclusiveMinimum" in schema else []
    highs = [math.floor(schema["maximum"])] if "maximum" in schema else []
    highs += [math.ceil(schema["exclusiveMaximum"]) - 1] if "exclusiveMaximum" in schema else []
    step = schema["multipleOf"]
    if not lows or not highs or (min(highs) - max(lows)) // step > MAX_MULTIPLES:
        raise refuse("multipleOf", path, f"beside minimum / maximum unless both bound it to {MAX_MULTIPLES} values")
    low, high = max(lows), min(highs)
    values = list(range(low + (-low) % step, high + 1, step))
    if not values:
        raise ValidationError(FIELD, f"no multiple of {step} lies within the bounds: no output matches (at {path})")
    for k in NUMBER_KEYWORDS:
        schema.pop(k, None)
    schema["enum"] = values


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")
