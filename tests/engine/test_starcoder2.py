"""BigCode's StarCoder2 (``Starcoder2ForCausalLM``): LayerNorm with biases, a GELU MLP,
biases on every projection, a sliding window on every layer, a tied LM head. Greedy tokens
identical to HF transformers (float32) across block sizes with a window the longer prompts
pass (shown to change HF's tokens), chunked prefill with prefix hits, and two
tensor-parallel ranks; bfloat16's first tokens agree with HF's bfloat16.
"""

from __future__ import annotations

import pytest

from helpers.family_configs import STARCODER2
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

model_dir, hf_reference = family_fixtures(STARCODER2)


@pytest.mark.parametrize("block_size", [8, 16])
def test_starcoder2_matches_hf(model_dir, hf_reference, block_size):
    llm = LLM(model_dir, block_size=block_size, num_blocks=256)
    assert llm.model_config.layer_sliding_windows == (32, 32)
    assert token_ids(llm.generate(prompts(), GREEDY)) == hf_reference


def test_chunked_prefill_prefix_hits_and_two_ranks_match_hf(model_dir, hf_reference):
    check_chunked_prefix_hits_and_two_ranks(model_dir, hf_reference)


def test_the_window_changes_hf_s_tokens(model_dir, hf_reference, tmp_path):
    unwindowed = rewritten(model_dir, tmp_path / "unwindowed", sliding_window=None)
    assert hf_greedy(unwindowed, prompts()) != hf_reference


def test_bfloat16_first_tokens_agree_with_hf_bfloat16(model_dir):
    check_bfloat16_first_tokens_agree_with_hf(model_dir)
