"""The CUDA ops against the float64 torch references of tests/ops (same cases, moved to the GPU):
every dtype, head size and block size; GQA; single-pass and split-K decode; prefill over cached
context; exact bytes for the cache ops. Skipped without a GPU or without pagedserve._C_cuda."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ops import reference
from ops.cases import TOLERANCES, fused_qkv, paged_case, query_start_loc, random_pool

from pagedserve.gpu_worker import cuda_ops, fused_ops, ops
from pagedserve.gpu_worker.layers.gathered_prefill import PrefillPlan, prefill_attention

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no CUDA GPU (torch.cuda.is_available() is False)"
    ),
    pytest.mark.skipif(
        not cuda_ops.is_built(), reason="pagedserve._C_cuda is not built (no nvcc at install)"
    ),
]

CUDA = "cuda"
HEAD_SIZES = [64, 80, 96, 128, 192, 256]
BLOCK_SIZES = [8, 16, 32]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (num_heads, num_kv_heads): plain multi-head, GQA groups of 3 and 4, and a group of 16 (the
# decode kernel's wide variant: two warps of 8 heads sharing staged rows).
HEAD_LAYOUTS = [(4, 4), (6, 2), (8, 2), (16, 1)]


def _cpu(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [tensor.cpu() for tensor in tensors]


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(actual.cpu().double(), expected, **TOLERANCES[dtype])


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.cpu().contiguous(), b.cpu().contiguous()
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# --- decode ------------------------------------------------------------------------------------


def _decode_inputs(seq_lens, num_heads, num_kv_heads, block_size, head_size, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    case = paged_case(seq_lens, num_kv_heads, block_size, head_size, dtype, generator, device=CUDA)
    query, _, _ = fused_qkv(
        len(seq_lens), num_heads, num_kv_heads, head_size, dtype, generator, device=CUDA
    )
    return case, query


def _decode_args(case, query, scale):
    return (query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, scale)


def _decode_reference(case, query, scale):
    return reference.decode_attention(*_cpu(*_decode_args(case, query, scale)[:5]), scale)


@pytest.mark.parametrize("layout", HEAD_LAYOUTS[:2])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_matches_reference(dtype, head_size, block_size, layout):
    num_heads, num_kv_heads = layout
    seq_lens = [1, block_size, block_size + 1, 3 * block_size - 1, 100]
    case, query = _decode_inputs(seq_lens, num_heads, num_kv_heads, block_size, head_size, dtype)
    scale = head_size**-0.5
    expected = _decode_reference(case, query, scale)
    for partition_size in (0, 2 * block_size, None):
        out = ops.paged_attention_decode(
            *_decode_args(case, query, scale), partition_size=partition_size
        )
        assert out.shape == query.shape and out.dtype == dtype and out.is_cuda
        _assert_close(out, expected, dtype)


@pytest.mark.parametrize("layout", HEAD_LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_gqa_groups(dtype, layout):
    num_heads, num_kv_heads = layout
    case, query = _decode_inputs([7, 64, 130], num_heads, num_kv_heads, 16, 128, dtype, seed=1)
    expected = _decode_reference(case, query, 0.09)
    for partition_size in (0, 32):
        out = ops.paged_attention_decode(
            *_decode_args(case, query, 0.09), partition_size=partition_size
        )
        _assert_close(out, expected, dtype)


@pytest.mark.parametrize("layout", [(48, 1), (64, 2), (96, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_multi_query_groups(dtype, layout):
    # Groups of 48 and 32 (one pass of the wide kernel) and 96 (two passes of 64 heads).
    num_heads, num_kv_heads = layout
    case, query = _decode_inputs([7, 300, 1300], num_heads, num_kv_heads, 16, 128, dtype, seed=7)
    expected = _decode_reference(case, query, 0.09)
    for partition_size in (0, 256, None):
        out = ops.paged_attention_decode(
            *_decode_args(case, query, 0.09), partition_size=partition_size
        )
        _assert_close(out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_split_k_on_long_contexts(dtype):
    # Lengths below, at and across the 512-token partitions, and one sequence far longer than
    # the rest (fewer partitions for the others).
    seq_lens = [1, 511, 512, 513, 2000, 4100]
    case, query = _decode_inputs(seq_lens, 32, 8, 16, 128, dtype, seed=2)
    expected = _decode_reference(case, query, 0.088)
    single = ops.paged_attention_decode(*_decode_args(case, query, 0.088), partition_size=0)
    split = ops.paged_attention_decode(*_decode_args(case, query, 0.088), partition_size=512)
    automatic = ops.paged_attention_decode(*_decode_args(case, query, 0.088))
    for out in (single, split, automatic):
        _assert_close(out, expected, dtype)
    tolerance = {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else TOLERANCES[dtype]
    torch.testing.assert_close(split, single, **tolerance)


def test_automatic_choice_splits_when_few_sequences_have_long_contexts():
    module = cuda_ops.kernels()
    # One sequence of 8 kv heads and 8192 tokens: far too few thread blocks for one pass.
    partition, workspace = module.plan_paged_attention_decode(1, 32, 8, 128, 8192, 0, -1, 0)
    assert partition > 0 and workspace == 1 * 32 * (8192 // partition) * (128 + 2)
    # Short contexts never split; a forced single pass needs no workspace.
    assert module.plan_paged_attention_decode(64, 32, 32, 128, 256, 0, -1, 0) == (0, 0)
    assert module.plan_paged_attention_decode(1, 32, 8, 128, 8192, 0, 0, 0) == (0, 0)


def test_decode_zero_length_sequence_gives_zeros():
    case, query = _decode_inputs([5, 0, 17], 4, 2, 8, 64, torch.float32)
    for partition_size in (0, 8):
        out = ops.paged_attention_decode(
            *_decode_args(case, query, 0.125), partition_size=partition_size
        )
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        assert out[0].abs().sum() > 0 and out[2].abs().sum() > 0


def test_decode_writes_into_strided_out_only():
    case, query = _decode_inputs([9, 40], 6, 2, 16, 80, torch.bfloat16)
    buffer = torch.full((2, 8 * 80), 7.0, dtype=torch.bfloat16, device=CUDA)
    out = buffer[:, 80 : 7 * 80].view(2, 6, 80)
    returned = ops.paged_attention_decode(*_decode_args(case, query, 0.1), out=out)
    assert returned.data_ptr() == out.data_ptr()
    _assert_close(out, _decode_reference(case, query, 0.1), torch.bfloat16)
    assert torch.all(buffer[:, :80] == 7.0) and torch.all(buffer[:, 7 * 80 :] == 7.0)


def test_decode_on_a_side_stream():
    case, query = _decode_inputs([300, 20], 8, 2, 16, 64, torch.float16, seed=3)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out = ops.paged_attention_decode(*_decode_args(case, query, 0.125), partition_size=64)
    torch.cuda.current_stream().wait_stream(stream)
    _assert_close(out, _decode_reference(case, query, 0.125), torch.float16)


def test_decode_results_are_deterministic():
    case, query = _decode_inputs([3000, 5, 770, 1280], 8, 4, 16, 64, torch.float32, seed=6)
    args = _decode_args(case, query, 0.125)
    first = ops.paged_attention_decode(*args, partition_size=64)
    assert torch.equal(first, ops.paged_attention_decode(*args, partition_size=64))


# --- prefill -----------------------------------------------------------------------------------


def _prefill_inputs(prior, q_lens, num_heads, num_kv_heads, block_size, head_size, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    seq_lens = [p + q for p, q in zip(prior, q_lens)]
    case = paged_case(seq_lens, num_kv_heads, block_size, head_size, dtype, generator, device=CUDA)
    query, _, _ = fused_qkv(
        sum(q_lens), num_heads, num_kv_heads, head_size, dtype, generator, device=CUDA
    )
    return case, query, query_start_loc(q_lens, device=CUDA)


def _prefill(case, query, loc, scale, **kwargs):
    return ops.paged_prefill_attention(
        query,
        case.key_cache,
        case.value_cache,
        case.block_tables,
        loc,
        case.seq_lens,
        scale,
        **kwargs,
    )


def _prefill_reference(case, query, loc, scale):
    tensors = _cpu(query, case.key_cache, case.value_cache, case.block_tables, loc, case.seq_lens)
    return reference.attention(*tensors, scale)


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
    expected = _prefill_reference(case, query, loc, scale)
    out = _prefill(case, query, loc, scale)
    assert out.shape == query.shape and out.dtype == dtype and out.is_cuda
    _assert_close(out, expected, dtype)
    _assert_close(_prefill(case, query, loc, scale, max_query_len=max(q_lens)), expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_few_hundred_tokens(dtype):
    case, query, loc = _prefill_inputs([0, 120], [300, 200], 9, 3, 16, 64, dtype, seed=3)
    _assert_close(
        _prefill(case, query, loc, 0.125), _prefill_reference(case, query, loc, 0.125), dtype
    )


def test_prefill_long_prompt_with_gqa_of_eight():
    case, query, loc = _prefill_inputs([0, 700], [1100, 90], 32, 4, 16, 128, torch.bfloat16)
    _assert_close(
        _prefill(case, query, loc, 0.088),
        _prefill_reference(case, query, loc, 0.088),
        torch.bfloat16,
    )


def test_prefill_skips_sequences_without_new_tokens():
    case, query, loc = _prefill_inputs([10, 4, 0], [3, 0, 5], 4, 2, 8, 64, torch.float32)
    out = _prefill(case, query, loc, 0.125)
    _assert_close(out, _prefill_reference(case, query, loc, 0.125), torch.float32)


def test_prefill_of_single_tokens_equals_decode():
    prior = [0, 7, 31, 100]
    case, query, loc = _prefill_inputs(prior, [1] * 4, 8, 2, 16, 96, torch.float32, seed=4)
    prefill = _prefill(case, query, loc, 0.1)
    decode = ops.paged_attention_decode(*_decode_args(case, query, 0.1), partition_size=0)
    torch.testing.assert_close(prefill, decode, atol=1e-5, rtol=1e-5)


# --- prefill through torch's flash attention over packed K/V (the CUDA default) ---------------


def _packed_prefill(case, query, q_lens, scale, sliding_window=0):
    plan = PrefillPlan(
        case.block_tables.cpu().numpy(),
        np.array(q_lens, dtype=np.int32),
        case.seq_lens.cpu().numpy(),
        case.key_cache.shape[2],
        query.device,
        flash=True,
    )
    out = torch.full_like(query, 7.0).contiguous()
    prefill_attention(
        query, case.key_cache, case.value_cache, plan, scale, out, sliding_window=sliding_window
    )
    assert "packed" in vars(plan) and "padded" not in vars(plan)
    return out


@pytest.mark.parametrize("window", [0, 5, 24])
@pytest.mark.parametrize("layout", [(4, 4), (8, 2), (32, 8), (16, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_packed_flash_prefill_matches_reference(dtype, layout, window):
    # torch's FlashAttention-2 variable-length kernel itself: causal at each sequence's bottom
    # right (chunks over cached context), grouped heads as they are, windows, a sequence
    # without new tokens left out of the packing.
    num_heads, num_kv_heads = layout
    prior, q_lens = [0, 13, 16, 50, 9, 0], [37, 1, 17, 30, 0, 1]
    case, query, loc = _prefill_inputs(prior, q_lens, num_heads, num_kv_heads, 16, 128, dtype)
    tensors = _cpu(query, case.key_cache, case.value_cache, case.block_tables, loc, case.seq_lens)
    expected = reference.attention(*tensors, 0.088, sliding_window=window)
    _assert_close(_packed_prefill(case, query, q_lens, 0.088, window), expected, dtype)


def test_packed_flash_prefill_of_long_prompts():
    # The shapes: 1024-token prompts and a chunk of 161 over 700 cached tokens.
    prior, q_lens = [0, 0, 700], [1024, 1024, 161]
    case, query, loc = _prefill_inputs(prior, q_lens, 32, 8, 16, 128, torch.bfloat16, seed=5)
    tensors = _cpu(query, case.key_cache, case.value_cache, case.block_tables, loc, case.seq_lens)
    expected = reference.attention(*tensors, 0.088)
    _assert_close(_packed_prefill(case, query, q_lens, 0.088), expected, torch.bfloat16)


# --- sliding window ----------------------------------------------------------------------------
# Query position i sees keys i - W < j <= i (HF transformers' sliding-window mask). Windows below
# a block, of one block, across blocks, equal to the longest context (100) and past every one.

WINDOWS = [1, 5, "block", 24, 100, 1000]


def _poison_before(case, seq: int, first_position: int, whole_blocks: bool) -> None:
    """NaN into sequence ``seq``'s K/V before ``first_position`` (only whole blocks before its
    block with ``whole_blocks``): a kernel that reads them, even masked, gives NaN."""
    block_size = case.key_cache.shape[2]
    end = first_position // block_size * block_size if whole_blocks else first_position
    for position in range(end):
        block = int(case.block_tables[seq, position // block_size])
        case.key_cache[block, :, position % block_size] = float("nan")
        case.value_cache[block, :, position % block_size] = float("nan")


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("layout", HEAD_LAYOUTS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_with_window_matches_reference(dtype, block_size, layout, window):
    window = block_size if window == "block" else window
    num_heads, num_kv_heads = layout
    seq_lens = [1, block_size, block_size + 1, 3 * block_size - 1, 100]
    case, query = _decode_inputs(seq_lens, num_heads, num_kv_heads, block_size, 64, dtype)
    args = _decode_args(case, query, 0.125)
    expected = reference.decode_attention(*_cpu(*args[:5]), 0.125, window)
    for seq, seq_len in enumerate(seq_lens):
        _poison_before(case, seq, max(0, seq_len - window), whole_blocks=False)
    for partition_size in (None, 0, block_size, 2 * block_size):
        out = ops.paged_attention_decode(
            *args, partition_size=partition_size, sliding_window=window
        )
        _assert_close(out, expected, dtype)


@pytest.mark.parametrize("window", [17, 512, 700, 4096])
@pytest.mark.parametrize("dtype", DTYPES)
def test_split_k_with_window_on_long_contexts(dtype, window):
    # Windows shorter than, equal to and longer than a 512-token partition, and past the contexts.
    seq_lens = [1, 511, 513, 1400, 3000]
    case, query = _decode_inputs(seq_lens, 8, 2, 16, 64, dtype, seed=2)
    args = _decode_args(case, query, 0.088)
    expected = reference.decode_attention(*_cpu(*args[:5]), 0.088, window)
    for seq, seq_len in enumerate(seq_lens):
        _poison_before(case, seq, max(0, seq_len - window), whole_blocks=False)
    single = ops.paged_attention_decode(*args, partition_size=0, sliding_window=window)
    split = ops.paged_attention_decode(*args, partition_size=512, sliding_window=window)
    automatic = ops.paged_attention_decode(*args, sliding_window=window)
    for out in (single, split, automatic):
        _assert_close(out, expected, dtype)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_with_window_matches_reference(dtype, block_size, window):
    window = block_size if window == "block" else window
    layout = HEAD_LAYOUTS[(DTYPES.index(dtype) + BLOCK_SIZES.index(block_size)) % 4]
    num_heads, num_kv_heads = layout
    prior = [0, 13, block_size, 50, 0, 70]
    q_lens = [37, 1, block_size + 1, 30, 1, 30]
    case, query, loc = _prefill_inputs(
        prior, q_lens, num_heads, num_kv_heads, block_size, 64, dtype
    )
    tensors = _cpu(query, case.key_cache, case.value_cache, case.block_tables, loc, case.seq_lens)
    expected = reference.attention(*tensors, 0.125, window)
    for seq, context in enumerate(prior):  # whole blocks before the first query's window
        _poison_before(case, seq, max(0, context - window + 1), whole_blocks=True)
    out = _prefill(case, query, loc, 0.125, max_query_len=max(q_lens), sliding_window=window)
    _assert_close(out, expected, dtype)


def test_prefill_long_prompt_with_window_and_gqa_of_eight():
    prior, q_lens = [0, 700], [1100, 90]
    case, query, loc = _prefill_inputs(prior, q_lens, 32, 4, 16, 128, torch.bfloat16)
    tensors = _cpu(query, case.key_cache, case.value_cache, case.block_tables, loc, case.seq_lens)
    expected = reference.attention(*tensors, 0.088, 256)
    for seq, context in enumerate(prior):
        _poison_before(case, seq, max(0, context - 256 + 1), whole_blocks=True)
    _assert_close(_prefill(case, query, loc, 0.088, sliding_window=256), expected, torch.bfloat16)


# --- attention sinks (gpt-oss) -----------------------------------------------------------------
# Sinks of std 3 over logits of std 1 lie both below and above a row's max (tests/ops).


@pytest.mark.parametrize("window", [0, 128])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_and_prefill_with_sinks_match_reference(dtype, window):
    sinks = torch.randn(64, generator=torch.Generator().manual_seed(1)) * 3.0
    case, query = _decode_inputs([0, 1, 100, 700, 3000], 64, 8, 16, 64, dtype)
    tensors = _cpu(query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens)
    expected = reference.decode_attention(*tensors, 0.125, window, sinks=sinks)
    for partition_size in (0, 256, None):
        out = ops.paged_attention_decode(
            *_decode_args(case, query, 0.125),
            partition_size=partition_size,
            sliding_window=window,
            sinks=sinks.to(CUDA),
        )
        _assert_close(out, expected, dtype)
    case, query, loc = _prefill_inputs([0, 40, 300], [200, 1, 77], 64, 8, 16, 64, dtype)
    tensors = _cpu(query, case.key_cache, case.value_cache, case.block_tables, loc, case.seq_lens)
    expected = reference.attention(*tensors, 0.125, window, sinks=sinks)
    out = _prefill(case, query, loc, 0.125, sliding_window=window, sinks=sinks.to(CUDA))
    _assert_close(out, expected, dtype)


# --- cache ops ---------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_and_cache_writes_slots(dtype, head_size, block_size):
    generator = torch.Generator().manual_seed(0)
    num_blocks, num_kv_heads, num_tokens = 12, 2, 23
    pool = random_pool(num_blocks, num_kv_heads, block_size, head_size, dtype, generator).to(CUDA)
    key_cache, value_cache = pool[:, 1, 0], pool[:, 1, 1]
    _, key, value = fused_qkv(num_tokens, 6, num_kv_heads, head_size, dtype, generator, CUDA)
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    slots[[3, 11, 22]] = -1  # padding tokens
    expected_key, expected_value = reference.reshape_and_cache(
        *_cpu(key, value, key_cache, value_cache), slots
    )
    other_layer = pool[:, 0].clone()

    ops.reshape_and_cache(key, value, key_cache, value_cache, slots.to(CUDA))

    assert _same_bytes(key_cache, expected_key)
    assert _same_bytes(value_cache, expected_value)
    assert _same_bytes(pool[:, 0], other_layer)


def test_reshape_and_cache_from_unaligned_views():
    # Keys starting one element into their buffer: the kernel falls back to narrow copies.
    generator = torch.Generator().manual_seed(1)
    pool = random_pool(4, 2, 8, 80, torch.float16, generator, num_layers=1).to(CUDA)
    key_cache, value_cache = pool[:, 0, 0], pool[:, 0, 1]
    buffer = torch.randn(5, 1 + 4 * 160, generator=generator).to(torch.float16).to(CUDA)
    key = buffer[:, 1 : 1 + 160].view(5, 2, 80)
    value = buffer[:, 1 + 160 : 1 + 320].view(5, 2, 80)
    slots = torch.tensor([0, 9, -1, 31, 17])
    expected_key, expected_value = reference.reshape_and_cache(
        *_cpu(key, value, key_cache, value_cache), slots
    )
    ops.reshape_and_cache(key, value, key_cache, value_cache, slots.to(CUDA))
    assert _same_bytes(key_cache, expected_key) and _same_bytes(value_cache, expected_value)


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_blocks_copies_whole_blocks_exactly(dtype):
    generator = torch.Generator().manual_seed(3)
    pool = random_pool(10, 1, 16, 64, dtype, generator, num_layers=3)
    pool.view(-1).view(torch.int16)[:64] = 0x7F81  # NaN payloads arithmetic could change
    pool.view(-1)[100] = -0.0
    pool = pool.to(CUDA)
    mapping = torch.tensor([[0, 5], [2, 7], [0, 9]])
    expected = reference.copy_blocks(pool.cpu(), pool.cpu(), mapping)
    ops.copy_blocks(pool, mapping)
    assert _same_bytes(pool, expected)


def test_copy_blocks_many_large_blocks_in_one_launch():
    generator = torch.Generator().manual_seed(4)
    pool = random_pool(300, 4, 16, 128, torch.bfloat16, generator).to(CUDA)  # 256 KiB blocks
    mapping = torch.stack([torch.arange(0, 150), torch.arange(150, 300)], dim=1)
    expected = reference.copy_blocks(pool.cpu(), pool.cpu(), mapping)
    ops.copy_blocks(pool, mapping)
    assert _same_bytes(pool, expected)


@pytest.mark.parametrize(
    ("mapping", "message"),
    [
        ([[0, 3], [1, 3]], "destination block 3 more than once"),
        ([[0, 3], [3, 4]], r"block_mapping\[1\]\[0\] = 3 is also a destination"),
        ([[0, 10]], r"block_mapping\[0\]\[1\] = 10 is outside \[0, 10\)"),
    ],
)
def test_copy_blocks_rejects_bad_mappings(mapping, message):
    pool = random_pool(10, 1, 8, 64, torch.float32, torch.Generator().manual_seed(5)).to(CUDA)
    before = pool.clone()
    with pytest.raises(ValueError, match=message):
        ops.copy_blocks(pool, torch.tensor(mapping))
    assert torch.equal(pool, before)


def test_block_mapping_must_be_on_the_host():
    pool = random_pool(4, 1, 8, 64, torch.float32, torch.Generator().manual_seed(5)).to(CUDA)
    with pytest.raises(ValueError, match="block_mapping is on cuda:0; it must be a CPU tensor"):
        ops.copy_blocks(pool, torch.tensor([[0, 1]], device=CUDA))


@pytest.mark.parametrize("pinned", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_swap_blocks_between_device_and_host(dtype, pinned):
    generator = torch.Generator().manual_seed(6)
    device_pool = random_pool(12, 2, 8, 80, dtype, generator).to(CUDA)
    host_pool = random_pool(6, 2, 8, 80, dtype, generator)
    if pinned:
        host_pool = host_pool.pin_memory()
    # (3, 4), (4, 5) continue a run on both sides: one copy.
    swap_out = torch.tensor([[11, 0], [3, 4], [4, 5], [7, 2]])
    expected_host = reference.copy_blocks(device_pool.cpu(), host_pool, swap_out)
    ops.swap_blocks(device_pool, host_pool, swap_out)
    torch.cuda.synchronize()
    assert _same_bytes(host_pool, expected_host)

    swap_in = torch.tensor([[0, 1], [4, 6], [2, 2]])
    expected_device = reference.copy_blocks(host_pool, device_pool.cpu(), swap_in)
    ops.swap_blocks(host_pool, device_pool, swap_in)
    assert _same_bytes(device_pool, expected_device)
    assert _same_bytes(device_pool[1], device_pool[11])


def test_swap_on_a_side_stream_is_ordered_by_an_event():
    generator = torch.Generator().manual_seed(7)
    device_pool = random_pool(64, 4, 16, 128, torch.float16, generator).to(CUDA)
    host_pool = torch.empty((64, *device_pool.shape[1:]), dtype=torch.float16).pin_memory()
    mapping = torch.stack([torch.arange(64), torch.arange(64).flip(0)], dim=1)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ops.swap_blocks(device_pool, host_pool, mapping)
    done = stream.record_event()
    done.synchronize()
    assert _same_bytes(host_pool, device_pool.cpu().flip(0))


# --- fused elementwise ops: HF's torch expressions on the GPU, bit for bit --------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_elementwise_ops_equal_hf_expressions_on_the_gpu(dtype):
    generator = torch.Generator().manual_seed(8)
    x = torch.randn(7, 256, generator=generator).to(dtype).to(CUDA)
    weight = torch.rand(256, generator=generator).to(dtype).to(CUDA)
    out = torch.empty_like(x)
    fused_ops.rms_norm(out, x, weight, 1e-6)
    assert torch.equal(out, reference.rms_norm(x, weight, 1e-6))

    residual = torch.randn(7, 256, generator=generator).to(dtype).to(CUDA)
    hidden, summed = x.clone(), residual.clone()
    fused_ops.fused_add_rms_norm(hidden, summed, weight, 1e-6)
    assert torch.equal(summed, residual + x)
    assert torch.equal(hidden, reference.rms_norm(residual + x, weight, 1e-6))

    qkv = torch.randn(7, 6 * 64, generator=generator).to(dtype).to(CUDA)
    query, key = qkv[:, : 4 * 64], qkv[:, 4 * 64 : 5 * 64]
    positions = torch.tensor([0, 1, 5, 9, 100, 2, 3], device=CUDA)
    freqs = torch.arange(128.0, device=CUDA)[:, None] * torch.rand(32, device=CUDA)[None, :]
    cos, sin = freqs.cos().contiguous(), freqs.sin().contiguous()
    expected_query = reference.rotate_half(query, cos, sin, positions, 64)
    expected_key = reference.rotate_half(key, cos, sin, positions, 64)
    fused_ops.rotary_embedding(positions, query, key, cos, sin)
    assert torch.equal(query, expected_query) and torch.equal(key, expected_key)

    gate_up = torch.randn(7, 512, generator=generator).to(dtype).to(CUDA)
    product = torch.empty(7, 256, dtype=dtype, device=CUDA)
    fused_ops.silu_and_mul(product, gate_up)
    assert torch.equal(product, reference.silu_and_mul(gate_up))


def test_tensors_of_one_op_must_share_a_device():
    case, query = _decode_inputs([5], 4, 2, 8, 64, torch.float32)
    with pytest.raises(ValueError, match="query is on cpu but key_cache is on cuda:0"):
        ops.paged_attention_decode(
            query.cpu(), case.key_cache, case.value_cache, case.block_tables, case.seq_lens, 0.1
        )
