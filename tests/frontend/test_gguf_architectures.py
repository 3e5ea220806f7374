"""GGUF files of every architecture the converter reads (llama and its Mixtral, qwen2,
qwen3, qwen2moe, qwen3moe, phi3 (Phi-3 and Phi-4-mini's LongRoPE), granite, smollm3,
olmo2 and OLMo 3's windowed olmo2, gpt-oss (also with MXFP4 experts), glm4moe (GLM-4.5,
also with its multi-token-prediction block), deepseek2 as DeepSeek-V2 and V3 (kv_b split as
newer llama.cpp writes it, or whole as older), dots1, ernie4_5-moe (also with its experts
ending before the last layer), exaone4 (windowed, or not), olmoe, minimax-m2, ernie4_5 (with
biases, or not), hunyuan-dense (its NTK alpha folded into the base, or apart), hunyuan-moe,
nemotron (its norms stored as 1 + w; with biases, or not), apertus (its xIELU scalars as
metadata) and llama4 (its experts restacked; the chunks, RoPE-less layers and temperature
llama.cpp fixes, a prompt crossing its 8192-token chunk); gemma2 and gemma3 below),
written from tiny HF models the way llama.cpp writes them (tests/gguf_writer.py): the engine
on the converted model gives HF transformers' greedy tokens on the original (float32 weights
survive exactly, norms llama.cpp stores as 1 + w to float32's resolution), a Q8_0 file
converts to its dequantized weights, the config carries what llama.cpp keeps only in tensors
(biases, a tied head, expert sizes and layers), files HF cannot express are refused by name,
and the tokenizer and chat template come through."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from helpers.family_configs import DOTS1, ERNIE
from helpers.gguf_writer import byte_level_vocab, write_gguf
from helpers.parity import GREEDY, hf_greedy, random_prompts
from helpers.tiny_family import TINY_SHAPE, rewritten, with_next_token_layer
from helpers.tiny_models import random_hf_model
from pagedserve.frontend import LLM, SamplingParams, gguf_convert
from pagedserve.frontend.gguf import config as gguf_config
from pagedserve.frontend.gguf import registry as gguf_registry
from pagedserve.frontend.gguf.metadata import tensor_shapes
from pagedserve.frontend.model_resolver import resolve_model
from pagedserve.frontend.tokenizer import Tokenizer
from pagedserve.gpu_worker.layers.rope_config import rope_parameters
from pagedserve.gpu_worker.layers.rotary import inverse_frequencies
from pagedserve.gpu_worker.model_config import ModelConfig

VOCAB_SIZE = 512
PARITY_TOKENS = 16
_COMMON = dict(
    hidden_size=256,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB_SIZE,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=0,
    eos_token_id=2,
)
_HUNYUAN = dict(
    architectures=["HunYuanDenseV1ForCausalLM"],
    **{**TINY_SHAPE, "max_position_embeddings": 32768},
    head_dim=64,
    rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "alpha": 1000.0, "factor": 1.0},
    tie_word_embeddings=False,
    pad_token_id=0,
    eos_token_id=2,
)
FAMILIES = {
    # Separate LM head; Q/K interleaved by llama.cpp for its RoPE.
    "llama": dict(architectures=["LlamaForCausalLM"], tie_word_embeddings=False, **_COMMON),
    # Llama 3's RoPE scaling, which llama.cpp keeps as a rope_freqs tensor.
    "llama3": dict(
        architectures=["LlamaForCausalLM"],
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500_000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        **_COMMON,
    ),
    # llama.cpp's Mixtral: "llama" with stacked experts (4, top 2); Q/K interleaved.
    "mixtral": dict(
        architectures=["MixtralForCausalLM"],
        num_local_experts=4,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
        **_COMMON,
    ),
    # q/k/v biases, tied LM head, another RoPE base.
    "qwen2": dict(
        architectures=["Qwen2ForCausalLM"], tie_word_embeddings=True, rope_theta=1e6, **_COMMON
    ),
    # head_dim (128) is not hidden_size / heads (64): the GGUF's key_length must say so.
    "qwen3": dict(
        architectures=["Qwen3ForCausalLM"], head_dim=128, tie_word_embeddings=False, **_COMMON
    ),
    # Every layer sparse (llama.cpp has no dense layers for these): 6 experts of 96, top 2,
    # not renormalised, a gated shared expert of 160.
    "qwen2_moe": dict(
        architectures=["Qwen2MoeForCausalLM"],
        moe_intermediate_size=96,
        shared_expert_intermediate_size=160,
        num_experts=6,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
        **_COMMON,
    ),
    # Phi-3: fused qkv_proj and gate_up_proj (llama.cpp's attn_qkv, ffn_up), a 32-token
    # window the longer prompts pass.
    "phi3": dict(
        architectures=["Phi3ForCausalLM"],
        tie_word_embeddings=False,
        sliding_window=32,
        original_max_position_embeddings=512,
        pad_token_id=None,  # Phi3Config's default (32000) is past this vocabulary
        **_COMMON,
    ),
    # Phi-4-mini's shape: three quarters of each head rotated, LongRoPE (llama.cpp's
    # rope_factors_long / _short tensors) within a 256-token original context, tied.
    "phi4_mini": dict(
        architectures=["Phi3ForCausalLM"],
        tie_word_embeddings=True,
        partial_rotary_factor=0.75,
        original_max_position_embeddings=256,
        rope_scaling={
            "type": "longrope",
            "short_factor": [1.0 + i / 32 for i in range(24)],
            "long_factor": [4.0 + i for i in range(24)],
        },
        pad_token_id=None,
        **{**_COMMON, "max_position_embeddings": 1024},
    ),
    # Granite: Q/K interleaved as llama's; its scalars as llama.cpp's *_scale keys.
    "granite": dict(
        architectures=["GraniteForCausalLM"],
        tie_word_embeddings=True,
        embedding_multiplier=1.5,
        residual_multiplier=0.7,
        attention_multiplier=0.05,
        logits_scaling=4.0,
        **_COMMON,
    ),
    # SmolLM3: llama.cpp's Llama whose every fourth layer has no RoPE.
    "smollm3": dict(
        architectures=["SmolLM3ForCausalLM"],
        tie_word_embeddings=True,
        pad_token_id=None,
        **{**_COMMON, "num_hidden_layers": 4},
    ),
    # OLMo 2: post-sublayer norms and q/k norms over all heads.
    "olmo2": dict(
        architectures=["Olmo2ForCausalLM"],
        tie_word_embeddings=False,
        pad_token_id=None,
        **_COMMON,
    ),
    # OLMo 3, which llama.cpp writes as olmo2 with its window: three sliding layers and a
    # full one with YaRN (its attention factor written too).
    "olmo3": dict(
        architectures=["Olmo3ForCausalLM"],
        tie_word_embeddings=False,
        pad_token_id=None,
        sliding_window=16,
        rope_theta=500_000.0,
        rope_scaling={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 128,
            "attention_factor": 1.25,
        },
        **{**_COMMON, "num_hidden_layers": 4},
    ),
    # gpt-oss: sinks, a 16-token window on layer 0, YaRN, 4 experts (top 2) under a biased
    # router, with biases (its SwiGLU's constants are gpt-oss's own, which llama.cpp fixes).
    "gpt_oss": dict(
        architectures=["GptOssForCausalLM"],
        head_dim=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=16,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 128,
        },
        tie_word_embeddings=False,
        pad_token_id=None,
        **_COMMON,
    ),
    # GLM-4.5 in small: layer 0 dense, then 8 experts of 64 in 4 groups (2 kept, top 3) under a
    # biased sigmoid router, scaled and renormalised, beside one shared expert; q/k/v biases,
    # q/k norms, half of each head rotated. No multi-token-prediction layer (see below).
    "glm4_moe": dict(
        architectures=["Glm4MoeForCausalLM"],
        head_dim=64,
        moe_intermediate_size=64,
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        attention_bias=True,
        use_qk_norm=True,
        num_nextn_predict_layers=0,
        tie_word_embeddings=False,
        **{**_COMMON, "num_hidden_layers": 3},
    ),
    # DeepSeek-V2-Lite's shape in small: a straight query, heads of 64 + 32 (values 64) from a
    # 64-value latent; layer 0 dense, then 8 experts (top 3 by softmax, scaled) and 2 shared.
    "deepseek_v2": dict(
        architectures=["DeepseekV2ForCausalLM"],
        q_lora_rank=None,
        kv_lora_rank=64,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        moe_intermediate_size=64,
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_shared_experts=2,
        first_k_dense_replace=1,
        routed_scaling_factor=1.5,
        topk_method="greedy",
        tie_word_embeddings=False,
        **{**_COMMON, "num_hidden_layers": 3, "num_key_value_heads": 4},
    ),
    # DeepSeek-V3's shape in small: a low-rank query, heads of 128 + 64 (values 128), YaRN with
    # mscale_all_dim, 8 experts in 4 groups (2 kept) under a biased sigmoid router.
    "deepseek_v3": dict(
        architectures=["DeepseekV3ForCausalLM"],
        q_lora_rank=96,
        kv_lora_rank=64,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        moe_intermediate_size=64,
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 128,
        },
        tie_word_embeddings=False,
        **{**_COMMON, "num_hidden_layers": 3, "num_key_value_heads": 4},
    ),
    # tests/engine/test_dots1.py's dots.llm1 (Qwen3's attention with biases, layer 0 dense,
    # then a biased sigmoid router over 8 experts in 2 groups beside one shared expert), its
    # weights scaled. No window: llama.cpp's dots1 keeps none.
    "dots1": {
        **{name: value for name, value in DOTS1.items() if name != "max_window_layers"},
        "sliding_window": None,
        "routed_scaling_factor": 2.5,
        "tie_word_embeddings": False,
    },
    # tests/engine/test_ernie4_5_moe.py's ERNIE 4.5 MoE: experts at layers 1 and 3 (start 1,
    # interval 2), 8 of 64, top 3, two shared, a biased softmax router; use_bias's biases
    # everywhere, the LM head's included.
    "ernie4_5_moe": dict(
        architectures=["Ernie4_5_MoeForCausalLM"],
        **{**TINY_SHAPE, "num_hidden_layers": 4},
        head_dim=64,
        use_bias=True,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        moe_num_experts=8,
        moe_k=3,
        moe_intermediate_size=64,
        moe_num_shared_experts=2,
        moe_layer_start_index=1,
        moe_layer_interval=2,
        pad_token_id=0,
        eos_token_id=2,
    ),
    # tests/engine/test_exaone4.py's EXAONE 4: every second layer global without RoPE, the
    # others windowed to 32 tokens; EXAONE 4.0 32B's Llama 3 RoPE scaling (rope_freqs).
    "exaone4": dict(
        architectures=["Exaone4ForCausalLM"],
        **{**TINY_SHAPE, "num_hidden_layers": 4, "max_position_embeddings": 16384},
        head_dim=64,
        sliding_window=32,
        sliding_window_pattern=2,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 1_000_000.0,
            "factor": 16.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=2,
    ),
    # OLMoE: q/k norms over the whole projections, 8 experts of 128 in every layer, top 3 by
    # softmax, not renormalised (llama.cpp's OLMoE graph fixes that router); OLMoE's epsilon,
    # which llama.cpp's converter writes whatever the config says, and no clamp (it drops
    # clip_qkv; its graph clamps nothing).
    "olmoe": dict(
        architectures=["OlmoeForCausalLM"],
        num_experts=8,
        num_experts_per_tok=3,
        clip_qkv=None,
        tie_word_embeddings=False,
        **{**_COMMON, "intermediate_size": 128, "rms_norm_eps": 1e-5},
    ),
    # tests/engine/test_minimax_m2.py's MiniMax-M2: heads of 64 rotated over their first 32
    # values, q/k norms over the whole projections, 8 experts of 96 in every layer, top 3 under
    # a sigmoid router whose selection bias (exp_probs_b) only chooses.
    "minimax_m2": dict(
        architectures=["MiniMaxM2ForCausalLM"],
        head_dim=64,
        rotary_dim=32,
        num_local_experts=8,
        num_experts_per_tok=3,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        **{**_COMMON, "intermediate_size": 96},
    ),
    # tests/engine/test_ernie4_5.py's ERNIE 4.5 (dense): use_bias's biases on every projection,
    # RoPE on adjacent pairs in both llama.cpp and HF (no rows permuted).
    "ernie4_5": ERNIE,
    # tests/engine/test_hunyuan.py's Hunyuan (dense, and with 4 experts, top 2, beside a shared
    # MLP): "dynamic" RoPE with alpha 1000, which llama.cpp folds into the base; the context
    # llama.cpp's converter asserts (32K, which it writes as 256K).
    "hunyuan_dense": _HUNYUAN,
    "hunyuan_moe": dict(
        _HUNYUAN, architectures=["HunYuanMoEV1ForCausalLM"], num_experts=4, moe_topk=2
    ),
    # tests/engine/test_nemotron.py's Nemotron: LayerNorm1P, half of each head rotated, the
    # squared ReLU.
    "nemotron": dict(
        architectures=["NemotronForCausalLM"],
        **TINY_SHAPE,
        head_dim=64,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=2,
    ),
    # tests/engine/test_apertus.py's Apertus with Apertus's own RoPE (Llama 3's scaling over
    # 8192 tokens and a base of 12M, the llama3 settings a GGUF's rope_freqs can give back),
    # xIELU's scalars per layer.
    "apertus": dict(
        architectures=["ApertusForCausalLM"],
        **TINY_SHAPE,
        head_dim=64,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 12_000_000.0,
            "factor": 8.0,
            "original_max_position_embeddings": 8192,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
        },
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=2,
    ),
    # tests/engine/test_llama4.py's Llama 4 as llama.cpp's llama4 can hold it: chunks of
    # 8192 (its fixed size, which a long prompt below crosses) on three layers of four, no
    # RoPE on the fourth, which scales its queries with 8192 and 0.1 (llama.cpp's fixed
    # temperature); experts at every second layer (interleave_moe_layer_step: llama.cpp
    # keeps no moe_layers), 4 of 96, top 1, beside a shared expert of 96, dense layers of
    # 384; Llama 4 Scout's RoPE scaling (rope_freqs); q/k norms (llama.cpp's: not 128
    # experts).
    "llama4": dict(
        architectures=["Llama4ForCausalLM"],
        **{
            **TINY_SHAPE,
            "num_hidden_layers": 4,
            "max_position_embeddings": 16384,
            "intermediate_size": 96,
        },
        head_dim=64,
        intermediate_size_mlp=384,
        interleave_moe_layer_step=2,
        num_local_experts=4,
        num_experts_per_tok=1,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500_000.0,
            "factor": 16.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
        },
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=2,
    ),
    # 8 experts of 96, top 3, renormalised; per-head q/k norms.
    "qwen3_moe": dict(
        architectures=["Qwen3MoeForCausalLM"],
        moe_intermediate_size=96,
        num_experts=8,
        num_experts_per_tok=3,
        norm_topk_prob=True,
        tie_word_embeddings=False,
        **_COMMON,
    ),
}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {family: random_hf_model(config, root / family) for family, config in FAMILIES.items()}


@pytest.fixture(scope="module")
def converted(hf_dirs, tmp_path_factory) -> dict[str, Path]:
    """family -> the converted HF directory of its float32 GGUF."""
    root = tmp_path_factory.mktemp("gguf")
    result = {}
    for family, hf_dir in hf_dirs.items():
        gguf_path = write_gguf(hf_dir, root / f"{family}.gguf", byte_level_vocab(VOCAB_SIZE))
        result[family] = resolve_model(gguf_path, cache_dir=str(root / "cache")).path
    return result


@pytest.mark.parametrize("family", list(FAMILIES))
def test_float32_gguf_converts_to_the_original_weights(hf_dirs, converted, family):
    original = load_file(hf_dirs[family] / "model.safetensors")
    ours = load_file(converted[family] / "model.safetensors")
    if FAMILIES[family]["tie_word_embeddings"]:
        original.pop("lm_head.weight", None)
    check_original_weights(ours, original, FAMILIES[family]["architectures"][0])


# The HF architectures whose norms llama.cpp stores as 1 + w (Gemma's: below).
_ONE_PLUS_NORMS = ("NemotronForCausalLM",)


def check_original_weights(ours: dict, original: dict, architecture: str) -> None:
    """The converted weights are the original ones, names and shapes (Apertus's scalars
    included) and values: exactly, but for norms stored as 1 + w, whose w comes back to
    float32's resolution near 1 (the + 1 and - 1 round)."""
    assert sorted(ours) == sorted(original)
    for name, weight in original.items():
        assert ours[name].shape == weight.shape, name
        if architecture in _ONE_PLUS_NORMS and name.endswith("norm.weight"):
            np.testing.assert_allclose(ours[name], weight, rtol=0, atol=2**-22, err_msg=name)
            continue
        np.testing.assert_array_equal(ours[name], weight, err_msg=name)


