"""HF's rope_scaling from what llama.cpp keeps of it: the rope.scaling keys, Llama 3's
per-frequency divisors (rope_freqs) and LongRoPE's factor tensors."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from pagedserve.frontend.gguf.metadata import float32_value

# Llama 3's RoPE scaling besides its factor: every Llama 3.x model's values, and those
# llama.cpp assumes when a config leaves them out.
LLAMA3_ROPE = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
# Llama 4 Scout's: no band between the kept and the stretched wavelengths.
SCOUT_ROPE = {**LLAMA3_ROPE, "high_freq_factor": 1.0}


def scaling_from_keys(key: Callable[[str], Any]) -> dict[str, Any] | None:
    scaling_type = key("rope.scaling.type")
    if scaling_type in (None, "none"):
        return None
    if scaling_type not in ("linear", "yarn"):
        raise ValueError(
            f"GGUF rope.scaling.type {scaling_type!r} is not supported; supported: none, "
            "linear, yarn"
        )
    scaling: dict[str, Any] = {
        "rope_type": scaling_type,
        "factor": float32_value(key("rope.scaling.factor")),
    }
    original_context = key("rope.scaling.original_context_length")
    if original_context is not None:
        scaling["original_max_position_embeddings"] = int(original_context)
    return scaling


def llama3_rope_scaling(
    rope_freqs: np.ndarray,
    rope_theta: float,
    head_dim: int,
    candidates: tuple[dict[str, Any], ...] = (LLAMA3_ROPE, SCOUT_ROPE),
) -> dict[str, Any]:
    """HF's llama3 rope_scaling for a GGUF's rope_freqs tensor. llama.cpp's converter turns
    HF's settings into one divisor per frequency (1 for short wavelengths, the factor for long
    ones, a blend between); the factor is the largest divisor, and the other settings are the
    first of ``candidates`` that gives back every divisor (where no frequency falls in Llama
    3's band, both do, alike)."""
    factors = np.asarray(rope_freqs, dtype=np.float64).reshape(-1)
    if factors.shape != (head_dim // 2,):
        raise ValueError(
            f"GGUF rope_freqs has {factors.size} values; expected head_dim / 2 = {head_dim // 2}"
        )
    for settings in candidates:
        scaling = {"rope_type": "llama3", "factor": float32_value(factors.max()), **settings}
        expected = _llama3_divisors(scaling, rope_theta, head_dim)
        if np.allclose(factors, expected, rtol=1e-5, atol=0):
            return scaling
    raise ValueError(
        "GGUF rope_freqs is not Llama 3's RoPE scaling with factor "
        f"{float32_value(factors.max())}, low_freq_factor 1, high_freq_factor 4 (Llama 4 "
        "Scout's: 1) and original_max_position_embeddings 8192, the only llama3 settings this "
        "converter reads from a GGUF"
    )


def _llama3_divisors(scaling: dict[str, Any], rope_theta: float, head_dim: int) -> np.ndarray:
    """What each RoPE frequency is divided by under llama3 scaling (HF's and llama.cpp's)."""
    frequencies = 1.0 / rope_theta ** (np.arange(0, head_dim, 2) / head_dim)
    wavelengths = 2 * np.pi / frequencies
    original = scaling["original_max_position_embeddings"]
    low, high, factor = scaling["low_freq_factor"], scaling["high_freq_factor"], scaling["factor"]
    # Without a band (Llama 4 Scout's high_freq_factor = low_freq_factor) every wavelength is
    # kept or stretched below.
    band = high - low
    smooth = (original / wavelengths - low) / band if band else np.zeros_like(wavelengths)
    divisors = 1 / ((1 - smooth) / factor + smooth)
    divisors[wavelengths < original / high] = 1.0
    divisors[wavelengths > original / low] = factor
    return divisors


def longrope_scaling(factors: dict[str, list[float]]) -> dict[str, Any]:
    """LongRoPE from llama.cpp's factor tensors (both); the attention factor is left for the
    reader to derive from the two contexts, as HF does."""
    return {
        "rope_type": "longrope",
        "long_factor": [float32_value(value) for value in factors["long_factor"]],
        "short_factor": [float32_value(value) for value in factors["short_factor"]],
    }
