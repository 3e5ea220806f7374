"""reshape_and_cache, copy_blocks and swap_blocks: exact results, exact bytes."""

from __future__ import annotations

import pytest
import torch

from pagedserve.gpu_worker import ops

from . import reference
from .cases import fused_qkv, random_pool

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_size", [64, 80, 96, 128, 192, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_and_cache_writes_slots(dtype, head_size, block_size):
    generator = torch.Generator().manual_seed(0)
    num_blocks, num_kv_heads, num_tokens = 12, 2, 23
    pool = random_pool(num_blocks, num_kv_heads, block_size, head_size, dtype, generator)
    key_cache, value_cache = pool[:, 1, 0], pool[:, 1, 1]
    _, key, value = fused_qkv(num_tokens, 6, num_kv_heads, head_size, dtype, generator)
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    slots[[3, 11, 22]] = -1  # padding tokens
    expected_key, expected_value = reference.reshape_and_cache(
        key, value, key_cache, value_cache, slots
    )
    other_layer = pool[:, 0].clone()

    ops.reshape_and_cache(key, value, key_cache, value_cache, slots)

    assert _same_bytes(key_cache, expected_key)
    assert _same_bytes(value_cache, expected_value)
    assert _same_bytes(pool[:, 0], other_layer)


def test_reshape_and_cache_first_and_last_slot():
    generator = torch.Generator().manual_seed(1)
    pool = random_pool(4, 1, 8, 64, torch.float32, generator, num_layers=1)
    key_cache, value_cache = pool[:, 0, 0], pool[:, 0, 1]
    _, key, value = fused_qkv(2, 1, 1, 64, torch.float32, generator)
    ops.reshape_and_cache(key, value, key_cache, value_cache, torch.tensor([0, 31]))
    assert torch.equal(key_cache[0, 0, 0], key[0, 0])
    assert torch.equal(value_cache[3, 0, 7], value[1, 0])


def test_reshape_and_cache_rejects_slot_past_the_cache():
    generator = torch.Generator().manual_seed(2)
    pool = random_pool(4, 1, 8, 64, torch.float32, generator, num_layers=1)
    before = pool.clone()
    _, key, value = fused_qkv(2, 1, 1, 64, torch.float32, generator)
    with pytest.raises(ValueError, match=r"slot_mapping\[1\] = 32 is past the last slot"):
        ops.reshape_and_cache(key, value, pool[:, 0, 0], pool[:, 0, 1], torch.tensor([0, 32]))
    assert torch.equal(pool, before)  # nothing written


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_blocks_copies_whole_blocks_exactly(dtype):
    generator = torch.Generator().manual_seed(3)
    pool = random_pool(10, 1, 16, 64, dtype, generator, num_layers=3)
    # Bit patterns arithmetic could change: NaN payloads and negative zero.
    pool.view(-1).view(torch.int16)[:64] = 0x7F81  # signalling NaNs with payload
    pool.view(-1)[100] = -0.0
    mapping = torch.tensor([[0, 5], [2, 7], [0, 9]])
    expected = reference.copy_blocks(pool, pool, mapping)
    ops.copy_blocks(pool, mapping)
    assert _same_bytes(pool, expected)
    assert _same_bytes(pool[5], pool[0]) and _same_bytes(pool[9], pool[0])


def test_copy_blocks_large_batch_runs_in_parallel_and_exactly():
    generator = torch.Generator().manual_seed(4)
    pool = random_pool(300, 4, 16, 128, torch.bfloat16, generator)  # 256 KiB blocks
    mapping = torch.stack([torch.arange(0, 150), torch.arange(150, 300)], dim=1)
    expected = reference.copy_blocks(pool, pool, mapping)
    ops.copy_blocks(pool, mapping)
    assert _same_bytes(pool, expected)


@pytest.mark.parametrize(
    ("mapping", "message"),
    [
        ([[0, 3], [1, 3]], "destination block 3 more than once"),
        ([[0, 3], [3, 4]], r"block_mapping\[1\]\[0\] = 3 is also a destination"),
        ([[0, 10]], r"block_mapping\[0\]\[1\] = 10 is outside \[0, 10\)"),
        ([[-1, 2]], r"block_mapping\[0\]\[0\] = -1 is outside"),
    ],
)
def test_copy_blocks_rejects_bad_mappings(mapping, message):
    pool = random_pool(10, 1, 8, 64, torch.float32, torch.Generator().manual_seed(5))
    before = pool.clone()
    with pytest.raises(ValueError, match=message):
        ops.copy_blocks(pool, torch.tensor(mapping))
    assert torch.equal(pool, before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_swap_blocks_between_pools_of_different_sizes(dtype):
    generator = torch.Generator().manual_seed(6)
    device_pool = random_pool(12, 2, 8, 80, dtype, generator)
    host_pool = random_pool(5, 2, 8, 80, dtype, generator)
    swap_out = torch.tensor([[11, 0], [3, 4], [7, 2]])
    expected_host = reference.copy_blocks(device_pool, host_pool, swap_out)
    ops.swap_blocks(device_pool, host_pool, swap_out)
    assert _same_bytes(host_pool, expected_host)

    swap_in = torch.tensor([[0, 1], [4, 6], [2, 2]])
    expected_device = reference.copy_blocks(host_pool, device_pool, swap_in)
    ops.swap_blocks(host_pool, device_pool, swap_in)
    assert _same_bytes(device_pool, expected_device)
    assert _same_bytes(device_pool[1], device_pool[11])


def test_swap_blocks_rejects_block_outside_destination_pool():
    generator = torch.Generator().manual_seed(7)
    device_pool = random_pool(12, 1, 8, 64, torch.float32, generator)
    host_pool = random_pool(5, 1, 8, 64, torch.float32, generator)
    with pytest.raises(ValueError, match=r"block_mapping\[0\]\[1\] = 5 is outside \[0, 5\)"):
        ops.swap_blocks(device_pool, host_pool, torch.tensor([[11, 5]]))


def test_empty_mappings_and_batches_are_no_ops():
    generator = torch.Generator().manual_seed(8)
    pool = random_pool(4, 1, 8, 64, torch.float32, generator)
    before = pool.clone()
    ops.copy_blocks(pool, torch.empty(0, 2, dtype=torch.int64))
    ops.swap_blocks(pool, pool.clone(), torch.empty(0, 2, dtype=torch.int64))
    empty = torch.empty(0, 1, 64)
    ops.reshape_and_cache(empty, empty, pool[:, 0, 0], pool[:, 0, 1], torch.empty(0).long())
    assert torch.equal(pool, before)
