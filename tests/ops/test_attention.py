"""Decode and prefill paged attention against the float64 torch reference."""

from __future__ import annotations

import pytest
import torch

from pagedserve.gpu_worker import ops

from . import reference
from .cases import TOLERANCES, fused_qkv, paged_case, query_start_loc

HEAD_SIZES = [64, 80, 96, 128, 192, 256]
BLOCK_SIZES = [8, 16, 32]
DTYPES = [torch.float32, torch.bfloat16]
# (num_heads, num_kv_heads): plain multi-head and GQA groups of 3 and 4.
HEAD_LAYOUTS = [(4, 4), (6, 2), (8, 2)]


def _decode_lens(block_size: int) -> list[int]:
    # Context of one token, exactly one block, one token past a block, and longer ones.
    return [1, block_size, block_size + 1, 3 * block_size - 1, 100]


def _decode_inputs(seq_lens, num_heads, num_kv_heads, block_size, head_size, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    case = paged_case(seq_lens, num_kv_heads, block_size, head_size, dtype, generator)
    query, _, _ = fused_qkv(len(seq_lens), num_heads, num_kv_heads, head_size, dtype, generator)
    return case, query


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(actual.double(), expected, **TOLERANCES[dtype])


@pytest.mark.parametrize("layout", HEAD_LAYOUTS[:2])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_matches_reference(dtype, head_size, block_size, layout):
    num_heads, num_kv_heads = layout
    seq_lens = _decode_lens(block_size)
    case, query = _decode_inputs(seq_lens, num_heads, num_kv_heads, block_size, head_size, dtype)
    scale = head_size**-0.5
    expected = reference.decode_attention(
        query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, scale
    )
    out = ops.paged_attention_decode(
        query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, scale
    )
    assert out.shape == query.shape and out.dtype == dtype
    _assert_close(out, expected, dtype)


@pytest.mark.parametrize("partition_size", [32, 64, 128])
@pytest.mark.parametrize("dtype", DTYPES)
def test_partitioned_decode_equals_single_pass(dtype, partition_size):
    # Lengths below, at and across partition boundaries, and sequences with fewer
    # partitions than the longest one.
    seq_lens = [1, 31, 32, 33, 64, 65, 200, 333]
    case, query = _decode_inputs(seq_lens, 8, 2, 16, 128, dtype, seed=1)
    args = (query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, 0.1)
    single = ops.paged_attention_decode(*args, partition_size=0)
    partitioned = ops.paged_attention_decode(*args, partition_size=partition_size)
    automatic = ops.paged_attention_decode(*args)
    # Same math in another summation order: float32 rounding apart, or one 16-bit ulp.
    tolerance = {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else TOLERANCES[dtype]
    torch.testing.assert_close(partitioned, single, **tolerance)
    torch.testing.assert_close(automatic, single, **tolerance)
    _assert_close(partitioned, reference.decode_attention(*args), dtype)


def test_automatic_partitioning_on_a_long_context(restore_threads):
    # One sequence, one kv head, 2000 tokens: few work items, so the automatic choice splits.
    case, query = _decode_inputs([2000, 7], 4, 1, 16, 64, torch.float32, seed=2)
    args = (query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, 0.125)
    expected = reference.decode_attention(*args)
    for num_threads in (1, 2, 8):
        ops.set_num_threads(num_threads)
        _assert_close(ops.paged_attention_decode(*args), expected, torch.float32)


def test_decode_zero_length_sequence_gives_zeros():
    case, query = _decode_inputs([5, 0, 17], 4, 2, 8, 64, torch.float32)
    for partition_size in (0, 8):
        out = ops.paged_attention_decode(
            query,
            case.key_cache,
            case.value_cache,
            case.block_tables,
            case.seq_lens,
            0.125,
            partition_size=partition_size,
        )
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        assert out[0].abs().sum() > 0 and out[2].abs().sum() > 0


def test_decode_writes_into_strided_out_only():
    case, query = _decode_inputs([9, 40], 6, 2, 16, 80, torch.bfloat16)
    buffer = torch.full((2, 8 * 80), 7.0, dtype=torch.bfloat16)
    out = buffer[:, 80 : 7 * 80].view(2, 6, 80)
    args = (query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, 0.1)
    returned = ops.paged_attention_decode(*args, out=out)
    assert returned.data_ptr() == out.data_ptr()
    _assert_close(out, reference.decode_attention(*args), torch.bfloat16)
    assert torch.all(buffer[:, :80] == 7.0) and torch.all(buffer[:, 7 * 80 :] == 7.0)


def _prefill_inputs(prior, q_lens, num_heads, num_kv_heads, block_size, head_size, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    seq_lens = [p + q for p, q in zip(prior, q_lens)]
    case = paged_case(seq_lens, num_kv_heads, block_size, head_size, dtype, generator)
    query, _, _ = fused_qkv(sum(q_lens), num_heads, num_kv_heads, head_size, dtype, generator)
    return case, query, query_start_loc(q_lens)


def _prefill(case, query, loc, scale):
    return ops.paged_prefill_attention(
        query, case.key_cache, case.value_cache, case.block_tables, loc, case.seq_lens, scale
    )


def _prefill_reference(case, query, loc, scale):
    return reference.attention(
        query, case.key_cache, case.value_cache, case.block_tables, loc, case.seq_lens, scale
    )


@pytest.mark.parametrize("layout", HEAD_LAYOUTS[::2])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_mixed_batch_matches_reference(dtype, head_size, block_size, layout):
    num_heads, num_kv_heads = layout
    # Plain prefill, a decode (q_len 1) with context, chunked prefill over cached context,
    # a prefill of exactly one block plus one token, and a single-token prompt.
    prior = [0, 13, block_size, 50, 0]
    q_lens = [37, 1, block_size + 1, 30, 1]
    case, query, loc = _prefill_inputs(
        prior, q_lens, num_heads, num_kv_heads, block_size, head_size, dtype
    )
    scale = head_size**-0.5
    out = _prefill(case, query, loc, scale)
    assert out.shape == query.shape and out.dtype == dtype
    _assert_close(out, _prefill_reference(case, query, loc, scale), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_few_hundred_tokens(dtype):
    case, query, loc = _prefill_inputs([0, 120], [300, 200], 9, 3, 16, 64, dtype, seed=3)
    _assert_close(
        _prefill(case, query, loc, 0.125), _prefill_reference(case, query, loc, 0.125), dtype
    )


def test_prefill_skips_sequences_without_new_tokens():
    case, query, loc = _prefill_inputs([10, 4, 0], [3, 0, 5], 4, 2, 8, 64, torch.float32)
    out = _prefill(case, query, loc, 0.125)
    _assert_close(out, _prefill_reference(case, query, loc, 0.125), torch.float32)


def test_prefill_of_single_tokens_equals_decode():
    prior = [0, 7, 31, 100]
    case, query, loc = _prefill_inputs(prior, [1] * 4, 8, 2, 16, 96, torch.float32, seed=4)
    prefill = _prefill(case, query, loc, 0.1)
    decode = ops.paged_attention_decode(
        query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, 0.1
    )
    torch.testing.assert_close(prefill, decode, atol=1e-6, rtol=1e-6)


def test_float16(isa):
    dtype = torch.float16
    case, query = _decode_inputs(_decode_lens(16), 6, 2, 16, 128, dtype)
    args = (query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, 0.09)
    _assert_close(ops.paged_attention_decode(*args), reference.decode_attention(*args), dtype)
    case, query, loc = _prefill_inputs([0, 20], [25, 9], 6, 2, 16, 128, dtype)
    _assert_close(
        _prefill(case, query, loc, 0.09), _prefill_reference(case, query, loc, 0.09), dtype
    )


@pytest.mark.parametrize("head_size", [80, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_isa_variant(isa, dtype, head_size):
    case, query = _decode_inputs(_decode_lens(8), 9, 3, 8, head_size, dtype, seed=5)
    args = (query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, 0.1)
    expected = reference.decode_attention(*args)
    _assert_close(ops.paged_attention_decode(*args, partition_size=0), expected, dtype)
    _assert_close(ops.paged_attention_decode(*args, partition_size=16), expected, dtype)
    # 16 query heads per kv head: more rows than one register-blocked step takes.
    case, query, loc = _prefill_inputs([0, 9, 3], [70, 1, 20], 16, 1, 8, head_size, dtype)
    _assert_close(_prefill(case, query, loc, 0.1), _prefill_reference(case, query, loc, 0.1), dtype)


def test_results_do_not_depend_on_thread_count(restore_threads):
    # Large enough that the ops use more than one thread (tiny ones run on the caller's).
    case, query = _decode_inputs([3000, 5, 770, 1280], 8, 4, 16, 64, torch.float32, seed=6)
    args = (query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, 0.125)
    prefill_case, prefill_query, loc = _prefill_inputs(
        [0, 30], [150, 40], 8, 2, 16, 64, torch.float32, seed=7
    )
    results = []
    for num_threads in (1, 2, 3):
        ops.set_num_threads(num_threads)
        results.append(
            (
                ops.paged_attention_decode(*args, partition_size=0),
                ops.paged_attention_decode(*args, partition_size=64),
                _prefill(prefill_case, prefill_query, loc, 0.125),
            )
        )
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)
