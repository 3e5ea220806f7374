"""Attention logit soft-capping (Gemma 2) of the decode, prefill and gathered-prefill ops against
the float64 reference: each logit s = scale * q . k becomes cap * tanh(s / cap) before the mask
and the softmax, as HF transformers' Gemma 2 eager attention computes it."""

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

BLOCK_SIZES = [8, 16, 32]
DTYPES = [torch.float32, torch.bfloat16]
# (num_heads, num_kv_heads): plain multi-head and a GQA group of 3.
HEAD_LAYOUTS = [(4, 4), (6, 2)]
# (cap, scale, sliding_window). The query and key elements are standard normal and the head
# size is 64, so scale * q . k has a standard deviation of 8 * scale: a cap of 1 saturates most
# logits, 5 bends the tails, and Gemma 2's 50 bends logits of scale 1 (std 8) visibly. Each cap
# also runs with a window (capping before the mask must not unmask a position).
CAPS = [(1.0, 0.125, 0), (5.0, 0.125, 24), (50.0, 1.0, 0), (50.0, 1.0, 5)]


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(actual.double(), expected, **TOLERANCES[dtype])


def _assert_cap_matters(reference_fn, args, cap: float, window: int) -> torch.Tensor:
    """The reference with the cap, after checking it differs from the uncapped one by far more
    than the float32 tolerance (a kernel ignoring the cap must fail)."""
    expected = reference_fn(*args, sliding_window=window, logits_soft_cap=cap)
    uncapped = reference_fn(*args, sliding_window=window)
    assert (expected - uncapped).abs().max() > 100 * TOLERANCES[torch.float32]["atol"]
    return expected


