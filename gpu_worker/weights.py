"""Reading checkpoint tensors from a local HF-format directory."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

# A vision-language checkpoint's language model, under the names a text model's checkpoint
# gives it: as transformers saves such models (``language_model.model.``,
# ``language_model.lm_head.``), and as newer checkpoints name them (``model.language_model.``).
_LANGUAGE_MODEL_PREFIXES = (
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
)
# Its image side, which a text-only engine leaves unread.
_IMAGE_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
    "visual.",  # Qwen2.5-VL's and Qwen3-VL's vision encoders and mergers
    "model.visual.",
    "image_newline",  # LLaVA-NeXT's learned separator between image rows
    "vision_model.",  # Llama 4's vision encoder
    "model.image_newline",
)


def language_model_weights(
    weights: Iterator[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """A vision-language checkpoint's tensors as its language model's alone
    (``models/architectures/vision_language.py``): renamed as a text checkpoint names them;
    the vision encoder and the projector dropped. Any other name passes as is (the loader
    refuses what it does not know)."""
    for name, tensor in weights:
        if name.startswith(_IMAGE_PREFIXES):
            continue
        for prefix, replacement in _LANGUAGE_MODEL_PREFIXES:
            if name.startswith(prefix):
                name = replacement + name[len(prefix) :]
                break
        yield name, tensor


def iterate_weights(
    path: Path, names: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of the checkpoint in ``path`` (those whose
    name ``names`` accepts, when given: safetensors then reads no other).

    safetensors files are preferred; PyTorch ``.bin`` files are read with
    ``weights_only=True`` so a checkpoint can never run code.
    """
    safetensors_files = sorted(path.glob("*.safetensors"))
    if safetensors_files:
        for file in safetensors_files:
            with safe_open(file, framework="pt") as reader:
                for name in reader.keys():  # noqa: SIM118 (safe_open is not a dict)
                    if names is None or names(name):
                        yield name, reader.get_tensor(name)
        return
    bin_files = sorted(path.glob("pytorch_model*.bin"))
    if not bin_files:
        raise ValueError(
            f"model: {str(path)!r} has no *.safetensors or pytorch_model*.bin weight files"
        )
    for file in bin_files:
        state = torch.load(file, map_location="cpu", weights_only=True)
        yield from (item for item in state.items() if names is None or names(item[0]))
