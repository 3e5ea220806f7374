"""AllenAI's OLMoE (``OlmoeForCausalLM``): Llama with RMSNorms over the whole query and key
projections (all heads at once, before RoPE; each tensor-parallel rank its rows, the sum of
squares over the ranks), q / k / v optionally clamped (``clip_qkv``), and experts in every
layer (softmax top-k, weights rounded to the dtype). Greedy tokens identical to HF transformers
(float32) across block sizes, chunked prefill with prefix hits and two tensor-parallel ranks,
with and without the clamp, which changes HF's own tokens, so the check can fail; bfloat16's
first tokens agree with HF's bfloat16 (its norms round, then scale, as Llama's)."""

from __future__ import annotations

import pytest

from helpers.parity import check_bfloat16_first_tokens_agree_with_hf, hf_greedy
from helpers.tiny_family import (
    GREEDY,
    TINY_SHAPE,
    check_chunked_prefix_hits_and_two_ranks,
    family_fixtures,
    prompts,
    rewritten,
    token_ids,
)
from pagedserve.frontend import LLM

# OLMoE-1B-7B's shape in small: 8 experts of 128, top 3, not renormalised; a clamp of 0.5
# that these random projections cross.
OLMOE = dict(
    architectures=["OlmoeForCausalLM"],
    **{**TINY_SHAPE, "intermediate_size": 128},
    num_experts=8,
    num_experts_per_tok=3,
    clip_qkv=0.5,
    pad_token_id=0,
    eos_token_id=2,
)


model_dir, hf_reference = family_fixtures(OLMOE)


@pytest.mark.parametrize("block_size", [8, 16])
def test_olmoe_matches_hf(model_dir, hf_reference, block_size):
    llm = LLM(model_dir, block_size=block_size, num_blocks=256)
    assert token_ids(llm.generate(prompts(), GREEDY)) == hf_reference


def test_chunked_prefill_prefix_hits_and_two_ranks_match_hf(model_dir, hf_reference):
    check_chunked_prefix_hits_and_two_ranks(model_dir, hf_reference)


def test_the_clamp_changes_hf_s_tokens(model_dir, hf_reference, tmp_path):
    unclamped = rewritten(model_dir, tmp_path / "unclamped", clip_qkv=None)
    expected = hf_greedy(unclamped, prompts())
    assert expected != hf_reference
    llm = LLM(unclamped, num_blocks=256)
    assert token_ids(llm.generate(prompts(), GREEDY)) == expected


def test_bfloat16_first_tokens_agree_with_hf_bfloat16(model_dir):
    check_bfloat16_first_tokens_agree_with_hf(model_dir)
