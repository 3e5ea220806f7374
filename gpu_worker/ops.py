"""The paged-attention and KV-cache ops (contract and KV layout: csrc/ops.h).

Each wrapper checks device, dtype, strides and shapes, raising ``TypeError`` (wrong type or
dtype) or ``ValueError`` (wrong shape, stride or value) with a message that names the
argument, the value and what is allowed, and then calls the compiled kernels with raw
pointers. Values the kernels read anyway (slots, block-table entries, sequence lengths) are
checked in C++ and raise ``ValueError`` before anything is written.

CPU tensors run the kernels of ``pagedserve._C_cpu``; CUDA tensors those of
``pagedserve._C_cuda`` (imported on the first CUDA tensor, see :mod:`cuda_ops`), enqueued on
torch's current stream. On CUDA, values in device memory (slots, block tables, sequence lengths)
are not checked: that would synchronize with the device on every call. Block mappings are CPU
tensors for either device.

A layer's caches are views of the pool tensor
``kv_cache [num_blocks, num_layers, 2, num_kv_heads, block_size, head_size]``::

    key_cache = kv_cache[:, layer, 0]    # [num_blocks, num_kv_heads, block_size, head_size]
    value_cache = kv_cache[:, layer, 1]  # inner three dims contiguous, any block stride

and a token's slot is ``block_id * block_size + offset``.

The fused elementwise ops of a decoder layer are in ``fused_ops.py``; the checks both use,
in ``op_checks.py``.
"""

from __future__ import annotations

import math

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
    _DeviceOf,
)

SUPPORTED_HEAD_SIZES = (64, 80, 96, 128, 192, 256)
SUPPORTED_BLOCK_SIZES = (8, 16, 32)
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# A cache may also hold float8 (e5m2, or e4m3 "fn") under activations of any supported dtype
# (CPU only; ops.h).
FLOAT8_CACHE_DTYPES = (torch.float8_e5m2, torch.float8_e4m3fn)
SUPPORTED_CACHE_DTYPES = (*SUPPORTED_DTYPES, *FLOAT8_CACHE_DTYPES)
_DTYPE_CODES = {
    torch.float32: 0,
    torch.bfloat16: 1,
    torch.float16: 2,
    torch.float8_e5m2: 3,
    torch.float8_e4m3fn: 4,
}

_LAYOUT_TOKENS = "[num_tokens, num_heads, head_size]"
_LAYOUT_CACHE = "[num_blocks, num_kv_heads, block_size, head_size]"


def _runs_cuda_kernels(tensor: torch.Tensor) -> bool:
    """Whether the paged ops on this cache or pool run csrc/cuda's kernels (via cuda_ops).

    The emulated engine tests (tests/cuda_emu) replace it to run the CUDA kernels, under the CPU
    emulator, on CPU tensors; everywhere else the tensor's device decides.
    """
    return tensor.is_cuda


def set_num_threads(num_threads: int) -> None:
    """Sets the OpenMP threads every op of this module uses (not torch's own count).

    NOTE: each op ends when its slowest thread does; with other busy processes on the same
    cores, a thread that is not scheduled stalls the whole op for a time slice, so leave the
    cores those processes need.
    """
    if isinstance(num_threads, bool) or not isinstance(num_threads, int):
        raise TypeError(f"num_threads must be an int, got {type(num_threads).__name__}")
    if num_threads < 1:
        raise ValueError(f"num_threads must be >= 1, got {num_threads}")
    _C_cpu.set_num_threads(num_threads)


