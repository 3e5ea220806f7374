"""Tencent's Hunyuan dense models (``HunYuanDenseV1ForCausalLM``): Llama with an RMSNorm
over each query and key head after RoPE (not before, as Qwen3's), and RoPE whose checkpoints
say "dynamic" with an ``alpha``: a fixed NTK stretch of the base, the same frequencies at
every length. Greedy tokens identical to HF transformers (float32) across block sizes (the
parity matrix), chunked prefill with prefix hits and two tensor-parallel ranks; the alpha
changes HF's own tokens, so the checks can fail; bfloat16's first tokens agree with HF's
bfloat16; adapters give peft's tokens."""

from __future__ import annotations

import pytest

from helpers.family_configs import HUNYUAN, HUNYUAN_MOE
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

model_dir, hf_reference = family_fixtures(HUNYUAN)


def test_alpha_makes_a_fixed_stretch_of_the_base(model_dir, tmp_path):
    config = ModelConfig.from_dir(model_dir)
    assert config.hf_config["rope_parameters"]["rope_type"] == "ntk_alpha"
    assert config.context_window_reason == ""  # no dynamic re-basing to stop at
    # Only Hunyuan's: another model naming it is refused, as HF refuses it.
    llama = rewritten(
        model_dir,
        tmp_path / "llama",
        architectures=["LlamaForCausalLM"],
        rope_parameters={"rope_type": "ntk_alpha", "rope_theta": 1e4, "alpha": 2.0},
    )
    with pytest.raises(ValueError, match="rope_type 'ntk_alpha' is not supported yet"):
        ModelConfig.from_dir(llama)


def test_chunked_prefill_prefix_hits_and_two_ranks_match_hf(model_dir, hf_reference):
    check_chunked_prefix_hits_and_two_ranks(model_dir, hf_reference)


def test_alpha_changes_hf_s_tokens(model_dir, hf_reference, tmp_path):
    plain = rewritten(
        model_dir, tmp_path / "plain", rope_parameters={"rope_type": "default", "rope_theta": 1e4}
    )
    expected = hf_greedy(plain, prompts())
    assert expected != hf_reference
    llm = LLM(plain, num_blocks=256)
    assert token_ids(llm.generate(prompts(), GREEDY)) == expected


def test_an_adapter_matches_hf_peft(model_dir, tmp_path):
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    check_adapter_matches_hf_peft(model_dir, tmp_path, targets, seed=10, prompt_seed=11)


def test_bfloat16_first_tokens_agree_with_hf_bfloat16(model_dir):
    check_bfloat16_first_tokens_agree_with_hf(model_dir)


def test_hunyuan_moe_matches_hf_on_one_and_two_ranks(family_models, tmp_path):
    model_dir = family_models.model_dir(HUNYUAN_MOE)
    expected = family_models.reference(HUNYUAN_MOE)
    llm = LLM(model_dir, num_blocks=256)
    spec = llm.model_config.layer_experts[0]
    assert (spec.num_experts, spec.top_k, spec.shared_intermediate_size) == (4, 2, 384)
    assert token_ids(llm.generate(prompts(), GREEDY)) == expected
    chunked = LLM(model_dir, num_blocks=256, enable_chunked_prefill=True, max_num_batched_tokens=24)
    assert token_ids(chunked.generate(prompts(), GREEDY)) == expected
    parallel = LLM(model_dir, num_blocks=256, tensor_parallel_size=2)
    try:
        assert token_ids(parallel.generate(prompts(), GREEDY)) == expected
    finally:
        parallel.shutdown()
    # Per-layer lists (as Hunyuan-A13B's config writes them) that agree read the same.
    listed = rewritten(model_dir, tmp_path / "listed", num_experts=[4, 4], moe_topk=[2, 2])
    assert ModelConfig.from_dir(listed).layer_experts == llm.model_config.layer_experts
    mixed = rewritten(model_dir, tmp_path / "mixed", num_experts=[4, 2])
    with pytest.raises(ValueError, match="num_experts per layer must hold one value"):
        ModelConfig.from_dir(mixed)
    check_bfloat16_first_tokens_agree_with_hf(model_dir)
