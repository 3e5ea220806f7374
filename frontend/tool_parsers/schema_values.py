"""A parameter's text typed as its tool's JSON schema says, for the formats that write
arguments as text rather than JSON (``qwen3_coder.py``, ``glm45.py``, ``minimax_m2.py``)."""

from __future__ import annotations

import ast
import json
from typing import Any


def typed_value(text: str, schema: Any) -> Any:
    """A parameter's text as its JSON schema types it (``Qwen3CoderReader``,
    ``Glm45Reader``, ``MiniMaxM2Reader``)."""
    kinds = schema.get("type") if isinstance(schema, dict) else None
    kinds = [kinds] if isinstance(kinds, str) else list(kinds or [])
    if kinds == ["string"] or (isinstance(schema, dict) and "enum" in schema and not kinds):
        return text
    stripped = text.strip()
    if "null" in kinds and stripped.lower() == "null":
        return None
    if "boolean" in kinds and stripped.lower() in ("true", "false"):
        return stripped.lower() == "true"
    if "integer" in kinds:
        try:
            return int(stripped)
        except ValueError:
            pass
    if "number" in kinds:
        try:
            number = float(stripped)
            return int(number) if number.is_integer() and "." not in stripped else number
        except ValueError:
            pass
    try:
        value = json.loads(stripped)
    except (ValueError, RecursionError):
        try:
            value = ast.literal_eval(stripped)  # Python's literals (True, single quotes)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return text
    if kinds and "string" in kinds and not isinstance(value, (dict, list)):
        return text
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return text
    return value


def schema_types(schema: Any) -> list[str]:
    """The JSON types a parameter's schema allows, as vLLM's ``minimax_m2`` reads them: its
    ``type`` (one or a list), the types of its ``enum``'s values, and those of its
    ``anyOf`` / ``oneOf`` / ``allOf`` alternatives (``{"anyOf": [{"type": "integer"},
    {"type": "null"}]}`` is an integer or null); none when the schema says nothing of them."""
    if not isinstance(schema, dict):
        return []
    kinds = schema.get("type")
    found = [kinds] if isinstance(kinds, str) else []
    if isinstance(kinds, list):
        found += [kind for kind in kinds if isinstance(kind, str)]
    values = schema.get("enum")
    found += [_json_type(value) for value in (values if isinstance(values, list) else [])]
    for key in ("anyOf", "oneOf", "allOf"):
        alternatives = schema.get(key)
        for alternative in alternatives if isinstance(alternatives, list) else []:
            found += schema_types(alternative)
    return list(dict.fromkeys(found))  # each once, in the schema's order


def _json_type(value: Any) -> str:
    """The JSON type of a value an ``enum`` lists."""
    if value is None:
        return "null"
    if isinstance(value, bool):  # before int: a bool is an int to Python
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, (list, tuple)):
        return "array"
    if isinstance(value, dict):
        return "object"
    return "string"