# The ops run beside torch's own kernels: use the same number of threads.
set_num_threads(torch.get_num_threads())


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Writes each token's key and value into its slot of the paged caches.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_size]``; the token stride may be
            anything (views into a fused qkv output), heads and dims contiguous.
        key_cache, value_cache: ``[num_blocks, num_kv_heads, block_size, head_size]``, inner
            three dims contiguous, any block stride; same dtype as ``key``, or float8 (CPU
            only): each value rounded as ``.to(torch.float8_e5m2)`` rounds it, or for
            float8_e4m3fn as ``.clamp(-448, 448).to(torch.float8_e4m3fn)`` (saturating).
        slot_mapping: int64 ``[num_tokens]``; ``slot = block_id * block_size + offset``, a
            negative slot marks a padding token, which is skipped.
    """
    cache = _check_caches(key_cache, value_cache)
    _check_tokens("key", key, cache.num_kv_heads, cache.head_size, cache.dtype)
    _check_tokens("value", value, cache.num_kv_heads, cache.head_size, cache.dtype)
    if value.dtype != key.dtype:
        raise TypeError(f"value has dtype {value.dtype} but key has {key.dtype}; they must match")
    num_tokens = key.shape[0]
    _check_same_length("value", value, "key", num_tokens)
    _check_index_vector("slot_mapping", slot_mapping, torch.int64, num_tokens, "num_tokens")
    cache.check_same_device(("key", key), ("value", value), ("slot_mapping", slot_mapping))
    if num_tokens == 0:
        return
    if cache.is_cuda:
        cuda_ops.reshape_and_cache(key, value, slot_mapping, cache.args)
        return
    _C_cpu.reshape_and_cache(
        key.data_ptr(),
        key.stride(0),
        value.data_ptr(),
        value.stride(0),
        slot_mapping.data_ptr(),
        num_tokens,
        *cache.cpu_args(key.dtype),
    )


def paged_attention_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    partition_size: int | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention: one query token per sequence over its paged context.

    Sequence ``s`` attends to cache positions ``0 .. seq_lens[s] - 1`` (its current token's
    K/V already written by :func:`reshape_and_cache`), or with a ``sliding_window`` of ``W``
    tokens to the last ``W`` of them; a sequence with ``seq_len`` 0 gets zeros.

    Args:
        query: ``[num_seqs, num_heads, head_size]``, any token stride, heads and dims
            contiguous. ``num_heads`` is a multiple of ``num_kv_heads`` (GQA: query head
            ``h`` reads kv head ``h // (num_heads // num_kv_heads)``).
        key_cache, value_cache: ``[num_blocks, num_kv_heads, block_size, head_size]``.
        block_tables: int32 ``[num_seqs, max_blocks_per_seq]``, rows contiguous; entries past
            a sequence's blocks are never read.
        seq_lens: int32 ``[num_seqs]``.
        scale: softmax scale, usually ``head_size ** -0.5``.
        out: ``[num_seqs, num_heads, head_size]`` like ``query`` (any token stride), or
            ``None`` to allocate one.
        partition_size: ``None`` chooses: split-K when long contexts leave too few
            (sequence, kv head) work items for the threads; ``0`` forces a single pass; ``N``
            (a multiple of ``block_size``) forces partitions of ``N`` tokens, each keeping its
            max / exp-sum / partial output, combined by a reduction step. Partitions start at
            the window's first position: none lies outside it.
        sliding_window: ``None`` or ``0``: full attention; ``W > 0``: the query at position
            ``i`` attends to positions ``i - W < j <= i`` (HF transformers' sliding window).
        logits_soft_cap: ``None`` or ``0``: off; ``c > 0``: each logit ``s = scale * q . k``
            becomes ``c * tanh(s / c)`` before the softmax (Gemma 2's
            ``attn_logit_softcapping``).
        sinks: ``None``, or float32 ``[num_heads]`` on the query's device: one logit per
            query head that joins its softmax as a key whose value is zero (gpt-oss's
            attention sinks; csrc/ops.h).

    Returns:
        ``out``.
    """
    cache = _check_caches(key_cache, value_cache)
    num_heads = _check_query("query", query, cache)
    num_seqs = query.shape[0]
    window = _check_sliding_window(sliding_window)
    cap = _check_logits_soft_cap(logits_soft_cap)
    sinks_ptr = _check_sinks(sinks, num_heads)
    _check_block_tables(block_tables, num_seqs)
    _check_index_vector("seq_lens", seq_lens, torch.int32, num_seqs, "num_seqs")
    out = _check_or_allocate_out(out, query)
    scale = _check_scale(scale)
    if partition_size is None:
        partition = -1
    else:
        if isinstance(partition_size, bool) or not isinstance(partition_size, int):
            raise TypeError(
                f"partition_size must be None or an int, got {type(partition_size).__name__}"
            )
        if partition_size < 0 or partition_size % cache.block_size != 0:
            raise ValueError(
                f"partition_size must be None, 0 or a positive multiple of block_size "
                f"{cache.block_size}, got {partition_size}"
            )
        partition = partition_size
    cache.check_same_device(
        ("query", query),
        ("block_tables", block_tables),
        ("seq_lens", seq_lens),
        ("out", out),
        *(() if sinks is None else (("sinks", sinks),)),
    )
    if num_seqs == 0:
        return out
    if cache.is_cuda:
        cuda_ops.paged_attention_decode(
            out,
            query,
            block_tables,
            seq_lens,
            scale,
            window,
            cap,
            sinks_ptr,
            partition,
            cache.args,
            cache.num_kv_heads,
            cache.head_size,
            cache.block_size,
        )
        return out
    _C_cpu.paged_attention_decode(
        out.data_ptr(),
        out.stride(0),
        query.data_ptr(),
        query.stride(0),
        num_heads,
        scale,
        window,
        cap,
        sinks_ptr,
        *cache.cpu_args(query.dtype),
        block_tables.data_ptr(),
        block_tables.stride(0),
        block_tables.shape[1],
        seq_lens.data_ptr(),
        num_seqs,
        partition,
    )
    return out


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    max_query_len: int | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of new query tokens over their sequences' paged caches.

    Covers plain prefill, chunked prefill / prefix-cache hits (prior context already
    cached) and decode (one query token). Sequence ``s`` owns query rows
    ``query_start_loc[s] .. query_start_loc[s + 1] - 1`` (``q_len`` rows); its token ``j``
    sits at position ``i = seq_lens[s] - q_len + j`` and attends to cached positions up to its
    own (this step's K/V already written by :func:`reshape_and_cache`), and with a
    ``sliding_window`` of ``W`` tokens only to those after ``i - W``::

        cache of s:  [ prior context ........ | this step's q_len tokens ]
                      0                        seq_len - q_len    seq_len - 1

    Args:
        query: ``[num_tokens, num_heads, head_size]``, all sequences' tokens back to back,
            any token stride, heads and dims contiguous.
        key_cache, value_cache: ``[num_blocks, num_kv_heads, block_size, head_size]``.
        block_tables: int32 ``[num_seqs, max_blocks_per_seq]``, rows contiguous.
        query_start_loc: int32 ``[num_seqs + 1]``, starting at 0 and ending at
            ``num_tokens``.
        seq_lens: int32 ``[num_seqs]``: tokens in the cache incl. this step's.
        scale: softmax scale.
        out: ``[num_tokens, num_heads, head_size]`` like ``query``, or ``None``.
        max_query_len: the most query tokens any one sequence has (``None``: ``num_tokens``).
            The CUDA kernel sizes its grid by it without reading ``query_start_loc``; a value
            below a sequence's length leaves that sequence's last rows unwritten.
        sliding_window: ``None`` or ``0``: full causal attention; ``W > 0``: the last ``W``
            positions up to each query's own (HF transformers' sliding window).
        logits_soft_cap: ``None`` or ``0``: off; ``c > 0``: logits ``s`` become
            ``c * tanh(s / c)`` before the mask and the softmax (Gemma 2).
        sinks: ``None``, or float32 ``[num_heads]``: each query head's sink logit (as
            :func:`paged_attention_decode`).

    Returns:
        ``out``.
    """
    cache = _check_caches(key_cache, value_cache)
    num_heads = _check_query("query", query, cache)
    num_seqs = _check_block_tables(block_tables, None)
    window = _check_sliding_window(sliding_window)
    cap = _check_logits_soft_cap(logits_soft_cap)
    sinks_ptr = _check_sinks(sinks, num_heads)
    _check_index_vector(
        "query_start_loc", query_start_loc, torch.int32, num_seqs + 1, "num_seqs + 1"
    )
    _check_index_vector("seq_lens", seq_lens, torch.int32, num_seqs, "num_seqs")
    out = _check_or_allocate_out(out, query)
    scale = _check_scale(scale)
    max_query_len = _check_max_query_len(max_query_len, query.shape[0])
    cache.check_same_device(
        ("query", query),
        ("block_tables", block_tables),
        ("query_start_loc", query_start_loc),
        ("seq_lens", seq_lens),
        ("out", out),
        *(() if sinks is None else (("sinks", sinks),)),
    )
    if num_seqs == 0:
        if query.shape[0] != 0:
            raise ValueError(f"query has {query.shape[0]} tokens but there are no sequences")
        return out
    if cache.is_cuda:
        cuda_ops.paged_prefill_attention(
            out,
            query,
            block_tables,
            query_start_loc,
            seq_lens,
            scale,
            window,
            cap,
            sinks_ptr,
            max_query_len,
            cache.args,
        )
        return out
    _C_cpu.paged_prefill_attention(
        out.data_ptr(),
        out.stride(0),
        query.data_ptr(),
        query.stride(0),
        query.shape[0],
        num_heads,
        query_start_loc.data_ptr(),
        scale,
        window,
        cap,
        sinks_ptr,
        *cache.cpu_args(query.dtype),
        block_tables.data_ptr(),
        block_tables.stride(0),
        block_tables.shape[1],
        seq_lens.data_ptr(),
        num_seqs,
    )
    return out


def copy_blocks(kv_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copy-on-write: copies whole blocks (all layers, K and V) inside one pool.

    Args:
        kv_cache: the pool tensor ``[num_blocks, ...]``, contiguous, any dtype; on the CPU or
            a GPU (all pairs, all layers in one kernel launch).
        block_mapping: int64 ``[num_pairs, 2]`` of ``(src_block, dst_block)`` on the CPU
            (checked on the host); destinations distinct and never also a source.
    """
    _check_pool("kv_cache", kv_cache)
    num_pairs = _check_block_mapping(block_mapping)
    if num_pairs == 0:
        return
    if _runs_cuda_kernels(kv_cache):
        cuda_ops.copy_blocks(kv_cache, block_mapping, _block_bytes(kv_cache))
        return
    _C_cpu.copy_blocks(
        kv_cache.data_ptr(),
        kv_cache.shape[0],
        _block_bytes(kv_cache),
        block_mapping.data_ptr(),
        num_pairs,
    )


