"""Attention sinks (gpt-oss) in the decode, prefill and gathered-prefill ops against the float64
reference: each query head's sink logit joins its softmax as a key whose value is zero, as HF
transformers' gpt-oss eager attention computes it (the logits concatenated with the sink, the
softmax, the sink's column dropped)."""

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

from . import reference
from .cases import TOLERANCES, decode_case, prefill_case, query_start_loc

# Head layouts (num_heads, num_kv_heads): plain multi-head and a GQA group of 3.
HEAD_LAYOUTS = [(4, 4), (6, 2)]
# Sink scales: logits scale * q . k have std 8 * 0.125 = 1 here, so sinks of std 3 are now far
# below a row's max (a few percent of its mass) and now far above it (most of it), which takes
# the kernels' both branches (the sink as the softmax's max or not).
SINK_STD = 3.0
SCALE = 0.125


def _sinks(num_heads: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + seed)
    return torch.randn(num_heads, generator=generator) * SINK_STD


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(actual.double(), expected, **TOLERANCES[dtype])


def _assert_sinks_matter(reference_fn, args, sinks, **options) -> torch.Tensor:
    """The reference with the sinks, after checking it differs from the one without by far more
    than the float32 tolerance (a kernel ignoring the sinks must fail)."""
    expected = reference_fn(*args, sinks=sinks, **options)
    without = reference_fn(*args, **options)
    assert (expected - without).abs().max() > 100 * TOLERANCES[torch.float32]["atol"]
    return expected


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("layout", HEAD_LAYOUTS)
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_with_sinks_matches_reference(dtype, block_size, layout, window):
    num_heads, num_kv_heads = layout
    seq_lens = [1, block_size, block_size + 1, 3 * block_size - 1, 100]
    case, query = decode_case(seq_lens, num_heads, num_kv_heads, block_size, 64, dtype)
    args = (query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, SCALE)
    sinks = _sinks(num_heads)
    expected = _assert_sinks_matter(reference.decode_attention, args, sinks, sliding_window=window)
    for partition_size in (None, 0, block_size, 2 * block_size):
        out = ops.paged_attention_decode(
            *args, partition_size=partition_size, sliding_window=window, sinks=sinks
        )
        _assert_close(out, expected, dtype)


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("layout", HEAD_LAYOUTS)
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_with_sinks_matches_reference(dtype, block_size, layout, window):
    num_heads, num_kv_heads = layout
    # Plain prefill, a decode with context, chunked prefill over cached context, a one-token
    # prompt, and a chunk starting deep in the context.
    prior = [0, 13, block_size, 0, 70]
    q_lens = [37, 1, block_size + 1, 1, 30]
    case, query, loc = prefill_case(prior, q_lens, num_heads, num_kv_heads, block_size, 64, dtype)
    args = (query, case.key_cache, case.value_cache, case.block_tables, loc, case.seq_lens, SCALE)
    sinks = _sinks(num_heads, seed=1)
    expected = _assert_sinks_matter(reference.attention, args, sinks, sliding_window=window)
    out = ops.paged_prefill_attention(*args, sliding_window=window, sinks=sinks)
    _assert_close(out, expected, dtype)


def test_sinks_with_a_soft_cap_and_a_sequence_of_length_zero():
    # Both per-logit options at once; a seq_len of 0 still gives zeros (the sink alone has no
    # value to weigh).
    case, query = decode_case([0, 9, 40, 130], 8, 2, 16, 128, torch.float32, seed=2)
    args = (query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, 0.5)
    sinks = _sinks(8, seed=2)
    options = {"sliding_window": 17, "logits_soft_cap": 4.0}
    expected = _assert_sinks_matter(reference.decode_attention, args, sinks, **options)
    for partition_size in (0, 32):
        out = ops.paged_attention_decode(
            *args, partition_size=partition_size, sinks=sinks, **options
        )
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        _assert_close(out, expected, torch.float32)


@pytest.mark.parametrize("head_size", [64, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sinks_on_every_isa_variant(isa, dtype, head_size):
    scale = 1.0 / math.sqrt(head_size)
    case, query = decode_case([1, 8, 9, 23, 100], 9, 3, 8, head_size, dtype, seed=6)
    args = (query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, scale)
    sinks = _sinks(9, seed=3)
    expected = _assert_sinks_matter(reference.decode_attention, args, sinks)
    for partition_size in (0, 16):
        out = ops.paged_attention_decode(*args, partition_size=partition_size, sinks=sinks)
        _assert_close(out, expected, dtype)
    # 16 query heads per kv head: the prefill tiles hold rows of several query positions.
    prior, q_lens = [0, 9, 3], [70, 1, 20]
    case, query, loc = prefill_case(prior, q_lens, 16, 1, 8, head_size, dtype, seed=7)
    args = (query, case.key_cache, case.value_cache, case.block_tables, loc, case.seq_lens, scale)
    sinks = _sinks(16, seed=4)
    expected = _assert_sinks_matter(reference.attention, args, sinks, sliding_window=3)
    out = ops.paged_prefill_attention(*args, sliding_window=3, sinks=sinks)
    _assert_close(out, expected, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gathered_prefill_with_sinks_matches_reference(dtype):
    prior, q_lens = [0, 50, 16, 70], [37, 30, 17, 1]
    case, query, loc = prefill_case(prior, q_lens, 6, 2, 16, 64, dtype)
    plan = plan_gathered_prefill(
        case.block_tables.numpy(),
        np.array(q_lens, dtype=np.int32),
        case.seq_lens.numpy(),
        16,
        torch.device("cpu"),
    )
    args = (query, case.key_cache, case.value_cache, case.block_tables, loc, case.seq_lens, SCALE)
    sinks = _sinks(6, seed=5)
    for window in (0, 7):
        out = torch.full_like(query, 7.0).contiguous()
        gathered_prefill_attention(
            query,
            case.key_cache,
            case.value_cache,
            plan,
            SCALE,
            out,
            sliding_window=window,
            sinks=sinks,
        )
        expected = _assert_sinks_matter(reference.attention, args, sinks, sliding_window=window)
        _assert_close(out, expected, dtype)


@pytest.mark.parametrize(
    ("sinks", "error", "message"),
    [
        (
            torch.zeros(4, dtype=torch.float64),
            ValueError,
            r"sinks must be float32 \[num_heads = 4\]",
        ),
        (torch.zeros(3), ValueError, r"sinks must be float32 \[num_heads = 4\], got .* \[3\]"),
        (torch.zeros(4, 2)[:, 0], ValueError, "sinks must be contiguous"),
        ([0.0] * 4, TypeError, "sinks must be None or a tensor, got list"),
        (torch.tensor([0.0, math.nan, 0.0, 0.0]), ValueError, r"sinks\[1\] = nan must be finite"),
        (torch.tensor([0.0, 0.0, 0.0, -math.inf]), ValueError, r"sinks\[3\] = -inf must be"),
    ],
)
def test_bad_sinks_are_refused_naming_them(sinks, error, message):
    case, query = decode_case([5], 4, 2, 8, 64, torch.float32)
    cache = (case.key_cache, case.value_cache, case.block_tables)
    with pytest.raises(error, match=message):
        ops.paged_attention_decode(query, *cache, case.seq_lens, 0.1, sinks=sinks)
    with pytest.raises(error, match=message):
        ops.paged_prefill_attention(
            query, *cache, query_start_loc([1]), case.seq_lens, 0.1, sinks=sinks
        )
