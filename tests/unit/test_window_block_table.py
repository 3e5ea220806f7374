"""Blocks behind a sliding window go back to the pool: the block manager's tables, the
scheduler's steps and its admission check, on hand-made step results.

Window W: the query token at position i reads positions i - W < j <= i, so a block whose last
position is at or before i - W is never read again by i or any later token.
"""

from __future__ import annotations

from itertools import accumulate

import pytest

from helpers.scheduling import EOS, run_step
from pagedserve.scheduler.block_manager import BlockManager, blocks_for_tokens, blocks_spanned
from pagedserve.scheduler.capacity import check_request_fits, max_sequence_tokens
from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.messages import NULL_BLOCK
from pagedserve.scheduler.request import Request
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.scheduler.scheduler import Scheduler

N = NULL_BLOCK


def test_blocks_spanned_by_consecutive_positions():
    # 1 position: one block; 9 positions of blocks of 8 may straddle two blocks, never three.
    assert [blocks_spanned(n, 8) for n in (0, 1, 8, 9, 16, 17)] == [0, 1, 2, 2, 3, 3]
    # Checked against every start offset.
    for num_tokens in range(1, 40):
        worst = max((start + num_tokens - 1) // 8 - start // 8 + 1 for start in range(8))
        assert blocks_spanned(num_tokens, 8) == worst, num_tokens


def test_blocks_wholly_before_the_window_are_freed_in_place():
    manager = BlockManager(num_blocks=8, block_size=8, sliding_window=12)
    assert manager.allocate("a", 40) == [0, 1, 2, 3, 4]
    # Query at 19 reads 8..19: block 0 (0..7) is behind the window.
    assert manager.first_needed_block(19) == 1
    assert manager.free_blocks_before_window("a", 19) == 1
    assert manager.block_tables["a"] == [N, 1, 2, 3, 4]
    assert manager.num_free_blocks == 4
    # Nothing more until the window leaves block 1 (position 20 reads 9..20).
    assert manager.free_blocks_before_window("a", 19) == 0
    assert manager.free_blocks_before_window("a", 20) == 0
    # Position 36 reads 25..36: blocks 1 and 2 go; the count is of the table's freed entries.
    assert manager.free_blocks_before_window("a", 36) == 3
    assert manager.block_tables["a"] == [N, N, N, 3, 4]
    assert (manager.num_window_freed("a"), manager.num_held_blocks("a")) == (3, 2)
    manager.check_integrity()
    # Growing keeps the positions: token 40 goes to entry 5.
    assert manager.append("a", 41) == [5]
    assert manager.block_tables["a"] == [N, N, N, 3, 4, 5]
    manager.free("a")
    assert manager.num_free_blocks == 8
    manager.check_integrity()


def test_without_a_window_nothing_is_freed():
    manager = BlockManager(num_blocks=8, block_size=8)
    manager.allocate("a", 40)
    assert manager.free_blocks_before_window("a", 39) == 0
    assert manager.block_tables["a"] == [0, 1, 2, 3, 4]
    # A contiguous reservation is held whole: the baselines have no window freeing.
    contiguous = BlockManager(8, 8, allocation_policy="max", sliding_window=12)
    assert contiguous.sliding_window == 0


def test_shared_blocks_are_freed_by_each_holder():
    manager = BlockManager(num_blocks=8, block_size=8, sliding_window=8)
    manager.allocate("a", 24)
    manager.fork("a", "b")
    assert manager.free_blocks_before_window("a", 24) == 2
    # b still holds blocks 0 and 1: nothing returned to the pool yet.
    assert manager.num_free_blocks == 5
    # A fork of a trimmed table shares its freed prefix.
    manager.fork("a", "c")
    assert manager.block_tables["c"] == [N, N, 2]
    manager.check_integrity()
    assert manager.free_blocks_before_window("b", 24) == 2
    assert manager.num_free_blocks == 7
    for request_id in "abc":
        manager.free(request_id)
    assert manager.num_free_blocks == 8
    manager.check_integrity()


def test_swap_moves_only_the_blocks_held():
    manager = BlockManager(num_blocks=8, block_size=8, num_host_blocks=4, sliding_window=8)
    manager.allocate("a", 32)
    manager.free_blocks_before_window("a", 31)
    assert manager.block_tables["a"] == [N, N, N, 3]
    assert manager.swap_out(["a"]) == [(3, 0)]
    assert manager.host_block_tables["a"] == [N, N, N, 0]
    manager.check_integrity()
    assert manager.blocks_to_swap_in(["a"], [33]) == 2
    assert manager.swap_in(["a"]) == [(0, 4)]
    assert manager.block_tables["a"] == [N, N, N, 4]
    assert manager.num_window_freed("a") == 3
    manager.check_integrity()


def test_a_prefix_hit_takes_only_the_blocks_inside_the_window():
    manager = BlockManager(
        num_blocks=10, block_size=8, enable_prefix_caching=True, sliding_window=10
    )
    prompt = list(range(100, 141))  # 41 tokens: five full blocks cached
    manager.allocate("a", 41)
    manager.cache_full_blocks("a", prompt, 41)
    manager.free("a")
    cached = manager.find_cached_prefix(prompt)
    assert cached == [4, 3, 2, 1, 0][::-1]
    # The hit's 40 tokens are computed; the query at 40 reads 31..40: blocks 0-2 are skipped,
    # so only blocks 3 and 4 (free but cached) and one new block are taken.
    assert manager.blocks_to_allocate(41, cached) == 3
    table = manager.allocate("b", 41, cached_block_ids=cached)
    assert table[:5] == [N, N, N, 3, 4]
    assert manager.num_window_freed("b") == 3
    assert manager.num_free_blocks == 7
    manager.check_integrity()
    # Registering b's blocks keeps the hash chain through the freed entries: a third request
    # still hits all five blocks (0-2 were never taken out of the cache).
    manager.cache_full_blocks("b", prompt, 41)
    assert manager.find_cached_prefix(prompt) == cached


def test_a_block_freed_before_it_was_registered_still_links_the_chain():
    manager = BlockManager(
        num_blocks=10, block_size=8, enable_prefix_caching=True, sliding_window=8
    )
    tokens = list(range(200, 233))  # 33 tokens
    manager.allocate("a", 33)
    # Its window passed blocks 0-2 before any block was registered (tokens known late).
    manager.free_blocks_before_window("a", 32)
    manager.cache_full_blocks("a", tokens, 33)
    # Blocks 0-2 were never cached: the chain of hashes is complete, the lookup finds no
    # first block, so nothing.
    assert manager.find_cached_prefix(tokens) == []
    assert len(manager._block_hashes["a"]) == 4
    manager.check_integrity()


def test_integrity_check_catches_a_freed_entry_out_of_place():
    manager = BlockManager(num_blocks=8, block_size=8, sliding_window=8)
    manager.allocate("a", 24)
    manager.free_blocks_before_window("a", 16)
    manager.block_tables["a"][0], manager.block_tables["a"][1] = 1, N
    with pytest.raises(AssertionError, match=r"NULL_BLOCK entries at \[1\]"):
        manager.check_integrity()


# ------------------------------------------------------------------------------ scheduler


def windowed_scheduler(num_blocks, window=16, block_size=8, **config) -> Scheduler:
    config.setdefault("max_model_len", 1024)
    config.setdefault("watermark_fraction", 0.0)
    config.setdefault("max_num_batched_tokens", 16)
    return Scheduler(
        SchedulerConfig(sliding_window=window, **config),
        BlockManager(num_blocks, block_size, sliding_window=window),
    )


def windowed_request(request_id, num_prompt_tokens, max_tokens, n=1, priority=0) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=[10 + i % 50 for i in range(num_prompt_tokens)],
        sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0, n=n),
        eos_token_ids=frozenset({EOS}),
        arrival_time_s=0.0,
        max_model_len=1024,
        priority=priority,
    )