def swap_blocks(
    src_kv_cache: torch.Tensor, dst_kv_cache: torch.Tensor, block_mapping: torch.Tensor
) -> None:
    """Swapping: copies whole blocks between two pools (device pool <-> host pool).

    Args:
        src_kv_cache, dst_kv_cache: pool tensors ``[num_blocks, ...]``, contiguous, same
            dtype and per-block shape; their ``num_blocks`` may differ. Both on the CPU, or one
            on a GPU and the other on the same GPU or on the CPU (pinned memory makes the copy
            asynchronous on the current stream; pageable memory makes it synchronous).
        block_mapping: int64 ``[num_pairs, 2]`` of ``(src_block, dst_block)`` on the CPU;
            destinations distinct.
    """
    _check_pool("src_kv_cache", src_kv_cache)
    _check_pool("dst_kv_cache", dst_kv_cache)
    if dst_kv_cache.dtype != src_kv_cache.dtype:
        raise TypeError(
            f"dst_kv_cache has dtype {dst_kv_cache.dtype} but src_kv_cache has "
            f"{src_kv_cache.dtype}; they must match"
        )
    if dst_kv_cache.shape[1:] != src_kv_cache.shape[1:]:
        raise ValueError(
            f"dst_kv_cache blocks have shape {tuple(dst_kv_cache.shape[1:])} but src_kv_cache "
            f"blocks have {tuple(src_kv_cache.shape[1:])}; they must match"
        )
    num_pairs = _check_block_mapping(block_mapping)
    _check_swap_devices(src_kv_cache, dst_kv_cache)
    if num_pairs == 0:
        return
    if _runs_cuda_kernels(src_kv_cache) or _runs_cuda_kernels(dst_kv_cache):
        cuda_ops.swap_blocks(src_kv_cache, dst_kv_cache, block_mapping, _block_bytes(src_kv_cache))
        return
    _C_cpu.swap_blocks(
        src_kv_cache.data_ptr(),
        src_kv_cache.shape[0],
        dst_kv_cache.data_ptr(),
        dst_kv_cache.shape[0],
        _block_bytes(src_kv_cache),
        block_mapping.data_ptr(),
        num_pairs,
    )


