"""Schema algebra for backend/core/json_schema.py: two schemas merged into one that both describe
(allOf), whether two oneOf branches can both match a value, whether a value satisfies a few
keywords (an enum's values checked against the keywords beside it).

Every function is exact or refuses: a merge it cannot make exactly, a oneOf it cannot prove
exclusive, a keyword it cannot check beside an enum, is a ValidationError naming the keyword.
"""
from __future__ import annotations

import math
import re
from typing import Any, Callable

from backend.errors import ValidationError

FIELD = "guided_decoding"
MAX_ANYOF_PRODUCT = 64  # branches of two anyOf merged in an allOf (one per pair)
LOWER_BOUNDS = ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties")
UPPER_BOUNDS = ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties")
ALL_TYPES = frozenset({"null", "boolean", "object", "array", "string", "integer", "number"})  # number: not integer
OBJECT_EXTRAS = ("additionalProperties", "patternProperties", "unevaluatedProperties", "propertyNames")
STRING_KEYWORDS = ("minLength", "maxLength", "pattern", "format")
NUMBER_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
ARRAY_KEYWORDS = ("items", "prefixItems", "additionalItems", "minItems", "maxItems", "unevaluatedItems", "uniqueItems")
OBJECT_KEYWORDS = ("properties", "required", "additionalProperties", "patternProperties", "propertyNames",
                   "minProperties", "maxProperties", "unevaluatedProperties")
FAMILIES = {"string": STRING_KEYWORDS, "number": NUMBER_KEYWORDS, "array": ARRAY_KEYWORDS, "object": OBJECT_KEYWORDS}
Resolve = Callable[[Any, str], Any]  # ($ref, where) -> the schema it points at


def refuse(keyword: str, path: str, why: str = "") -> ValidationError:
    return ValidationError(FIELD, f"JSON Schema keyword {keyword!r} is not supported{' ' + why if why else ''} "
                                  f"(at {path})")


def merge(a: Any, b: Any, path: str) -> Any:
    """One schema that a value satisfies exactly when it satisfies both `a` and `b` (each without
    allOf or a $ref beside other keywords)."""
    if a is True or b is False:
        return b
    if b is True or a is False:
        return a
    out = dict(a)
    for key, theirs in b.items():
        if key not in out:
            out[key] = theirs
        else:
            out[key] = _merge_keyword(key, out[key], theirs, a, b, path)
    for side, other in ((a, b), (b, a)):  # additionalProperties (and the like) of one side judge the other's
        if any(k in side for k in OBJECT_EXTRAS[:2]) and not set(other.get("properties", {})) <= set(side.get("properties", {})):
            raise refuse("allOf", path, "where one part's additionalProperties or patternProperties would "
                                        "judge another part's properties")
    return out


def _merge_keyword(key: str, mine: Any, theirs: Any, a: dict, b: dict, path: str) -> Any:
    if same(mine, theirs) or key in ("$defs", "definitions"):
        return mine
    if key == "type":
        return _merge_types(mine, theirs, path)
    if key in LOWER_BOUNDS + UPPER_BOUNDS and _is_number(mine) and _is_number(theirs):
        return max(mine, theirs) if key in LOWER_BOUNDS else min(mine, theirs)
    if key == "required" and isinstance(mine, list) and isinstance(theirs, list):
        return mine + [n for n in theirs if n not in mine]
    if key == "properties" and isinstance(mine, dict) and isinstance(theirs, dict):
        return mine | {n: ({"allOf": [mine[n], s]} if n in mine else s) for n, s in theirs.items()}
    if key in ("items", "additionalProperties", "unevaluatedProperties", "unevaluatedItems", "propertyNames") \
            and isinstance(mine, (dict, bool)) and isinstance(theirs, (dict, bool)):
        return {"allOf": [mine, theirs]}
    if key in ("enum", "const"):
        kept = [v for v in (mine if key == "enum" else [mine]) if any(same(v, w) for w in (theirs if key == "enum" else [theirs]))]
        if not kept:
            raise ValidationError(FIELD, f"allOf: the parts' {key} values do not overlap: no output matches (at {path})")
        return kept if key == "enum" else kept[0]
    if key == "anyOf" and isinstance(mine, list) and isinstance(theirs, list):
        if len(mine) * len(theirs) > MAX_ANYOF_PRODUCT:
            raise refuse("allOf", path, f"over two anyOf of more than {MAX_ANYOF_PRODUCT} branch pairs")
        return [{"allOf": [x, y]} for x in mine for y in theirs]
    if key == "multipleOf" and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (mine, theirs)):
        return mine * theirs // math.gcd(mine, theirs)
    raise refuse("allOf", path, f"with two different {key!r}")


def _merge_types(mine: Any, theirs: Any, path: str) -> Any:
    both = _type_set(mine, path) & _type_set(theirs, path)
    if not both:
        raise ValidationError(FIELD, f"allOf: the parts' types {mine!r} and {theirs!r} do not overlap: no output "
                                     f"matches (at {path})")
    names = sorted(both - {"integer"} if "number" in both else both)
    return names[0] if len(names) == 1 else names


def _type_set(names: Any, path: str = "#") -> frozenset[str]:
    """The types `type` names, "number" as integers and other numbers."""
    names = [names] if isinstance(names, str) else _list(names)
    if not all(isinstance(t, str) for t in names):  # allOf merges its parts before they are checked
        raise ValidationError(FIELD, f"type must be a type name or a list of them, got {names!r} (at {path})")
    return frozenset(n for t in names for n in (("integer", "number") if t == "number" else (t,)))


