"""MiniMax-M2 (``MiniMaxM2ForCausalLM``): Llama's layers with RMS norms over the whole query
and key projections, RoPE over the first ``rotary_dim`` values of each head, and Mixtral's
experts in every layer under a sigmoid router whose learned bias chooses the experts but not
their weights (renormalised scores). Greedy tokens identical to HF transformers (float32)
across block sizes (the parity matrix), chunked prefill with prefix hits, two
tensor-parallel ranks and preemption by swap; the bias, the partial RoPE and the q/k norms
each change HF's own tokens, so the checks can fail; bfloat16's first tokens agree with HF's
bfloat16."""

from __future__ import annotations

import torch
from safetensors.torch import load_file, save_file

from helpers.family_configs import MINIMAX_M2
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
from pagedserve.gpu_worker.model_config import GroupedRouting, ModelConfig

model_dir, hf_reference = family_fixtures(MINIMAX_M2)


def test_the_router_and_the_partial_rope_are_read(model_dir):
    config = ModelConfig.from_dir(model_dir)
    spec = config.layer_experts[0]
    assert (spec.num_experts, spec.top_k, spec.intermediate_size) == (8, 3, 96)
    assert spec.renormalize and spec.weights_in_float32
    assert spec.grouped == GroupedRouting(
        True, 1, 1, 1.0, correction_bias=True, router_in_float32=False
    )
    assert all(layer == spec for layer in config.layer_experts)
    assert config.head_size == 64


def test_chunked_prefill_prefix_hits_and_two_ranks_match_hf(model_dir, hf_reference):
    check_chunked_prefix_hits_and_two_ranks(model_dir, hf_reference)


def test_preemption_by_swap_keeps_the_tokens(model_dir, hf_reference):
    check_preemption_by_swap_keeps_the_tokens(model_dir, hf_reference)


def with_tensors(model_dir, path, edit):
    variant = rewritten(model_dir, path)
    tensors = load_file(variant / "model.safetensors")
    edit(tensors)
    save_file(tensors, variant / "model.safetensors", metadata={"format": "pt"})
    return variant


def test_the_router_bias_and_the_norms_each_change_hf_s_tokens(model_dir, hf_reference, tmp_path):
    """A router bias that favours some experts (chosen, not weighted), the full RoPE, unit
    q/k norms: HF's tokens move each time, and ours follow them."""

    def bias(tensors):
        for name in [n for n in tensors if n.endswith("e_score_correction_bias")]:
            tensors[name] = torch.linspace(-0.5, 0.5, tensors[name].numel())

    def unit_norms(tensors):
        for name in [n for n in tensors if n.endswith(("q_norm.weight", "k_norm.weight"))]:
            tensors[name] = torch.ones_like(tensors[name])

    variants = [
        with_tensors(model_dir, tmp_path / "biased", bias),
        rewritten(
            model_dir,
            tmp_path / "full_rope",
            rotary_dim=64,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
        with_tensors(model_dir, tmp_path / "unit_norms", unit_norms),
    ]
    for variant in variants:
        expected = hf_greedy(variant, prompts())
        assert expected != hf_reference, variant.name
        llm = LLM(variant, num_blocks=256)
        assert token_ids(llm.generate(prompts(), GREEDY)) == expected, variant.name


def test_the_checkpoints_own_config_gives_the_rotated_part_as_rotary_dim(
    model_dir, hf_reference, tmp_path
):
    """MiniMax-M2's config.json says ``rotary_dim`` (no ``partial_rotary_factor``), which
    transformers reads as the rotated fraction of each head."""
    original = rewritten(model_dir, tmp_path / "original", rope_parameters=None, rope_theta=10000.0)
    assert ModelConfig.from_dir(original).hf_config["partial_rotary_factor"] == 0.5
    llm = LLM(original, num_blocks=256)
    assert token_ids(llm.generate(prompts(), GREEDY)) == hf_reference


def test_bfloat16_first_tokens_agree_with_hf_bfloat16(model_dir):
    check_bfloat16_first_tokens_agree_with_hf(model_dir)