# --- checks ---------------------------------------------------------------------------------
# NOTE: these run for every layer of every step, so the common case is a few tuple compares;
# the detailed messages are built only on failure.


class _CacheGeometry:
    """A validated pair of layer caches and the leading kernel arguments they make."""

    __slots__ = (
        "num_blocks",
        "num_kv_heads",
        "block_size",
        "head_size",
        "dtype",
        "is_cuda",
        "device",
        "args",
    )

    def __init__(self, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
        self.num_blocks, self.num_kv_heads, self.block_size, self.head_size = key_cache.shape
        self.dtype = key_cache.dtype
        self.is_cuda = _runs_cuda_kernels(key_cache)
        self.device = key_cache.device
        if self.is_cuda and self.dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"key_cache has dtype {self.dtype}: the CUDA kernels keep the cache in the "
                "activations' dtype (a float8 cache runs on the CPU only)"
            )
        # key_cache, value_cache, key_block_stride, value_block_stride, num_blocks,
        # num_kv_heads, block_size, head_size, dtype (the bindings' order).
        self.args = (
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            key_cache.stride(0),
            value_cache.stride(0),
            self.num_blocks,
            self.num_kv_heads,
            self.block_size,
            self.head_size,
            _DTYPE_CODES[self.dtype],
        )

    def cpu_args(self, dtype: torch.dtype) -> tuple:
        """``args`` for the CPU bindings, which also take the activations' ``dtype``: the
        geometry, the activations' dtype code, then the cache's."""
        return (*self.args[:8], _DTYPE_CODES[dtype], self.args[8])

    def check_same_device(self, *named: tuple[str, torch.Tensor]) -> None:
        """Every named tensor lives where the caches do."""
        _check_same_device("key_cache", _DeviceOf(self.device, self.is_cuda), *named)


