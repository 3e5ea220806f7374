"""Sliding-window attention (Mistral, Qwen2) of the decode, prefill and gathered-prefill ops
against the float64 reference: query position i sees keys i - W < j <= i, as HF transformers'
masking_utils (``kv_idx > q_idx - sliding_window`` and ``kv_idx <= q_idx``)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pagedserve.gpu_worker import ops
from pagedserve.gpu_worker.layers.gathered_prefill import (
    gathered_prefill_attention,
    plan_gathered_prefill,
)
from pagedserve.scheduler.messages import NULL_BLOCK

from . import reference
from .cases import PADDING_BLOCK, TOLERANCES, decode_case, prefill_case, query_start_loc

BLOCK_SIZES = [8, 16, 32]
DTYPES = [torch.float32, torch.bfloat16]
# (num_heads, num_kv_heads): plain multi-head and a GQA group of 3.
HEAD_LAYOUTS = [(4, 4), (6, 2)]
# Windows below a block, of one block, across blocks, equal to the longest context (100) and
# past every context (then the window changes nothing).
WINDOWS = [1, 5, "block", 24, 100, 1000]


def _window(window, block_size: int) -> int:
    return block_size if window == "block" else window


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(actual.double(), expected, **TOLERANCES[dtype])


def _poison_before(case, seq: int, first_position: int, whole_blocks: bool) -> None:
    """NaN into sequence ``seq``'s cached K/V before ``first_position`` (only whole blocks
    before its block with ``whole_blocks``): a kernel that reads them, even masked, gives NaN."""
    block_size = case.key_cache.shape[2]
    end = first_position // block_size * block_size if whole_blocks else first_position
    for position in range(end):
        block = int(case.block_tables[seq, position // block_size])
        case.key_cache[block, :, position % block_size] = float("nan")
        case.value_cache[block, :, position % block_size] = float("nan")


# --- decode ------------------------------------------------------------------------------------


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("layout", HEAD_LAYOUTS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_with_window_matches_reference(dtype, block_size, layout, window):
    window = _window(window, block_size)
    num_heads, num_kv_heads = layout
    seq_lens = [1, block_size, block_size + 1, 3 * block_size - 1, 100]
    case, query = decode_case(seq_lens, num_heads, num_kv_heads, block_size, 64, dtype)
    args = (query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, 0.125)
    expected = reference.decode_attention(*args, sliding_window=window)
    if window < 100:  # the window changes the longest sequence's result
        assert not torch.allclose(expected[-1], reference.decode_attention(*args)[-1])
    # Positions before each window are never read: NaN there would show in the output.
    for seq, seq_len in enumerate(seq_lens):
        _poison_before(case, seq, max(0, seq_len - window), whole_blocks=False)
    for partition_size in (None, 0, block_size, 2 * block_size):
        out = ops.paged_attention_decode(
            *args, partition_size=partition_size, sliding_window=window
        )
        _assert_close(out, expected, dtype)


@pytest.mark.parametrize("partition_size", [32, 64])
@pytest.mark.parametrize("window", [17, 64, 200, 4000])
def test_partitioned_decode_with_window_equals_single_pass(window, partition_size):
    # Windows shorter than, equal to and longer than a partition, and longer than the contexts.
    seq_lens = [1, 31, 33, 64, 65, 200, 333, 1000]
    case, query = decode_case(seq_lens, 8, 2, 16, 128, torch.float32, seed=1)
    args = (query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, 0.1)
    single = ops.paged_attention_decode(*args, partition_size=0, sliding_window=window)
    split = ops.paged_attention_decode(*args, partition_size=partition_size, sliding_window=window)
    torch.testing.assert_close(split, single, atol=1e-6, rtol=1e-6)
    _assert_close(split, reference.decode_attention(*args, sliding_window=window), torch.float32)


def test_window_of_zero_or_none_is_full_attention():
    case, query = decode_case([5, 40, 77], 6, 2, 16, 80, torch.float32, seed=2)
    args = (query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, 0.1)
    full = ops.paged_attention_decode(*args)
    assert torch.equal(ops.paged_attention_decode(*args, sliding_window=0), full)
    assert torch.equal(ops.paged_attention_decode(*args, sliding_window=None), full)
    loc = query_start_loc([1, 1, 1])
    prefill_args = (query, case.key_cache, case.value_cache, case.block_tables, loc, case.seq_lens)
    assert torch.equal(
        ops.paged_prefill_attention(*prefill_args, 0.1, sliding_window=0),
        ops.paged_prefill_attention(*prefill_args, 0.1),
    )


def test_automatic_split_k_counts_only_the_window(restore_threads):
    # One long sequence and few work items: without a window the automatic choice splits; the
    # 300-token window leaves only one partition's worth (it must not read the 2700 before it).
    case, query = decode_case([3000], 4, 1, 16, 64, torch.float32, seed=3)
    args = (query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, 0.125)
    expected = reference.decode_attention(*args, sliding_window=300)
    _poison_before(case, 0, 3000 - 300, whole_blocks=False)
    for num_threads in (1, 2, 8):
        ops.set_num_threads(num_threads)
        _assert_close(
            ops.paged_attention_decode(*args, sliding_window=300), expected, torch.float32
        )


def test_table_entries_before_the_window_are_neither_read_nor_checked():
    # Blocks wholly before the window of a sequence's first query token may leave the table (a
    # block manager may free them): the ops run without them, and still refuse a bad entry
    # inside the window.
    block_size, window = 8, 20
    case, query = decode_case([100, 37, 5], 4, 2, block_size, 64, torch.float32, seed=10)
    args = (query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, 0.125)
    expected = reference.decode_attention(*args, sliding_window=window)
    for seq, seq_len in enumerate([100, 37, 5]):
        case.block_tables[seq, : max(0, seq_len - window) // block_size] = PADDING_BLOCK
    for partition_size in (None, 0, 8):
        out = ops.paged_attention_decode(
            *args, partition_size=partition_size, sliding_window=window
        )
        _assert_close(out, expected, torch.float32)
    with pytest.raises(ValueError, match=r"block_tables\[0\]\[0\] = 1073741824 is not a block"):
        ops.paged_attention_decode(*args)  # full attention reads them
    case.block_tables[0, 10] = PADDING_BLOCK  # position 80..87: inside the window of 100
    with pytest.raises(ValueError, match=r"block_tables\[0\]\[10\] = 1073741824 is not a block"):
        ops.paged_attention_decode(*args, sliding_window=window)

    prior, q_lens = [60, 0], [10, 40]
    case, query, loc = prefill_case(prior, q_lens, 4, 2, block_size, 64, torch.float32, seed=11)
    args = (query, case.key_cache, case.value_cache, case.block_tables, loc, case.seq_lens, 0.125)
    expected = reference.attention(*args, sliding_window=12)
    case.block_tables[0, : (60 - 12 + 1) // block_size] = PADDING_BLOCK  # positions 0..47
    _assert_close(ops.paged_prefill_attention(*args, sliding_window=12), expected, torch.float32)
    with pytest.raises(ValueError, match=r"block_tables\[0\]\[5\] = 1073741824 is not a block"):
        ops.paged_prefill_attention(*args, sliding_window=14)  # its window reaches position 47


def test_gathered_prefill_skips_entries_freed_behind_the_window():
    # The block manager frees blocks behind the window and the runner's table holds NULL_BLOCK
    # there; the gather reads those positions as padding, never a block (-1 would index the
    # pool's last block, here poisoned as a reused or uninitialised one may be).
    block_size, window = 8, 12
    prior, q_lens = [60, 0, 33], [10, 40, 1]
    case, query, loc = prefill_case(prior, q_lens, 4, 2, block_size, 64, torch.float32, seed=12)
    args = (query, case.key_cache, case.value_cache, case.block_tables, loc, case.seq_lens, 0.125)
    expected = reference.attention(*args, sliding_window=window)
    tables = case.block_tables.numpy().copy()
    for seq, first_query in enumerate(prior):
        tables[seq, : max(0, first_query - window + 1) // block_size] = NULL_BLOCK
    assert (tables == NULL_BLOCK).sum() == 6 + 2
    # One more block, last in the pool, that no sequence holds.
    key_cache, value_cache = (
        torch.cat([cache, torch.full_like(cache[:1], float("nan"))])
        for cache in (case.key_cache, case.value_cache)
    )
    plan = plan_gathered_prefill(
        tables,
        np.array(q_lens, dtype=np.int32),
        case.seq_lens.numpy(),
        block_size,
        torch.device("cpu"),
    )
    out = torch.full_like(query, 7.0).contiguous()
    gathered_prefill_attention(
        query, key_cache, value_cache, plan, 0.125, out, sliding_window=window
    )
    _assert_close(out, expected, torch.float32)


# --- prefill -----------------------------------------------------------------------------------


def _poison_before_windows(case, prior, window: int) -> None:
    """Whole blocks before each sequence's first query token's window: never read."""
    for seq, context in enumerate(prior):
        _poison_before(case, seq, max(0, context - window + 1), whole_blocks=True)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("layout", HEAD_LAYOUTS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_with_window_matches_reference(dtype, block_size, layout, window):
    window = _window(window, block_size)
    num_heads, num_kv_heads = layout
    # Plain prefill past the window, a decode with context, chunked prefill over cached context,
    # one block plus one token, a one-token prompt, and a chunk starting deep in the context.
    prior = [0, 13, block_size, 50, 0, 70]
    q_lens = [37, 1, block_size + 1, 30, 1, 30]
    case, query, loc = prefill_case(prior, q_lens, num_heads, num_kv_heads, block_size, 64, dtype)
    args = (query, case.key_cache, case.value_cache, case.block_tables, loc, case.seq_lens, 0.125)
    expected = reference.attention(*args, sliding_window=window)
    _poison_before_windows(case, prior, window)
    _assert_close(ops.paged_prefill_attention(*args, sliding_window=window), expected, dtype)


@pytest.mark.parametrize("window", [1, 7, 33, 200])
def test_prefill_with_window_over_a_few_hundred_tokens(window):
    case, query, loc = prefill_case([0, 120], [300, 200], 9, 3, 16, 64, torch.float32, seed=4)
    args = (query, case.key_cache, case.value_cache, case.block_tables, loc, case.seq_lens, 0.1)
    expected = reference.attention(*args, sliding_window=window)
    _poison_before_windows(case, [0, 120], window)
    _assert_close(
        ops.paged_prefill_attention(*args, sliding_window=window), expected, torch.float32
    )


def test_prefill_of_single_tokens_with_window_equals_decode():
    prior = [0, 7, 31, 100]
    case, query, loc = prefill_case(prior, [1] * 4, 8, 2, 16, 96, torch.float32, seed=5)
    cache = (case.key_cache, case.value_cache, case.block_tables)
    prefill = ops.paged_prefill_attention(query, *cache, loc, case.seq_lens, 0.1, sliding_window=9)
    decode = ops.paged_attention_decode(query, *cache, case.seq_lens, 0.1, sliding_window=9)
    torch.testing.assert_close(prefill, decode, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("head_size", [80, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_window_on_every_isa_variant(isa, dtype, head_size):
    seq_lens = [1, 8, 9, 23, 100]
    case, query = decode_case(seq_lens, 9, 3, 8, head_size, dtype, seed=6)
    args = (query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, 0.1)
    expected = reference.decode_attention(*args, sliding_window=11)
    for partition_size in (0, 16):
        out = ops.paged_attention_decode(*args, partition_size=partition_size, sliding_window=11)
        _assert_close(out, expected, dtype)
    # 16 query heads per kv head: the tiles hold rows of two or more query positions, whose
    # windows start at different keys.
    prior, q_lens = [0, 9, 3], [70, 1, 20]
    case, query, loc = prefill_case(prior, q_lens, 16, 1, 8, head_size, dtype, seed=7)
    args = (query, case.key_cache, case.value_cache, case.block_tables, loc, case.seq_lens, 0.1)
    expected = reference.attention(*args, sliding_window=3)
    _assert_close(ops.paged_prefill_attention(*args, sliding_window=3), expected, dtype)


def test_window_results_do_not_depend_on_thread_count(restore_threads):
    case, query = decode_case([3000, 5, 770, 1280], 8, 4, 16, 64, torch.float32, seed=8)
    args = (query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, 0.125)
    prefilling, prefill_query, loc = prefill_case(
        [0, 30], [150, 40], 8, 2, 16, 64, torch.float32, seed=9
    )
    prefill_args = (
        prefill_query,
        prefilling.key_cache,
        prefilling.value_cache,
        prefilling.block_tables,
        loc,
        prefilling.seq_lens,
        0.125,
    )
    results = []
    for num_threads in (1, 2, 3):
        ops.set_num_threads(num_threads)
        results.append(
            (
                ops.paged_attention_decode(*args, partition_size=0, sliding_window=500),
                ops.paged_attention_decode(*args, partition_size=64, sliding_window=500),
                ops.paged_prefill_attention(*prefill_args, sliding_window=40),
            )
        )
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("window", "error", "message"),
    [
        (-1, ValueError, "sliding_window must be None, 0 .* got -1"),
        (2**31, ValueError, "sliding_window must be .* got 2147483648"),
        (8.0, TypeError, "sliding_window must be None or an int .* got float"),
        (True, TypeError, "sliding_window must be None or an int .* got bool"),
    ],
)
def test_bad_window_is_refused_naming_it(window, error, message):
    case, query = decode_case([5], 4, 2, 8, 64, torch.float32)
    cache = (case.key_cache, case.value_cache, case.block_tables)
    with pytest.raises(error, match=message):
        ops.paged_attention_decode(query, *cache, case.seq_lens, 0.1, sliding_window=window)
    with pytest.raises(error, match=message):
        ops.paged_prefill_attention(
            query, *cache, query_start_loc([1]), case.seq_lens, 0.1, sliding_window=window
        )


# --- gathered prefill (SDPA over gathered K/V, the CUDA default) --------------------------------


@pytest.mark.parametrize("window", [1, 5, 16, 24, 100])
@pytest.mark.parametrize("layout", [(4, 4), (6, 2)])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gathered_prefill_with_window_matches_reference(dtype, block_size, layout, window):
    num_heads, num_kv_heads = layout
    prior = [0, 50, block_size, 70, 0]
    q_lens = [37, 30, block_size + 1, 1, 1]
    case, query, loc = prefill_case(prior, q_lens, num_heads, num_kv_heads, block_size, 64, dtype)
    seq_lens = case.seq_lens.numpy()
    plan = plan_gathered_prefill(
        case.block_tables.numpy(),
        np.array(q_lens, dtype=np.int32),
        seq_lens,
        block_size,
        torch.device("cpu"),
    )
    scale = 64**-0.5
    out = torch.full_like(query, 7.0).contiguous()
    gathered_prefill_attention(
        query, case.key_cache, case.value_cache, plan, scale, out, sliding_window=window
    )
    expected = reference.attention(
        query,
        case.key_cache,
        case.value_cache,
        case.block_tables,
        loc,
        case.seq_lens,
        scale,
        sliding_window=window,
    )
    _assert_close(out, expected, dtype)
    # The plan keeps the causal mask for full-attention layers of the same step.
    full = torch.empty_like(out)
    gathered_prefill_attention(query, case.key_cache, case.value_cache, plan, scale, full)
    expected_full = reference.attention(
        query, case.key_cache, case.value_cache, case.block_tables, loc, case.seq_lens, scale
    )
    _assert_close(full, expected_full, dtype)
    assert math.isfinite(float(out.float().abs().sum()))
