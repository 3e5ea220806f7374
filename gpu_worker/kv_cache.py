"""The KV cache tensor of one pool and its size arithmetic."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
from dataclasses import dataclass

import torch

from pagedserve.gpu_worker.model_config import ModelConfig
from pagedserve.gpu_worker.parallel import TensorParallel

_HUGE_PAGE_BYTES = 2 << 20


# vLLM's names (model_config.KV_CACHE_DTYPES): "fp8" is e4m3, as on vLLM's GPUs.
_FLOAT8_CACHE_DTYPES = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensor's dtype for ``kv_cache_dtype`` under a model of ``model_dtype``."""
    return _FLOAT8_CACHE_DTYPES.get(kv_cache_dtype, model_dtype)


@dataclass(frozen=True)
class KVCacheSpec:
    """Geometry of the cache: ``[num_blocks, num_layers, 2, num_kv_heads, block_size,
    head_size]``, block-major so one block across all layers is one contiguous chunk
    (copy-on-write and swap move whole blocks). Layout contract: csrc/ops.h."""

    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: torch.dtype

    @classmethod
    def for_model(
        cls,
        config: ModelConfig,
        parallel: TensorParallel,
        block_size: int,
        dtype: torch.dtype,
    ) -> KVCacheSpec:
        """The pool of one model's tensor-parallel rank: its layers and its KV heads."""
        return cls(
            num_layers=config.num_layers,
            num_kv_heads=len(parallel.kv_heads(config.num_kv_heads)),
            head_size=config.head_size,
            block_size=block_size,
            dtype=dtype,
        )

    @property
    def bytes_per_block(self) -> int:
        element_size = torch.empty((), dtype=self.dtype).element_size()
        return (
            self.num_layers * 2 * self.num_kv_heads * self.block_size * self.head_size
        ) * element_size

    def allocate(
        self, num_blocks: int, device: torch.device | str = "cpu", pin_memory: bool = False
    ) -> torch.Tensor:
        """The pool tensor; ``pin_memory`` (host pools only) makes copies to and from a GPU
        asynchronous."""
        shape = (num_blocks, self.num_layers, 2, self.num_kv_heads, self.block_size, self.head_size)
        # Left uninitialised: every slot is written before it is read, and untouched
        # pages of a large pool then cost no memory and no start-up time.
        cache = torch.empty(shape, dtype=self.dtype, device=device, pin_memory=pin_memory)
        if cache.device.type == "cpu" and not pin_memory:
            _advise_huge_pages(cache)
        return cache


def layer_caches(kv_cache: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The key and value cache views of one layer: ``[num_blocks, num_kv_heads,
    block_size, head_size]`` each, inner dims contiguous, block stride spanning all
    layers."""
    return kv_cache[:, layer, 0], kv_cache[:, layer, 1]


def _advise_huge_pages(tensor: torch.Tensor) -> None:
    """Ask Linux for transparent huge pages under a CPU pool: decode attention reads
    blocks scattered over the pool, and 2 MiB pages spare it most TLB misses. Best
    effort: where madvise or THP is missing, the pool works the same, only slower."""
    size = tensor.numel() * tensor.element_size()
    start = tensor.data_ptr()
    aligned_start = -(-start // _HUGE_PAGE_BYTES) * _HUGE_PAGE_BYTES
    end = (start + size) // _HUGE_PAGE_BYTES * _HUGE_PAGE_BYTES
    if end <= aligned_start or not hasattr(mmap, "MADV_HUGEPAGE"):
        return
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return
    libc = ctypes.CDLL(libc_name, use_errno=True)
    libc.madvise(
        ctypes.c_void_p(aligned_start), ctypes.c_size_t(end - aligned_start), mmap.MADV_HUGEPAGE
    )