def _check_swap_devices(src_kv_cache: torch.Tensor, dst_kv_cache: torch.Tensor) -> None:
    """Both pools on the CPU, or a GPU pool and one on that GPU or the CPU."""
    if src_kv_cache.is_cuda and dst_kv_cache.is_cuda and src_kv_cache.device != dst_kv_cache.device:
        raise ValueError(
            f"src_kv_cache is on {src_kv_cache.device} and dst_kv_cache on "
            f"{dst_kv_cache.device}; swaps run between one GPU and the host (or inside one GPU)"
        )


def _check_max_query_len(max_query_len: int | None, num_tokens: int) -> int:
    if max_query_len is None:
        return num_tokens
    if isinstance(max_query_len, bool) or not isinstance(max_query_len, int):
        raise TypeError(f"max_query_len must be None or an int, got {type(max_query_len).__name__}")
    if not 0 <= max_query_len <= num_tokens:
        raise ValueError(
            f"max_query_len must be in [0, num_tokens = {num_tokens}], got {max_query_len}"
        )
    return max_query_len


def _check_sliding_window(sliding_window: int | None) -> int:
    """Returns the window in tokens, 0 for full attention."""
    if sliding_window is None:
        return 0
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int):
        raise TypeError(
            f"sliding_window must be None or an int (tokens), got {type(sliding_window).__name__}"
        )
    if not 0 <= sliding_window < 2**31:
        raise ValueError(
            f"sliding_window must be None, 0 (full attention) or a positive number of tokens "
            f"below 2**31, got {sliding_window}"
        )
    return sliding_window


def _check_logits_soft_cap(logits_soft_cap: float | None) -> float:
    """Returns the cap, 0.0 for none."""
    if logits_soft_cap is None:
        return 0.0
    if isinstance(logits_soft_cap, bool) or not isinstance(logits_soft_cap, (int, float)):
        raise TypeError(
            f"logits_soft_cap must be None or a number, got {type(logits_soft_cap).__name__}"
        )
    if not (math.isfinite(logits_soft_cap) and logits_soft_cap >= 0):
        raise ValueError(
            f"logits_soft_cap must be None, 0 (off) or a positive finite number, "
            f"got {logits_soft_cap}"
        )
    return float(logits_soft_cap)


