"""The fused elementwise ops of a decoder layer: :func:`rms_norm`, :func:`fused_add_rms_norm`,
:func:`rotary_embedding`, :func:`silu_and_mul` (contract: csrc/ops.h). Each replaces a chain
of torch ops of HF's modeling code and reproduces its rounding step by step (float32 math,
rounded to the activation dtype after every torch op), so they match that torch code bit for
bit; see each docstring for the one condition where they may not. They check their
arguments as ``ops.py``'s wrappers do, then run ``pagedserve._C_cpu`` or, on CUDA tensors,
``pagedserve._C_cuda``.
"""

from __future__ import annotations

import torch

from pagedserve import _C_cpu
from pagedserve.gpu_worker import cuda_ops
from pagedserve.gpu_worker.op_checks import (
    _check_device,
    _check_dtype,
    _check_index_vector,
    _check_inner_strides,
    _check_same_device,
    _check_same_length,
)
from pagedserve.gpu_worker.ops import _DTYPE_CODES, SUPPORTED_DTYPES

_LAYOUT_ROWS = "[num_tokens, hidden_size]"


def rms_norm(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """HF's RMSNorm of each row of ``x`` into ``out``, bit for bit::

        h = x.float(); h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        out = weight * h.to(x.dtype)

    The mean's sum adds in the order torch's CPU sum kernel does (rows of 8 elements or more),
    so float32 results are identical too.

    Args:
        out: ``[num_tokens, hidden_size]`` like ``x`` (any token stride); may be ``x`` itself.
        x: ``[num_tokens, hidden_size]``, any token stride, rows contiguous.
        weight: ``[hidden_size]``, contiguous, ``x``'s dtype.
        eps: added to the mean square, as a float32 (as torch adds it).
    """
    args = _fast_norm_args(out, x, weight, eps)
    if args is None:
        _check_rows("x", x)
        _check_rows_like("out", out, "x", x)
        _check_weight(weight, x)
        eps = _check_eps(eps)
        _check_same_device("x", x, ("out", out), ("weight", weight))
        args = _norm_args(out, x)
    out_stride, x_stride, num_tokens, hidden_size, dtype = args
    if num_tokens == 0:
        return
    if x.is_cuda:
        cuda_ops.rms_norm(out, x, weight, eps)
        return
    _C_cpu.rms_norm(
        out.data_ptr(),
        out_stride,
        x.data_ptr(),
        x_stride,
        weight.data_ptr(),
        num_tokens,
        hidden_size,
        eps,
        dtype,
    )


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    """In place: ``residual = x + residual`` (rounded to the dtype, as torch adds), then
    ``x = rms_norm(residual)``; replaces ``hidden = residual + out; normed = norm(hidden)``.

    Args:
        x: ``[num_tokens, hidden_size]``, any token stride, rows contiguous; becomes the
            normed rows.
        residual: ``[num_tokens, hidden_size]`` like ``x``; becomes the sum.
        weight: ``[hidden_size]``, contiguous, ``x``'s dtype.
        eps: as in :func:`rms_norm`.
    """
    args = _fast_norm_args(residual, x, weight, eps)
    if args is None:
        _check_rows("x", x)
        _check_rows_like("residual", residual, "x", x)
        _check_rows_disjoint("x", x)
        _check_weight(weight, x)
        eps = _check_eps(eps)
        _check_same_device("x", x, ("residual", residual), ("weight", weight))
        args = _norm_args(residual, x)
    residual_stride, x_stride, num_tokens, hidden_size, dtype = args
    if num_tokens == 0:
        return
    if x.is_cuda:
        cuda_ops.fused_add_rms_norm(x, residual, weight, eps)
        return
    _C_cpu.fused_add_rms_norm(
        x.data_ptr(),
        x_stride,
        residual.data_ptr(),
        residual_stride,
        weight.data_ptr(),
        num_tokens,
        hidden_size,
        eps,
        dtype,
    )


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> None:
    """In place: rotate-half (NeoX) RoPE of every query and key head, bit for bit HF's::

        c, s = cos[positions].to(dtype), sin[positions].to(dtype)
        x = cat((x1 * c + (-x2) * s, x2 * c + x1 * s), -1)   # x1, x2: the halves of a head

    Args:
        positions: int64 ``[num_tokens]``, each in ``[0, max_positions)`` (checked before
            anything is written).
        query: ``[num_tokens, num_heads * head_size]``, any token stride (a view into a fused
            qkv output), rows contiguous.
        key: ``[num_tokens, num_kv_heads * head_size]`` like ``query``, same dtype.
        cos, sin: float32 ``[max_positions, head_size // 2]``, contiguous; ``head_size`` is
            ``2 * cos.shape[1]``.
    """
    args = _fast_rotary_args(positions, query, key, cos, sin)
    if args is None:
        head_size = _check_rotary_tables(cos, sin)
        num_heads = _check_head_rows("query", query, head_size)
        num_tokens = query.shape[0]
        num_kv_heads = _check_head_rows("key", key, head_size)
        if key.dtype != query.dtype:
            raise TypeError(
                f"key has dtype {key.dtype} but query has {query.dtype}; they must match"
            )
        _check_same_length("key", key, "query", num_tokens)
        _check_index_vector("positions", positions, torch.int64, num_tokens, "num_tokens")
        _check_same_device(
            "query", query, ("key", key), ("positions", positions), ("cos", cos), ("sin", sin)
        )
        args = (
            query.stride(0),
            num_heads,
            key.stride(0),
            num_kv_heads,
            head_size,
            cos.shape[0],
            num_tokens,
            _DTYPE_CODES[query.dtype],
        )
    query_stride, num_heads, key_stride, num_kv_heads, head_size, max_positions = args[:6]
    num_tokens, dtype = args[6:]
    if num_tokens == 0:
        return
    if query.is_cuda:
        cuda_ops.rotary_embedding(positions, query, key, cos, sin)
        return
    _C_cpu.rotary_embedding(
        positions.data_ptr(),
        query.data_ptr(),
        query_stride,
        num_heads,
        key.data_ptr(),
        key_stride,
        num_kv_heads,
        head_size,
        cos.data_ptr(),
        sin.data_ptr(),
        max_positions,
        num_tokens,
        dtype,
    )


def silu_and_mul(out: torch.Tensor, x: torch.Tensor) -> None:
    """``out = F.silu(gate) * up`` with ``gate, up = x.chunk(2, -1)``, bit for bit torch's.

    silu runs in float32 with torch's own exp (SLEEF's algorithm in the AVX2 and AVX-512
    variants, libm's ``expf`` in the generic one), so results are identical where the kernel
    variant (``_C_cpu.isa()``) is the one torch's CPU capability names; otherwise float32
    results may differ by a few ulp.

    Args:
        out: ``[num_tokens, intermediate_size]``, any token stride, rows contiguous.
        x: ``[num_tokens, 2 * intermediate_size]`` (gate | up), any token stride, rows
            contiguous, ``out``'s dtype.
    """
    args = _fast_silu_args(out, x)
    if args is None:
        width = _check_rows("x", x, "[num_tokens, 2 * intermediate_size]")
        intermediate_size = _check_rows("out", out, "[num_tokens, intermediate_size]")
        if out.dtype != x.dtype:
            raise TypeError(f"out has dtype {out.dtype} but x has {x.dtype}; they must match")
        if width != 2 * intermediate_size or out.shape[0] != x.shape[0]:
            raise ValueError(
                f"x [num_tokens, 2 * intermediate_size] has shape {tuple(x.shape)} but out "
                f"[num_tokens, intermediate_size] has {tuple(out.shape)}; x must be "
                f"{(out.shape[0], 2 * intermediate_size)}"
            )
        _check_rows_disjoint("out", out)
        _check_same_device("x", x, ("out", out))
        args = _norm_args(out, x)[:3] + (intermediate_size, _DTYPE_CODES[x.dtype])
    out_stride, x_stride, num_tokens, intermediate_size, dtype = args
    if num_tokens == 0:
        return
    if x.is_cuda:
        cuda_ops.silu_and_mul(out, x)
        return
    _C_cpu.silu_and_mul(
        out.data_ptr(),
        out_stride,
        x.data_ptr(),
        x_stride,
        num_tokens,
        intermediate_size,
        dtype,
    )


def _one_device(first: torch.Tensor, *others: torch.Tensor) -> bool:
    """All on the CPU, or all on one CUDA device (the CPU case first: it is the cheap one)."""
    if first.is_cpu:
        return all(other.is_cpu for other in others)
    if not first.is_cuda:
        return False
    device = first.device
    return all(other.device == device for other in others)


def _rows_disjoint(shape: torch.Size, strides: tuple[int, ...]) -> bool:
    return strides[1] == 1 and (strides[0] >= shape[1] or shape[0] <= 1)


def _fast_norm_args(
    written: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[int, int, int, int, int] | None:
    """(written's and x's token strides, num_tokens, hidden_size, dtype code), or None."""
    if not (
        isinstance(written, torch.Tensor)
        and isinstance(x, torch.Tensor)
        and isinstance(weight, torch.Tensor)
        and type(eps) is float
        and eps >= 0
    ):
        return None
    shape, dtype = x.shape, x.dtype
    if not (
        len(shape) == 2
        and shape[1] > 0
        and written.shape == shape
        and weight.dim() == 1
        and weight.numel() == shape[1]
        and _one_device(x, written, weight)
        and dtype in _DTYPE_CODES
        and written.dtype is dtype
        and weight.dtype is dtype
        and weight.is_contiguous()
    ):
        return None
    written_strides, x_strides = written.stride(), x.stride()
    if not (_rows_disjoint(shape, written_strides) and _rows_disjoint(shape, x_strides)):
        return None
    return written_strides[0], x_strides[0], shape[0], shape[1], _DTYPE_CODES[dtype]


def _norm_args(written: torch.Tensor, x: torch.Tensor) -> tuple[int, int, int, int, int]:
    return written.stride(0), x.stride(0), x.shape[0], x.shape[1], _DTYPE_CODES[x.dtype]


def _fast_rotary_args(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[int, ...] | None:
    """(query stride, num_heads, key stride, num_kv_heads, head_size, max_positions, num_tokens,
    dtype code), or None."""
    if not (
        isinstance(positions, torch.Tensor)
        and isinstance(query, torch.Tensor)
        and isinstance(key, torch.Tensor)
        and isinstance(cos, torch.Tensor)
        and isinstance(sin, torch.Tensor)
    ):
        return None
    table_shape, query_shape, key_shape = cos.shape, query.shape, key.shape
    if not (len(table_shape) == 2 and len(query_shape) == 2 and len(key_shape) == 2):
        return None
    head_size, num_tokens, dtype = 2 * table_shape[1], query_shape[0], query.dtype
    if not (
        head_size > 0
        and query_shape[1] > 0
        and key_shape[1] > 0
        and query_shape[1] % head_size == 0
        and key_shape[1] % head_size == 0
        and key_shape[0] == num_tokens
        and sin.shape == table_shape
        and positions.shape == (num_tokens,)
        and _one_device(query, key, positions, cos, sin)
        and dtype in _DTYPE_CODES
        and key.dtype is dtype
        and positions.dtype is torch.int64
        and cos.dtype is torch.float32
        and sin.dtype is torch.float32
        and positions.is_contiguous()
        and cos.is_contiguous()
        and sin.is_contiguous()
    ):
        return None
    query_strides, key_strides = query.stride(), key.stride()
    if not (_rows_disjoint(query_shape, query_strides) and _rows_disjoint(key_shape, key_strides)):
        return None
    return (
        query_strides[0],
        query_shape[1] // head_size,
        key_strides[0],
        key_shape[1] // head_size,
        head_size,
        table_shape[0],
        num_tokens,
        _DTYPE_CODES[dtype],
    )


def _fast_silu_args(out: torch.Tensor, x: torch.Tensor) -> tuple[int, int, int, int, int] | None:
    """(out's and x's token strides, num_tokens, intermediate_size, dtype code), or None."""
    if not (isinstance(out, torch.Tensor) and isinstance(x, torch.Tensor)):
        return None
    out_shape, x_shape, dtype = out.shape, x.shape, x.dtype
    if not (
        len(out_shape) == 2
        and len(x_shape) == 2
        and out_shape[1] > 0
        and x_shape[0] == out_shape[0]
        and x_shape[1] == 2 * out_shape[1]
        and _one_device(x, out)
        and dtype in _DTYPE_CODES
        and out.dtype is dtype
    ):
        return None
    out_strides, x_strides = out.stride(), x.stride()
    if not (_rows_disjoint(out_shape, out_strides) and x_strides[1] == 1):
        return None
    return out_strides[0], x_strides[0], x_shape[0], out_shape[1], _DTYPE_CODES[dtype]


def _check_rows(name: str, tensor: torch.Tensor, layout: str = _LAYOUT_ROWS) -> int:
    """``tensor`` is 2-D ``layout`` with contiguous rows; returns the row size."""
    _check_device(name, tensor)
    _check_dtype(name, tensor, SUPPORTED_DTYPES)
    if tensor.dim() != 2 or tensor.shape[1] == 0:
        raise ValueError(f"{name} must be 2-D {layout}, got shape {tuple(tensor.shape)}")
    if tensor.stride(1) != 1 and tensor.shape[1] != 1:
        _check_inner_strides(name, tensor, layout)
    return tensor.shape[1]


def _check_rows_disjoint(name: str, tensor: torch.Tensor) -> None:
    """Rows written in parallel must not share memory (e.g. an ``expand``-ed tensor)."""
    if tensor.shape[0] > 1 and tensor.stride(0) < tensor.shape[1]:
        raise ValueError(
            f"{name} rows overlap: token stride {tensor.stride(0)} < row size {tensor.shape[1]}"
        )


def _check_rows_like(name: str, tensor: torch.Tensor, other: str, like: torch.Tensor) -> None:
    """``tensor`` is written: ``like``'s shape and dtype, contiguous disjoint rows."""
    _check_device(name, tensor)
    if tensor.dtype != like.dtype:
        raise TypeError(
            f"{name} has dtype {tensor.dtype} but {other} has {like.dtype}; they must match"
        )
    if tensor.shape != like.shape:
        raise ValueError(
            f"{name} has shape {tuple(tensor.shape)} but {other} has {tuple(like.shape)}; "
            "they must match"
        )
    _check_rows(name, tensor)
    _check_rows_disjoint(name, tensor)


def _check_weight(weight: torch.Tensor, x: torch.Tensor) -> None:
    _check_device("weight", weight)
    if weight.dtype != x.dtype:
        raise TypeError(f"weight has dtype {weight.dtype} but x has {x.dtype}; they must match")
    if weight.shape != (x.shape[1],):
        raise ValueError(
            f"weight must have shape [hidden_size] = [{x.shape[1]}], got {tuple(weight.shape)}"
        )
    if not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous, got stride {weight.stride()}")


def _check_eps(eps: float) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps must be a float, got {type(eps).__name__}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    return float(eps)


def _check_rotary_tables(cos: torch.Tensor, sin: torch.Tensor) -> int:
    """Checks the float32 ``[max_positions, head_size // 2]`` tables; returns head_size."""
    for name, table in (("cos", cos), ("sin", sin)):
        _check_device(name, table)
        if table.dtype != torch.float32:
            raise TypeError(f"{name} has dtype {table.dtype}; expected torch.float32")
        if table.dim() != 2 or table.shape[1] == 0:
            raise ValueError(
                f"{name} must be 2-D [max_positions, head_size // 2], got {tuple(table.shape)}"
            )
        if not table.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {table.stride()}")
    if sin.shape != cos.shape:
        raise ValueError(
            f"sin has shape {tuple(sin.shape)} but cos has {tuple(cos.shape)}; they must match"
        )
    return 2 * cos.shape[1]


def _check_head_rows(name: str, tensor: torch.Tensor, head_size: int) -> int:
    """``tensor`` is ``[num_tokens, heads * head_size]``, written in place; returns heads."""
    width = _check_rows(name, tensor, "[num_tokens, num_heads * head_size]")
    if width % head_size != 0:
        raise ValueError(
            f"{name} [num_tokens, num_heads * head_size] has {width} columns, not a multiple "
            f"of head_size {head_size} (2 * cos.shape[1])"
        )
    _check_rows_disjoint(name, tensor)
    return width // head_size
