"""A value with its objects' keys in the order a grammar compiled from its (prepared) JSON Schema
writes them."""
from __future__ import annotations

from typing import Any


def in_schema_order(value: Any, schema: Any) -> Any:
    """`value` with every object's keys in the order its (prepared) schema lists them, the others
    after them: the order a grammar compiled from the schema writes them in. In anyOf, the branch
    that lists most of an object's keys decides."""
    defs = schema.get("$defs", {}) if isinstance(schema, dict) else {}

    def order(value: Any, schema: Any, depth: int = 0) -> Any:
        for _ in range(8):
            if not isinstance(schema, dict) or "$ref" not in schema:
                break
            schema = defs.get(schema["$ref"].rsplit("/", 1)[-1], True)
        if not isinstance(schema, dict) or depth > 64:
            return value
        if "anyOf" in schema and isinstance(value, dict):
            schema = max(schema["anyOf"], key=lambda b: len(set(value) & set(_properties(b, defs))))
        if isinstance(value, dict):
            listed = _properties(schema, defs)
            keys = [k for k in listed if k in value] + [k for k in value if k not in listed]
            extra = schema.get("additionalProperties", True)
            return {k: order(value[k], listed.get(k, extra), depth + 1) for k in keys}
        if isinstance(value, list):
            prefix = schema.get("prefixItems", [])
            return [order(v, prefix[i] if i < len(prefix) else schema.get("items", True), depth + 1)
                    for i, v in enumerate(value)]
        return value

    return order(value, schema)


def _properties(schema: Any, defs: dict) -> dict:
    if isinstance(schema, dict) and "$ref" in schema:
        schema = defs.get(schema["$ref"].rsplit("/", 1)[-1], True)
    properties = schema.get("properties") if isinstance(schema, dict) else None
    return properties if isinstance(properties, dict) else {}