def check_exclusive(resolve: Resolve, branches: list[Any], path: str) -> None:
    """oneOf is anyOf when no value the grammar writes for one branch satisfies another."""
    for i, a in enumerate(branches):
        for j in range(i + 1, len(branches)):
            b = branches[j]
            if not (_exclusive(resolve, a, b) and _exclusive(resolve, b, a)):
                raise refuse("oneOf", path, f"with branches {i} and {j} that a value may satisfy both of (only "
                                            "branches of different types, or objects with a required property of "
                                            "different const / enum values, are); anyOf may be what is meant")


def _exclusive(resolve: Resolve, a: Any, b: Any) -> bool:
    """No value a's grammar writes satisfies b."""
    if not _types(resolve, a, inferred=True) & _types(resolve, b, inferred=False):
        return True
    a, b = _deref(resolve, a), _deref(resolve, b)
    values_a, values_b = _values(a), _values(b)
    if values_a is not None and values_b is not None and not any(same(x, y) for x in values_a for y in values_b):
        return True
    if not isinstance(a, dict) or not isinstance(b, dict) or _types(resolve, a, inferred=True) != {"object"}:
        return False
    props_a, props_b = (s.get("properties") if isinstance(s.get("properties"), dict) else {} for s in (a, b))
    for name in set(_list(a.get("required"))) & set(_list(b.get("required"))):  # a discriminator
        tag_a = _values(_deref(resolve, props_a.get(name, True)))
        tag_b = _values(_deref(resolve, props_b.get(name, True)))
        if tag_a is not None and tag_b is not None and not any(same(x, y) for x in tag_a for y in tag_b):
            return True
    return False


def _types(resolve: Resolve, schema: Any, inferred: bool, depth: int = 0) -> frozenset[str]:
    """The types of the values `schema` allows (a superset); with `inferred`, of the values its
    grammar writes (a type made explicit from its keywords, as json_schema.py does)."""
    if schema is False:
        return frozenset()
    if not isinstance(schema, dict) or depth > 8:
        return ALL_TYPES
    if "$ref" in schema:
        return _types(resolve, resolve(schema["$ref"], "#"), inferred, depth + 1)
    types = ALL_TYPES
    if "type" in schema:
        types = _type_set(schema["type"])
    elif inferred and (families := inferred_types(schema)):
        types = _type_set(families)
    values = _values(schema)
    if values is not None:
        types &= frozenset(_type_of(v) for v in values)
    for keyword in ("anyOf", "oneOf"):
        if isinstance(schema.get(keyword), list):
            types &= frozenset().union(*(_types(resolve, s, inferred, depth + 1) for s in schema[keyword]))
    return types


def inferred_types(schema: dict) -> list[str]:
    """The types a schema without `type` constrains by its keywords (minLength: strings, ...)."""
    return [t for t, keywords in FAMILIES.items() if any(k in schema for k in keywords)]


def _deref(resolve: Resolve, schema: Any) -> Any:
    for _ in range(8):
        if not (isinstance(schema, dict) and set(schema) - {"$defs", "definitions"} == {"$ref"}):
            break
        schema = resolve(schema["$ref"], "#")
    return schema


def _values(schema: Any) -> list | None:
    if not isinstance(schema, dict):
        return None
    if "const" in schema:
        return [schema["const"]]
    return schema["enum"] if isinstance(schema.get("enum"), list) else None


def _list(value: Any) -> list:
    return value if isinstance(value, list) else []


def _type_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object"}[type(value)]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def same(a: Any, b: Any) -> bool:
    """JSON equality: 1 and 1.0 are one value, true and 1 are not."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if _is_number(a) and _is_number(b):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def satisfies(value: Any, schema: dict, path: str) -> bool:
    """Whether `value` satisfies `schema`'s keywords (those beside an enum); a keyword this does
    not check is refused."""
    for key, bound in schema.items():
        if key == "type":
            names = [bound] if isinstance(bound, str) else _list(bound)
            kind = _type_of(value)
            if kind not in names and not (kind == "integer" and "number" in names):
                return False
        elif key in LOWER_BOUNDS + UPPER_BOUNDS + ("multipleOf",) and _is_number(bound):
            size = _size(value, key)
            if size is not None and not _within(size, key, bound):
                return False
        elif key == "pattern" and isinstance(bound, str):
            if isinstance(value, str) and not re.search(bound, value):
                return False
        elif key == "required" and isinstance(bound, list):
            if isinstance(value, dict) and not all(n in value for n in bound):
                return False
        else:
            raise refuse(key, path, "beside enum or const")
    return True


def _within(size: float, key: str, bound: float) -> bool:
    if key == "multipleOf":
        return bound > 0 and (size / bound).is_integer()
    if key.startswith("exclusive"):
        return size > bound if key == "exclusiveMinimum" else size < bound
    return size >= bound if key.startswith("min") else size <= bound


def _size(value: Any, key: str) -> float | None:
    """What a bound keyword measures in `value`; None where it does not apply."""
    if key.endswith("Length"):
        return len(value) if isinstance(value, str) else None
    if key.endswith("Items"):
        return len(value) if isinstance(value, list) else None
    if key.endswith("Properties"):
        return len(value) if isinstance(value, dict) else None
    return value if _is_number(value) else None