def _check_sinks(sinks: torch.Tensor | None, num_heads: int) -> int:
    """The address of ``sinks`` (float32 ``[num_heads]``, contiguous), 0 for none. Their
    values are not read here (that would synchronize a GPU); the CPU op refuses a non-finite
    one, and a model checks its own when it loads them."""
    if sinks is None:
        return 0
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks must be None or a tensor, got {type(sinks).__name__}")
    if sinks.dtype != torch.float32 or tuple(sinks.shape) != (num_heads,):
        raise ValueError(
            f"sinks must be float32 [num_heads = {num_heads}], got {sinks.dtype} "
            f"{list(sinks.shape)}"
        )
    if not sinks.is_contiguous():
        raise ValueError("sinks must be contiguous")
    return sinks.data_ptr()


def _check_caches(key_cache: torch.Tensor, value_cache: torch.Tensor) -> _CacheGeometry:
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        _check_device(name, cache)
        _check_dtype(name, cache, SUPPORTED_CACHE_DTYPES)
        shape = cache.shape
        if len(shape) != 4:
            raise ValueError(f"{name} must be 4-D {_LAYOUT_CACHE}, got shape {tuple(shape)}")
        if cache.stride()[1:] != (shape[2] * shape[3], shape[3], 1):
            _check_inner_strides(name, cache, _LAYOUT_CACHE)
    if value_cache.shape != key_cache.shape:
        raise ValueError(
            f"value_cache has shape {tuple(value_cache.shape)} but key_cache has "
            f"{tuple(key_cache.shape)}; they must match"
        )
    if value_cache.dtype != key_cache.dtype:
        raise TypeError(
            f"value_cache has dtype {value_cache.dtype} but key_cache has {key_cache.dtype}; "
            "they must match"
        )
    _, num_kv_heads, block_size, head_size = key_cache.shape
    if head_size not in SUPPORTED_HEAD_SIZES:
        raise ValueError(
            f"head_size {head_size} (key_cache.shape[3]) is not supported; supported: "
            f"{', '.join(map(str, SUPPORTED_HEAD_SIZES))}"
        )
    if block_size not in SUPPORTED_BLOCK_SIZES:
        raise ValueError(
            f"block_size {block_size} (key_cache.shape[2]) is not supported; supported: "
            f"{', '.join(map(str, SUPPORTED_BLOCK_SIZES))}"
        )
    if num_kv_heads < 1:
        raise ValueError(f"key_cache must have at least one kv head, got shape {key_cache.shape}")
    return _CacheGeometry(key_cache, value_cache)


def _check_tokens(
    name: str, tensor: torch.Tensor, num_heads: int, head_size: int, dtype: torch.dtype
) -> None:
    """``tensor`` is ``[num_tokens, num_heads, head_size]`` of the cache's dtype (any
    supported one over a float8 cache)."""
    _check_device(name, tensor)
    if tensor.dtype != dtype or dtype not in SUPPORTED_DTYPES:
        _check_dtype(name, tensor, SUPPORTED_DTYPES)
        if dtype in SUPPORTED_DTYPES:
            raise TypeError(
                f"{name} has dtype {tensor.dtype} but the cache holds {dtype}; they must match"
            )
    _check_token_shape(name, tensor, num_heads, head_size)


def _check_token_shape(name: str, tensor: torch.Tensor, num_heads: int, head_size: int) -> None:
    shape = tensor.shape
    if len(shape) != 3 or shape[1] != num_heads or shape[2] != head_size:
        raise ValueError(
            f"{name} must be {_LAYOUT_TOKENS} with num_heads={num_heads}, "
            f"head_size={head_size} (from the cache); got shape {tuple(shape)}"
        )
    if tensor.stride()[1:] != (head_size, 1):
        _check_inner_strides(name, tensor, _LAYOUT_TOKENS)