# --- decode ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("cap", "scale", "window"), CAPS)
@pytest.mark.parametrize("layout", HEAD_LAYOUTS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_with_soft_cap_matches_reference(dtype, block_size, layout, cap, scale, window):
    num_heads, num_kv_heads = layout
    seq_lens = [1, block_size, block_size + 1, 3 * block_size - 1, 100]
    case, query = decode_case(seq_lens, num_heads, num_kv_heads, block_size, 64, dtype)
    args = (query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, scale)
    expected = _assert_cap_matters(reference.decode_attention, args, cap, window)
    for partition_size in (None, 0, block_size, 2 * block_size):
        out = ops.paged_attention_decode(
            *args, partition_size=partition_size, sliding_window=window, logits_soft_cap=cap
        )
        _assert_close(out, expected, dtype)


@pytest.mark.parametrize("partition_size", [32, 64])
@pytest.mark.parametrize("window", [0, 17, 200])
def test_partitioned_decode_with_soft_cap_equals_single_pass(window, partition_size):
    seq_lens = [1, 31, 33, 64, 65, 200, 333, 1000]
    case, query = decode_case(seq_lens, 8, 2, 16, 128, torch.float32, seed=1)
    args = (query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, 0.5)
    capped = {"sliding_window": window, "logits_soft_cap": 50.0}
    single = ops.paged_attention_decode(*args, partition_size=0, **capped)
    split = ops.paged_attention_decode(*args, partition_size=partition_size, **capped)
    torch.testing.assert_close(split, single, atol=1e-6, rtol=1e-6)
    _assert_close(split, reference.decode_attention(*args, **capped), torch.float32)


def test_soft_cap_of_zero_or_none_is_off():
    case, query = decode_case([5, 40, 77], 6, 2, 16, 80, torch.float32, seed=2)
    args = (query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, 0.1)
    plain = ops.paged_attention_decode(*args)
    assert torch.equal(ops.paged_attention_decode(*args, logits_soft_cap=0.0), plain)
    assert torch.equal(ops.paged_attention_decode(*args, logits_soft_cap=None), plain)
    loc = query_start_loc([1, 1, 1])
    prefill_args = (query, case.key_cache, case.value_cache, case.block_tables, loc, case.seq_lens)
    assert torch.equal(
        ops.paged_prefill_attention(*prefill_args, 0.1, logits_soft_cap=0),
        ops.paged_prefill_attention(*prefill_args, 0.1),
    )


def test_saturated_logits_keep_the_mask():
    # Logits of hundreds against a cap of 2: nearly every visible logit is +-2 after the cap,
    # where a future key capped after the mask would show up as -2 (a finite weight) instead of
    # -inf. tanh's argument also leaves the range where it is computed (|x| > 8).
    prior, q_lens = [0, 20], [40, 9]
    case, query, loc = prefill_case(prior, q_lens, 4, 2, 8, 64, torch.float32, seed=3)
    args = (query, case.key_cache, case.value_cache, case.block_tables, loc, case.seq_lens, 30.0)
    for window in (0, 6):
        expected = _assert_cap_matters(reference.attention, args, 2.0, window)
        out = ops.paged_prefill_attention(*args, sliding_window=window, logits_soft_cap=2.0)
        _assert_close(out, expected, torch.float32)


# --- prefill -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("cap", "scale", "window"), CAPS)
@pytest.mark.parametrize("layout", HEAD_LAYOUTS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_with_soft_cap_matches_reference(dtype, block_size, layout, cap, scale, window):
    num_heads, num_kv_heads = layout
    # Plain prefill, a decode with context, chunked prefill over cached context, one block plus
    # one token, a one-token prompt, and a chunk starting deep in the context.
    prior = [0, 13, block_size, 50, 0, 70]
    q_lens = [37, 1, block_size + 1, 30, 1, 30]
    case, query, loc = prefill_case(prior, q_lens, num_heads, num_kv_heads, block_size, 64, dtype)
    args = (query, case.key_cache, case.value_cache, case.block_tables, loc, case.seq_lens, scale)
    expected = _assert_cap_matters(reference.attention, args, cap, window)
    out = ops.paged_prefill_attention(*args, sliding_window=window, logits_soft_cap=cap)
    _assert_close(out, expected, dtype)


def test_prefill_of_single_tokens_with_soft_cap_equals_decode():
    prior = [0, 7, 31, 100]
    case, query, loc = prefill_case(prior, [1] * 4, 8, 2, 16, 96, torch.float32, seed=5)
    cache = (case.key_cache, case.value_cache, case.block_tables)
    capped = {"sliding_window": 9, "logits_soft_cap": 3.0}
    prefill = ops.paged_prefill_attention(query, *cache, loc, case.seq_lens, 0.3, **capped)
    decode = ops.paged_attention_decode(query, *cache, case.seq_lens, 0.3, **capped)
    torch.testing.assert_close(prefill, decode, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("head_size", [80, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_soft_cap_on_every_isa_variant(isa, dtype, head_size):
    scale = 4.0 / math.sqrt(head_size)  # logits of std 4: the cap of 5 bends them
    seq_lens = [1, 8, 9, 23, 100]
    case, query = decode_case(seq_lens, 9, 3, 8, head_size, dtype, seed=6)
    args = (query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, scale)
    for window in (0, 11):
        expected = _assert_cap_matters(reference.decode_attention, args, 5.0, window)
        for partition_size in (0, 16):
            out = ops.paged_attention_decode(
                *args, partition_size=partition_size, sliding_window=window, logits_soft_cap=5.0
            )
            _assert_close(out, expected, dtype)
    # 16 query heads per kv head: the tiles hold rows of two or more query positions.
    prior, q_lens = [0, 9, 3], [70, 1, 20]
    case, query, loc = prefill_case(prior, q_lens, 16, 1, 8, head_size, dtype, seed=7)
    args = (query, case.key_cache, case.value_cache, case.block_tables, loc, case.seq_lens, scale)
    for window in (0, 3):
        expected = _assert_cap_matters(reference.attention, args, 5.0, window)
        out = ops.paged_prefill_attention(*args, sliding_window=window, logits_soft_cap=5.0)
        _assert_close(out, expected, dtype)


@pytest.mark.parametrize(
    ("cap", "error", "message"),
    [
        (-1.0, ValueError, "logits_soft_cap must be None, 0 .* got -1.0"),
        (math.inf, ValueError, "logits_soft_cap must be .* finite number, got inf"),
        (math.nan, ValueError, "logits_soft_cap must be .* finite number, got nan"),
        ("50", TypeError, "logits_soft_cap must be None or a number, got str"),
        (True, TypeError, "logits_soft_cap must be None or a number, got bool"),
    ],
)
def test_bad_soft_cap_is_refused_naming_it(cap, error, message):
    case, query = decode_case([5], 4, 2, 8, 64, torch.float32)
    cache = (case.key_cache, case.value_cache, case.block_tables)
    with pytest.raises(error, match=message):
        ops.paged_attention_decode(query, *cache, case.seq_lens, 0.1, logits_soft_cap=cap)
    with pytest.raises(error, match=message):
        ops.paged_prefill_attention(
            query, *cache, query_start_loc([1]), case.seq_lens, 0.1, logits_soft_cap=cap
        )


# --- gathered prefill (explicit scores: torch's SDPA has no soft-cap) ---------------------------


@pytest.mark.parametrize(("cap", "scale", "window"), CAPS)
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gathered_prefill_with_soft_cap_matches_reference(dtype, block_size, cap, scale, window):
    prior = [0, 50, block_size, 70, 0]
    q_lens = [37, 30, block_size + 1, 1, 1]
    case, query, loc = prefill_case(prior, q_lens, 6, 2, block_size, 64, dtype)
    plan = plan_gathered_prefill(
        case.block_tables.numpy(),
        np.array(q_lens, dtype=np.int32),
        case.seq_lens.numpy(),
        block_size,
        torch.device("cpu"),
    )
    out = torch.full_like(query, 7.0).contiguous()
    gathered_prefill_attention(
        query,
        case.key_cache,
        case.value_cache,
        plan,
        scale,
        out,
        sliding_window=window,
        logits_soft_cap=cap,
    )
    args = (query, case.key_cache, case.value_cache, case.block_tables, loc, case.seq_lens, scale)
    _assert_close(out, _assert_cap_matters(reference.attention, args, cap, window), dtype)
