"""Ministral 3 (``Ministral3ForCausalLM``): Mistral with Llama 4's attention temperature,
each query scaled by ``1 + beta * log(1 + floor(position / L))`` after RoPE (``beta`` =
``llama_4_scaling_beta``, ``L`` = YaRN's original context), under YaRN. Greedy tokens
identical to HF transformers (float32) across block sizes (the parity matrix), chunked
prefill with prefix hits, two tensor-parallel ranks and preemption by swap, and with a
sliding window; the scaling changes HF's own tokens, so the checks can fail; bfloat16's
first tokens agree with HF's bfloat16."""

from __future__ import annotations

import pytest

from helpers.family_configs import MINISTRAL3, MINISTRAL3_ROPE
from helpers.parity import check_bfloat16_first_tokens_agree_with_hf, hf_greedy
from helpers.tiny_family import (
    GREEDY,
    check_chunked_prefix_hits_and_two_ranks,
    check_preemption_by_swap_keeps_the_tokens,
    family_fixtures,
    prompts,
    rewritten,
    token_ids,
)
from pagedserve.frontend import LLM
from pagedserve.gpu_worker.model_config import ModelConfig

model_dir, hf_reference = family_fixtures(MINISTRAL3)


def test_the_query_scaling_is_read_from_the_rope_parameters(model_dir, tmp_path):
    config = ModelConfig.from_dir(model_dir)
    assert config.spec.query_scaling(config) == (0.5, 32)
    bad = rewritten(
        model_dir,
        tmp_path / "bad",
        rope_parameters={**MINISTRAL3_ROPE, "llama_4_scaling_beta": None},
    )
    with pytest.raises(ValueError, match="llama_4_scaling_beta must be a finite number"):
        LLM(bad, num_blocks=64)


def test_chunked_prefill_prefix_hits_and_two_ranks_match_hf(model_dir, hf_reference):
    check_chunked_prefix_hits_and_two_ranks(model_dir, hf_reference)


def test_preemption_by_swap_keeps_the_tokens(model_dir, hf_reference):
    check_preemption_by_swap_keeps_the_tokens(model_dir, hf_reference)


def test_the_scaling_changes_hf_s_tokens_and_a_window_matches_hf(model_dir, hf_reference, tmp_path):
    unscaled = rewritten(
        model_dir,
        tmp_path / "unscaled",
        rope_parameters={**MINISTRAL3_ROPE, "llama_4_scaling_beta": 0.0},
    )
    assert hf_greedy(unscaled, prompts()) != hf_reference
    windowed = rewritten(model_dir, tmp_path / "windowed", sliding_window=24)
    expected = hf_greedy(windowed, prompts())
    assert expected != hf_reference
    llm = LLM(windowed, num_blocks=256)
    assert token_ids(llm.generate(prompts(), GREEDY)) == expected


def test_bfloat16_first_tokens_agree_with_hf_bfloat16(model_dir):
    check_bfloat16_first_tokens_agree_with_hf(model_dir)
