"""Constraints the structured-output tests share (tests/engine and tests/server), shaped so
that a tiny random model's greedy output completes them: bounded strings, enums, compact
JSON; each as the engine's ``StructuredOutputsParams`` too, and prompts to constrain."""

from __future__ import annotations

from pagedserve.scheduler.sampling_params import StructuredOutputsParams

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
# Each kind of constraint on the cases above, by name.
CONSTRAINTS = {
    "json": StructuredOutputsParams(json=PERSON_SCHEMA),
    "regex": StructuredOutputsParams(regex=REGEX),
    "choice": StructuredOutputsParams(choice=CHOICES),
    "grammar": StructuredOutputsParams(grammar=GRAMMAR),
}
# Prompts (token ids) the engine tests constrain.
PROMPTS = [[5, 300, 301, 302], [400, 7, 7, 401, 402, 403, 404, 405, 406], [17, 18, 19]]
