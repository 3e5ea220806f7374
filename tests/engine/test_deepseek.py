"""DeepSeek-V2 and DeepSeek-V3 (``DeepseekV2ForCausalLM``, ``DeepseekV3ForCausalLM``), and
GLM-4.7-Flash (``Glm4MoeLiteForCausalLM``: V3's attention and experts, its own layer types):
multi-head latent attention (keys and values from a normed latent per token, one rotated key
part shared by all heads, RoPE on interleaved pairs or halves, a query straight or through a
low-rank projection, YaRN's softmax scale; the cache holds the latents, attended over with
``kv_b_proj`` absorbed) over Llama's residual stream; dense first layers, then experts
beside shared experts under V2's softmax router (greedy, or limited to groups) or V3's
grouped sigmoid router. Greedy tokens identical to HF transformers (float32) across block
sizes (the parity matrix), chunked prefill with prefix hits, two tensor-parallel ranks and
preemption by swap; the checkpoint's next-token-prediction layer is skipped as HF skips it;
the rotary layout, YaRN's scale and the router's groups each change HF's own tokens, so the
checks can fail; bfloat16's first tokens agree with HF's bfloat16."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.family_configs import DEEPSEEK_CONFIGS
from helpers.parity import check_bfloat16_first_tokens_agree_with_hf, hf_greedy
from helpers.speculative_decoding import SPECULATIVE, assert_speculated, repetitive_prompts
from helpers.tiny_family import (
    GREEDY,
    check_chunked_prefix_hits_and_two_ranks,
    check_preemption_by_swap_keeps_the_tokens,
    prompts,
    rewritten,
    token_ids,
    with_next_token_layer,
)
from pagedserve.frontend import LLM
from pagedserve.gpu_worker.kv_cache import KVCacheSpec
from pagedserve.gpu_worker.model_config import GroupedRouting, ModelConfig
from pagedserve.gpu_worker.parallel import TensorParallel


@pytest.fixture(scope="module")
def model_dirs(family_models):
    return {name: family_models.model_dir(config) for name, config in DEEPSEEK_CONFIGS.items()}


@pytest.fixture(scope="module")
def hf_references(family_models):
    return {name: family_models.reference(config) for name, config in DEEPSEEK_CONFIGS.items()}


def test_the_cache_holds_the_latents_and_the_router_is_deepseek_s(model_dirs):
    """One KV head per layer whose key and value rows hold a token's latent and rotated key,
    half each (v2: 64 + 32, v3: 64 + 64), as HF caches them: not every head expanded."""
    v2, v3 = (ModelConfig.from_dir(model_dirs[name]) for name in ("v2", "v3"))
    assert (v2.head_size, v2.num_kv_heads, v3.head_size, v3.num_kv_heads) == (48, 1, 64, 1)
    assert v2.latent_attention and v3.latent_attention
    spec = KVCacheSpec.for_model(v3, TensorParallel(0, 2), 16, torch.float32)
    assert spec.num_kv_heads == 1  # every rank holds every latent
    assert spec.bytes_per_block == 3 * 2 * 16 * 64 * 4  # layers x (k, v) x tokens x row x 4
    assert v2.layer_experts[0] is None and v2.layer_experts[1].grouped == GroupedRouting(
        False, 1, 1, 1.5
    )
    assert not v2.layer_experts[1].renormalize
    assert v2.layer_experts[1].shared_intermediate_size == 128
    assert v3.layer_experts[2].grouped == GroupedRouting(True, 4, 2, 2.5, correction_bias=True)
    assert v3.layer_experts[2].renormalize


def test_glm4_moe_lite_reads_its_layer_types_and_caches_latents(model_dirs, tmp_path):
    lite = ModelConfig.from_dir(model_dirs["glm4_moe_lite"])
    assert (lite.head_size, lite.num_kv_heads) == (48, 1)  # latents of 64 + 32
    assert [spec is not None for spec in lite.layer_experts] == [False, True, False]
    assert lite.layer_experts[1].grouped == GroupedRouting(True, 2, 1, 1.8, correction_bias=True)
    # Without the field, HF's default: the first layer dense, the rest sparse (HF reads no
    # first_k_dense_replace for this model).
    default = rewritten(model_dirs["glm4_moe_lite"], tmp_path / "default", mlp_layer_types=None)
    config = json.loads((default / "config.json").read_text())
    config.pop("mlp_layer_types", None)
    (default / "config.json").write_text(json.dumps({**config, "first_k_dense_replace": 2}))
    layers = ModelConfig.from_dir(default).layer_experts
    assert [spec is not None for spec in layers] == [False, True, True]
    with pytest.raises(ValueError, match="mlp_layer_types must list 'dense' or 'sparse'"):
        ModelConfig.from_dir(
            rewritten(model_dirs["glm4_moe_lite"], tmp_path / "bad", mlp_layer_types=["dense"])
        )


@pytest.mark.parametrize("name", list(DEEPSEEK_CONFIGS))
def test_chunked_prefill_prefix_hits_and_two_ranks_match_hf(model_dirs, hf_references, name):
    check_chunked_prefix_hits_and_two_ranks(model_dirs[name], hf_references[name])


def test_speculative_decoding_over_the_latent_cache_matches_hf(model_dirs):
    """Prompt-lookup drafts verified several tokens a sequence a step: the latent plans
    run those rows with the prefills."""
    prompts = repetitive_prompts(1)
    llm = LLM(model_dirs["v3"], num_blocks=256, speculative_config=SPECULATIVE)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert got == hf_greedy(model_dirs["v3"], prompts)
    assert_speculated(llm)


def test_preemption_by_swap_keeps_the_tokens(model_dirs, hf_references):
    check_preemption_by_swap_keeps_the_tokens(model_dirs["v3"], hf_references["v3"])


@pytest.mark.parametrize(
    ("name", "changes"),
    [
        ("v2", dict(topk_method="group_limited_greedy", n_group=4, topk_group=2)),
        ("v3", dict(rope_interleave=False)),
        ("v3", dict(q_lora_rank=None)),
    ],
)
def test_other_router_rope_and_query_layouts_match_hf(model_dirs, tmp_path, name, changes):
    variant = rewritten(model_dirs[name], tmp_path / "variant", **changes)
    if "q_lora_rank" in changes:  # a straight query projection in place of the low-rank one
        config = json.loads((variant / "config.json").read_text())
        (variant / "config.json").write_text(json.dumps({**config, "q_lora_rank": None}))
        tensors = load_file(variant / "model.safetensors")
        for layer in range(3):
            prefix = f"model.layers.{layer}.self_attn."
            a = tensors.pop(prefix + "q_a_proj.weight")
            tensors.pop(prefix + "q_a_layernorm.weight")
            tensors[prefix + "q_proj.weight"] = tensors.pop(prefix + "q_b_proj.weight") @ a
        save_file(tensors, variant / "model.safetensors", metadata={"format": "pt"})
    expected = hf_greedy(variant, prompts())
    llm = LLM(variant, num_blocks=256)
    assert token_ids(llm.generate(prompts(), GREEDY)) == expected


def test_rope_layout_yarn_scale_and_groups_each_change_hf_s_tokens(
    model_dirs, hf_references, tmp_path
):
    halves = rewritten(model_dirs["v3"], tmp_path / "halves", rope_interleave=False)
    parameters = dict(DEEPSEEK_CONFIGS["v3"]["rope_parameters"], mscale_all_dim=0.0)
    unscaled = rewritten(model_dirs["v3"], tmp_path / "unscaled", rope_parameters=parameters)
    ungrouped = rewritten(model_dirs["v3"], tmp_path / "ungrouped", topk_group=4)
    for variant in (halves, unscaled, ungrouped):
        assert hf_greedy(variant, prompts()) != hf_references["v3"], variant.name


@pytest.mark.parametrize("name", ["v3", "glm4_moe_lite"])
def test_the_next_token_prediction_layer_is_skipped(model_dirs, hf_references, tmp_path, name):
    with_mtp = with_next_token_layer(model_dirs[name], tmp_path / "with_mtp")
    llm = LLM(with_mtp, num_blocks=256)
    assert token_ids(llm.generate(prompts(), GREEDY)) == hf_references[name]


@pytest.mark.parametrize("name", list(DEEPSEEK_CONFIGS))
def test_bfloat16_first_tokens_agree_with_hf_bfloat16(model_dirs, name):
    check_bfloat16_first_tokens_agree_with_hf(model_dirs[name])


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(kv_lora_rank=0), "kv_lora_rank must be a positive integer"),
        (dict(qk_rope_head_dim=33), "qk_rope_head_dim=33 must be even"),
        (dict(q_lora_rank="96"), "q_lora_rank must be a positive integer or null"),
        (dict(topk_method="noaux_tc"), "topk_method='noaux_tc' is not a DeepSeek-V2 router"),
    ],
)
def test_bad_latent_fields_are_refused_by_name(model_dirs, tmp_path, changes, message):
    bad = rewritten(model_dirs["v2"], tmp_path / "bad", **changes)
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dir(bad)