def test_a_request_longer_than_the_cache_runs_to_its_end():
    # 5 blocks of 8 = 40 slots; the request reaches 60 + 100 = 160 tokens.
    scheduler = windowed_scheduler(num_blocks=5)
    scheduler.add_request(windowed_request("a", 60, 100))
    manager = scheduler.block_manager
    held = []
    freed_reports = []
    outputs = 0
    while scheduler.has_unfinished_requests():
        plan, deltas = run_step(scheduler)
        outputs += sum(len(d.new_token_ids) for d in deltas)
        freed_reports.extend(plan.window_freed_blocks.items())
        if "a" in manager.block_tables:
            held.append(manager.num_held_blocks("a"))
        manager.check_integrity()
    assert outputs == 100
    assert scheduler.num_preemptions == 0
    # A 16-token chunk plus the 15 positions before it: at most 5 blocks, never the 20 of 160.
    assert max(held) <= blocks_spanned(16 - 1 + 16, 8) == 5
    # The workers heard of every freed block, the count growing to the table's last window.
    counts = [count for request_id, count in freed_reports if request_id == "a"]
    assert counts == sorted(counts) and counts[-1] >= (160 - 16) // 8 - 1
    assert manager.num_free_blocks == 5


def test_two_long_requests_share_a_small_cache():
    # Each holds at most 3 blocks when decoding (window 16 and one token); 8 blocks hold both.
    scheduler = windowed_scheduler(num_blocks=8, max_num_batched_tokens=32)
    scheduler.add_request(windowed_request("a", 20, 80))
    scheduler.add_request(windowed_request("b", 20, 80))
    while scheduler.has_unfinished_requests():
        run_step(scheduler)
        scheduler.block_manager.check_integrity()
    assert scheduler.num_preemptions == 0


