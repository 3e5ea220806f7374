"""Block pool and block tables: exact ids, ref counts, capacity as a value."""

from __future__ import annotations

import pytest

from pagedserve.scheduler.block_manager import BlockManager
from pagedserve.scheduler.block_pool import BlockPool


def test_pool_hands_out_ids_in_fifo_order():
    pool = BlockPool(6)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) == [3, 4]
    pool.decref([1, 0])
    assert pool.num_free_blocks == 3
    # Block 5 was free longest, then 1, then 0.
    assert pool.allocate(3) == [5, 1, 0]
    assert pool.num_free_blocks == 0


def test_pool_capacity_is_a_value():
    pool = BlockPool(2)
    assert pool.allocate(3) is None
    assert pool.num_free_blocks == 2
    assert pool.allocate(0) == []


def test_pool_ref_counts_keep_shared_blocks_alive():
    pool = BlockPool(4)
    block_ids = pool.allocate(2)
    pool.incref(block_ids)
    assert [pool.ref_count(b) for b in block_ids] == [2, 2]
    pool.decref(block_ids)
    assert pool.num_free_blocks == 2  # still held once
    pool.decref(block_ids)
    assert pool.num_free_blocks == 4
    with pytest.raises(RuntimeError, match="double free of block 0"):
        pool.decref([0])
    with pytest.raises(RuntimeError, match="incref of free block 1"):
        pool.incref([1])


def test_pool_rejects_empty_size():
    with pytest.raises(ValueError, match="num_blocks must be >= 1, got 0"):
        BlockPool(0)


def test_tables_grow_on_demand_with_exact_ids():
    manager = BlockManager(num_blocks=8, block_size=16)
    assert manager.allocate("a", 17) == [0, 1]
    assert manager.allocate("b", 16) == [2]
    # 32 tokens still fit in a's two blocks; token 33 needs a third.
    assert manager.append("a", 32) == []
    assert manager.append("a", 33) == [3]
    assert manager.append("b", 17) == [4]
    assert manager.block_tables == {"a": [0, 1, 3], "b": [2, 4]}
    manager.check_integrity()
    manager.free("a")
    assert manager.num_free_blocks == 6
    assert manager.append("b", 40) == [5]  # FIFO: 5, 6, 7 were free before a's blocks
    manager.free("b")
    assert manager.num_free_blocks == 8
    manager.check_integrity()


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_block_boundaries(block_size):
    manager = BlockManager(num_blocks=4, block_size=block_size)
    assert len(manager.allocate("r", 1)) == 1
    assert manager.append("r", block_size) == []
    assert len(manager.append("r", block_size + 1)) == 1
    assert manager.num_new_blocks("r", 2 * block_size) == 0
    assert manager.num_new_blocks("r", 2 * block_size + 1) == 1


def test_can_append_and_allocate_report_capacity():
    manager = BlockManager(num_blocks=3, block_size=8)
    manager.allocate("a", 16)
    assert manager.can_append("a", 24)
    assert not manager.can_append("a", 25)
    assert manager.append("a", 25) is None
    assert manager.block_tables["a"] == [0, 1]  # a failed append changes nothing
    assert not manager.can_allocate(9)
    assert manager.allocate("b", 9) is None
    assert "b" not in manager.block_tables


def test_watermark_applies_only_when_asked():
    manager = BlockManager(num_blocks=4, block_size=8, watermark_blocks=1)
    assert not manager.can_allocate(32)
    assert manager.can_allocate(32, keep_watermark=False)
    assert manager.allocate("a", 24) == [0, 1, 2]
    assert manager.allocate("b", 1) is None  # would eat the watermark
    assert manager.allocate("b", 1, keep_watermark=False) == [3]


def test_integrity_check_catches_corruption():
    manager = BlockManager(num_blocks=4, block_size=8)
    manager.allocate("a", 8)
    manager.check_integrity()
    manager.block_tables["a"].append(3)  # a table pointing at a free block
    with pytest.raises(AssertionError, match="block 3: ref count 0 but 1 holder"):
        manager.check_integrity()
    manager.block_tables["a"].pop()
    manager.pool._ref_counts[2] = -1
    with pytest.raises(AssertionError, match="negative ref count"):
        manager.check_integrity()


