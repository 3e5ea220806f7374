"""How much memory the KV cache takes when the user names no size."""

from __future__ import annotations

import os

import torch

# Without a size from the user the cache takes this share of the memory still available
# once the weights are loaded, after keeping this much back for activations, the
# tokenizer and everything else on the machine; and, as vLLM does on CPUs, at most this.
DEFAULT_KV_CACHE_MEMORY_FRACTION = 0.5
DEFAULT_MEMORY_RESERVE_BYTES = 2 << 30
DEFAULT_MAX_KV_CACHE_BYTES = 4 << 30
# On a GPU the cache takes this share of the device memory still free once the weights are
# loaded, after keeping this much back for activations and the allocator's slack.
DEFAULT_GPU_KV_CACHE_MEMORY_FRACTION = 0.9
DEFAULT_GPU_MEMORY_RESERVE_BYTES = 2 << 30


def available_memory_bytes() -> int:
    """MemAvailable (free plus reclaimable page cache), else the free pages."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def default_kv_cache_bytes(num_ranks_sharing_memory: int = 1) -> int:
    """The cache size from the memory available now: call it in the process that holds
    the cache, after its weights are loaded. Tensor-parallel ranks on one CPU share its
    memory: each takes its part of the share (and of the cap). NOTE: ranks measure at
    slightly different times, so their counts may differ; the scheduler takes the
    smallest."""
    usable = available_memory_bytes() - DEFAULT_MEMORY_RESERVE_BYTES
    share = min(DEFAULT_MAX_KV_CACHE_BYTES, int(usable * DEFAULT_KV_CACHE_MEMORY_FRACTION))
    return max(0, share // num_ranks_sharing_memory)


def default_gpu_kv_cache_bytes(device: torch.device) -> int:
    """The cache size from the GPU memory free now: call it after the weights are loaded."""
    free_bytes, _ = torch.cuda.mem_get_info(device)
    usable = free_bytes - DEFAULT_GPU_MEMORY_RESERVE_BYTES
    return max(0, int(usable * DEFAULT_GPU_KV_CACHE_MEMORY_FRACTION))
