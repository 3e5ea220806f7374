"""Zhipu's GLM-4.5 (``Glm4MoeForCausalLM``): Llama attention with q/k/v biases, RoPE over
half of each head and per-head q/k norms; a dense first layer, then experts under
DeepSeek-V3's router (sigmoid scores, a learned bias that only steers the choice, experts in
groups of which each token keeps the best, renormalised and scaled weights) beside an
ungated shared expert. Greedy tokens identical to HF transformers (float32) across block
sizes (the parity matrix), chunked prefill with prefix hits, two tensor-parallel ranks, and
preemption by swap; the checkpoint's multi-token-prediction layer is skipped as HF skips it;
the router's bias, its groups and its scale each change HF's own tokens, so the parity
checks can fail; bfloat16's first tokens agree with HF's bfloat16 (the router kept in
float32 as HF keeps it)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.family_configs import GLM4_MOE
from helpers.lora_adapters import check_adapter_matches_hf_peft
from helpers.parity import check_bfloat16_first_tokens_agree_with_hf, hf_greedy
from helpers.tiny_family import (
    GREEDY,
    check_chunked_prefix_hits_and_two_ranks,
    check_preemption_by_swap_keeps_the_tokens,
    family_fixtures,
    prompts,
    rewritten,
    token_ids,
    with_next_token_layer,
)
from pagedserve.frontend import LLM
from pagedserve.gpu_worker.model_config import ExpertsSpec, GroupedRouting, ModelConfig

model_dir, hf_reference = family_fixtures(GLM4_MOE)


def test_layers_get_the_grouped_router_and_a_shared_expert(model_dir):
    config = ModelConfig.from_dir(model_dir)
    sparse = ExpertsSpec(
        8,
        3,
        64,
        "moe_intermediate_size",
        True,
        True,
        shared_intermediate_size=64,
        grouped=GroupedRouting(True, 4, 2, 2.5, correction_bias=True),
        shared_expert_gated=False,
    )
    assert config.layer_experts == (None, sparse, sparse)


def test_chunked_prefill_prefix_hits_and_two_ranks_match_hf(model_dir, hf_reference):
    check_chunked_prefix_hits_and_two_ranks(model_dir, hf_reference)


def test_preemption_by_swap_keeps_the_tokens(model_dir, hf_reference):
    check_preemption_by_swap_keeps_the_tokens(model_dir, hf_reference)


def test_the_next_token_prediction_layer_is_skipped_as_hf_skips_it(model_dir, tmp_path):
    with_mtp = with_next_token_layer(model_dir, tmp_path / "with_mtp")
    expected = hf_greedy(with_mtp, prompts())
    llm = LLM(with_mtp, num_blocks=256)
    assert token_ids(llm.generate(prompts(), GREEDY)) == expected


def test_router_bias_groups_and_scale_each_change_hf_s_tokens(model_dir, hf_reference, tmp_path):
    unbiased = rewritten(model_dir, tmp_path / "unbiased")
    tensors = load_file(unbiased / "model.safetensors")
    for name in tensors:
        if name.endswith("e_score_correction_bias"):
            tensors[name] = torch.zeros_like(tensors[name])
    save_file(tensors, unbiased / "model.safetensors", metadata={"format": "pt"})
    ungrouped = rewritten(model_dir, tmp_path / "ungrouped", topk_group=4)
    unscaled = rewritten(model_dir, tmp_path / "unscaled", routed_scaling_factor=1.0)
    for variant in (unbiased, ungrouped, unscaled):
        assert hf_greedy(variant, prompts()) != hf_reference, variant.name
        llm = LLM(variant, num_blocks=256)
        assert token_ids(llm.generate(prompts(), GREEDY)) == hf_greedy(variant, prompts())


def test_an_attention_adapter_matches_hf_peft(model_dir, tmp_path):
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    check_adapter_matches_hf_peft(model_dir, tmp_path, targets, seed=3, prompt_seed=6)


def test_bfloat16_first_tokens_agree_with_hf_bfloat16(model_dir):
    check_bfloat16_first_tokens_agree_with_hf(model_dir)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(n_group=3), "n_routed_experts=8 must divide into n_group=3"),
        (dict(topk_group=5), "topk_group=5 exceeds n_group=4"),
        (dict(n_group=8, topk_group=2), "each group needs at least 2 experts"),
        (dict(num_experts_per_tok=5), "num_experts_per_tok=5 exceeds the 4 experts"),
        (dict(routed_scaling_factor=0), "routed_scaling_factor must be a positive number"),
        (dict(first_k_dense_replace=-1), "first_k_dense_replace must be an integer >= 0"),
        (dict(n_shared_experts="1"), "n_shared_experts must be an integer >= 0"),
    ],
)
def test_bad_router_fields_are_refused_by_name(model_dir, tmp_path, changes, message):
    bad = rewritten(model_dir, tmp_path / "bad", **changes)
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dir(bad)