def test_block_size_is_validated():
    with pytest.raises(ValueError, match="block_size must be one of 8, 16, 32 .*got 12"):
        BlockManager(num_blocks=4, block_size=12)


def test_free_unknown_request_is_a_no_op():
    manager = BlockManager(num_blocks=2, block_size=8)
    manager.free("never-allocated")
    assert manager.num_free_blocks == 2


def test_swap_out_and_in_move_tables_between_pools_with_exact_pairs():
    manager = BlockManager(num_blocks=6, block_size=8, num_host_blocks=4)
    manager.allocate("a", 8)
    assert manager.allocate("b", 20) == [1, 2, 3]
    assert manager.swap_out(["b"]) == [(1, 0), (2, 1), (3, 2)]
    assert "b" not in manager.block_tables and manager.host_block_tables["b"] == [0, 1, 2]
    assert manager.num_free_blocks == 5 and manager.num_free_host_blocks == 1
    manager.check_integrity()
    manager.allocate("c", 8)  # takes block 4
    assert manager.swap_in(["b"]) == [(0, 5), (1, 1), (2, 2)]
    assert manager.block_tables["b"] == [5, 1, 2]
    assert manager.num_free_host_blocks == 4
    manager.check_integrity()


def test_swap_capacity_is_a_value():
    manager = BlockManager(num_blocks=4, block_size=8, num_host_blocks=1)
    manager.allocate("a", 16)
    assert not manager.can_swap_out(["a"])
    assert manager.swap_out(["a"]) is None
    assert manager.block_tables["a"] == [0, 1]
    without_host = BlockManager(num_blocks=4, block_size=8)
    without_host.allocate("a", 8)
    assert without_host.swap_out(["a"]) is None


def test_free_releases_a_swapped_request():
    manager = BlockManager(num_blocks=4, block_size=8, num_host_blocks=4)
    manager.allocate("a", 16)
    manager.swap_out(["a"])
    manager.free("a")
    assert manager.num_free_blocks == 4 and manager.num_free_host_blocks == 4
    manager.check_integrity()


def test_fork_shares_blocks_and_copy_on_write_gives_a_private_copy():
    manager = BlockManager(num_blocks=8, block_size=8)
    assert manager.allocate("p", 20) == [0, 1, 2]  # tokens 16..19 in block 2
    assert manager.fork("p", "c") == [0, 1, 2]
    assert [manager.pool.ref_count(b) for b in (0, 1, 2)] == [2, 2, 2]
    manager.check_integrity()
    # Token 20 goes into block 2, which holds tokens and is shared: copy first.
    assert manager.needs_copy_on_write("c", 20)
    assert manager.decode_growth("c", 20) is None  # a decode's view: copy first
    assert manager.can_append("c", 21, 20)
    assert manager.copy_on_write("c", 20) == (2, 3)
    assert manager.block_tables["c"] == [0, 1, 3]
    assert manager.block_tables["p"] == [0, 1, 2]  # the sibling keeps its block
    assert manager.pool.ref_count(2) == 1
    # The parent now holds block 2 alone: it writes in place.
    assert not manager.needs_copy_on_write("p", 20)
    assert manager.copy_on_write("p", 20) is None
    assert manager.decode_growth("p", 20) == 0  # in place, in a block it has
    # A write that starts a fresh block never copies.
    manager.fork("p", "d")
    assert not manager.needs_copy_on_write("d", 24)
    assert manager.decode_growth("d", 24) == 1  # token 24 needs a fourth block
    manager.check_integrity()