def _check_query(name: str, query: torch.Tensor, cache: _CacheGeometry) -> int:
    """Checks a query tensor; returns num_heads."""
    _check_device(name, query)
    if query.dim() != 3:
        raise ValueError(f"{name} must be 3-D {_LAYOUT_TOKENS}, got shape {tuple(query.shape)}")
    num_heads = query.shape[1]
    if num_heads % cache.num_kv_heads != 0 or num_heads == 0:
        raise ValueError(
            f"{name} has {num_heads} heads, which is not a positive multiple of the cache's "
            f"num_kv_heads {cache.num_kv_heads}"
        )
    _check_tokens(name, query, num_heads, cache.head_size, cache.dtype)
    return num_heads


def _check_or_allocate_out(out: torch.Tensor | None, query: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(query.shape, dtype=query.dtype, device=query.device)
    _check_device("out", out)
    if out.dtype != query.dtype:
        raise TypeError(f"out has dtype {out.dtype} but query has {query.dtype}; they must match")
    if out.shape != query.shape:
        raise ValueError(
            f"out has shape {tuple(out.shape)} but query has {tuple(query.shape)}; they must match"
        )
    if out.stride()[1:] != (query.shape[2], 1):
        _check_inner_strides("out", out, _LAYOUT_TOKENS)
    return out


def _check_block_tables(block_tables: torch.Tensor, num_seqs: int | None) -> int:
    """Checks int32 ``[num_seqs, max_blocks_per_seq]`` with contiguous rows; returns num_seqs."""
    _check_device("block_tables", block_tables)
    if block_tables.dtype != torch.int32:
        raise TypeError(f"block_tables has dtype {block_tables.dtype}; expected torch.int32")
    shape = block_tables.shape
    if len(shape) != 2 or (num_seqs is not None and shape[0] != num_seqs):
        expected = "num_seqs" if num_seqs is None else f"num_seqs={num_seqs}"
        raise ValueError(
            f"block_tables must have shape [{expected}, max_blocks_per_seq], got {tuple(shape)}"
        )
    if shape[1] > 1 and block_tables.stride(1) != 1:
        raise ValueError(
            f"block_tables rows must be contiguous, got strides {block_tables.stride()}"
        )
    return shape[0]


def _check_scale(scale: float) -> float:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float, got {type(scale).__name__}")
    return float(scale)


# NOTE: the fused elementwise ops are called a few times per layer per step and their kernels
# take about a microsecond on one token, where each tensor attribute read costs 0.1-0.3 us. So
# the _fast_*_args checks read each attribute once and return the kernel arguments when the
# input is valid in the common way, and None otherwise; only then do the named checks run, to
# raise their messages (or accept a valid but uncommon input).


def _check_pool(name: str, kv_cache: torch.Tensor) -> None:
    _check_device(name, kv_cache)
    if kv_cache.dim() < 1:
        raise ValueError(f"{name} must be [num_blocks, ...], got a 0-d tensor")
    if not kv_cache.is_contiguous():
        raise ValueError(
            f"{name} must be contiguous (the whole pool tensor), got shape "
            f"{tuple(kv_cache.shape)} with strides {kv_cache.stride()}"
        )


def _check_block_mapping(block_mapping: torch.Tensor) -> int:
    """Checks int64 ``[num_pairs, 2]``, contiguous, on the CPU; returns num_pairs."""
    _check_device("block_mapping", block_mapping)
    if not block_mapping.is_cpu:
        raise ValueError(
            f"block_mapping is on {block_mapping.device}; it must be a CPU tensor (the pairs are "
            "checked on the host) for pools on any device"
        )
    if block_mapping.dtype != torch.int64:
        raise TypeError(f"block_mapping has dtype {block_mapping.dtype}; expected torch.int64")
    if block_mapping.dim() != 2 or block_mapping.shape[1] != 2:
        raise ValueError(
            f"block_mapping must have shape [num_pairs, 2], got {tuple(block_mapping.shape)}"
        )
    if not block_mapping.is_contiguous():
        raise ValueError(f"block_mapping must be contiguous, got strides {block_mapping.stride()}")
    return block_mapping.shape[0]


def _block_bytes(kv_cache: torch.Tensor) -> int:
    return math.prod(kv_cache.shape[1:]) * kv_cache.element_size()
