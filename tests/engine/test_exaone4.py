"""LG AI's EXAONE 4 (``Exaone4ForCausalLM``): OLMo 2's post-norm layers (each sublayer's
output normalised, then added) with an RMSNorm over each query and key head; with a window,
every ``sliding_window_pattern``-th layer global and without RoPE, the others windowed with
it. Greedy tokens identical to HF transformers (float32) across block sizes (the parity
matrix), chunked prefill with prefix hits and two tensor-parallel ranks, windowed or not;
the window and the global layers' missing RoPE each change HF's own tokens, so the checks
can fail; bfloat16's first tokens agree with HF's bfloat16; adapters give peft's tokens."""

from __future__ import annotations

import json

from helpers.family_configs import EXAONE4
from helpers.lora_adapters import check_adapter_matches_hf_peft
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
from pagedserve.gpu_worker.model_config import ModelConfig

model_dir, hf_reference = family_fixtures(EXAONE4)


def test_windowed_layers_rotate_and_global_ones_do_not(model_dir, tmp_path):
    config = ModelConfig.from_dir(model_dir)
    assert config.layer_sliding_windows == (32, 0, 32, 0)
    assert config.spec.rope_layers(config.hf_config) == (True, False, True, False)
    untyped = ModelConfig.from_dir(rewritten(model_dir, tmp_path / "untyped", layer_types=None))
    assert untyped.layer_sliding_windows == (32, 0, 32, 0)


def test_chunked_prefill_prefix_hits_and_two_ranks_match_hf(model_dir, hf_reference):
    check_chunked_prefix_hits_and_two_ranks(model_dir, hf_reference)


def test_without_a_window_every_layer_rotates_and_matches_hf(model_dir, hf_reference, tmp_path):
    # EXAONE-4.0-1.2B's kind: no window, so no global layer skips RoPE.
    unwindowed = rewritten(model_dir, tmp_path / "unwindowed", layer_types=["full_attention"] * 4)
    config = json.loads((unwindowed / "config.json").read_text())
    (unwindowed / "config.json").write_text(json.dumps({**config, "sliding_window": None}))
    config = ModelConfig.from_dir(unwindowed)
    assert config.spec.rope_layers(config.hf_config) == (True,) * 4
    expected = hf_greedy(unwindowed, prompts())
    assert expected != hf_reference  # the window and the NoPE layers show in HF's tokens
    llm = LLM(unwindowed, num_blocks=256)
    assert token_ids(llm.generate(prompts(), GREEDY)) == expected


def test_an_adapter_matches_hf_peft(model_dir, tmp_path):
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    check_adapter_matches_hf_peft(model_dir, tmp_path, targets, seed=8, prompt_seed=9)


def test_bfloat16_first_tokens_agree_with_hf_bfloat16(model_dir):
    check_bfloat16_first_tokens_agree_with_hf(model_dir)
