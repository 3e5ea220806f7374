"""A GGUF file's metadata as the converter reads it: its fields, its tensors' shapes, the
tensors llama.cpp keeps RoPE settings in, and the sizes every architecture's config derives
from them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np

# Llama 3's per-frequency RoPE divisors, which llama.cpp stores as a tensor.
ROPE_FREQS_TENSOR = "rope_freqs.weight"
# LongRoPE's factors (llama.cpp's rope_factors_long / _short), also no weights.
ROPE_FACTOR_TENSORS = {
    "rope_factors_long.weight": "long_factor",
    "rope_factors_short.weight": "short_factor",
}


@dataclass(frozen=True)
class GGUFMetadata:
    """What the config is made from: the metadata fields, the tensor shapes (torch's order),
    and the RoPE tensors' values (rope_freqs; rope_factors by long_factor / short_factor)."""

    fields: dict[str, Any]
    tensor_shapes: dict[str, tuple[int, ...]]
    rope_freqs: np.ndarray | None = None
    rope_factors: dict[str, list[float]] | None = None

    @property
    def architecture(self) -> Any:
        return self.fields.get("general.architecture")

    def key(self, name: str, default: Any = None) -> Any:
        """The architecture's key ``name`` (llama.cpp prefixes each with the architecture)."""
        return self.fields.get(f"{self.architecture}.{name}", default)

    @property
    def hidden_size(self) -> int:
        return int(self.key("embedding_length"))

    @property
    def num_heads(self) -> int:
        return int(self.key("attention.head_count"))

    @property
    def head_dim(self) -> int:
        return int(self.key("attention.key_length", self.hidden_size // self.num_heads))

    @property
    def rope_dim(self) -> int:
        return int(self.key("rope.dimension_count", self.head_dim))

    @property
    def rope_theta(self) -> float:
        return float32_value(self.key("rope.freq_base", 10000.0))

    @property
    def num_layers(self) -> int:
        # llama.cpp appends a checkpoint's multi-token-prediction layers as the last blocks.
        return int(self.key("block_count")) - int(self.key("nextn_predict_layers", 0))


def read_metadata(reader: gguf.GGUFReader) -> GGUFMetadata:
    fields = {name: field.contents() for name, field in reader.fields.items()}
    rope_freqs = next(
        (tensor.data for tensor in reader.tensors if tensor.name == ROPE_FREQS_TENSOR), None
    )
    rope_factors = {
        ROPE_FACTOR_TENSORS[tensor.name]: [float(value) for value in tensor.data]
        for tensor in reader.tensors
        if tensor.name in ROPE_FACTOR_TENSORS
    }
    return GGUFMetadata(fields, tensor_shapes(reader), rope_freqs, rope_factors)


def tensor_shapes(reader: gguf.GGUFReader) -> dict[str, tuple[int, ...]]:
    # GGUF lists dimensions fastest-first; torch wants them slowest-first.
    return {
        tensor.name: tuple(int(dim) for dim in reversed(tensor.shape)) for tensor in reader.tensors
    }


def float32_value(value: float) -> float:
    # GGUF stores these as float32; the shortest float32 repr keeps 1e-5 reading as 1e-05 in
    # config.json instead of 9.999999747378752e-06 (the same float32 either way).
    return float(str(np.float32(value)))


def optional_int(value: Any) -> int | None:
    return None if value is None else int(value)
