"""Baidu's ERNIE 4.5 MoE models (``Ernie4_5_MoeForCausalLM``): the dense model's attention
(one bias switch, RoPE on interleaved pairs), experts at the layers its start, end and
interval fields pick, under a float32 softmax router whose learned bias per expert only
chooses, the weights renormalised and rounded to the model's dtype, beside shared experts.
Greedy tokens identical to HF transformers (float32) across block sizes (the parity matrix),
chunked prefill with prefix hits, two tensor-parallel ranks and preemption by swap; the
router's bias changes HF's own tokens, so the checks can fail; the multi-token-prediction
tensors are skipped as HF skips them; bfloat16's first tokens agree with HF's bfloat16;
attention adapters give peft's tokens."""

from __future__ import annotations

import torch
from safetensors.torch import load_file, save_file

from helpers.family_configs import ERNIE_MOE
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
)
from pagedserve.frontend import LLM
from pagedserve.gpu_worker.model_config import GroupedRouting, ModelConfig

model_dir, hf_reference = family_fixtures(ERNIE_MOE)


def test_layers_get_the_experts_their_fields_pick(model_dir, tmp_path):
    config = ModelConfig.from_dir(model_dir)
    spec = config.layer_experts[1]
    assert [e is not None for e in config.layer_experts] == [False, True, False, True]
    assert spec.grouped == GroupedRouting(False, 1, 1, 1.0, correction_bias=True)
    assert spec.shared_intermediate_size == 128 and not spec.weights_in_float32
    ended = rewritten(model_dir, tmp_path / "ended", moe_layer_end_index=2, moe_layer_interval=1)
    assert [e is not None for e in ModelConfig.from_dir(ended).layer_experts] == [
        False,
        True,
        True,
        False,
    ]


def test_chunked_prefill_prefix_hits_and_two_ranks_match_hf(model_dir, hf_reference):
    check_chunked_prefix_hits_and_two_ranks(model_dir, hf_reference)


def test_preemption_by_swap_keeps_the_tokens(model_dir, hf_reference):
    check_preemption_by_swap_keeps_the_tokens(model_dir, hf_reference)


def _with_tensors(model_dir, path, change):
    copy = rewritten(model_dir, path)
    tensors = load_file(copy / "model.safetensors")
    change(tensors)
    save_file(tensors, copy / "model.safetensors", metadata={"format": "pt"})
    return copy


def test_the_router_bias_changes_hf_s_tokens(model_dir, hf_reference, tmp_path):
    def unbias(tensors):
        for name in tensors:
            if name.endswith("e_score_correction_bias"):
                tensors[name] = torch.zeros_like(tensors[name])

    unbiased = _with_tensors(model_dir, tmp_path / "unbiased", unbias)
    expected = hf_greedy(unbiased, prompts())
    assert expected != hf_reference
    llm = LLM(unbiased, num_blocks=256)
    assert token_ids(llm.generate(prompts(), GREEDY)) == expected


def test_multi_token_prediction_tensors_are_skipped(model_dir, hf_reference, tmp_path):
    def add_mtp(tensors):
        tensors["model.mtp_emb_norm.0.weight"] = torch.ones(256)
        tensors["model.mtp_linear_proj.0.weight"] = torch.zeros(256, 512)

    with_mtp = _with_tensors(model_dir, tmp_path / "with_mtp", add_mtp)
    llm = LLM(with_mtp, num_blocks=256)
    assert token_ids(llm.generate(prompts(), GREEDY)) == hf_reference


def test_an_attention_adapter_matches_hf_peft(model_dir, tmp_path):
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    check_adapter_matches_hf_peft(model_dir, tmp_path, targets, seed=5, prompt_seed=7)


def test_bfloat16_first_tokens_agree_with_hf_bfloat16(model_dir):
    check_bfloat16_first_tokens_agree_with_hf(model_dir)