def converted_tokens_and_hf_s(converted_dir, hf_dir, seed: int):
    """The engine's greedy tokens on the converted model and HF's on ``hf_dir``: four
    prompts (5, 17, 64 and 150 tokens: past a block, a window of 16 or 32, a chunk) and 16
    new tokens each. The weights' exact equality is checked above; this checks the config
    the converter wrote (RoPE, windows, norms, scales), which 16 tokens show."""
    prompts = random_prompts(seed, VOCAB_SIZE)[1::2]
    params = SamplingParams(max_tokens=PARITY_TOKENS, temperature=0.0, ignore_eos=True)
    llm = LLM(converted_dir, num_blocks=256)
    tokens = [output.outputs[0].token_ids for output in llm.generate(prompts, params)]
    return tokens, hf_greedy(hf_dir, prompts, max_new_tokens=PARITY_TOKENS)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_engine_on_the_converted_gguf_matches_hf_on_the_original(hf_dirs, converted, family):
    tokens, expected = converted_tokens_and_hf_s(converted[family], hf_dirs[family], 3)
    assert tokens == expected


def test_a_gguf_file_as_the_draft_model(hf_dirs, tmp_path):
    """``speculative_config.model`` may be a GGUF file: converted once, like the target."""
    gguf_path = write_gguf(hf_dirs["llama"], tmp_path / "draft.gguf", byte_level_vocab(VOCAB_SIZE))
    prompts = random_prompts(4, VOCAB_SIZE)[1::2]
    params = SamplingParams(max_tokens=PARITY_TOKENS, temperature=0.0, ignore_eos=True)
    llm = LLM(
        hf_dirs["llama"],
        num_blocks=256,
        cache_dir=str(tmp_path / "cache"),
        speculative_config={"model": str(gguf_path), "num_speculative_tokens": 3},
    )
    tokens = [output.outputs[0].token_ids for output in llm.generate(prompts, params)]
    assert tokens == hf_greedy(hf_dirs["llama"], prompts, max_new_tokens=PARITY_TOKENS)
    # The converted draft is the target's own weights: every guess is accepted.
    stats = llm.stats()
    assert 0 < stats["num_accepted_tokens"] == stats["num_draft_tokens"], stats


