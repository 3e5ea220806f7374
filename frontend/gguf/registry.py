"""Which module and class convert each of llama.cpp's architectures: one line per
``general.architecture`` name, the module imported on first use.

A table rather than decorators on the classes: the supported names (and the error for any
other) need no import, the list reads in one place, and a conversion imports only the
module of its own architecture.
"""

from __future__ import annotations

import functools
import importlib
from typing import TYPE_CHECKING, Any

from pagedserve.frontend.gguf.metadata import GGUFMetadata

if TYPE_CHECKING:
    from pagedserve.frontend.gguf.architecture import Architecture

# llama.cpp's architecture name -> (module under architectures/, class).
_ARCHITECTURES = {
    "llama": ("llama", "Llama"),
    "qwen2": ("qwen", "Qwen2"),
    "qwen3": ("qwen", "Qwen3"),
    "qwen2moe": ("qwen", "Qwen2Moe"),
    "qwen3moe": ("qwen", "Qwen3Moe"),
    "gemma2": ("gemma", "Gemma2"),
    "gemma3": ("gemma", "Gemma3"),
    "phi3": ("phi3", "Phi3"),
    "granite": ("granite", "Granite"),
    "smollm3": ("smollm3", "SmolLM3"),
    "olmo2": ("olmo2", "Olmo2"),
    "exaone4": ("exaone4", "Exaone4"),
    "olmoe": ("olmoe", "Olmoe"),
    "gpt-oss": ("gpt_oss", "GptOss"),
    "glm4moe": ("glm4moe", "Glm4Moe"),
    "deepseek2": ("deepseek2", "DeepseekV2"),
    "dots1": ("dots1", "Dots1"),
    "ernie4_5-moe": ("ernie4_5", "Ernie4_5Moe"),
    "minimax-m2": ("minimax_m2", "MiniMaxM2"),
    "ernie4_5": ("ernie4_5", "Ernie4_5"),
    "hunyuan-dense": ("hunyuan", "HunyuanDense"),
    "hunyuan-moe": ("hunyuan", "HunyuanMoe"),
    "nemotron": ("nemotron", "Nemotron"),
    "apertus": ("apertus", "Apertus"),
    "llama4": ("llama4", "Llama4"),
}
SUPPORTED_ARCHITECTURES = tuple(_ARCHITECTURES)


@functools.cache
def architecture(name: str) -> Architecture:
    """The architecture registered under llama.cpp's ``name`` (a KeyError for any other)."""
    module_name, class_name = _ARCHITECTURES[name]
    module = importlib.import_module(f"{__package__}.architectures.{module_name}")
    return getattr(module, class_name)()


def architecture_for(
    fields: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]]
) -> Architecture:
    """The architecture a GGUF file converts as; ValueError for a name not registered."""
    name = fields.get("general.architecture")
    if name not in _ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {name!r} is not supported; "
            f"supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return architecture(name).variant(GGUFMetadata(fields, tensor_shapes))


def architectures_with(flag: str) -> list[str]:
    """The names whose architecture sets ``flag``, for a message that lists them."""
    return [name for name in _ARCHITECTURES if getattr(architecture(name), flag)]
