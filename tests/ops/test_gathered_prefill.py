"""Prefill through torch over gathered K/V (the CUDA default), checked on the CPU against the
float64 reference: the padded SDPA layout whole, the packed layout's plan and gather with flash
attention's semantics computed in float64 in its place (it has no CPU kernel; tests/cuda runs
the kernel itself). The engine path: tests/engine/test_gathered_prefill_engine.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedserve.gpu_worker.layers import gathered_prefill
from pagedserve.gpu_worker.layers.gathered_prefill import (
    PREFILL_ATTENTION_ENV,
    PrefillPlan,
    gathered_prefill_attention,
    plan_gathered_prefill,
    plan_prefill,
    prefill_attention,
    use_gathered_prefill,
)
from pagedserve.scheduler.messages import NULL_BLOCK

from . import reference
from .cases import TOLERANCES, fused_qkv, paged_case, query_start_loc


def _gathered(prior, q_lens, num_heads, num_kv_heads, block_size, head_size, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    seq_lens = [p + q for p, q in zip(prior, q_lens)]
    case = paged_case(seq_lens, num_kv_heads, block_size, head_size, dtype, generator)
    # Slot 0 of block 0 is what padding reads: make it poison, as uninitialised memory may be.
    case.key_cache[0].fill_(float("nan"))
    case.value_cache[0].fill_(float("nan"))
    used = {int(b) for b in case.block_tables.flatten() if b < case.key_cache.shape[0]}
    if 0 in used:  # keep the sequences' own data finite
        case.key_cache[0].normal_(generator=generator)
        case.value_cache[0].normal_(generator=generator)
    query, _, _ = fused_qkv(sum(q_lens), num_heads, num_kv_heads, head_size, dtype, generator)
    plan = plan_gathered_prefill(
        case.block_tables.numpy(),
        np.array(q_lens, dtype=np.int32),
        np.array(seq_lens, dtype=np.int32),
        block_size,
        torch.device("cpu"),
    )
    scale = head_size**-0.5
    out = torch.full_like(query, 7.0).contiguous()
    gathered_prefill_attention(query, case.key_cache, case.value_cache, plan, scale, out)
    expected = reference.attention(
        query,
        case.key_cache,
        case.value_cache,
        case.block_tables,
        query_start_loc(q_lens),
        case.seq_lens,
        scale,
    )
    return out, expected


@pytest.mark.parametrize("layout", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mixed_batch_matches_reference(dtype, head_size, block_size, layout):
    num_heads, num_kv_heads = layout
    # Plain prefill, a chunk over cached context, one block plus one token, one token after a
    # long context, a one-token prompt.
    prior = [0, 50, block_size, 70, 0]
    q_lens = [37, 30, block_size + 1, 1, 1]
    out, expected = _gathered(prior, q_lens, num_heads, num_kv_heads, block_size, head_size, dtype)
    torch.testing.assert_close(out.double(), expected, **TOLERANCES[dtype])


def test_sequences_without_new_tokens_are_skipped():
    out, expected = _gathered([10, 4, 0], [3, 0, 5], 4, 2, 8, 64, torch.float32)
    torch.testing.assert_close(out.double(), expected, **TOLERANCES[torch.float32])


def test_few_hundred_tokens():
    out, expected = _gathered([0, 120], [300, 200], 9, 3, 16, 64, torch.float32, seed=3)
    torch.testing.assert_close(out.double(), expected, **TOLERANCES[torch.float32])


def test_choice_comes_from_the_environment(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv(PREFILL_ATTENTION_ENV, raising=False)
    assert not use_gathered_prefill(cpu) and use_gathered_prefill(cuda)
    monkeypatch.setenv(PREFILL_ATTENTION_ENV, "sdpa")
    assert use_gathered_prefill(cpu)
    monkeypatch.setenv(PREFILL_ATTENTION_ENV, "kernel")
    assert not use_gathered_prefill(cuda)
    monkeypatch.setenv(PREFILL_ATTENTION_ENV, "flash")
    with pytest.raises(ValueError, match="PAGEDSERVE_PREFILL_ATTENTION='flash'.*auto"):
        use_gathered_prefill(cpu)
    monkeypatch.setenv(PREFILL_ATTENTION_ENV, "varlen")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="varlen needs torch's flash attention on a CUDA"):
            use_gathered_prefill(cuda)
    # Plans choose the packed layout only on CUDA, where torch has flash attention.
    for choice in ("auto", "sdpa", "varlen"):
        monkeypatch.setenv(PREFILL_ATTENTION_ENV, choice)
        plan = plan_prefill(np.zeros((1, 1), np.int32), np.ones(1), np.ones(1), 16, cpu)
        assert not plan.flash


# --- the packed layout (flash attention's variable-length kernel) -----------------------------


def _flash_in_float64(query, keys, values, plan, scale, sliding_window):
    """flash_varlen's semantics on the CPU (reference.varlen_attention), in the query's dtype."""
    out = reference.varlen_attention(
        query, keys, values, plan.cu_query.cpu(), plan.cu_key.cpu(), scale, sliding_window
    )
    return out.to(query.dtype)


def _reference(case, query, q_lens, scale, sliding_window=0):
    """The float64 reference of the prefill tokens ``query`` of the sequences in ``case``."""
    return reference.attention(
        query, case.key_cache, case.value_cache, case.block_tables, query_start_loc(q_lens),
        case.seq_lens, scale, sliding_window=sliding_window,
    )  # fmt: skip


def _packed(case, query, q_lens, tables, scale, sliding_window=0, key_cache=None, value_cache=None):
    plan = PrefillPlan(
        tables,
        np.array(q_lens, dtype=np.int32),
        case.seq_lens.numpy(),
        case.key_cache.shape[2],
        torch.device("cpu"),
        flash=True,
    )
    out = torch.full_like(query, 7.0).contiguous()
    prefill_attention(
        query,
        case.key_cache if key_cache is None else key_cache,
        case.value_cache if value_cache is None else value_cache,
        plan,
        scale,
        out,
        sliding_window=sliding_window,
    )
    assert "padded" not in vars(plan)  # the packed path ran, and nothing padded was made
    return out


@pytest.mark.parametrize("layout", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_packed_layout_gives_the_reference_attention(dtype, layout, monkeypatch):
    # Plain prefill, a chunk over cached context, a sequence without new tokens (left out of
    # the packing), one block plus one token, one token after a long context, a one-token prompt.
    monkeypatch.setattr(gathered_prefill, "flash_varlen", _flash_in_float64)
    num_heads, num_kv_heads = layout
    generator = torch.Generator().manual_seed(4)
    prior, q_lens = [0, 50, 9, 16, 70, 0], [37, 30, 0, 17, 1, 1]
    seq_lens = [p + q for p, q in zip(prior, q_lens)]
    case = paged_case(seq_lens, num_kv_heads, 16, 64, dtype, generator)
    query, _, _ = fused_qkv(sum(q_lens), num_heads, num_kv_heads, 64, dtype, generator)
    out = _packed(case, query, q_lens, case.block_tables.numpy(), 0.125)
    expected = _reference(case, query, q_lens, 0.125)
    torch.testing.assert_close(out.double(), expected, **TOLERANCES[dtype])


def test_packed_layout_reads_freed_positions_as_zeros(monkeypatch):
    # Blocks freed behind a sliding window hold NULL_BLOCK in the table: the packed keys read
    # block 0 there, zeroed, since flash multiplies their probabilities (0) by their values and
    # block 0 may hold anything (here NaN).
    monkeypatch.setattr(gathered_prefill, "flash_varlen", _flash_in_float64)
    block_size, window = 8, 12
    generator = torch.Generator().manual_seed(12)
    prior, q_lens = [60, 0, 33], [10, 40, 1]
    seq_lens = [p + q for p, q in zip(prior, q_lens)]
    case = paged_case(seq_lens, 2, block_size, 64, torch.bfloat16, generator)
    query, _, _ = fused_qkv(sum(q_lens), 4, 2, 64, torch.bfloat16, generator)
    expected = _reference(case, query, q_lens, 0.125, window)
    tables = case.block_tables.numpy().copy()
    for seq, first_query in enumerate(prior):
        tables[seq, : max(0, first_query - window + 1) // block_size] = NULL_BLOCK
    assert (tables == NULL_BLOCK).sum() == 6 + 2
    # A poisoned block 0 that no sequence holds: the others move up by one.
    tables = np.where(tables == NULL_BLOCK, NULL_BLOCK, tables + 1).astype(np.int32)
    key_cache, value_cache = (
        torch.cat([torch.full_like(cache[:1], float("nan")), cache])
        for cache in (case.key_cache, case.value_cache)
    )
    out = _packed(case, query, q_lens, tables, 0.125, window, key_cache, value_cache)
    torch.testing.assert_close(out.double(), expected, **TOLERANCES[torch.bfloat16])
