"""Rotary position embeddings (rotate-half form), with the RoPE scalings HF configs use."""

from __future__ import annotations

import math
from typing import Any

import torch

from pagedserve.gpu_worker import ops

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(hf_config: dict[str, Any]) -> dict[str, Any]:
    """RoPE settings from either config style: transformers 5's ``rope_parameters`` or the
    older ``rope_theta`` + ``rope_scaling`` pair."""
    parameters = dict(hf_config.get("rope_parameters") or {})
    scaling = hf_config.get("rope_scaling") or {}
    parameters = {**scaling, **parameters}
    parameters.setdefault("rope_theta", hf_config.get("rope_theta", 10000.0))
    parameters["rope_type"] = parameters.get("rope_type") or parameters.get("type") or "default"
    return parameters


def inverse_frequencies(head_size: int, parameters: dict[str, Any]) -> torch.Tensor:
    """Per-pair rotation frequencies, float32, computed as HF computes them so positions
    rotate by bit-identical angles."""
    base = float(parameters["rope_theta"])
    # On the CPU whatever the default device, as HF computes them at model creation.
    exponents = (
        torch.arange(0, head_size, 2, dtype=torch.int64, device="cpu").to(torch.float32) / head_size
    )
    inv_freq = 1.0 / (base**exponents)
    rope_type = parameters["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(parameters["factor"])
    if rope_type == "llama3":
        return _llama3_frequencies(inv_freq, parameters)
    raise NotImplementedError(
        f"rope_type {rope_type!r} is not supported yet; "
        f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


def _llama3_frequencies(inv_freq: torch.Tensor, parameters: dict[str, Any]) -> torch.Tensor:
    factor = float(parameters["factor"])
    low_freq_factor = float(parameters["low_freq_factor"])
    high_freq_factor = float(parameters["high_freq_factor"])
    old_context_len = float(parameters["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are stretched by the factor, short ones kept, the band between
    # them interpolated smoothly.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """Applies RoPE to query and key rows at given positions, in place.

    cos/sin are tabulated once in float32 for every position up to ``max_positions``, on the
    default device (the model's: HF takes cos and sin on the device that runs the model); the
    fused kernel casts them to the activation dtype and rotates in HF's exact arithmetic
    (csrc: rotary_embedding).
    """

    def __init__(self, head_size: int, max_positions: int, parameters: dict[str, Any]) -> None:
        self.head_size = head_size
        positions = torch.arange(max_positions, dtype=torch.float32)
        inv_freq = inverse_frequencies(head_size, parameters).to(positions.device)
        freqs = positions[:, None] * inv_freq[None, :]
        # [max_positions, head_size // 2] each
        self.cos = freqs.cos().contiguous()
        self.sin = freqs.sin().contiguous()

    def __call__(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> None:
        """``query`` [num_tokens, num_heads * head_size], ``key`` [num_tokens,
        num_kv_heads * head_size], both views into the qkv output: rotated in place."""
        ops.rotary_embedding(positions, query, key, self.cos, self.sin)
