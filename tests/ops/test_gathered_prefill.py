"""Prefill as one SDPA call over gathered K/V (the CUDA default), checked on the CPU against
the float64 reference (the engine path: tests/engine/test_gathered_prefill_engine.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedserve.gpu_worker.layers.gathered_prefill import (
    PREFILL_ATTENTION_ENV,
    gathered_prefill_attention,
    plan_gathered_prefill,
    use_gathered_prefill,
)

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
