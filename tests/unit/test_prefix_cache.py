"""Prefix caching in the block manager: hits, ref counts, exact eviction order."""

from __future__ import annotations

import pagedserve.scheduler.block_manager as block_manager_module
from pagedserve.scheduler import prefix_cache
from pagedserve.scheduler.block_manager import BlockManager


def manager(num_blocks=8) -> BlockManager:
    return BlockManager(num_blocks, 8, enable_prefix_caching=True)


def run_prefill(m: BlockManager, request_id: str, tokens: list[int], namespace=None) -> list[int]:
    cached = m.find_cached_prefix(tokens, namespace)
    table = m.allocate(request_id, len(tokens), keep_watermark=False, cached_block_ids=cached)
    m.cache_full_blocks(request_id, tokens, len(tokens), namespace)
    return table


def test_second_request_shares_the_full_blocks_of_its_prefix():
    m = manager()
    prompt = list(range(100, 120))  # 2 full blocks of 8 + 4 tokens
    assert run_prefill(m, "a", prompt) == [0, 1, 2]
    assert m.find_cached_prefix(prompt) == [0, 1]
    table = run_prefill(m, "b", prompt[:16] + [7, 7, 7])
    assert table == [0, 1, 3]
    assert [m.pool.ref_count(b) for b in (0, 1, 2, 3)] == [2, 2, 1, 1]
    m.check_integrity()


def test_last_token_is_always_computed():
    m = manager()
    prompt = list(range(16))  # exactly two blocks
    run_prefill(m, "a", prompt)
    # Only the first block can be a hit: the second holds the last token.
    assert m.find_cached_prefix(prompt) == [0]


def test_free_cached_blocks_stay_reusable_until_evicted():
    m = manager(num_blocks=4)
    prompt = list(range(24))
    run_prefill(m, "a", prompt)  # blocks 0, 1, 2
    m.free("a")
    assert m.num_free_blocks == 4
    assert m.find_cached_prefix(prompt + [1]) == [0, 1, 2]
    table = run_prefill(m, "b", prompt + [1])
    assert table[:3] == [0, 1, 2] and m.num_free_blocks == 0
    m.check_integrity()


def test_eviction_is_least_recently_used_and_tail_first():
    m = manager(num_blocks=6)
    run_prefill(m, "a", list(range(24)))  # 0, 1, 2
    run_prefill(m, "b", list(range(50, 66)))  # 3, 4
    m.free("a")  # freed first, tail first: 2, 1, 0
    m.free("b")  # then 4, 3
    # Free queue: 5 (never used), then 2, 1, 0, then 4, 3.
    assert m.allocate("c", 8 * 3, keep_watermark=False) == [5, 2, 1]
    # a's block 0 still serves its first block; its tail is gone.
    assert m.find_cached_prefix(list(range(24)) + [9]) == [0]
    assert m.find_cached_prefix(list(range(50, 66)) + [9]) == [3, 4]


def test_namespaces_do_not_share():
    m = manager()
    prompt = list(range(17))
    run_prefill(m, "a", prompt, namespace="tenant-1")
    assert m.find_cached_prefix(prompt, "tenant-1") == [0, 1]
    assert m.find_cached_prefix(prompt, "tenant-2") == []
    assert m.find_cached_prefix(prompt) == []


def test_a_hash_collision_is_not_a_hit(monkeypatch):
    monkeypatch.setattr(prefix_cache, "block_hash", lambda parent, tokens, namespace: 42)
    monkeypatch.setattr(block_manager_module, "block_hash", prefix_cache.block_hash)
    m = manager()
    run_prefill(m, "a", list(range(9)))
    assert m.find_cached_prefix(list(range(9))) == [0]
    assert m.find_cached_prefix(list(range(1, 10))) == []  # same hash, other tokens


def test_reset_forgets_everything():
    m = manager()
    prompt = list(range(17))
    run_prefill(m, "a", prompt)
    m.reset_prefix_cache()
    assert m.find_cached_prefix(prompt) == []
    assert len(m.prefix_cache) == 0
    m.free("a")
    m.check_integrity()


def test_prefix_hit_blocks_count_against_free_blocks():
    m = manager(num_blocks=3)
    prompt = list(range(17))
    run_prefill(m, "a", prompt)  # 0, 1, 2 in use... then freed
    m.free("a")
    cached = m.find_cached_prefix(prompt)
    assert cached == [0, 1]
    # 3 blocks needed, 2 of them free-but-cached hits: all 3 free blocks are taken.
    assert m.can_allocate(17, keep_watermark=False, cached_block_ids=cached)
    assert not m.can_allocate(25, keep_watermark=False, cached_block_ids=cached)
