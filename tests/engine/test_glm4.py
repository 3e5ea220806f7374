"""Zhipu's GLM-4 (``Glm4ForCausalLM``): q/k/v biases, interleaved RoPE over half of each
head (run as the ops' partial rotate-half on reordered query and key rows), four norms a
layer, a fused gate/up MLP. Greedy tokens identical to HF transformers (float32) across
block sizes, chunked prefill with prefix hits and two tensor-parallel ranks, also for a
config that leaves the rotated share to Glm4Config's default (0.5); bfloat16's first tokens
agree with HF's bfloat16.
"""

from __future__ import annotations

from helpers.family_configs import GLM4
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

model_dir, hf_reference = family_fixtures(GLM4)


def test_rope_turns_half_of_each_head(model_dir):
    llm = LLM(model_dir, num_blocks=16)
    assert llm.worker.runner.model.rotary.rotary_dim == 32  # half of each 64-value head


def test_chunked_prefill_prefix_hits_and_two_ranks_match_hf(model_dir, hf_reference):
    check_chunked_prefix_hits_and_two_ranks(model_dir, hf_reference)


def test_a_config_without_the_rotated_share_takes_glm4config_s_default(model_dir, tmp_path):
    # As GLM-4's Hub configs are written (transformers 4): rope_theta at the top, no
    # partial_rotary_factor anywhere; Glm4Config rotates half of each head.
    bare = rewritten(model_dir, tmp_path / "bare", rope_parameters=None, partial_rotary_factor=None)
    llm = LLM(bare, num_blocks=256)
    assert token_ids(llm.generate(prompts(), GREEDY)) == hf_greedy(bare, prompts())


def test_bfloat16_first_tokens_agree_with_hf_bfloat16(model_dir):
    check_bfloat16_first_tokens_agree_with_hf(model_dir)
