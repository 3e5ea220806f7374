"""AllenAI's OLMoE (``OlmoeForCausalLM``): Llama with RMSNorms over the whole query and key
projections (all heads at once, before RoPE; each tensor-parallel rank its rows, the sum of
squares over the ranks), q / k / v optionally clamped (``clip_qkv``), and experts in every
layer (softmax top-k, weights rounded to the dtype). Greedy tokens identical to HF
transformers (float32) across block sizes (the parity matrix), chunked prefill with prefix
hits and two tensor-parallel ranks, with and without the clamp, which changes HF's own
tokens, so the check can fail; bfloat16's first tokens agree with HF's bfloat16 (its norms
round, then scale, as Llama's)."""

from __future__ import annotations

from helpers.family_configs import OLMOE
from helpers.parity import check_bfloat16_first_tokens_agree_with_hf, hf_greedy
from helpers.tiny_family import (
    GREEDY,
    check_chunked_prefix_hits_and_two_ranks,
    family_fixtures,
    prompts,
    rewritten,
    token_ids,
)
from pagedserve.frontend import LLM

model_dir, hf_reference = family_fixtures(OLMOE)


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
