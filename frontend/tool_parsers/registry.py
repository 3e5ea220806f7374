"""Which module and class read each ``--tool-call-parser`` format: one line per name, the
module imported on first use.

A table rather than decorators on the classes: the supported names (for the command line
and its errors) need no import, the list reads in one place, and a server imports only the
reader of its own format.
"""

from __future__ import annotations

import functools
import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedserve.frontend.tool_parsers.base import OutputReader

# --tool-call-parser name -> (module under tool_parsers/, reader class).
_READERS = {
    "hermes": ("hermes", "HermesReader"),
    "llama3_json": ("json_calls", "Llama3JsonReader"),
    "llama4_json": ("json_calls", "Llama3JsonReader"),  # vLLM's name for Llama 4 of the same reader
    "pythonic": ("pythonic", "PythonicReader"),
    "llama4_pythonic": ("pythonic", "PythonicReader"),  # vLLM's name for Llama 4 of the same reader
    "mistral": ("mistral", "MistralReader"),
    "qwen3_coder": ("qwen3_coder", "Qwen3CoderReader"),
    "seed_oss": ("qwen3_coder", "SeedOssReader"),
    "deepseek_v3": ("deepseek", "DeepSeekV3Reader"),
    "deepseek_v31": ("deepseek", "DeepSeekV31Reader"),
    "glm45": ("glm45", "Glm45Reader"),
    "kimi_k2": ("kimi_k2", "KimiK2Reader"),
    "minimax_m2": ("minimax_m2", "MiniMaxM2Reader"),
    "granite": ("json_calls", "GraniteReader"),
    "phi4_mini_json": ("json_calls", "Phi4MiniReader"),
    "openai": ("harmony_calls", "HarmonyReader"),
}
# --tool-call-parser: the model families whose output format the server can read.
TOOL_CALL_PARSERS = tuple(_READERS)


@functools.cache
def reader_class(name: str) -> type[OutputReader]:
    """The reader class registered under ``name`` (a KeyError for any other)."""
    module_name, class_name = _READERS[name]
    module = importlib.import_module(f"{__package__}.{module_name}")
    return getattr(module, class_name)


def new_reader(name: str, schemas: dict[str, dict[str, Any]]) -> OutputReader:
    """A reader of ``name``'s format for one request, whose tools' parameters schemas by
    name are ``schemas``; ValueError for a name not registered."""
    if name not in _READERS:
        raise ValueError(
            f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got {name!r}"
        )
    return reader_class(name)(schemas)
