"""Random inputs for the op tests: a pool tensor with the real layout, scrambled block
tables, and query/key/value views into a fused qkv buffer (token stride > row size)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Entries past a sequence's blocks: never a valid block, so a kernel reading one fails loudly.
PADDING_BLOCK = 1 << 30

TOLERANCES = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.bfloat16: {"atol": 1e-2, "rtol": 1e-2},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
}


@dataclass
class PagedCase:
    pool: torch.Tensor  # [num_blocks, num_layers, 2, num_kv_heads, block_size, head_size]
    key_cache: torch.Tensor  # layer 1 views: [num_blocks, num_kv_heads, block_size, head_size]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq]
    seq_lens: torch.Tensor  # int32 [num_seqs]


def random_pool(
    num_blocks: int,
    num_kv_heads: int,
    block_size: int,
    head_size: int,
    dtype: torch.dtype,
    generator: torch.Generator,
    num_layers: int = 2,
) -> torch.Tensor:
    shape = (num_blocks, num_layers, 2, num_kv_heads, block_size, head_size)
    return torch.randn(shape, generator=generator).to(dtype)


def scrambled_block_tables(
    seq_lens: list[int], block_size: int, num_blocks: int, generator: torch.Generator
) -> torch.Tensor:
    """Each sequence gets its blocks from one random permutation of the pool."""
    needed = [math.ceil(n / block_size) for n in seq_lens]
    assert sum(needed) <= num_blocks
    perm = torch.randperm(num_blocks, generator=generator)
    width = max([1, *needed]) + 2  # some padding columns for every sequence
    tables = torch.full((len(seq_lens), width), PADDING_BLOCK, dtype=torch.int32)
    start = 0
    for s, n in enumerate(needed):
        tables[s, :n] = perm[start : start + n].to(torch.int32)
        start += n
    return tables


def paged_case(
    seq_lens: list[int],
    num_kv_heads: int,
    block_size: int,
    head_size: int,
    dtype: torch.dtype,
    generator: torch.Generator,
    spare_blocks: int = 5,
    device: str = "cpu",
) -> PagedCase:
    num_blocks = sum(math.ceil(n / block_size) for n in seq_lens) + spare_blocks
    pool = random_pool(num_blocks, num_kv_heads, block_size, head_size, dtype, generator)
    pool = pool.to(device)
    return PagedCase(
        pool=pool,
        key_cache=pool[:, 1, 0],
        value_cache=pool[:, 1, 1],
        block_tables=scrambled_block_tables(seq_lens, block_size, num_blocks, generator).to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
    )


def fused_qkv(
    num_tokens: int,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    generator: torch.Generator,
    device: str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """query [T, H, D], key and value [T, KVH, D]: views into one [T, (H + 2 KVH) D] buffer."""
    q_width, kv_width = num_heads * head_size, num_kv_heads * head_size
    qkv = torch.randn(num_tokens, q_width + 2 * kv_width, generator=generator).to(dtype)
    qkv = qkv.to(device)
    query = qkv[:, :q_width].view(num_tokens, num_heads, head_size)
    key = qkv[:, q_width : q_width + kv_width].view(num_tokens, num_kv_heads, head_size)
    value = qkv[:, q_width + kv_width :].view(num_tokens, num_kv_heads, head_size)
    return query, key, value


def query_start_loc(q_lens: list[int], device: str = "cpu") -> torch.Tensor:
    loc = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    loc[1:] = torch.cumsum(torch.tensor(q_lens, dtype=torch.int64), 0).to(torch.int32)
    return loc.to(device)


def decode_case(seq_lens, num_heads, num_kv_heads, block_size, head_size, dtype, seed=0):
    """(a ``paged_case`` of ``seq_lens``, one query token per sequence), seeded."""
    generator = torch.Generator().manual_seed(seed)
    case = paged_case(seq_lens, num_kv_heads, block_size, head_size, dtype, generator)
    query, _, _ = fused_qkv(len(seq_lens), num_heads, num_kv_heads, head_size, dtype, generator)
    return case, query


def prefill_case(prior, q_lens, num_heads, num_kv_heads, block_size, head_size, dtype, seed=0):
    """(a ``paged_case`` of ``prior + q_lens`` tokens per sequence, the ``q_lens`` query
    tokens, their ``query_start_loc``), seeded."""
    generator = torch.Generator().manual_seed(seed)
    seq_lens = [p + q for p, q in zip(prior, q_lens)]
    case = paged_case(seq_lens, num_kv_heads, block_size, head_size, dtype, generator)
    query, _, _ = fused_qkv(sum(q_lens), num_heads, num_kv_heads, head_size, dtype, generator)
    return case, query, query_start_loc(q_lens)