def test_copy_on_write_capacity_is_a_value_and_can_be_undone():
    manager = BlockManager(num_blocks=4, block_size=8)
    manager.allocate("p", 12)
    manager.fork("p", "c")
    manager.allocate("x", 8)
    assert manager.num_free_blocks == 1
    # A copy plus a new block for token 16 would need two.
    assert not manager.can_append("c", 17, 12)
    assert manager.can_append("c", 16, 12)
    assert manager.copy_on_write("c", 12) == (1, 3)
    assert manager.copy_on_write("p", 12) is None  # no longer shared
    manager.undo_copy_on_write("c", 1, 1, 3)
    assert manager.block_tables["c"] == [0, 1]
    assert manager.pool.ref_count(1) == 2 and manager.pool.is_free(3)
    manager.check_integrity()


def test_group_swap_keeps_shared_blocks_shared():
    manager = BlockManager(num_blocks=8, block_size=8, num_host_blocks=8)
    manager.allocate("a", 20)  # [0, 1, 2]
    manager.fork("a", "b")
    manager.copy_on_write("b", 20)  # b: [0, 1, 3]
    assert manager.can_swap_out(["a", "b"])
    # Four distinct blocks travel once each.
    assert manager.swap_out(["a", "b"]) == [(0, 0), (1, 1), (2, 2), (3, 3)]
    assert manager.host_block_tables == {"a": [0, 1, 2], "b": [0, 1, 3]}
    assert [manager.host_pool.ref_count(b) for b in range(4)] == [2, 2, 1, 1]
    assert manager.num_free_blocks == 8
    manager.check_integrity()
    manager.allocate("z", 8)  # takes device block 4, free the longest
    assert manager.can_swap_in(["a", "b"], keep_watermark=False, num_tokens=[21, 21])
    pairs = manager.swap_in(["a", "b"])
    device_of = dict(pairs)
    assert len(pairs) == 4
    assert manager.block_tables["a"] == [device_of[0], device_of[1], device_of[2]]
    assert manager.block_tables["b"] == [device_of[0], device_of[1], device_of[3]]
    assert manager.pool.ref_count(device_of[0]) == 2
    assert manager.num_free_host_blocks == 8
    manager.check_integrity()


def test_group_swap_capacity_counts_shared_blocks_once():
    manager = BlockManager(num_blocks=8, block_size=8, num_host_blocks=3)
    manager.allocate("a", 20)
    manager.fork("a", "b")
    assert manager.can_swap_out(["a", "b"])  # 3 distinct blocks, not 6
    manager.copy_on_write("b", 20)
    assert not manager.can_swap_out(["a", "b"])
    assert manager.swap_out(["a", "b"]) is None
    manager.check_integrity()


def test_contiguous_allocation_is_first_fit_and_fragments():
    pool = BlockPool(10)
    assert pool.allocate_contiguous(3) == [0, 1, 2]
    assert pool.allocate_contiguous(4) == [3, 4, 5, 6]
    assert pool.allocate_contiguous(2) == [7, 8]
    pool.decref([0, 1, 2])
    pool.decref([7, 8])
    # 6 blocks free, but in runs of 3 (0..2) and 3 (7..9): no run of 4.
    assert pool.num_free_blocks == 6
    assert pool.largest_free_run() == 3
    assert pool.allocate_contiguous(4) is None
    assert pool.allocate_contiguous(3) == [0, 1, 2]
    pool.check_integrity({block: 1 for block in range(7)})


def test_contiguous_policy_reserves_the_whole_range_up_front():
    manager = BlockManager(num_blocks=10, block_size=8, allocation_policy="max")
    assert manager.can_allocate(5, reserve_tokens=40)
    assert manager.allocate("a", 5, reserve_tokens=40) == [0, 1, 2, 3, 4]
    # Growing inside the reservation needs no block.
    assert manager.num_new_blocks("a", 40) == 0
    assert manager.append("a", 40) == []
    assert not manager.can_allocate(5, reserve_tokens=48)  # 6 blocks, 5 free
    assert manager.allocate("b", 5, reserve_tokens=48) is None
    manager.check_integrity()
    with pytest.raises(ValueError, match="prefix caching needs allocation_policy 'paged'"):
        BlockManager(10, 8, allocation_policy="oracle", enable_prefix_caching=True)
