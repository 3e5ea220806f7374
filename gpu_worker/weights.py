"""Reading checkpoint tensors from a local HF-format directory."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open


def iterate_weights(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of the checkpoint in ``path``.

    safetensors files are preferred; PyTorch ``.bin`` files are read with
    ``weights_only=True`` so a checkpoint can never run code.
    """
    safetensors_files = sorted(path.glob("*.safetensors"))
    if safetensors_files:
        for file in safetensors_files:
            with safe_open(file, framework="pt") as reader:
                for name in reader.keys():  # noqa: SIM118 (safe_open is not a dict)
                    yield name, reader.get_tensor(name)
        return
    bin_files = sorted(path.glob("pytorch_model*.bin"))
    if not bin_files:
        raise ValueError(
            f"model: {str(path)!r} has no *.safetensors or pytorch_model*.bin weight files"
        )
    for file in bin_files:
        state = torch.load(file, map_location="cpu", weights_only=True)
        yield from state.items()
