"""Constraints the structured-output tests share (tests/engine and tests/server), shaped so
that a tiny random model's greedy output completes them: bounded strings, enums, compact
JSON. The tests directory is on ``sys.path``, so test modules ``import grammar_cases``."""

from __future__ import annotations

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "none"]},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
    # llguidance lets whitespace run between JSON tokens by default (as vLLM does), and a
    # random model's favourite token may be one; compact JSON makes the schema end.
    "x-guidance": {"whitespace_flexible": False},
}
CHOICES = ["alpha", "beta", "gamma delta"]
REGEX = r"[a-f]{2,5}-[0-9]{2}"
GRAMMAR = 'start: "(" item ("," item)* ")"\nitem: /[xyz]/ | start'