def test_a_large_model_converts_into_shards(hf_dirs, tmp_path, monkeypatch):
    # Shards of at most ~1 MB here (2 GiB by default): the converter holds one at a time.
    monkeypatch.setattr(gguf_convert, "SHARD_BYTES", 1 << 20)
    gguf_path = write_gguf(hf_dirs["qwen3"], tmp_path / "qwen3.gguf", byte_level_vocab(VOCAB_SIZE))
    converted = resolve_model(gguf_path, cache_dir=str(tmp_path / "cache")).path
    index = json.loads((converted / "model.safetensors.index.json").read_text())
    files = sorted(path.name for path in converted.glob("*.safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sorted(set(index["weight_map"].values())) == files
    original = load_file(hf_dirs["qwen3"] / "model.safetensors")
    assert sorted(index["weight_map"]) == sorted(original)
    assert index["metadata"]["total_size"] == sum(weight.nbytes for weight in original.values())
    for name, weight in original.items():
        shard = load_file(converted / index["weight_map"][name])
        np.testing.assert_array_equal(shard[name], weight, err_msg=name)
    prompts = random_prompts(5, VOCAB_SIZE)[:3]
    llm = LLM(converted, num_blocks=256)
    tokens = [output.outputs[0].token_ids for output in llm.generate(prompts, GREEDY)]
    assert tokens == hf_greedy(hf_dirs["qwen3"], prompts)


def test_config_carries_what_llama_cpp_keeps_in_tensors(converted):
    configs = {
        family: json.loads((path / "config.json").read_text()) for family, path in converted.items()
    }
    assert configs["llama"]["architectures"] == ["LlamaForCausalLM"]
    assert configs["llama"]["tie_word_embeddings"] is False
    assert configs["llama3"]["rope_parameters"] == {
        **FAMILIES["llama3"]["rope_parameters"],
        "rope_theta": 500_000.0,
    }
    mixtral = configs["mixtral"]
    assert mixtral["architectures"] == ["MixtralForCausalLM"]
    assert (mixtral["num_local_experts"], mixtral["num_experts_per_tok"]) == (4, 2)
    assert configs["qwen2"]["architectures"] == ["Qwen2ForCausalLM"]
    assert configs["qwen2"]["tie_word_embeddings"] is True
    assert configs["qwen2"]["rope_theta"] == 1e6
    assert configs["qwen3"]["head_dim"] == 128
    assert configs["qwen3"]["attention_bias"] is False
    moe2 = configs["qwen2_moe"]
    assert (moe2["num_experts"], moe2["num_experts_per_tok"]) == (6, 2)
    assert (moe2["moe_intermediate_size"], moe2["shared_expert_intermediate_size"]) == (96, 160)
    assert (moe2["qkv_bias"], moe2["norm_topk_prob"], moe2["mlp_only_layers"]) == (True, False, [])
    moe3 = configs["qwen3_moe"]
    assert (moe3["num_experts"], moe3["num_experts_per_tok"], moe3["norm_topk_prob"]) == (
        8,
        3,
        True,
    )
    assert "shared_expert_intermediate_size" not in moe3
    gpt_oss = configs["gpt_oss"]
    assert (gpt_oss["num_local_experts"], gpt_oss["num_experts_per_tok"]) == (4, 2)
    assert (gpt_oss["sliding_window"], gpt_oss["attention_bias"]) == (16, True)
    assert gpt_oss["rope_parameters"] == FAMILIES["gpt_oss"]["rope_parameters"]


_ENGINE_CONFIG_CHECKED = [
    "glm4_moe",
    "deepseek_v2",
    "deepseek_v3",
    "dots1",
    "ernie4_5_moe",
    "exaone4",
    "olmoe",
    "minimax_m2",
    "ernie4_5",
    "nemotron",
    "apertus",
    "llama4",
]


def check_engine_config_matches(converted_dir: Path, hf_dir: Path) -> None:
    """Layers, heads (DeepSeek's: every head expanded from the latent, though llama.cpp's file
    says one KV head), each layer's window and experts (where the experts are, their router),
    which layers rotate, and the RoPE settings, as the engine reads them from the HF config
    the model came from."""
    ours, original = (ModelConfig.from_dir(path) for path in (converted_dir, hf_dir))
    assert dataclasses.replace(ours, path=original.path) == original
    assert rope_parameters(ours.hf_config) == rope_parameters(original.hf_config)
    assert ours.spec.rope_layers(ours.hf_config) == original.spec.rope_layers(original.hf_config)
    fields = (
        "moe_intermediate_size",
        "routed_scaling_factor",
        "norm_topk_prob",
        "q_lora_rank",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "attention_bias",
        "use_qk_norm",
        "rope_interleave",
        "use_bias",
        "sliding_window",
        "layer_types",
        "clip_qkv",
        "rotary_dim",
    )
    for name in fields:
        assert ours.hf_config.get(name) == original.hf_config.get(name), name


@pytest.mark.parametrize("family", _ENGINE_CONFIG_CHECKED)
def test_the_engine_reads_the_converted_config_as_the_original_s(hf_dirs, converted, family):
    check_engine_config_matches(converted[family], hf_dirs[family])


@pytest.mark.parametrize(
    ("family", "changes"),
    [
        # llama.cpp keeps no moe_layer_end_index (it assumes the last layer): the tensors show
        # that layer 3, which the interval would pick, is dense.
        ("ernie4_5_moe", dict(moe_layer_end_index=2)),
        # EXAONE 4.0 1.2B's kind: no window, every layer global and rotating (Exaone4Config
        # needs the layer kinds given then).
        ("exaone4", dict(sliding_window=None, layer_types=["full_attention"] * 4)),
        # ERNIE 4.5 0.3B's kind: no biases, the LM head tied to the embeddings.
        ("ernie4_5", dict(use_bias=False, tie_word_embeddings=True)),
        # Nemotron with biases on the attention and the MLP (each its own switch).
        ("nemotron", dict(attention_bias=True, mlp_bias=True)),
        ("nemotron", dict(attention_bias=True, mlp_bias=False)),
        # Llama 4 whose layers all attend in full and rotate (MobileLLM-R1's kind), which
        # llama.cpp writes as a sliding window of 0; experts in every layer (Scout's step).
        (
            "llama4",
            dict(
                layer_types=["full_attention"] * 4,
                no_rope_layers=[1] * 4,
                attention_chunk_size=None,
                interleave_moe_layer_step=1,
            ),
        ),
    ],
)
def test_other_layouts_convert_to_the_original_model(family, changes, tmp_path):
    config = {**FAMILIES[family], **changes}
    hf_dir = random_hf_model(config, tmp_path / "hf")
    gguf_path = write_gguf(hf_dir, tmp_path / "variant.gguf", byte_level_vocab(VOCAB_SIZE))
    converted = resolve_model(gguf_path, cache_dir=str(tmp_path / "cache")).path
    original = load_file(hf_dir / "model.safetensors")
    if config["tie_word_embeddings"]:
        original.pop("lm_head.weight", None)
    ours = load_file(converted / "model.safetensors")
    check_original_weights(ours, original, config["architectures"][0])
    check_engine_config_matches(converted, hf_dir)


def gguf_metadata(hf_dir: Path, path: Path) -> tuple[dict, dict]:
    """The metadata fields and tensor shapes of ``hf_dir``'s GGUF, as the converter reads
    them (to doctor what llama.cpp's converter never writes)."""
    reader = gguf.GGUFReader(write_gguf(hf_dir, path, byte_level_vocab(VOCAB_SIZE)))
    fields = {name: field.contents() for name, field in reader.fields.items()}
    return fields, tensor_shapes(reader)


_SOFTMAX = int(gguf.ExpertGatingFuncType.SOFTMAX)
_SIGMOID = int(gguf.ExpertGatingFuncType.SIGMOID)


@pytest.mark.parametrize(
    ("family", "changes", "tensors_dropped", "message"),
    [
        # HF's dots.llm1 router scores by sigmoid only.
        (
            "dots1",
            {"dots1.expert_gating_func": _SOFTMAX},
            [],
            "dots1 expert_gating_func=1 is not supported",
        ),
        # Routers at layers 1 and 3 are not every layer from 1 on.
        (
            "ernie4_5_moe",
            {"ernie4_5-moe.interleave_moe_layer_step": 1},
            [],
            r"expert router \(ffn_gate_inp\) in layers \[1, 3\]",
        ),
        # Two shared experts' rows (128) are not one expert's (64).
        (
            "ernie4_5_moe",
            {"ernie4_5-moe.expert_shared_count": 1},
            [],
            r"shared experts \(ffn_gate_shexp\) have 128 rows",
        ),
        # HF's use_bias puts a bias on the LM head whenever the attention has them.
        ("ernie4_5_moe", {}, ["output.bias"], "attention biases but no LM-head bias"),
        # Every ERNIE 4.5 router has its selection bias (HF's moe_statics).
        ("ernie4_5_moe", {}, ["blk.3.exp_probs_b.bias"], r"no router selection bias .* \[3\]"),
        # Which of EXAONE 4's layers slide is not llama.cpp's to guess.
        (
            "exaone4",
            {"exaone4.attention.sliding_window_pattern": None},
            [],
            "exaone4 file with a sliding window needs attention.sliding_window_pattern",
        ),
        # llama.cpp's OLMoE graph (and HF's OLMoE) routes by softmax, never renormalises, and
        # clamps nothing; it rotates whole heads.
        ("olmoe", {"olmoe.expert_gating_func": _SIGMOID}, [], "olmoe expert_gating_func=2"),
        ("olmoe", {"olmoe.expert_weights_norm": True}, [], "olmoe expert_weights_norm=True"),
        ("olmoe", {"olmoe.attention.clamp_kqv": 8.0}, [], "olmoe attention.clamp_kqv=8.0"),
        (
            "olmoe",
            {"olmoe.rope.dimension_count": 32},
            [],
            "rope.dimension_count=32 differs from head_dim=64",
        ),
        # Every OLMoE layer has its experts and its whole-projection q/k norms.
        ("olmoe", {}, ["blk.1.ffn_gate_inp.weight"], r"no expert router .* in layers \[1\]"),
        ("olmoe", {}, ["blk.1.attn_k_norm.weight"], "blk.1.attn_k_norm: no such tensor"),
        # MiniMax-M2's router: sigmoid, its top-k renormalised, unscaled, one group, a
        # selection bias in every layer.
        (
            "minimax_m2",
            {"minimax-m2.expert_gating_func": _SOFTMAX},
            [],
            "minimax-m2 expert_gating_func=1 is not supported",
        ),
        (
            "minimax_m2",
            {"minimax-m2.expert_weights_norm": False},
            [],
            "minimax-m2 expert_weights_norm=False",
        ),
        (
            "minimax_m2",
            {"minimax-m2.expert_weights_scale": 2.5},
            [],
            "minimax-m2 expert_weights_scale=2.5",
        ),
        (
            "minimax_m2",
            {"minimax-m2.expert_group_count": 4},
            [],
            "minimax-m2 expert_group_count=4",
        ),
        (
            "minimax_m2",
            {},
            ["blk.1.exp_probs_b.bias"],
            r"no router selection bias \(exp_probs_b\) in layers \[1\]",
        ),
        # ERNIE 4.5's use_bias gives every projection of every layer a bias, or none.
        (
            "ernie4_5",
            {},
            ["blk.1.ffn_down.bias"],
            r"ernie4_5 has .* but not blk.1.ffn_down.bias; HF's use_bias gives",
        ),
        # Hunyuan's q/k norms are in every layer; HunyuanVL's XD-RoPE is another model.
        ("hunyuan_dense", {}, ["blk.1.attn_k_norm.weight"], "blk.1.attn_k_norm: no such tensor"),
        (
            "hunyuan_dense",
            {"hunyuan-dense.rope.dimension_sections": [16, 16, 0, 0]},
            [],
            r"hunyuan-dense rope.dimension_sections=\[16, 16, 0, 0\] is not supported",
        ),
        # Hunyuan MoE's router: softmax, renormalised; a shared MLP in every layer. Its
        # llama.cpp graph ignores rope.scaling.alpha, HF's would not.
        (
            "hunyuan_moe",
            {"hunyuan-moe.expert_gating_func": _SIGMOID},
            [],
            "hunyuan-moe expert_gating_func=2 is not supported",
        ),
        (
            "hunyuan_moe",
            {"hunyuan-moe.expert_weights_norm": False},
            [],
            "hunyuan-moe expert_weights_norm=False",
        ),
        ("hunyuan_moe", {}, ["blk.1.ffn_gate_shexp.weight"], "blk.1.ffn_gate_shexp: no such"),
        ("hunyuan_moe", {}, ["blk.1.ffn_gate_inp.weight"], r"no expert router .* in layers \[1\]"),
        (
            "hunyuan_moe",
            {"hunyuan-moe.rope.scaling.alpha": 1000.0},
            [],
            "hunyuan-moe rope.scaling.alpha=1000.0 is not supported",
        ),
        # Nemotron's LayerNorm1P: an epsilon, a bias in every norm; its biases per switch.
        (
            "nemotron",
            {"nemotron.attention.layer_norm_epsilon": None},
            [],
            "nemotron has no attention.layer_norm_epsilon",
        ),
        ("nemotron", {}, ["blk.1.ffn_norm.bias"], "nemotron has no blk.1.ffn_norm.bias"),
        # Apertus's xIELU scalars: one of each per layer, as metadata.
        ("apertus", {"xielu.beta": None}, [], "apertus needs xielu.beta"),
        ("apertus", {"xielu.alpha_p": [0.1]}, [], r"xielu.alpha_p, one value per layer \(2\)"),
        ("apertus", {}, ["blk.0.attn_q_norm.weight"], "apertus blk.0.attn_q_norm: no such tensor"),
        # Llama 4: experts only where llama.cpp's step puts them, each layer's with its shared
        # expert; the sigmoid router llama.cpp and HF fix; only the chunks llama.cpp runs
        # (8192, or none), one RoPE base.
        (
            "llama4",
            {"llama4.interleave_moe_layer_step": 1},
            [],
            r"llama4 has an expert router \(ffn_gate_inp\) in layers \[1, 3\]; expected .*"
            r"\(\[0, 1, 2, 3\]\)",
        ),
        (
            "llama4",
            {"llama4.interleave_moe_layer_step": None},
            [],
            "llama4 needs interleave_moe_layer_step >= 1",
        ),
        ("llama4", {}, ["blk.3.ffn_gate_shexp.weight"], "blk.3.ffn_gate_shexp: no such tensor"),
        (
            "llama4",
            {"llama4.expert_gating_func": _SOFTMAX},
            [],
            "llama4 expert_gating_func=1 is not supported",
        ),
        ("llama4", {"llama4.expert_weights_norm": True}, [], "llama4 expert_weights_norm=True"),
        (
            "llama4",
            {"llama4.attention.sliding_window": 4096},
            [],
            "llama4 attention.sliding_window=4096 is not supported",
        ),
        (
            "llama4",
            {"llama4.attention.sliding_window_pattern": [True, True, True, False]},
            [],
            "llama4 attention.sliding_window_pattern=.* is not supported",
        ),
        (
            "llama4",
            {"llama4.rope.freq_base_swa": 10000.0},
            [],
            "llama4 rope.freq_base_swa=10000.0 differs from rope.freq_base=500000.0",
        ),
    ],
)
def test_files_hf_cannot_express_are_refused_by_name(
    hf_dirs, tmp_path, family, changes, tensors_dropped, message
):
    # ``changes``: metadata keys set, or removed where None.
    fields, shapes = gguf_metadata(hf_dirs[family], tmp_path / "file.gguf")
    for name, value in changes.items():
        if value is None:
            del fields[name]
        else:
            fields[name] = value
    for name in tensors_dropped:
        del shapes[name]
    with pytest.raises(ValueError, match=message):
        gguf_config.hf_config(fields, shapes)


@pytest.mark.parametrize(
    ("family", "architecture"), [("dots1", "dots1"), ("minimax_m2", "minimax-m2")]
)
def test_a_file_without_its_gating_function_is_read_as_sigmoid(
    hf_dirs, tmp_path, family, architecture
):
    # llama.cpp's current converter writes the gating function only when the HF config names
    # a scoring_func; HF's Dots1 and MiniMax-M2 have no other router than the sigmoid one.
    fields, shapes = gguf_metadata(hf_dirs[family], tmp_path / "file.gguf")
    key = f"{architecture}.expert_gating_func"
    assert fields.pop(key) == _SIGMOID
    assert gguf_config.hf_config(fields, shapes) == gguf_config.hf_config(
        {**fields, key: _SIGMOID}, shapes
    )


def test_olmoe_and_minimax_m2_metadata_as_llama_cpp_writes_and_reads_it(hf_dirs, tmp_path):
    """What llama.cpp keeps of the two, and the config the converter makes of it: OLMoE's
    router and epsilon written by no key but the experts' count and top-k (its graph fixes a
    softmax router, not renormalised; its converter fixes the epsilon), its q/k norms whole;
    MiniMax-M2's rotated dimensions as rope.dimension_count, its sigmoid router as
    expert_gating_func, its selection bias as a tensor per layer (exp_probs_b), its q/k norms
    whole; no Q/K rows permuted in either (llama.cpp's NEOX RoPE)."""
    fields, shapes = gguf_metadata(hf_dirs["olmoe"], tmp_path / "olmoe.gguf")
    assert fields["general.architecture"] == "olmoe"
    assert (fields["olmoe.expert_count"], fields["olmoe.expert_used_count"]) == (8, 3)
    assert not any(name.startswith("olmoe.expert_weights") for name in fields)
    assert "olmoe.expert_gating_func" not in fields
    assert np.float32(fields["olmoe.attention.layer_norm_rms_epsilon"]) == np.float32(1e-5)
    assert shapes["blk.0.attn_q_norm.weight"] == (256,)  # 4 heads of 64
    assert shapes["blk.0.attn_k_norm.weight"] == (128,)  # 2 KV heads of 64
    assert shapes["blk.1.ffn_gate_exps.weight"] == (8, 128, 256)
    olmoe = gguf_config.hf_config(fields, shapes)
    assert olmoe["architectures"] == ["OlmoeForCausalLM"]
    assert (olmoe["num_experts"], olmoe["num_experts_per_tok"]) == (8, 3)
    assert (olmoe["intermediate_size"], olmoe["norm_topk_prob"], olmoe["clip_qkv"]) == (
        128,
        False,
        None,
    )
    assert olmoe["rms_norm_eps"] == 1e-5

    fields, shapes = gguf_metadata(hf_dirs["minimax_m2"], tmp_path / "minimax_m2.gguf")
    assert fields["general.architecture"] == "minimax-m2"
    assert fields["minimax-m2.rope.dimension_count"] == 32
    assert fields["minimax-m2.attention.key_length"] == 64
    assert fields["minimax-m2.expert_gating_func"] == _SIGMOID
    assert fields["minimax-m2.expert_feed_forward_length"] == 96
    assert shapes["blk.1.exp_probs_b.bias"] == (8,)
    assert shapes["blk.0.attn_q_norm.weight"] == (256,)
    assert shapes["blk.0.attn_k_norm.weight"] == (128,)
    minimax = gguf_config.hf_config(fields, shapes)
    assert minimax["architectures"] == ["MiniMaxM2ForCausalLM"]
    assert (minimax["num_local_experts"], minimax["num_experts_per_tok"]) == (8, 3)
    assert (minimax["intermediate_size"], minimax["head_dim"], minimax["rotary_dim"]) == (
        96,
        64,
        32,
    )
    assert minimax["rope_parameters"] == {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
    }
    # llama.cpp's converter writes the RoPE base the config gives; one without it rotates
    # with llama.cpp's default base (10000), not MiniMaxM2Config's (5M).
    del fields["minimax-m2.rope.freq_base"]
    assert gguf_config.hf_config(fields, shapes)["rope_theta"] == 10000.0


def test_per_head_q_k_norms_are_refused_for_olmoe_and_minimax_m2(hf_dirs, tmp_path):
    # HF's OLMoE and MiniMax-M2 norm the whole projections; a norm per head (one head's
    # size) is another model.
    for family in ("olmoe", "minimax_m2"):
        fields, shapes = gguf_metadata(hf_dirs[family], tmp_path / f"{family}.gguf")
        shapes["blk.0.attn_q_norm.weight"] = (64,)
        with pytest.raises(ValueError, match=r"blk.0.attn_q_norm: shape \(64,\); expected"):
            gguf_config.hf_config(fields, shapes)


@pytest.mark.parametrize(
    ("family", "tensors", "message"),
    [
        # HF's dense ERNIE 4.5 has no LM-head bias (its MoE model's use_bias gives one).
        ("ernie4_5", {"output.bias": (VOCAB_SIZE,)}, "ernie4_5 has an LM-head bias"),
        # HF's Hunyuan MoE gives its experts and its shared MLP the same rows.
        (
            "hunyuan_moe",
            {"blk.1.ffn_gate_shexp.weight": (192, 256)},
            "blk.1.ffn_gate_shexp: 192 rows; expected 384",
        ),
        # Nemotron's and Apertus's MLPs are ungated.
        (
            "nemotron",
            {"blk.0.ffn_gate.weight": (384, 256)},
            r"nemotron has a gated MLP \(ffn_gate\) in layers \[0\]",
        ),
        (
            "apertus",
            {"blk.1.ffn_gate.weight": (384, 256)},
            r"apertus has a gated MLP \(ffn_gate\) in layers \[1\]",
        ),
        # attention_bias gives every layer's q/k/v/o a bias, or none.
        (
            "apertus",
            {"blk.1.attn_q.bias": (256,)},
            "apertus has blk.1.attn_q.bias but not blk.0.attn_q.bias",
        ),
    ],
)
def test_tensors_hf_cannot_hold_are_refused_by_name(hf_dirs, tmp_path, family, tensors, message):
    # ``tensors``: tensors added to the file, by shape (torch's order).
    fields, shapes = gguf_metadata(hf_dirs[family], tmp_path / "file.gguf")
    with pytest.raises(ValueError, match=message):
        gguf_config.hf_config(fields, {**shapes, **tensors})


@pytest.mark.parametrize("family", ["hunyuan_dense", "hunyuan_moe"])
def test_hunyuan_s_alpha_folded_into_the_base_rotates_as_the_original(
    hf_dirs, converted, tmp_path, family
):
    """llama.cpp's Hunyuan converters fold HF's NTK alpha into the RoPE base (base x alpha **
    (d / (d - 2))) and write a 256K context; the converted config's plain RoPE with that base
    rotates by HF's very angles (the engine's, as HF computes them), and everything else the
    engine reads is the original's."""
    fields, _ = gguf_metadata(hf_dirs[family], tmp_path / "file.gguf")
    prefix = family.replace("_", "-")  # llama.cpp's architecture
    assert fields[f"{prefix}.rope.freq_base"] == np.float32(10000.0 * 1000.0 ** (64 / 62))
    assert fields[f"{prefix}.context_length"] == 256 * 1024
    assert f"{prefix}.rope.scaling.alpha" not in fields
    ours, original = (ModelConfig.from_dir(path) for path in (converted[family], hf_dirs[family]))
    assert rope_parameters(original.hf_config)["rope_type"] == "ntk_alpha"
    assert rope_parameters(ours.hf_config) == {
        "rope_type": "default",
        "rope_theta": float(np.float32(10000.0 * 1000.0 ** (64 / 62))),
    }
    torch.testing.assert_close(
        inverse_frequencies(64, rope_parameters(ours.hf_config)),
        inverse_frequencies(64, rope_parameters(original.hf_config)),
        rtol=0,
        atol=0,
    )
    assert ours.max_position_embeddings == 256 * 1024
    assert (
        dataclasses.replace(
            ours, path=original.path, max_position_embeddings=original.max_position_embeddings
        )
        == original
    )
    assert ours.hf_config["attention_bias"] is False


def test_hunyuan_dense_s_alpha_kept_apart_converts_to_hf_s_dynamic_rope(hf_dirs, tmp_path):
    # Newer llama.cpp's hunyuan-dense also reads the alpha apart from the base
    # (rope.scaling.alpha, as its HunyuanVL converter writes it) and folds it in on loading:
    # HF's own "dynamic" RoPE with that alpha, the checkpoint's.
    hf_dir = hf_dirs["hunyuan_dense"]
    gguf_path = write_gguf(
        hf_dir, tmp_path / "apart.gguf", byte_level_vocab(VOCAB_SIZE), hunyuan_alpha_apart=True
    )
    fields = {name: field.contents() for name, field in gguf.GGUFReader(gguf_path).fields.items()}
    assert fields["hunyuan-dense.rope.scaling.alpha"] == 1000.0
    assert fields["hunyuan-dense.rope.freq_base"] == 10000.0
    converted = resolve_model(gguf_path, cache_dir=str(tmp_path / "cache")).path
    config = json.loads((converted / "config.json").read_text())
    assert config["rope_parameters"] == FAMILIES["hunyuan_dense"]["rope_parameters"]
    original = load_file(hf_dir / "model.safetensors")
    check_original_weights(load_file(converted / "model.safetensors"), original, "")
    check_engine_config_matches(converted, hf_dir)


def test_new_architectures_metadata_as_llama_cpp_writes_and_reads_it(hf_dirs, tmp_path):
    """What llama.cpp keeps of ERNIE 4.5, Nemotron and Apertus, and the config made of it:
    ERNIE's Q/K rows as HF has them (both rotate adjacent pairs); Nemotron's norms as 1 + w,
    their epsilon as a LayerNorm's, the rotated share of hidden / heads; Apertus's xIELU
    scalars as metadata arrays (no tensors), Llama 3's scaling as rope_freqs."""
    original = load_file(hf_dirs["ernie4_5"] / "model.safetensors")
    reader = gguf.GGUFReader(
        write_gguf(hf_dirs["ernie4_5"], tmp_path / "ernie.gguf", byte_level_vocab(VOCAB_SIZE))
    )
    stored = {tensor.name: tensor.data for tensor in reader.tensors}
    for gguf_name, hf_name in [("attn_q", "q_proj"), ("attn_k", "k_proj")]:
        np.testing.assert_array_equal(
            stored[f"blk.0.{gguf_name}.weight"],
            original[f"model.layers.0.self_attn.{hf_name}.weight"],
        )
    assert {"blk.0.ffn_up.bias", "blk.0.attn_output.bias"} <= set(stored)
    fields, shapes = gguf_metadata(hf_dirs["ernie4_5"], tmp_path / "ernie.gguf")
    ernie = gguf_config.hf_config(fields, shapes)
    assert (ernie["architectures"], ernie["use_bias"], ernie["head_dim"]) == (
        ["Ernie4_5ForCausalLM"],
        True,
        64,
    )

    original = load_file(hf_dirs["nemotron"] / "model.safetensors")
    path = write_gguf(hf_dirs["nemotron"], tmp_path / "nemotron.gguf", byte_level_vocab(VOCAB_SIZE))
    stored = {tensor.name: tensor.data for tensor in gguf.GGUFReader(path).tensors}
    np.testing.assert_array_equal(
        stored["blk.0.attn_norm.weight"],
        original["model.layers.0.input_layernorm.weight"] + np.float32(1.0),
    )
    np.testing.assert_array_equal(stored["output_norm.bias"], original["model.norm.bias"])
    fields, shapes = gguf_metadata(hf_dirs["nemotron"], tmp_path / "nemotron.gguf")
    assert fields["nemotron.rope.dimension_count"] == 32
    assert np.float32(fields["nemotron.attention.layer_norm_epsilon"]) == np.float32(1e-5)
    assert "nemotron.attention.layer_norm_rms_epsilon" not in fields
    nemotron = gguf_config.hf_config(fields, shapes)
    assert "rms_norm_eps" not in nemotron
    assert (nemotron["norm_eps"], nemotron["hidden_act"], nemotron["partial_rotary_factor"]) == (
        1e-5,
        "relu2",
        0.5,
    )
    assert nemotron["rope_parameters"] == {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
    }
    assert (nemotron["attention_bias"], nemotron["mlp_bias"]) == (False, False)

    original = load_file(hf_dirs["apertus"] / "model.safetensors")
    fields, shapes = gguf_metadata(hf_dirs["apertus"], tmp_path / "apertus.gguf")
    reader = gguf.GGUFReader(tmp_path / "apertus.gguf")
    rope_freqs = next(t.data for t in reader.tensors if t.name == "rope_freqs.weight")
    for name in ("alpha_p", "alpha_n", "beta", "eps"):
        np.testing.assert_array_equal(
            np.array(fields[f"xielu.{name}"], dtype=np.float32),
            [original[f"model.layers.{i}.mlp.act_fn.{name}"].item() for i in range(2)],
        )
    assert not any("act_fn" in name or "xielu" in name for name in shapes)
    apertus = gguf_config.hf_config(fields, shapes, rope_freqs)
    assert apertus["hidden_act"] == "xielu"
    assert apertus["rope_parameters"] == FAMILIES["apertus"]["rope_parameters"]


def test_llama4_metadata_as_llama_cpp_writes_and_reads_it(hf_dirs, tmp_path):
    """What llama.cpp keeps of Llama 4, and the config the converter makes of it: the dense
    layers' size as feed_forward_length, the experts' and their step as their own keys, no
    key for the chunk, the RoPE-less layers, the temperature or the q/k norms (what llama.cpp
    fixes is written out per layer); Q/K rows as HF has them (both rotate adjacent pairs);
    the experts split and transposed; Scout's RoPE scaling as rope_freqs."""
    original = load_file(hf_dirs["llama4"] / "model.safetensors")
    path = tmp_path / "llama4.gguf"
    fields, shapes = gguf_metadata(hf_dirs["llama4"], path)
    reader = gguf.GGUFReader(path)
    stored = {tensor.name: tensor.data for tensor in reader.tensors}
    for gguf_name, hf_name in [("attn_q", "q_proj"), ("attn_k", "k_proj")]:
        np.testing.assert_array_equal(
            stored[f"blk.0.{gguf_name}.weight"],
            original[f"model.layers.0.self_attn.{hf_name}.weight"],
        )
    gate_up = original["model.layers.1.feed_forward.experts.gate_up_proj"]
    up = gate_up[..., 96:].swapaxes(1, 2)  # HF's up columns, transposed
    np.testing.assert_array_equal(stored["blk.1.ffn_up_exps.weight"], up)
    assert (fields["llama4.feed_forward_length"], fields["llama4.expert_feed_forward_length"]) == (
        384,
        96,
    )
    assert (fields["llama4.interleave_moe_layer_step"], fields["llama4.expert_count"]) == (2, 4)
    assert not any("sliding_window" in name or "chunk" in name for name in fields)
    assert shapes["blk.1.ffn_gate_exps.weight"] == (4, 96, 256)
    assert shapes["blk.1.ffn_down_exps.weight"] == (4, 256, 96)
    assert shapes["blk.1.ffn_gate_shexp.weight"] == (96, 256)
    assert shapes["blk.2.ffn_gate.weight"] == (384, 256)
    assert "blk.2.ffn_gate_inp.weight" not in shapes
    rope_freqs = stored["rope_freqs.weight"]
    llama4 = gguf_config.hf_config(fields, shapes, rope_freqs)
    assert llama4["rope_parameters"] == FAMILIES["llama4"]["rope_parameters"]
    assert (llama4["moe_layers"], llama4["no_rope_layers"]) == ([1, 3], [1, 1, 1, 0])
    assert llama4["layer_types"] == ["chunked_attention"] * 3 + ["full_attention"]
    assert (llama4["attention_chunk_size"], llama4["floor_scale"], llama4["attn_scale"]) == (
        8192,
        8192,
        0.1,
    )
    assert llama4["attn_temperature_tuning"] and llama4["use_qk_norm"]
    # The window llama.cpp's converter writes for layers that all attend in full: no chunks,
    # RoPE everywhere (so no temperature); 8192 reads as no window does.
    unchunked = gguf_config.hf_config({**fields, "llama4.attention.sliding_window": 0}, shapes)
    assert (unchunked["attention_chunk_size"], unchunked["attn_temperature_tuning"]) == (
        None,
        False,
    )
    assert unchunked["no_rope_layers"] == [1] * 4
    assert unchunked["layer_types"] == ["full_attention"] * 4
    assert gguf_config.hf_config(
        {**fields, "llama4.attention.sliding_window": 8192}, shapes
    ) == gguf_config.hf_config(fields, shapes)
    # Newer llama.cpp reads the chunked layers' period from the file; the RoPE-less layers'
    # step stays its fixed 4.
    every_other = gguf_config.hf_config(
        {**fields, "llama4.attention.sliding_window_pattern": 2}, shapes
    )
    assert every_other["layer_types"] == ["chunked_attention", "full_attention"] * 2
    assert every_other["no_rope_layers"] == [1, 1, 1, 0]
    # llama.cpp's Maverick (128 experts) has no q/k norms.
    maverick = {
        name: (128, *shape[1:]) if "_exps." in name else (128, shape[1])
        for name, shape in shapes.items()
        if "_exps." in name or "ffn_gate_inp" in name
    }
    assert gguf_config.hf_config(fields, {**shapes, **maverick})["use_qk_norm"] is False


@pytest.mark.slow
def test_llama4_s_fixed_chunk_cuts_a_long_prompt_as_hf_s(hf_dirs, converted, tmp_path):
    """llama.cpp's chunks of 8192, which the converted config writes out: a prompt crossing a
    chunk's start in prefill, and one whose new tokens cross it in decode, give HF's tokens
    on the original; without the chunks HF's own tokens move, so the check can fail."""
    rng = np.random.default_rng(8)
    prompts = [rng.integers(VOCAB_SIZE, size=n).tolist() for n in (8185, 8250)]
    params = SamplingParams(max_tokens=PARITY_TOKENS, temperature=0.0, ignore_eos=True)
    llm = LLM(converted["llama4"], num_blocks=1100)
    tokens = [output.outputs[0].token_ids for output in llm.generate(prompts, params)]
    expected = hf_greedy(hf_dirs["llama4"], prompts, max_new_tokens=PARITY_TOKENS)
    assert tokens == expected
    full = ["full_attention"] * 4
    unchunked = rewritten(hf_dirs["llama4"], tmp_path / "unchunked", layer_types=full)
    assert hf_greedy(unchunked, prompts, max_new_tokens=PARITY_TOKENS) != expected


def test_glm4_moe_s_next_token_prediction_block_is_dropped(hf_dirs, tmp_path):
    # llama.cpp appends GLM-4.5's multi-token-prediction layer as one more block, with its
    # own nextn.* tensors; the converted model is the checkpoint without it, as HF loads it.
    with_mtp = with_next_token_layer(hf_dirs["glm4_moe"], tmp_path / "with_mtp")
    gguf_path = write_gguf(with_mtp, tmp_path / "mtp.gguf", byte_level_vocab(VOCAB_SIZE))
    reader = gguf.GGUFReader(gguf_path)
    assert reader.fields["glm4moe.block_count"].contents() == 4
    assert reader.fields["glm4moe.nextn_predict_layers"].contents() == 1
    names = {tensor.name for tensor in reader.tensors}
    assert {"blk.3.nextn.eh_proj.weight", "blk.3.ffn_gate_exps.weight"} <= names
    converted = resolve_model(gguf_path, cache_dir=str(tmp_path / "cache")).path
    original = load_file(hf_dirs["glm4_moe"] / "model.safetensors")
    ours = load_file(converted / "model.safetensors")
    assert sorted(ours) == sorted(original)
    for name, weight in original.items():
        np.testing.assert_array_equal(ours[name], weight, err_msg=name)
    config = json.loads((converted / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_nextn_predict_layers"]) == (3, 0)


def test_deepseek_s_whole_kv_b_as_older_llama_cpp_wrote_it_converts_alike(hf_dirs, tmp_path):
    # Before its MLA support llama.cpp kept kv_b_proj whole (attn_kv_b), gave the heads' own
    # key and value lengths and as many KV heads as query heads.
    gguf_path = write_gguf(
        hf_dirs["deepseek_v3"],
        tmp_path / "old.gguf",
        byte_level_vocab(VOCAB_SIZE),
        split_kv_b=False,
    )
    reader = gguf.GGUFReader(gguf_path)
    names = {tensor.name for tensor in reader.tensors}
    assert "blk.0.attn_kv_b.weight" in names and "blk.0.attn_k_b.weight" not in names
    assert "deepseek2.attention.key_length_mla" not in reader.fields
    assert reader.fields["deepseek2.attention.key_length"].contents() == 192
    converted = resolve_model(gguf_path, cache_dir=str(tmp_path / "cache")).path
    original = load_file(hf_dirs["deepseek_v3"] / "model.safetensors")
    ours = load_file(converted / "model.safetensors")
    assert sorted(ours) == sorted(original)
    for name, weight in original.items():
        np.testing.assert_array_equal(ours[name], weight, err_msg=name)
    expected = ModelConfig.from_dir(hf_dirs["deepseek_v3"])
    assert dataclasses.replace(ModelConfig.from_dir(converted), path=expected.path) == expected


def test_a_layer_s_split_kv_b_is_skipped_where_the_whole_one_is_kept_too():
    # Some files (ik_llama.cpp's) keep attn_kv_b beside the attn_k_b / attn_v_b split from
    # it: the whole one is converted. Blocks past the model's layers (multi-token
    # prediction) and the RoPE tensors are no weights either.
    names = [
        "token_embd.weight",
        "rope_freqs.weight",
        "blk.0.attn_kv_b.weight",
        "blk.0.attn_k_b.weight",
        "blk.0.attn_v_b.weight",
        "blk.1.attn_k_b.weight",
        "blk.1.attn_v_b.weight",
        "blk.2.attn_kv_b.weight",
        "blk.2.nextn.eh_proj.weight",
    ]
    skipped = gguf_registry.architecture("deepseek2").tensors_without_weights(names, num_layers=2)
    assert skipped & set(names) == {
        "rope_freqs.weight",
        "blk.0.attn_k_b.weight",
        "blk.0.attn_v_b.weight",
        "blk.2.attn_kv_b.weight",
        "blk.2.nextn.eh_proj.weight",
    }


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        # HF's DeepSeek-V2 router has no selection bias: a softmax file with one is refused.
        (
            dict(architectures=["DeepseekV2ForCausalLM"]),
            "a router scoring by softmax with a selection bias",
        ),
        # llama.cpp applies a YaRN attention factor to the rotation and the softmax scale.
        (
            dict(
                rope_parameters={
                    **FAMILIES["deepseek_v3"]["rope_parameters"],
                    "attention_factor": 1.5,
                }
            ),
            "rope.scaling.yarn_attn_factor=1.5 is not supported",
        ),
    ],
)
def test_deepseek2_files_hf_cannot_express_are_refused_by_name(hf_dirs, tmp_path, changes, message):
    variant = rewritten(hf_dirs["deepseek_v3"], tmp_path / "variant", **changes)
    gguf_path = write_gguf(variant, tmp_path / "variant.gguf", byte_level_vocab(VOCAB_SIZE))
    with pytest.raises(ValueError, match=message):
        resolve_model(gguf_path, cache_dir=str(tmp_path / "cache"))


def test_gpt_oss_s_fused_gate_up_experts_convert_alike(hf_dirs, tmp_path):
    # llama.cpp's --fuse-gate-up-exps: one tensor of gate rows then up rows, and its bias.
    gguf_path = write_gguf(
        hf_dirs["gpt_oss"], tmp_path / "fused.gguf", byte_level_vocab(VOCAB_SIZE), fuse_gate_up=True
    )
    names = {t.name for t in gguf.GGUFReader(gguf_path).tensors}
    assert {"blk.0.ffn_gate_up_exps.weight", "blk.0.ffn_gate_up_exps.bias"} <= names
    assert "blk.0.ffn_gate_exps.weight" not in names
    converted = resolve_model(gguf_path, cache_dir=str(tmp_path / "cache")).path
    original = load_file(hf_dirs["gpt_oss"] / "model.safetensors")
    ours = load_file(converted / "model.safetensors")
    assert sorted(ours) == sorted(original)
    for name, weight in original.items():
        np.testing.assert_array_equal(ours[name], weight, err_msg=name)


def test_an_mxfp4_gpt_oss_gguf_converts_to_its_dequantized_experts(hf_dirs, tmp_path):
    # As OpenAI's gpt-oss GGUFs keep them: the experts in MXFP4 (32 e2m1 values, one power of
    # two), restacked and interleaved as HF keeps them, within MXFP4's steps of the original;
    # the engine runs the dequantized model as HF does.
    gguf_path = write_gguf(
        hf_dirs["gpt_oss"],
        tmp_path / "mxfp4.gguf",
        byte_level_vocab(VOCAB_SIZE),
        gguf.GGMLQuantizationType.MXFP4,
    )
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(gguf_path).tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == gguf.GGMLQuantizationType.MXFP4
    converted = resolve_model(gguf_path, cache_dir=str(tmp_path / "cache")).path
    original = load_file(hf_dirs["gpt_oss"] / "model.safetensors")
    ours = load_file(converted / "model.safetensors")
    assert sorted(ours) == sorted(original)
    for name in ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"):
        # Each value within a step of its group's largest (e2m1's widest step is a third of
        # it); the gate_up columns interleaved back (a swapped gate and up would be far off).
        groups = original[name].swapaxes(1, 2).reshape(-1, 32)
        error = np.abs(ours[name].swapaxes(1, 2).reshape(-1, 32) - groups)
        assert (error <= np.abs(groups).max(axis=1, keepdims=True) / 3 + 1e-6).all(), name
        assert not np.array_equal(ours[name], original[name]), name
    prompts = random_prompts(4, VOCAB_SIZE)[:3]
    llm = LLM(converted, num_blocks=256)
    tokens = [output.outputs[0].token_ids for output in llm.generate(prompts, GREEDY)]
    assert tokens == hf_greedy(converted, prompts)


def test_quantized_gguf_converts_to_its_dequantized_weights(hf_dirs, tmp_path):
    # Q8_0 keeps each block of 32 values as int8 times one float16 scale (max |x| / 127,
    # rounded to float16): the matrices come back within half a step of their block's scale
    # plus that rounding (at most 127 / 2048 of a step), stacked experts included.
    gguf_path = write_gguf(
        hf_dirs["qwen2_moe"],
        tmp_path / "q8.gguf",
        byte_level_vocab(VOCAB_SIZE),
        gguf.GGMLQuantizationType.Q8_0,
    )
    converted = resolve_model(gguf_path, cache_dir=str(tmp_path / "cache")).path
    original = load_file(hf_dirs["qwen2_moe"] / "model.safetensors")
    ours = load_file(converted / "model.safetensors")
    assert sorted(ours) == sorted(original)
    for name, weight in original.items():
        if weight.ndim == 1 or name.endswith("shared_expert_gate.weight"):
            # 1-D in the GGUF (norms, biases, the gate): kept in float32.
            np.testing.assert_array_equal(ours[name], weight, err_msg=name)
            continue
        blocks = weight.reshape(-1, 32)
        step = np.abs(blocks).max(axis=1, keepdims=True) / 127
        error = np.abs(ours[name].reshape(-1, 32) - blocks)
        assert (error <= step * 0.57).all(), name
        assert not np.array_equal(ours[name], weight), name
    # The engine runs the dequantized model as HF does.
    prompts = random_prompts(4, VOCAB_SIZE)[:3]
    llm = LLM(converted, num_blocks=256)
    tokens = [output.outputs[0].token_ids for output in llm.generate(prompts, GREEDY)]
    assert tokens == hf_greedy(converted, prompts)


def test_rope_freqs_other_than_llama_3s_are_refused(hf_dirs, tmp_path):
    # The GGUF keeps only the divisors; settings other than Llama 3's low / high frequency
    # factors and original context cannot be told apart from them reliably, so say so.
    config_dir = tmp_path / "other"
    shutil.copytree(hf_dirs["llama3"], config_dir)
    config = json.loads((config_dir / "config.json").read_text())
    config["rope_parameters"]["high_freq_factor"] = 2.0
    (config_dir / "config.json").write_text(json.dumps(config))
    gguf_path = write_gguf(config_dir, tmp_path / "other.gguf", byte_level_vocab(VOCAB_SIZE))
    with pytest.raises(ValueError, match="rope_freqs is not Llama 3's RoPE scaling"):
        resolve_model(gguf_path, cache_dir=str(tmp_path / "cache"))


def test_end_of_turn_token_stops_generation_too(hf_dirs, converted, tmp_path):
    # A chat GGUF names its end-of-turn token apart from EOS (Qwen: <|im_end|> beside
    # <|endoftext|>); both end a generation, as the HF model's generation_config says.
    generation = json.loads((converted["qwen2"] / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2
    gguf_path = write_gguf(
        hf_dirs["qwen2"], tmp_path / "chat.gguf", byte_level_vocab(VOCAB_SIZE), end_of_turn_id=1
    )
    chat = resolve_model(gguf_path, cache_dir=str(tmp_path / "cache")).path
    assert json.loads((chat / "generation_config.json").read_text())["eos_token_id"] == [2, 1]
    assert LLM(chat, num_blocks=64).eos_token_ids == frozenset({1, 2})


def test_tokenizer_and_chat_template_come_through(converted):
    tokenizer = Tokenizer(converted["qwen2"])
    text = "hello world, Paris!"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_a_tokenizer_transformers_has_no_gguf_config_for_converts_alike(converted):
    # transformers reads no config from a granite GGUF: its vocabulary alone makes the
    # tokenizer, which tokenizes as the llama file's (the same vocabulary) does.
    text = "Hello world, the cat sat."
    granite, llama = Tokenizer(converted["granite"]), Tokenizer(converted["llama"])
    assert granite.encode(text) == llama.encode(text)
    assert granite.decode(granite.encode(text)) == text
    assert granite.hf_tokenizer.eos_token == llama.hf_tokenizer.eos_token


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_the_writer_follows_llama_cpp_as_transformers_reads_it(hf_dirs, tmp_path, family):
    # transformers' own GGUF loader (an implementation independent of ours) reads the
    # test writer's file back into the original weights: the writer is llama.cpp's layout.
    # (transformers 5.24 ignores the expert sizes a Qwen MoE GGUF gives and takes its config
    # defaults, so those files are checked through the engine's converter alone.)
    from transformers import AutoModelForCausalLM

    gguf_path = write_gguf(
        hf_dirs[family], tmp_path / f"{family}.gguf", byte_level_vocab(VOCAB_SIZE)
    )
    model = AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=gguf_path.name, dtype=torch.float32
    )
    original = load_file(hf_dirs[family] / "model.safetensors")
    state = model.state_dict()
    for name, weight in original.items():
        np.testing.assert_array_equal(state[name].numpy(), weight, err_msg=name)


_GEMMA_COMMON = dict(
    hidden_size=128,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=VOCAB_SIZE,
    max_position_embeddings=512,
)
# Configs llama.cpp can hold: it fixes the attention scale (head_dim ** -0.5 below 27B), the
# layer kinds and Gemma 3's local RoPE itself, so these take the same values.
GEMMA_FAMILIES = {
    # Sliding (16 tokens) and global layers alternating; both soft-caps.
    "gemma2": dict(
        architectures=["Gemma2ForCausalLM"],
        num_hidden_layers=4,
        query_pre_attn_scalar=64,
        sliding_window=16,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        **_GEMMA_COMMON,
    ),
    # Five sliding layers, then a global one with its own RoPE base and linear scaling; the
    # final soft-cap.
    "gemma3": dict(
        architectures=["Gemma3ForCausalLM"],
        num_hidden_layers=6,
        query_pre_attn_scalar=64,
        sliding_window=16,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
        },
        final_logit_softcapping=5.0,
        **_GEMMA_COMMON,
    ),
}


@pytest.fixture(scope="module")
def gemma_dirs(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """family -> (the HF directory, its GGUF's conversion)."""
    root = tmp_path_factory.mktemp("gemma")
    result = {}
    for family, config in GEMMA_FAMILIES.items():
        hf_dir = random_hf_model(config, root / family)
        gguf_path = write_gguf(hf_dir, root / f"{family}.gguf", byte_level_vocab(VOCAB_SIZE))
        result[family] = (hf_dir, resolve_model(gguf_path, cache_dir=str(root / "cache")).path)
    return result


@pytest.mark.parametrize("family", list(GEMMA_FAMILIES))
def test_gemma_gguf_converts_to_the_original_model(gemma_dirs, family):
    hf_dir, converted = gemma_dirs[family]
    original = load_file(hf_dir / "model.safetensors")
    original.pop("lm_head.weight", None)  # tied
    ours = load_file(converted / "model.safetensors")
    assert sorted(ours) == sorted(original)
    for name, weight in original.items():
        if name.endswith("norm.weight"):
            # Stored as 1 + w: w comes back to float32's resolution near 1.
            np.testing.assert_allclose(ours[name], weight, rtol=0, atol=2**-22, err_msg=name)
        else:
            np.testing.assert_array_equal(ours[name], weight, err_msg=name)
    # The config makes HF compute what it computes on the original model.
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([random_prompts(6, VOCAB_SIZE)[-1]])
    logits = [
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)(ids).logits
        for path in (hf_dir, converted)
    ]
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=1e-4)


@pytest.mark.parametrize("family", list(GEMMA_FAMILIES))
def test_engine_on_a_converted_gemma_gguf_matches_hf(gemma_dirs, family):
    _, converted = gemma_dirs[family]
    tokens, expected = converted_tokens_and_hf_s(converted, converted, 7)
    assert tokens == expected


def test_gemma_config_and_tokenizer_come_through(gemma_dirs):
    config = json.loads((gemma_dirs["gemma3"][1] / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"]
    assert (config["query_pre_attn_scalar"], config["sliding_window"]) == (64, 16)
    assert config["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    assert config["rope_parameters"]["full_attention"]["factor"] == 4.0
    assert config["final_logit_softcapping"] == 5.0
    assert config["attn_logit_softcapping"] is None
    gemma2 = json.loads((gemma_dirs["gemma2"][1] / "config.json").read_text())
    assert (gemma2["attn_logit_softcapping"], gemma2["final_logit_softcapping"]) == (50.0, 30.0)
    tokenizer = Tokenizer(gemma_dirs["gemma3"][1])
    assert tokenizer.decode(tokenizer.encode("hello world")) == "hello world"