def run_to_the_end(scheduler: Scheduler, arrivals: dict[int, Request], watched: str):
    """Run until every request has finished, adding ``arrivals`` at their step numbers.
    Returns the plans, ``watched``'s output token count, and its block table as it was at
    its last step (its blocks go back to the pool as it finishes)."""
    plans, num_outputs, last_table = [], 0, None
    while scheduler.has_unfinished_requests() or arrivals:
        if len(plans) in arrivals:
            scheduler.add_request(arrivals.pop(len(plans)))
        if watched in scheduler.block_manager.block_tables:
            last_table = list(scheduler.block_manager.block_tables[watched])
        plan, deltas = run_step(scheduler)
        plans.append(plan)
        num_outputs += sum(len(d.new_token_ids) for d in deltas if d.request_id == watched)
        scheduler.block_manager.check_integrity()
        assert len(plans) < 500, "no end in sight: requests preempting each other for good"
    return plans, num_outputs, last_table


def test_a_preempted_windowed_request_recomputes_in_chunks():
    # Recompute: its table is freed whole, and it comes back as a prompt of all its tokens,
    # computed a chunk at a time behind the window, so it fits the small cache again. A
    # request of a higher priority arrives when "a" is some 70 tokens long and preempts it
    # (first come, first served preempts the newest request, here before it grows long).
    window, block_size, budget, num_blocks = 16, 8, 16, 5
    scheduler = windowed_scheduler(num_blocks, window, block_size, scheduling_policy="priority")
    scheduler.add_request(windowed_request("a", 30, 80, priority=1))
    urgent = {40: windowed_request("b", 10, 10, priority=0)}
    plans, num_outputs, last_table = run_to_the_end(scheduler, urgent, "a")
    assert scheduler.num_recompute_preemptions >= 1
    assert all(plan.num_scheduled_tokens <= budget for plan in plans)

    # Its last return carries all its tokens so far, computed from position 0 again.
    start = max(i for i, plan in enumerate(plans) for r in plan.new_requests if r.request_id == "a")
    (resumed,) = [r for r in plans[start].new_requests if r.request_id == "a"]
    num_tokens = len(resumed.token_ids)
    assert num_tokens >= 70 and resumed.num_computed_tokens == 0
    chunks, freed_reports = [resumed.num_scheduled_tokens], []
    for plan in plans[start + 1 :]:
        (item,) = [r for r in plan.cached_requests if r.request_id == "a"]
        if item.num_computed_tokens == num_tokens:
            break  # recomputed: decoding again
        chunks.append(item.num_scheduled_tokens)
        freed_reports.append(plan.window_freed_blocks.get("a"))
    assert sum(chunks) == num_tokens and max(chunks) <= budget
    assert len(chunks) == -(-num_tokens // budget)  # whole budgets: it ran alone
    # Before each later chunk the blocks wholly behind the window of its first query went
    # back to the pool, and the plan told the workers the new count of NULL_BLOCK entries.
    freed = 0
    for chunk_start, report in zip(accumulate(chunks[:-1]), freed_reports):
        behind = max(0, chunk_start - window + 1) // block_size
        assert report == (behind if behind > freed else None), (chunk_start, report)
        freed = behind
    assert freed >= 4  # it recomputed holding a window's blocks, not all of its own

    # It ends as a run that was never preempted ends: same output, same table shape.
    alone = windowed_scheduler(64, window, block_size, scheduling_policy="priority")
    alone.add_request(windowed_request("a", 30, 80, priority=1))
    _, alone_outputs, alone_table = run_to_the_end(alone, {}, "a")
    assert alone.num_recompute_preemptions == 0
    assert num_outputs == alone_outputs == 80
    assert [b == N for b in last_table] == [b == N for b in alone_table]
    # 110 tokens: its last query, at position 108, reads 93..108, so blocks 0-10 are freed.
    assert last_table.count(N) == 11 and len(last_table) == blocks_for_tokens(109, block_size)
    assert scheduler.block_manager.num_free_blocks == num_blocks
    scheduler.block_manager.check_integrity()


def test_freed_blocks_of_a_preempted_request_leave_the_plan():
    scheduler = windowed_scheduler(num_blocks=4, max_num_batched_tokens=8)
    scheduler.add_request(windowed_request("a", 24, 40))
    for _ in range(3):
        run_step(scheduler)  # prefilled in 8-token chunks, then a decode
    scheduler.add_request(windowed_request("b", 8, 40))
    for _ in range(20):
        plan, _ = run_step(scheduler)
        assert set(plan.window_freed_blocks) <= {
            r.request_id for r in (*plan.new_requests, *plan.cached_requests)
        }
        scheduler.block_manager.check_integrity()


def test_admission_counts_the_window_not_the_whole_length():
    config = SchedulerConfig(max_model_len=1024, max_num_batched_tokens=16, sliding_window=16)
    # 5 blocks of 8 hold any step: 15 window positions + 16 new tokens span <= 5 blocks.
    check_request_fits(60, 900, config, 8, 5)
    with pytest.raises(
        ValueError,
        match=r"a step of up to 16 tokens \(max_num_batched_tokens\) with the 16-token sliding "
        r"window before it spans up to 5 blocks of 8 tokens, but the whole KV cache has 4 blocks",
    ):
        check_request_fits(60, 900, config, 8, 4)
    # Short requests need only their own blocks, as without a window.
    check_request_fits(10, 10, config, 8, 3)
    # n > 1: a group preempted by recompute gets all its blocks at once.
    with pytest.raises(ValueError, match=r"x 2 sequences = 240 blocks"):
        check_request_fits(60, 900, config, 8, 5, num_sequences=2)
    # Without chunked prefill a recomputed request is one prompt of all its tokens.
    unchunked = SchedulerConfig(
        max_model_len=1024,
        max_num_batched_tokens=1024,
        sliding_window=16,
        enable_chunked_prefill=False,
    )
    with pytest.raises(ValueError, match="= 120 blocks of 8 tokens"):
        check_request_fits(60, 900, unchunked, 8, 5)
    # Nor does a model without a window.
    with pytest.raises(ValueError, match="= 120 blocks of 8 tokens"):
        check_request_fits(60, 900, SchedulerConfig(max_model_len=1024), 8, 5)


def test_the_longest_sequence_a_cache_holds():
    # What an OpenAI request without max_tokens may generate up to.
    config = SchedulerConfig(max_model_len=1024, max_num_batched_tokens=16, sliding_window=16)
    assert max_sequence_tokens(config, 8, 5) == 1024
    assert max_sequence_tokens(config, 8, 4) == 32  # a step behind the window does not fit
    assert max_sequence_tokens(config, 8, 5, num_sequences=2) == 16
    assert max_sequence_tokens(SchedulerConfig(max_model_len=1024), 8, 5) == 40
    assert max_sequence_tokens(SchedulerConfig(max_model_len=30), 8, 5) == 30


def test_config_and_block_manager_must_agree_on_the_window():
    with pytest.raises(ValueError, match="sliding_window must be an integer >= 0"):
        SchedulerConfig(sliding_window=-1)
    with pytest.raises(ValueError, match="scheduler config's sliding_window is 0"):
        Scheduler(SchedulerConfig(), BlockManager(8, 8, sliding_window=16))
