"""The KV cache tensor of one pool and its size arithmetic."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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

    @property
    def bytes_per_block(self) -> int:
        element_size = torch.empty((), dtype=self.dtype).element_size()
        return (
            self.num_layers * 2 * self.num_kv_heads * self.block_size * self.head_size
        ) * element_size

    def num_blocks_for_bytes(self, kv_cache_bytes: int) -> int:
        return kv_cache_bytes // self.bytes_per_block

    def allocate(self, num_blocks: int, device: torch.device | str = "cpu") -> torch.Tensor:
        shape = (num_blocks, self.num_layers, 2, self.num_kv_heads, self.block_size, self.head_size)
        # Left uninitialised: every slot is written before it is read, and untouched
        # pages of a large pool then cost no memory and no start-up time.
        return torch.empty(shape, dtype=self.dtype, device=device)


def layer_caches(kv_cache: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The key and value cache views of one layer: ``[num_blocks, num_kv_heads,
    block_size, head_size]`` each, inner dims contiguous, block stride spanning all
    layers."""
    return kv_cache[:, layer, 0], kv_cache[:, layer, 1]
