"""BigCode's StarCoder2 (``Starcoder2ForCausalLM``): LayerNorm with biases, a GELU MLP,
biases on every projection, a sliding window on every layer, a tied LM head. Greedy tokens
identical to HF transformers (float32) across block sizes (the parity matrix) with a window
the longer prompts pass (shown to change HF's tokens), chunked prefill with prefix hits, and
two tensor-parallel ranks; bfloat16's first tokens agree with HF's bfloat16.
"""

from __future__ import annotations

from helpers.family_configs import STARCODER2
from helpers.parity import check_bfloat16_first_tokens_agree_with_hf, hf_greedy
from helpers.tiny_family import (
    check_chunked_prefix_hits_and_two_ranks,
    family_fixtures,
    prompts,
    rewritten,
)
from pagedserve.gpu_worker.model_config import ModelConfig

model_dir, hf_reference = family_fixtures(STARCODER2)


def test_the_window_is_on_every_layer(model_dir):
    assert ModelConfig.from_dir(model_dir).layer_sliding_windows == (32, 32)


def test_chunked_prefill_prefix_hits_and_two_ranks_match_hf(model_dir, hf_reference):
    check_chunked_prefix_hits_and_two_ranks(model_dir, hf_reference)


def test_the_window_changes_hf_s_tokens(model_dir, hf_reference, tmp_path):
    unwindowed = rewritten(model_dir, tmp_path / "unwindowed", sliding_window=None)
    assert hf_greedy(unwindowed, prompts()) != hf_reference


def test_bfloat16_first_tokens_agree_with_hf_bfloat16(model_dir):
    check_bfloat16_first_tokens_agree_with_hf(model_dir)
