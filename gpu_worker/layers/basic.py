"""Weight-holding layers with HF-identical arithmetic: linear, RMSNorm, LayerNorm."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.gpu_worker import fused_ops
from pagedserve.gpu_worker.layers.packed_weights import PackableLinear

if TYPE_CHECKING:
    from pagedserve.gpu_worker.parallel import TensorParallel


def empty_parameter(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    # Weights are always loaded from a checkpoint, so initialising them would be waste.
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Linear(PackableLinear):
    """``y = x W^T + b`` with ``W`` [out_features, in_features]."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = empty_parameter(out_features, in_features, dtype=dtype)
        self.bias = empty_parameter(out_features, dtype=dtype) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, self.bias)


class RMSNorm(nn.Module):
    """Normalises in float32 and scales in the activation dtype, bit for bit HF's
    arithmetic, in one fused pass (csrc: rms_norm, fused_add_rms_norm)."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = empty_parameter(hidden_size, dtype=dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        fused_ops.rms_norm(out, x, self.weight, self.eps)
        return out

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> None:
        """In place: ``residual += x`` (in the dtype, as HF adds), then ``x = norm(residual)``."""
        fused_ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


class WeightlessRMSNorm(nn.Module):
    """An RMSNorm without a learned scale (Llama 4's L2 norm of each query and key head):
    the fused kernel over a fixed weight of ones, which scales by 1 exactly."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("ones", torch.ones(hidden_size, dtype=dtype), persistent=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        fused_ops.rms_norm(out, x, self.ones, self.eps)
        return out


class ScaledInFloat32RMSNorm(RMSNorm):
    """An RMSNorm whose HF model scales the float32 normalised value by the weight before
    rounding to the activation dtype once (OLMo 2's ``(w * x.float()).to(dtype)``, Gemma's
    by ``1 + w``; Llama's rounds first, then scales). On float32 activations the two agree
    and the fused kernel runs; on others HF's expression does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return super().forward(x)
        # NOTE: four passes over the rows, not one; only off float32.
        floats = x.float()
        normed = floats * torch.rsqrt(floats.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * normed).to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> None:
        if x.dtype == torch.float32:
            super().add_and_norm(x, residual)
            return
        residual.add_(x)
        x.copy_(self(residual))


class GemmaRMSNorm(ScaledInFloat32RMSNorm):
    """Gemma's RMSNorm, which scales by ``1 + w`` (checkpoints store the offset ``w``), in
    HF's arithmetic: normalise in float32, multiply by ``1.0 + w.float()`` in float32, round
    to the activation dtype once.

    ``weight`` holds ``1 + w`` in float32 (``scale_from_checkpoint``). On float32
    activations the fused kernel then gives HF's bits: it multiplies the float32 normalised
    value by the weight, one rounding, the same product HF forms. On other dtypes the kernel
    would round the normalised value to the dtype before multiplying, so HF's own expression
    runs instead."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__(hidden_size, eps, torch.float32)

    @staticmethod
    def scale_from_checkpoint(offset: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The checkpoint's ``w`` -> ``1 + w`` as HF computes it on a model of ``dtype``
        (whose parameter holds ``w`` rounded to that dtype)."""
        return 1.0 + offset.to(dtype).float()


class ShardedRMSNorm(nn.Module):
    """An RMSNorm over a whole projection's output, all heads at once (OLMo 2's q_norm and
    k_norm), of which this rank holds ``rows``: the sum of squares is summed over the ranks
    (divided by ``replicas`` when each row is held by that many ranks: KV heads shared by
    several ranks), the weight is this rank's slice of the checkpoint's. HF's arithmetic:
    normalised in float32, scaled in float32, rounded once (OLMoE's, ``scale_in_float32``
    False: rounded, then scaled, as Llama's RMSNorm)."""

    def __init__(
        self,
        full_size: int,
        rows: range,
        eps: float,
        dtype: torch.dtype,
        parallel: TensorParallel,
        replicas: int = 1,
        scale_in_float32: bool = True,
    ) -> None:
        super().__init__()
        self.full_size, self.rows, self.eps = full_size, rows, eps
        self.parallel, self.replicas = parallel, replicas
        self.scale_in_float32 = scale_in_float32
        self.weight = empty_parameter(len(rows), dtype=dtype)

    def shard_of(
        self, attribute: str, tensor: torch.Tensor, part: int | None
    ) -> tuple[int, torch.Tensor]:
        return 0, tensor[self.rows.start : self.rows.stop]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        floats = x.float()
        if self.parallel.size == 1:
            variance = floats.pow(2).mean(-1, keepdim=True)  # HF's own reduction
        else:
            squares = self.parallel.all_reduce(floats.pow(2).sum(-1, keepdim=True))
            variance = squares / (self.replicas * self.full_size)
        normed = floats * torch.rsqrt(variance + self.eps)
        if not self.scale_in_float32:
            return self.weight * normed.to(x.dtype)
        return (self.weight.float() * normed).to(x.dtype)


def norm_each_head(
    norm: RMSNorm | WeightlessRMSNorm, rows: torch.Tensor, head_size: int
) -> torch.Tensor:
    """``rows`` [num_tokens, num_heads * head_size] -> a new tensor of that shape, each
    head's vector RMS-normalised on its own (HF's ``q_norm(q.view(..., head_size))``: Qwen3's
    and Gemma 3's per-head query and key norms)."""
    # NOTE: a copy of q (or k) per layer: in the fused qkv output one token's heads and the
    # next token's are not one stride apart, and the norm kernel takes rows of one stride.
    return norm(rows.reshape(-1, head_size)).view(rows.shape[0], -1)


def norm_query_and_key_heads(
    q_norm: RMSNorm | WeightlessRMSNorm,
    k_norm: RMSNorm | WeightlessRMSNorm,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``norm_each_head`` on the query rows with ``q_norm`` and the key rows with ``k_norm``:
    the per-head norms of Qwen3, Gemma 3, EXAONE 4, Hunyuan (after RoPE) and others."""
    return norm_each_head(q_norm, query, head_size), norm_each_head(k_norm, key, head_size)


class LayerNorm(nn.Module):
    def __init__(
        self, hidden_size: int, eps: float, elementwise_affine: bool, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = empty_parameter(hidden_size, dtype=dtype) if elementwise_affine else None
        self.bias = empty_parameter(hidden_size, dtype=dtype) if elementwise_affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (self.hidden_size,), self.weight, self.bias, self.eps)


class XIELU(nn.Module):
    """xIELU (arXiv 2411.13010; Apertus's MLP), with its learned scalars under HF's names:
    ``x > 0``: ``a_p x^2 + beta x``; else ``(expm1(min(x, eps)) - x) a_n + beta x``, where
    ``a_p = softplus(alpha_p)``, ``a_n = beta + softplus(alpha_n)``; HF's Python arithmetic
    op for op, in the activations' dtype."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.alpha_p = empty_parameter(1, dtype=dtype)
        self.alpha_n = empty_parameter(1, dtype=dtype)
        # Scalars (0-d), as HF keeps them.
        self.beta = nn.Parameter(torch.empty((), dtype=dtype), requires_grad=False)
        self.eps = nn.Parameter(torch.empty((), dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha_p = F.softplus(self.alpha_p)
        alpha_n = self.beta + F.softplus(self.alpha_n)
        return torch.where(
            x > 0,
            alpha_p * x * x + self.beta * x,
            (torch.expm1(torch.min(x, self.eps)) - x) * alpha_n + self.beta * x,
        )


def activation(name: str):
    """The activation function an HF config names."""
    functions = {
        "silu": F.silu,
        "swish": F.silu,
        "relu": F.relu,
        "gelu": F.gelu,
        "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
        "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
        # HF's ReLUSquaredActivation (Arcee, Nemotron): relu, then squared.
        "relu2": lambda x: torch.square(F.relu(x)),
    }
    if name not in functions:
        raise ValueError(f"activation {name!r} is not supported; supported: {', '.join(functions)}")
    return functions[name]
