"""Rotary position embeddings (rotate-half form), with the RoPE scalings HF configs use."""

from __future__ import annotations

import math
from typing import Any

import torch

from pagedserve.gpu_worker import fused_ops
from pagedserve.gpu_worker.layers.rope_config import (  # noqa: F401 (re-exported)
    NTK_ALPHA,
    SUPPORTED_ROPE_TYPES,
    rope_context_window,
    rope_parameters,
)


def inverse_frequencies(head_size: int, parameters: dict[str, Any]) -> torch.Tensor:
    """Per-pair rotation frequencies, float32, computed as HF computes them so positions
    rotate by bit-identical angles."""
    base = float(parameters["rope_theta"])
    if parameters["rope_type"] == NTK_ALPHA:
        # Hunyuan's fixed NTK: the base stretched by alpha^(d / (d - 2)), then plain RoPE.
        base = base * float(parameters["alpha"]) ** (head_size / (head_size - 2))
    # On the CPU whatever the default device, as HF computes them at model creation.
    exponents = (
        torch.arange(0, head_size, 2, dtype=torch.int64, device="cpu").to(torch.float32) / head_size
    )
    inv_freq = 1.0 / (base**exponents)
    rope_type = parameters["rope_type"]
    if rope_type in ("default", "dynamic", NTK_ALPHA):
        # Dynamic NTK rotates as the default within max_position_embeddings (rope_config's
        # DYNAMIC_WINDOW_REASON): HF re-bases only for a pass longer than that.
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(parameters["factor"])
    if rope_type == "llama3":
        return _llama3_frequencies(inv_freq, parameters)
    if rope_type == "yarn":
        return _yarn_frequencies(head_size, parameters)
    if rope_type == "longrope":
        # The short factors (within the original context; ``long_frequencies`` past it).
        return _longrope_frequencies(head_size, parameters, "short_factor")
    raise NotImplementedError(
        f"rope_type {rope_type!r} is not supported yet; "
        f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


def long_frequencies(head_size: int, parameters: dict[str, Any]) -> torch.Tensor:
    """LongRoPE's frequencies past the original context (its long factors)."""
    return _longrope_frequencies(head_size, parameters, "long_factor")


def _longrope_frequencies(head_size: int, parameters: dict[str, Any], name: str) -> torch.Tensor:
    """HF's order: the base's powers times the factors, inverted."""
    base = float(parameters["rope_theta"])
    exponents = (
        torch.arange(0, head_size, 2, dtype=torch.int64, device="cpu").to(torch.float32) / head_size
    )
    factors = torch.tensor(parameters[name], dtype=torch.float32, device="cpu")
    if factors.numel() != head_size // 2:
        raise ValueError(
            f"rope {name} has {factors.numel()} values; the rotated head size "
            f"{head_size} needs {head_size // 2}"
        )
    return 1.0 / (factors * base**exponents)


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


def _yarn_frequencies(head_size: int, parameters: dict[str, Any]) -> torch.Tensor:
    """YaRN (arXiv 2309.00071): high-frequency pairs keep their frequency (extrapolation),
    low-frequency ones are divided by the factor (interpolation), with a linear ramp
    between the pair dimensions that rotate ``beta_fast`` and ``beta_slow`` times over the
    original context. Step for step as transformers 5 computes it."""
    base = float(parameters["rope_theta"])
    factor = parameters["factor"]
    original_context = parameters["original_max_position_embeddings"]
    beta_fast = parameters.get("beta_fast") or 32
    beta_slow = parameters.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        # The pair dimension that turns num_rotations times over the original context.
        return (head_size * math.log(original_context / (num_rotations * 2 * math.pi))) / (
            2 * math.log(base)
        )

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if parameters.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_size - 1)
    if low == high:
        high += 0.001  # a ramp of one step, not a division by zero
    ramp = torch.clamp(
        (torch.arange(head_size // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1
    )
    extrapolation_weight = 1 - ramp
    pos_freqs = base ** (torch.arange(0, head_size, 2, device="cpu").to(torch.float32) / head_size)
    extrapolated = 1.0 / pos_freqs
    interpolated = 1.0 / (factor * pos_freqs)
    return interpolated * (1 - extrapolation_weight) + extrapolated * extrapolation_weight


def attention_factor(parameters: dict[str, Any]) -> float:
    """What cos and sin are scaled by (YaRN's attention temperature, LongRoPE's scale; 1
    for the others)."""
    if parameters["rope_type"] not in ("yarn", "longrope"):
        return 1.0
    if parameters.get("attention_factor") is not None:
        return parameters["attention_factor"]
    factor = parameters["factor"]
    if parameters["rope_type"] == "longrope":
        if factor <= 1.0:
            return 1.0
        original = parameters["original_max_position_embeddings"]
        return math.sqrt(1 + math.log(factor) / math.log(original))

    def mscale(scale: float, weight: float = 1) -> float:
        return 1.0 if scale <= 1 else 0.1 * weight * math.log(scale) + 1.0

    weight, weight_all_dims = parameters.get("mscale"), parameters.get("mscale_all_dim")
    if weight and weight_all_dims:
        return float(mscale(factor, weight) / mscale(factor, weight_all_dims))
    return mscale(factor)


class RotaryEmbedding:
    """Applies RoPE to query and key rows at given positions, in place.

    cos/sin are tabulated once in float32 for every position up to ``max_positions``, on the
    default device (the model's: HF takes cos and sin on the device that runs the model); the
    fused kernel casts them to the activation dtype and rotates in HF's exact arithmetic
    (csrc: rotary_embedding). LongRoPE tabulates both its rotations: rows ``max_positions +
    p`` hold position p's with the long factors, which the model runner asks for by that row
    (``long_offset``) where ``rope_config.long_rope_switch``'s rule says.
    """

    def __init__(self, head_size: int, max_positions: int, parameters: dict[str, Any]) -> None:
        self.head_size = head_size
        # Phi-3's partial_rotary_factor: only each head's first rotary_dim values rotate.
        self.rotary_dim = int(head_size * parameters.get("partial_rotary_factor", 1.0))
        if self.rotary_dim % 2 or not 2 <= self.rotary_dim <= head_size:
            raise ValueError(
                f"partial_rotary_factor={parameters.get('partial_rotary_factor')!r} rotates "
                f"{self.rotary_dim} of {head_size} values per head; it must be an even "
                "number in [2, head size]"
            )
        positions = torch.arange(max_positions, dtype=torch.float32)
        inv_freq = inverse_frequencies(self.rotary_dim, parameters).to(positions.device)
        freqs = positions[:, None] * inv_freq[None, :]
        # The row of position 0 rotated with LongRoPE's long factors (0: one rotation only).
        self.long_offset = 0
        if parameters["rope_type"] == "longrope":
            long_inv_freq = long_frequencies(self.rotary_dim, parameters).to(positions.device)
            freqs = torch.cat([freqs, positions[:, None] * long_inv_freq[None, :]])
            self.long_offset = max_positions
        # [max_positions, rotary_dim // 2] each; float32 times the factor, as HF scales them.
        scale = attention_factor(parameters)
        self.cos = (freqs.cos() * scale).contiguous()
        self.sin = (freqs.sin() * scale).contiguous()

    def __call__(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> None:
        """``query`` [num_tokens, num_heads * head_size], ``key`` [num_tokens,
        num_kv_heads * head_size], both views into the qkv output: rotated in place."""
        if self.rotary_dim == self.head_size:
            fused_ops.rotary_embedding(positions, query, key, self.cos, self.sin)
            return
        cos = self.cos[positions]
        sin = self.sin[positions]
        for rows in (query, key):
            _rotate_partially(rows.view(rows.shape[0], -1, self.head_size), cos, sin)


def _rotate_partially(heads: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """In place: RoPE over each head's first ``2 * cos.shape[1]`` values, the rest passed
    through, in HF's arithmetic (Phi-3's ``apply_rotary_pos_emb``: cos and sin cast to the
    activations' dtype, ``x * cos + rotate_half(x) * sin``). ``heads`` [tokens, heads,
    head_size]; ``cos``, ``sin`` float32 [tokens, rotary_dim // 2]."""
    rotary_dim = 2 * cos.shape[1]
    cos = torch.cat((cos, cos), dim=-1).to(heads.dtype)[:, None, :]
    sin = torch.cat((sin, sin), dim=-1).to(heads.dtype)[:, None, :]
    rotated = heads[..., :rotary_dim]
    half = rotary_dim // 2
    rotate_half = torch.cat((-rotated[..., half:], rotated[..., :half]), dim=-1)
    heads[..., :rotary_dim] = (rotated * cos) + (rotate_half * sin)


def pairs_to_halves(
    tensor: torch.Tensor,
    head_size: int,
    rotary_dim: int,
    per_head_last: bool = False,
    start: int = 0,
) -> torch.Tensor:
    """A query or key projection's rows (weight or bias, ``[heads * head_size, ...]``; with
    ``per_head_last``, per-head norm weights ``[..., head_size]``) reordered, in each head's
    ``rotary_dim`` dimensions from ``start`` (DeepSeek rotates each head's last ones), from
    RoPE on interleaved pairs (2i, 2i + 1: Cohere's, GLM's, DeepSeek's) to RoPE on halves (i,
    i + rotary_dim / 2: the ops'). The same rotation of the same values; queries and keys
    reordered alike keep their dot products, so the attention is unchanged."""
    rotary = range(start, start + rotary_dim)
    order = list(rotary[0::2]) + list(rotary[1::2])
    index = torch.tensor(list(range(start)) + order + list(range(rotary.stop, head_size)))
    if per_head_last:
        return tensor.index_select(-1, index)
    by_head = tensor.reshape(-1, head_size, *tensor.shape[1:])
    return by_head.index_select(1, index).reshape(tensor.shape)
