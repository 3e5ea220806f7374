"""The CUDA side of :mod:`pagedserve.gpu_worker.ops`.

``gpu_worker/ops.py`` validates every tensor (on any device) and then calls the function of
the same name here with CUDA tensors. The paged-attention and KV-cache ops call the kernels of
``pagedserve._C_cuda``, imported on the first CUDA tensor, so importing pagedserve never needs
a GPU or the CUDA build. The fused elementwise ops run HF's own torch expressions on the GPU:
the same arithmetic as HF transformers on that device, one small kernel per torch op.

Every call is enqueued on torch's current stream of the tensors' device.
"""

from __future__ import annotations

import importlib.util
from types import ModuleType

import torch
import torch.nn.functional as F

_module: ModuleType | None = None


def is_built() -> bool:
    """Whether the package holds the CUDA kernels (built where nvcc was found)."""
    return importlib.util.find_spec("pagedserve._C_cuda") is not None


def kernels() -> ModuleType:
    """``pagedserve._C_cuda``, imported on first use."""
    global _module
    if _module is None:
        try:
            from pagedserve import _C_cuda
        except ImportError as error:
            raise NotImplementedError(
                "CUDA tensors need the CUDA kernels (pagedserve._C_cuda), which this build of "
                "pagedserve does not have: reinstall where nvcc is found (PAGEDSERVE_BUILD_CUDA=1 "
                f"makes a missing nvcc an error): {error}"
            ) from error
        _module = _C_cuda
    return _module


def _stream(device: torch.device) -> tuple[int, int]:
    """(device ordinal, cudaStream_t of torch's current stream there) for the bindings."""
    # NOTE: ~1 us per call; the ops take it every time so they follow torch.cuda.stream(...).
    return device.index, torch.cuda.current_stream(device).cuda_stream


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    cache_args: tuple,
) -> None:
    kernels().reshape_and_cache(
        key.data_ptr(),
        key.stride(0),
        value.data_ptr(),
        value.stride(0),
        slot_mapping.data_ptr(),
        key.shape[0],
        *cache_args,
        *_stream(key.device),
    )


def paged_attention_decode(
    out: torch.Tensor,
    query: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int,
    logits_soft_cap: float,
    sinks: int,
    partition_size: int,
    cache_args: tuple,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
) -> None:
    """``partition_size`` as in ops.py (-1 chooses), ``sliding_window`` in tokens (0: full),
    ``logits_soft_cap`` (0.0: off), ``sinks`` the device address of the float32 sink logits
    (0: none);
    split-K gets a workspace from torch's caching allocator, freed in stream order once the
    kernels have run."""
    module = kernels()
    device_index, stream = _stream(query.device)
    num_seqs, num_heads = query.shape[0], query.shape[1]
    # An upper bound of seq_lens known on the host: reading seq_lens would synchronize.
    max_context_len = block_tables.shape[1] * block_size
    partition, workspace_floats = module.plan_paged_attention_decode(
        num_seqs,
        num_heads,
        num_kv_heads,
        head_size,
        max_context_len,
        sliding_window,
        partition_size,
        device_index,
    )
    workspace = (
        torch.empty(workspace_floats, dtype=torch.float32, device=query.device)
        if workspace_floats
        else None
    )
    module.paged_attention_decode(
        out.data_ptr(),
        out.stride(0),
        query.data_ptr(),
        query.stride(0),
        num_heads,
        scale,
        sliding_window,
        logits_soft_cap,
        sinks,
        *cache_args,
        block_tables.data_ptr(),
        block_tables.stride(0),
        block_tables.shape[1],
        seq_lens.data_ptr(),
        num_seqs,
        partition,
        0 if workspace is None else workspace.data_ptr(),
        workspace_floats,
        device_index,
        stream,
    )


def paged_prefill_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int,
    logits_soft_cap: float,
    sinks: int,
    max_query_len: int,
    cache_args: tuple,
) -> None:
    kernels().paged_prefill_attention(
        out.data_ptr(),
        out.stride(0),
        query.data_ptr(),
        query.stride(0),
        query.shape[0],
        query.shape[1],
        query_start_loc.data_ptr(),
        max_query_len,
        scale,
        sliding_window,
        logits_soft_cap,
        sinks,
        *cache_args,
        block_tables.data_ptr(),
        block_tables.stride(0),
        block_tables.shape[1],
        seq_lens.data_ptr(),
        block_tables.shape[0],
        *_stream(query.device),
    )


def copy_blocks(kv_cache: torch.Tensor, block_mapping: torch.Tensor, block_bytes: int) -> None:
    """``block_mapping`` is the host tensor; the kernel reads a device copy of it."""
    # NOTE: a small host-to-device copy per call (the pairs); copy-on-write is rare.
    device_mapping = block_mapping.to(kv_cache.device, non_blocking=True)
    kernels().copy_blocks(
        kv_cache.data_ptr(),
        kv_cache.shape[0],
        block_bytes,
        block_mapping.data_ptr(),
        device_mapping.data_ptr(),
        block_mapping.shape[0],
        *_stream(kv_cache.device),
    )


def swap_blocks(
    src_kv_cache: torch.Tensor,
    dst_kv_cache: torch.Tensor,
    block_mapping: torch.Tensor,
    block_bytes: int,
) -> None:
    """One pool on the GPU, the other on the same GPU or in (pinned) host memory."""
    device = src_kv_cache.device if src_kv_cache.is_cuda else dst_kv_cache.device
    kernels().swap_blocks(
        src_kv_cache.data_ptr(),
        src_kv_cache.shape[0],
        dst_kv_cache.data_ptr(),
        dst_kv_cache.shape[0],
        block_bytes,
        block_mapping.data_ptr(),
        block_mapping.shape[0],
        *_stream(device),
    )


# --- fused elementwise ops: HF's torch expressions on the GPU --------------------------------


def rms_norm(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    hidden = x.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    out.copy_(weight * hidden.to(x.dtype))


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    residual.add_(x)  # HF's `residual + hidden`: the same rounding, addition commutes
    rms_norm(x, residual, weight, eps)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> None:
    head_size = 2 * cos.shape[1]
    half = head_size // 2
    c = cos[positions].to(query.dtype).unsqueeze(1)
    s = sin[positions].to(query.dtype).unsqueeze(1)
    for rows in (query, key):
        heads = rows.view(rows.shape[0], -1, head_size)
        x1, x2 = heads[..., :half], heads[..., half:]
        heads.copy_(torch.cat((x1 * c + (-x2) * s, x2 * c + x1 * s), dim=-1))


def silu_and_mul(out: torch.Tensor, x: torch.Tensor) -> None:
    gate, up = x.chunk(2, dim=-1)
    out.copy_(F.silu(gate) * up)
