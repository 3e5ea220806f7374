"""Arcee's AFM (``ArceeForCausalLM``): Llama with an ungated MLP, ``down(relu(up(x))^2)``.
Greedy tokens identical to HF transformers (float32) across block sizes (the parity matrix),
chunked prefill with prefix hits and two tensor-parallel ranks; a config without
``hidden_act`` takes ArceeConfig's squared ReLU; adapters on its own up / down projections
give peft's tokens; its classifier matches HF's (tests/engine/test_classification.py).
"""

from __future__ import annotations

from helpers.family_configs import ARCEE
from helpers.parity import hf_greedy
from helpers.tiny_family import (
    GREEDY,
    check_chunked_prefix_hits_and_two_ranks,
    family_fixtures,
    prompts,
    rewritten,
    token_ids,
)
from pagedserve.frontend import LLM

model_dir, hf_reference = family_fixtures(ARCEE)


def test_chunked_prefill_prefix_hits_and_two_ranks_match_hf(model_dir, hf_reference, tmp_path):
    check_chunked_prefix_hits_and_two_ranks(model_dir, hf_reference)
    # The squared ReLU is ArceeConfig's default; a plain ReLU moves HF's own tokens.
    bare = rewritten(model_dir, tmp_path / "bare", hidden_act=None)
    assert token_ids(LLM(bare, num_blocks=256).generate(prompts(), GREEDY)) == hf_reference
    relu = rewritten(model_dir, tmp_path / "relu", hidden_act="relu")
    assert hf_greedy(relu, prompts()) != hf_reference


def test_lora_on_its_up_and_down_projections_matches_hf_peft(model_dir, tmp_path):
    from helpers.lora_adapters import check_adapter_matches_hf_peft

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"]
    check_adapter_matches_hf_peft(model_dir, tmp_path, targets, seed=7, prompt_seed=5)
