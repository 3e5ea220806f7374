"""Write an HF model directory as a GGUF file the way llama.cpp's converter
(convert_hf_to_gguf.py) does, so the engine's GGUF converter can be checked against the
HF model it came from: tensor names from gguf-py's own name map (not the converter's
tables), Llama's Q/K rows interleaved for llama.cpp's RoPE, a layer's experts stacked into
one tensor per projection, the shared-expert gate's leading 1 dropped, Gemma's and Nemotron's
norms stored as 1 + w, DeepSeek's kv_b_proj split per head into attn_k_b (transposed) and attn_v_b
(or kept whole, as older llama.cpp did), GLM-4.5's multi-token-prediction layer appended as
a block (DeepSeek's dropped), ERNIE 4.5's router bias kept [1, experts] as HF has it,
OLMoE's and MiniMax-M2's whole-projection q/k norms kept whole, MiniMax-M2's router bias as
exp_probs_b, Hunyuan's NTK alpha folded into the RoPE base, Apertus's xIELU scalars as
metadata, Llama 4's stacked gate_up split into gate and up and its experts transposed,
1-D tensors kept in float32, and a byte-level BPE vocabulary (or for Gemma a SentencePiece
one) in the tokenizer keys.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

# HF architecture -> llama.cpp's architecture name.
GGUF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MixtralForCausalLM": "llama",  # llama.cpp's Mixtral: llama with stacked experts
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2MoeForCausalLM": "qwen2moe",
    "Qwen3MoeForCausalLM": "qwen3moe",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3",
    "GraniteForCausalLM": "granite",
    "SmolLM3ForCausalLM": "smollm3",
    "Olmo2ForCausalLM": "olmo2",
    "Olmo3ForCausalLM": "olmo2",  # llama.cpp's OLMo 3: olmo2 with a sliding window
    "GptOssForCausalLM": "gpt-oss",
    "Glm4MoeForCausalLM": "glm4moe",
    "DeepseekV2ForCausalLM": "deepseek2",
    "DeepseekV3ForCausalLM": "deepseek2",
    "Dots1ForCausalLM": "dots1",
    "Ernie4_5_MoeForCausalLM": "ernie4_5-moe",
    "Exaone4ForCausalLM": "exaone4",
    "OlmoeForCausalLM": "olmoe",
    "MiniMaxM2ForCausalLM": "minimax-m2",
    "Ernie4_5ForCausalLM": "ernie4_5",
    "HunYuanDenseV1ForCausalLM": "hunyuan-dense",
    "HunYuanMoEV1ForCausalLM": "hunyuan-moe",
    "NemotronForCausalLM": "nemotron",
    "ApertusForCausalLM": "apertus",
    "Llama4ForCausalLM": "llama4",
}
_DEEPSEEK = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
_EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_gguf(
    hf_dir: Path,
    path: Path,
    tokens: tuple[list[str], list[str]],
    quantization: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
    end_of_turn_id: int | None = None,
    fuse_gate_up: bool = False,
    split_kv_b: bool = True,
    hunyuan_alpha_apart: bool = False,
) -> Path:
    """``tokens``: a byte-level BPE vocabulary by id and its merges (``byte_level_vocab``);
    ``quantization`` applies to the matrices; ``end_of_turn_id`` is written as the EOT token;
    ``fuse_gate_up``: gpt-oss's experts as llama.cpp's --fuse-gate-up-exps writes them (one
    ffn_gate_up_exps, gate rows then up rows); ``split_kv_b``: DeepSeek's attention as
    llama.cpp writes it since its MLA support (attn_k_b and attn_v_b, the *_mla lengths, one
    KV head), else as before it (one attn_kv_b, the heads' own lengths);
    ``hunyuan_alpha_apart``: a Hunyuan dense model's NTK alpha kept apart from the RoPE base
    (rope.scaling.alpha), as llama.cpp's HunyuanVL converter writes it and its hunyuan-dense
    reads it, instead of folded into the base as its Hunyuan converters write it."""
    config = json.loads((hf_dir / "config.json").read_text())
    architecture = GGUF_ARCHITECTURES[config["architectures"][0]]
    arch = next(key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == architecture)
    num_layers = config["num_hidden_layers"]
    # llama.cpp keeps GLM-4.5's multi-token-prediction layers as extra blocks, and drops
    # DeepSeek's.
    block_count = num_layers
    if architecture == "glm4moe":
        block_count += config.get("num_nextn_predict_layers", 0)
    name_map = gguf.get_tensor_name_map(arch, block_count)
    writer = gguf.GGUFWriter(path, architecture)
    _write_hparams(writer, config, block_count)
    if architecture.startswith("gemma"):
        _write_gemma_hparams(writer, architecture, config)
        _write_sentencepiece_vocab(writer, config["vocab_size"])
    else:
        _write_vocab(writer, *tokens)
    if end_of_turn_id is not None:
        writer.add_eot_token_id(end_of_turn_id)
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type") == "llama3":
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        writer.add_tensor("rope_freqs.weight", llama3_rope_freqs(rope, head_dim))
    if architecture == "phi3":
        _write_phi3_hparams(writer, config)
    if architecture == "granite":
        _write_granite_hparams(writer, config)
    if config["architectures"][0] == "Olmo3ForCausalLM":
        _write_olmo3_hparams(writer, config)
    if architecture == "gpt-oss":
        _write_gpt_oss_hparams(writer, config)
    if architecture == "glm4moe":
        _write_glm4_moe_hparams(writer, config)
    if architecture == "deepseek2":
        _write_deepseek2_hparams(writer, config, split_kv_b)
    if architecture == "dots1":
        _write_dots1_hparams(writer, config)
    if architecture == "ernie4_5-moe":
        _write_ernie4_5_moe_hparams(writer, config)
    if architecture == "exaone4":
        _write_exaone4_hparams(writer, config)
    if architecture == "minimax-m2":
        _write_minimax_m2_hparams(writer, config)
    if architecture.startswith("hunyuan"):
        _write_hunyuan_hparams(writer, architecture, config, hunyuan_alpha_apart)
    if architecture == "nemotron":
        _write_nemotron_hparams(writer, config)
    if architecture == "apertus":
        # LlamaModel's: the rotated dimensions (all of each head).
        writer.add_rope_dimension_count(config["head_dim"])
    if architecture == "llama4":
        _write_llama4_hparams(writer, config)

    weights = load_file(hf_dir / "model.safetensors")
    if config.get("tie_word_embeddings", architecture.startswith("gemma")):
        weights.pop("lm_head.weight", None)
    experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    xielu: dict[str, dict[int, float]] = {}
    for name, weight in weights.items():
        module, _, kind = name.rpartition(".")
        parts = module.split(".")
        if parts[:2] == ["model", "layers"] and int(parts[2]) >= block_count:
            continue  # DeepSeek's multi-token-prediction layer
        if module.endswith(".act_fn"):  # Apertus's xIELU scalars: metadata, per layer
            xielu.setdefault(kind, {})[int(parts[2])] = float(weight.reshape(()))
            continue
        if kind == "e_score_correction_bias":  # llama.cpp renames it e_score_correction.bias
            gguf_name = name_map.get_name(f"{module}.e_score_correction")
            _add(writer, f"{gguf_name}.bias", weight, F32)
            continue
        if module.endswith("kv_b_proj") and split_kv_b:
            for gguf_name, tensor in _split_kv_b(name_map, module, weight, config):
                _add(writer, gguf_name, tensor, quantization)
            continue
        if architecture == "gpt-oss" and (kind == "sinks" or parts[-1] == "experts"):
            for gguf_name, tensor in _gpt_oss_tensors(name, weight, fuse_gate_up):
                _add(writer, gguf_name, tensor, quantization if tensor.ndim == 3 else F32)
            continue
        if architecture == "llama4" and parts[-1] == "experts":
            for gguf_name, tensor in _llama4_tensors(name, weight):
                _add(writer, gguf_name, tensor, quantization)
            continue
        if "experts" in parts:  # model.layers.L.<mlp | block_sparse_moe>.experts.E.<projection>
            prefix, expert, projection = ".".join(parts[:5]), int(parts[5]), parts[6]
            experts.setdefault((prefix, projection), {})[expert] = weight
            continue
        gguf_name = name_map.get_name(module)
        if gguf_name is None:
            raise ValueError(f"llama.cpp has no {architecture} tensor for {name!r}")
        if architecture in ("llama", "granite", "smollm3") and module.endswith(
            ("q_proj", "k_proj")
        ):
            heads = config["num_attention_heads"]
            if module.endswith("k_proj"):
                heads = config.get("num_key_value_heads", heads)
            weight = permute_for_llama_cpp(weight, heads)
        if module.endswith("shared_expert_gate"):
            weight = weight.reshape(-1)
        # llama.cpp's Gemma and Nemotron converters store each norm's weight as 1 + w.
        one_plus_norms = architecture.startswith("gemma") or architecture == "nemotron"
        if one_plus_norms and name.endswith("norm.weight"):
            weight = weight + np.float32(1.0)
        _add(writer, f"{gguf_name}.{kind}", weight, quantization)
    for (prefix, projection), by_expert in sorted(experts.items()):
        stacked = np.stack([by_expert[e] for e in sorted(by_expert)])
        gguf_name = name_map.get_name(f"{prefix}.{projection}")
        _add(writer, f"{gguf_name}.weight", stacked, quantization)
    if xielu:
        writer.add_xielu_alpha_p(_by_layer(xielu["alpha_p"]))
        writer.add_xielu_alpha_n(_by_layer(xielu["alpha_n"]))
        writer.add_xielu_beta(_by_layer(xielu["beta"]))
        writer.add_xielu_eps(_by_layer(xielu["eps"]))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


F32 = gguf.GGMLQuantizationType.F32


def _by_layer(values: dict[int, float]) -> list[float]:
    return [values[layer] for layer in sorted(values)]


def _split_kv_b(
    name_map: gguf.TensorNameMap, module: str, weight: np.ndarray, config: dict
) -> list[tuple[str, np.ndarray]]:
    """As llama.cpp's DeepseekV2Model splits kv_b_proj ([heads x (nope + v), kv_lora_rank],
    each head's key rows then its value rows): attn_k_b [heads, kv_lora_rank, nope] (the key
    rows transposed) and attn_v_b [heads, v, kv_lora_rank]."""
    nope, heads = config["qk_nope_head_dim"], config["num_attention_heads"]
    by_head = weight.reshape(heads, nope + config["v_head_dim"], -1)
    keys, values = by_head[:, :nope], by_head[:, nope:]
    prefix = module.removesuffix("kv_b_proj")
    return [
        (f"{name_map.get_name(prefix + 'k_b_proj')}.weight", keys.swapaxes(1, 2)),
        (f"{name_map.get_name(prefix + 'v_b_proj')}.weight", values),
    ]


def _gpt_oss_tensors(
    name: str, weight: np.ndarray, fuse_gate_up: bool
) -> list[tuple[str, np.ndarray]]:
    """As llama.cpp's GptOssModel writes gpt-oss's own tensors: each head's sink; the stacked
    gate_up ([experts, hidden, 2 x intermediate], gate and up interleaved) split into gate and
    up ([experts, intermediate, hidden] each, biases likewise), the down transposed to
    [experts, hidden, intermediate]."""
    layer = name.split(".")[2]
    if name.endswith("self_attn.sinks"):
        return [(f"blk.{layer}.attn_sinks.weight", weight)]
    projection = name.rpartition(".")[2]
    if fuse_gate_up and projection.startswith("gate_up_proj"):
        gate, up = weight[..., 0::2], weight[..., 1::2]
        if projection == "gate_up_proj":
            fused = np.concatenate([gate.swapaxes(1, 2), up.swapaxes(1, 2)], axis=1)
            return [(f"blk.{layer}.ffn_gate_up_exps.weight", fused)]
        return [(f"blk.{layer}.ffn_gate_up_exps.bias", np.concatenate([gate, up], axis=-1))]
    if projection == "gate_up_proj":
        return [
            (f"blk.{layer}.ffn_gate_exps.weight", weight[..., 0::2].swapaxes(1, 2)),
            (f"blk.{layer}.ffn_up_exps.weight", weight[..., 1::2].swapaxes(1, 2)),
        ]
    if projection == "gate_up_proj_bias":
        return [
            (f"blk.{layer}.ffn_gate_exps.bias", weight[..., 0::2]),
            (f"blk.{layer}.ffn_up_exps.bias", weight[..., 1::2]),
        ]
    if projection == "down_proj":
        return [(f"blk.{layer}.ffn_down_exps.weight", weight.swapaxes(1, 2))]
    return [(f"blk.{layer}.ffn_down_exps.bias", weight)]


def _llama4_tensors(name: str, weight: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """As llama.cpp's Llama4Model writes Llama 4's experts: the stacked gate_up ([experts,
    hidden, 2 x intermediate], gate columns first) transposed and split into gate and up
    ([experts, intermediate, hidden] each), the down ([experts, intermediate, hidden])
    transposed to [experts, hidden, intermediate]."""
    layer = name.split(".")[2]
    if name.endswith(".gate_up_proj"):
        gate, up = np.split(weight.swapaxes(1, 2), 2, axis=1)
        return [
            (f"blk.{layer}.ffn_gate_exps.weight", gate),
            (f"blk.{layer}.ffn_up_exps.weight", up),
        ]
    return [(f"blk.{layer}.ffn_down_exps.weight", weight.swapaxes(1, 2))]


def llama3_rope_freqs(rope: dict, head_dim: int) -> np.ndarray:
    """llama.cpp's rope_freqs for HF's llama3 scaling: per frequency the divisor of its
    angle, computed in float32 one frequency at a time as llama.cpp's converter does."""
    import torch

    theta, factor = rope["rope_theta"], rope["factor"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    original = rope["original_max_position_embeddings"]
    frequencies = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    divisors = []
    for frequency in frequencies:
        wavelength = 2 * math.pi / frequency
        if wavelength < original / high:
            divisors.append(1)
        elif wavelength > original / low:
            divisors.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(divisors, dtype=torch.float32).numpy()


def permute_for_llama_cpp(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: each head's rows (r0 .. r(d-1)) reordered to
    (r0, r(d/2), r1, r(d/2+1), ...) for its adjacent-pair RoPE."""
    rows = weight.shape[0]
    by_head = weight.reshape(num_heads, 2, rows // num_heads // 2, -1)
    return by_head.swapaxes(1, 2).reshape(weight.shape)


def _write_hparams(writer: gguf.GGUFWriter, config: dict, block_count: int) -> None:
    deepseek = config["architectures"][0] in _DEEPSEEK
    olmoe = config["architectures"][0] == "OlmoeForCausalLM"
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(block_count)
    # Llama 4's: the dense layers' size (its experts': _write_llama4_hparams).
    writer.add_feed_forward_length(config.get("intermediate_size_mlp", config["intermediate_size"]))
    writer.add_head_count(config["num_attention_heads"])
    if not deepseek:  # its KV heads and lengths: _write_deepseek2_hparams
        writer.add_head_count_kv(config.get("num_key_value_heads", config["num_attention_heads"]))
    # transformers 5 saves RoPE's base in rope_parameters.
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    # llama.cpp's OlmoeModel overwrites the epsilon with 1e-5 (OLMoE's own), whatever the config.
    # (Nemotron's LayerNorms have none: _write_nemotron_hparams.)
    if olmoe or config.get("rms_norm_eps") is not None:
        writer.add_layer_norm_rms_eps(1e-5 if olmoe else config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    # llama.cpp's Granite and Phi-3 converters write no head size (hidden / heads).
    if config.get("head_dim") is not None and config["architectures"][0] not in (
        "GraniteForCausalLM",
        "Phi3ForCausalLM",
        *_DEEPSEEK,
    ):
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    # transformers 5 saves Qwen3-MoE's expert count as num_local_experts.
    num_experts = config.get("num_experts") or config.get("num_local_experts")
    if num_experts:
        writer.add_expert_count(num_experts)
        if config.get("num_experts_per_tok") is not None:  # Hunyuan's: moe_topk
            writer.add_expert_used_count(config["num_experts_per_tok"])
        if "moe_intermediate_size" in config:  # Mixtral's experts: intermediate_size
            writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        if "shared_expert_intermediate_size" in config:
            writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
        # (llama.cpp's OlmoeModel writes no renormalisation: its graph never renormalises.)
        if config.get("norm_topk_prob") is not None and not olmoe:
            writer.add_expert_weights_norm(config["norm_topk_prob"])


def _write_phi3_hparams(writer: gguf.GGUFWriter, config: dict) -> None:
    """What llama.cpp's Phi3MiniModel adds: the rotated dimensions, the pretraining context,
    the sliding window (0: none), and for LongRoPE its factors as tensors and the attention
    factor it derives."""
    rope = config["rope_parameters"]
    original = rope.get("original_max_position_embeddings") or config.get(
        "original_max_position_embeddings", config["max_position_embeddings"]
    )
    rotated = rope.get("partial_rotary_factor", 1.0)
    writer.add_rope_dimension_count(
        int(rotated * config["hidden_size"]) // config["num_attention_heads"]
    )
    writer.add_rope_scaling_orig_ctx_len(original)
    writer.add_sliding_window(config.get("sliding_window") or 0)
    if rope.get("long_factor"):
        scale = config["max_position_embeddings"] / original
        attn_factor = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
        writer.add_rope_scaling_attn_factors(attn_factor)
        long_factor = np.array(rope["long_factor"], dtype=np.float32)
        short_factor = np.array(rope["short_factor"], dtype=np.float32)
        writer.add_tensor("rope_factors_long.weight", long_factor)
        writer.add_tensor("rope_factors_short.weight", short_factor)


def _write_olmo3_hparams(writer: gguf.GGUFWriter, config: dict) -> None:
    """llama.cpp's Olmo2Model on OLMo 3: the window, which layers slide, and the full
    layers' YaRN (its base as the RoPE base)."""
    writer.add_sliding_window(config["sliding_window"])
    writer.add_sliding_window_pattern([t == "sliding_attention" for t in config["layer_types"]])
    full = config["rope_parameters"]["full_attention"]
    writer.add_rope_freq_base(full["rope_theta"])
    if full.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(full["factor"])
        writer.add_rope_scaling_attn_factors(full["attention_factor"])
        writer.add_rope_scaling_orig_ctx_len(full["original_max_position_embeddings"])


def _write_gpt_oss_hparams(writer: gguf.GGUFWriter, config: dict) -> None:
    """llama.cpp's GptOssModel: the window, the experts' size, YaRN's factor and original
    context (the rest of gpt-oss's YaRN and its SwiGLU's constants llama.cpp fixes)."""
    writer.add_sliding_window(config["sliding_window"])
    writer.add_expert_feed_forward_length(config["intermediate_size"])
    rope = config["rope_parameters"]
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])


def _write_glm4_moe_hparams(writer: gguf.GGUFWriter, config: dict) -> None:
    """What llama.cpp's Glm4MoeModel adds: the rotated part of each head, the experts (a
    sigmoid router, its scale, renormalisation and groups, the shared experts, the dense
    leading layers) and the multi-token-prediction layers it appends."""
    rope = config["rope_parameters"]
    rotated = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.5))
    writer.add_rope_dimension_count(int(config["head_dim"] * rotated))
    _write_routed_experts(writer, config, gguf.ExpertGatingFuncType.SIGMOID)
    writer.add_expert_weights_norm(config["norm_topk_prob"])
    if config.get("num_nextn_predict_layers") is not None:
        writer.add_nextn_predict_layers(config["num_nextn_predict_layers"])


def _write_deepseek2_hparams(writer: gguf.GGUFWriter, config: dict, split_kv_b: bool) -> None:
    """What llama.cpp's DeepseekV2Model writes: since its MLA support one KV head whose key is
    the latent and the rotated part (key_length, value_length) and the heads' own lengths as
    *_mla; the ranks; the experts (V3's sigmoid router, V2's softmax one, as the checkpoints'
    scoring_func says, which transformers 5 no longer saves); YaRN with 0.1 x mscale_all_dim
    as yarn_log_multiplier."""
    rope_dim, nope = config["qk_rope_head_dim"], config["qk_nope_head_dim"]
    kv_lora_rank = config["kv_lora_rank"]
    if split_kv_b:
        writer.add_head_count_kv(1)
        writer.add_key_length(kv_lora_rank + rope_dim)
        writer.add_value_length(kv_lora_rank)
        writer.add_key_length_mla(nope + rope_dim)
        writer.add_value_length_mla(config["v_head_dim"])
    else:
        writer.add_head_count_kv(config["num_key_value_heads"])
        writer.add_key_length(nope + rope_dim)
        writer.add_value_length(config["v_head_dim"])
    if config.get("q_lora_rank") is not None:
        writer.add_q_lora_rank(config["q_lora_rank"])
    writer.add_kv_lora_rank(kv_lora_rank)
    writer.add_rope_dimension_count(rope_dim)
    v3 = config["architectures"][0] == "DeepseekV3ForCausalLM"
    gating = gguf.ExpertGatingFuncType.SIGMOID if v3 else gguf.ExpertGatingFuncType.SOFTMAX
    _write_routed_experts(writer, config, gating)
    if config.get("norm_topk_prob"):
        writer.add_expert_weights_norm(True)
    rope = config["rope_parameters"]
    if rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        # As llama.cpp's base converter, each where the config has it.
        if rope.get("beta_fast") is not None:
            writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        if rope.get("beta_slow") is not None:
            writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
        if rope.get("attention_factor") is not None:
            writer.add_rope_scaling_yarn_attn_factor(rope["attention_factor"])
        if rope.get("mscale_all_dim") is not None:
            writer.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def _write_dots1_hparams(writer: gguf.GGUFWriter, config: dict) -> None:
    """What llama.cpp's Dots1Model adds: DeepSeek-V3's expert keys (the groups from n_group /
    topk_group, as its base converter writes them) and the sigmoid router its first version
    wrote for dots.llm1's scoring_func (noaux_tc). No window: llama.cpp keeps none for dots1."""
    _write_routed_experts(writer, config, gguf.ExpertGatingFuncType.SIGMOID)
    writer.add_expert_weights_norm(config["norm_topk_prob"])


def _write_ernie4_5_moe_hparams(writer: gguf.GGUFWriter, config: dict) -> None:
    """What llama.cpp's Ernie4_5MoeModel adds: the experts, where they start and their step
    (no end: llama.cpp assumes the last layer), and the shared experts' count and size, the
    size as llama.cpp computes it (intermediate_size / KV heads, not the shared experts' rows
    in general: 192 here for 2 x 64)."""
    writer.add_expert_count(config["moe_num_experts"])
    writer.add_expert_used_count(config["moe_k"])
    writer.add_interleave_moe_layer_step(config["moe_layer_interval"])
    writer.add_leading_dense_block_count(config["moe_layer_start_index"])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_expert_shared_count(config["moe_num_shared_experts"])
    if config["moe_num_shared_experts"] > 0:
        shared_size = config["intermediate_size"] // config["num_key_value_heads"]
        writer.add_expert_shared_feed_forward_length(shared_size)


def _write_exaone4_hparams(writer: gguf.GGUFWriter, config: dict) -> None:
    """llama.cpp's Exaone4Model: with a window, the window and which layers slide (one flag
    per layer, from layer_types)."""
    if config.get("sliding_window") is not None:
        writer.add_sliding_window(config["sliding_window"])
        writer.add_sliding_window_pattern(
            [kind == "sliding_attention" for kind in config["layer_types"]]
        )


def _write_minimax_m2_hparams(writer: gguf.GGUFWriter, config: dict) -> None:
    """What llama.cpp's MiniMaxM2Model adds: the experts' size (intermediate_size, as the
    dense one), the rotated dimensions (rotary_dim), and from its base converter the sigmoid
    router the checkpoints' scoring_func names (which transformers 5 no longer saves)."""
    writer.add_expert_feed_forward_length(config["intermediate_size"])
    writer.add_rope_dimension_count(config["rotary_dim"])
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)


def _write_hunyuan_hparams(
    writer: gguf.GGUFWriter, architecture: str, config: dict, alpha_apart: bool
) -> None:
    """What llama.cpp's HunYuanModel / HunYuanMoEModel add: HF's "dynamic" RoPE with an alpha
    folded into the base (base x alpha ** (d / (d - 2)), d the dense model's head_dim, the MoE
    model's hidden / heads), no scaling, and a 256K context (those converters assert the
    checkpoints' base, alpha and head size, which these tiny models need not have); the MoE
    model's expert keys (the shared MLP's size is intermediate_size). ``alpha_apart``: the
    dense model's alpha as HunyuanVLTextModel writes it instead (rope.scaling.alpha beside the
    unscaled base, and the model's own context)."""
    rope = config["rope_parameters"]
    if rope.get("rope_type") == "dynamic" and alpha_apart:
        assert architecture == "hunyuan-dense"
        writer.add_rope_freq_base(float(rope["rope_theta"]))
        writer.add_rope_scaling_alpha(float(rope["alpha"]))
        writer.add_rope_scaling_type(gguf.RopeScalingType.NONE)
        writer.add_rope_scaling_factor(float(rope.get("factor", 1)))
        writer.add_rope_scaling_orig_ctx_len(config["max_position_embeddings"])
    elif rope.get("rope_type") == "dynamic":
        dim = config["head_dim"]
        if architecture == "hunyuan-moe":
            dim = config["hidden_size"] // config["num_attention_heads"]
        alpha = rope.get("alpha", 1000 if architecture == "hunyuan-moe" else 50)
        writer.add_rope_freq_base(rope["rope_theta"] * alpha ** (dim / (dim - 2)))
        writer.add_rope_scaling_type(gguf.RopeScalingType.NONE)
        writer.add_rope_scaling_factor(1)
        writer.add_rope_scaling_orig_ctx_len(256 * 1024)
        writer.add_context_length(256 * 1024)
    if architecture == "hunyuan-moe":
        writer.add_expert_shared_feed_forward_length(config["intermediate_size"])
        expert_size = config.get("moe_intermediate_size", config["intermediate_size"])
        writer.add_expert_feed_forward_length(_first(expert_size))
        writer.add_expert_used_count(_first(config["moe_topk"]))
        writer.add_expert_shared_count(_first(config.get("num_shared_expert", 1)))


def _first(value: int | list[int]) -> int:
    """One of Hunyuan-A13B's per-layer values, which llama.cpp's converter asserts agree."""
    return value[0] if isinstance(value, list) else value


def _write_nemotron_hparams(writer: gguf.GGUFWriter, config: dict) -> None:
    """What llama.cpp's NemotronModel adds: the LayerNorms' epsilon, the rotated dimensions
    (the rotated share of hidden / heads, not of head_dim), linear scaling where the config
    has a factor, none else (its norms' 1 + w: write_gguf)."""
    writer.add_layer_norm_eps(config["norm_eps"])
    rope = config["rope_parameters"]
    rotated = rope.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    writer.add_rope_dimension_count(
        int(rotated * config["hidden_size"]) // config["num_attention_heads"]
    )
    factor = config.get("factor") or rope.get("factor")
    if factor is None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.NONE)
    else:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(factor)


def _write_llama4_hparams(writer: gguf.GGUFWriter, config: dict) -> None:
    """What llama.cpp's Llama4Model adds (its feed_forward_length being the dense layers'
    intermediate_size_mlp: _write_hparams): the experts' size (intermediate_size), their
    step (interleave_moe_layer_step; it writes no moe_layers), the rotated dimensions
    (head_dim, LlamaModel's), and a sliding window of 0 only for a config whose layers all
    attend in full. No chunk size, RoPE-less step, temperature or q/k norm switch: llama.cpp
    fixes those (chunks of 8192 on three layers of four, no RoPE on the fourth, whose queries
    it scales with 8192 and 0.1; with the window of 0, RoPE on every layer; q/k norms unless
    128 experts), so a config must match them, and its moe_layers the step."""
    num_layers, step = config["num_hidden_layers"], config["interleave_moe_layer_step"]
    assert config["moe_layers"] == list(range(step - 1, num_layers, step)), "only the step"
    assert config["use_qk_norm"] == (config["num_local_experts"] != 128)
    writer.add_expert_feed_forward_length(config["intermediate_size"])
    writer.add_interleave_moe_layer_step(step)
    writer.add_rope_dimension_count(config["head_dim"])
    if all(kind == "full_attention" for kind in config["layer_types"]):
        assert config["no_rope_layers"] == [1] * num_layers, "llama.cpp then rotates every layer"
        writer.add_sliding_window(0)
        return
    assert config["no_rope_layers"] == [int((i + 1) % 4 != 0) for i in range(num_layers)]
    assert config["layer_types"] == [
        "chunked_attention" if rotates else "full_attention" for rotates in config["no_rope_layers"]
    ]
    assert config["attention_chunk_size"] == 8192, "llama.cpp's fixed chunk"
    assert config["attn_temperature_tuning"]
    assert (config["floor_scale"], config["attn_scale"]) == (8192, 0.1)


def _write_routed_experts(
    writer: gguf.GGUFWriter, config: dict, gating: gguf.ExpertGatingFuncType
) -> None:
    """GLM-4.5's and DeepSeek's expert keys (their groups only where the config has them)."""
    writer.add_expert_count(config["n_routed_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_expert_shared_count(config["n_shared_experts"])
    writer.add_leading_dense_block_count(config["first_k_dense_replace"])
    writer.add_expert_gating_func(gating)
    writer.add_expert_weights_scale(config["routed_scaling_factor"])
    if config.get("n_group") is not None:
        writer.add_expert_group_count(config["n_group"])
        writer.add_expert_group_used_count(config["topk_group"])


def _write_granite_hparams(writer: gguf.GGUFWriter, config: dict) -> None:
    """llama.cpp's GraniteModel: the four scalars renamed *_scale, each written when set."""
    if config.get("attention_multiplier"):
        writer.add_attention_scale(config["attention_multiplier"])
    if config.get("embedding_multiplier"):
        writer.add_embedding_scale(config["embedding_multiplier"])
    if config.get("residual_multiplier"):
        writer.add_residual_scale(config["residual_multiplier"])
    if config.get("logits_scaling"):
        writer.add_logit_scale(config["logits_scaling"])


def _write_gemma_hparams(writer: gguf.GGUFWriter, architecture: str, config: dict) -> None:
    """What llama.cpp's Gemma 2 / 3 converters add; the rest (the attention scale, the layer
    kinds, Gemma 3's local RoPE) llama.cpp fixes itself, so a config must match it."""
    num_layers = config["num_hidden_layers"]
    assert config["query_pre_attn_scalar"] == config["head_dim"], "llama.cpp's rule (not 27B)"
    if architecture == "gemma2":
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
        kinds = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    else:
        if config.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(config["final_logit_softcapping"])
        kinds = [
            "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(num_layers)
        ]
        rope = config["rope_parameters"]
        assert rope["sliding_attention"] == {"rope_type": "default", "rope_theta": 10000.0}
        full = rope["full_attention"]
        writer.add_rope_freq_base(full["rope_theta"])
        if full["rope_type"] == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(full["factor"])
    assert config["layer_types"] == kinds, "llama.cpp's fixed layer kinds"
    writer.add_sliding_window(config["sliding_window"])


def _write_sentencepiece_vocab(writer: gguf.GGUFWriter, vocab_size: int) -> None:
    """Gemma's kind of vocabulary: ``<pad> <eos> <bos> <unk>``, the 256 byte tokens, ``▁``,
    the letters and two-letter pieces, best first (Gemma's GGUFs give no merges)."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    pieces = [
        "▁",
        *letters,
        *(f"▁{c}" for c in letters),
        *(a + b for a in letters for b in letters),
    ]
    tokens = [*specials, *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    tokens = tokens[:vocab_size]
    types = [gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.UNKNOWN]
    types += [gguf.TokenType.BYTE] * 256 + [gguf.TokenType.NORMAL] * (len(tokens) - 260)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 260 + [-float(i) for i in range(len(tokens) - 260)])
    writer.add_token_types([int(t) for t in types])
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_space_prefix(False)
    writer.add_chat_template(CHAT_TEMPLATE)


def byte_level_vocab(vocab_size: int) -> tuple[list[str], list[str]]:
    """A byte-level BPE vocabulary of ``vocab_size`` tokens and its merges: ids 0-2 the
    special tokens ``<|endoftext|> <|im_start|> <|im_end|>``, then the 256 bytes (as GPT-2
    spells them), then two-letter tokens, each made by one merge ("a b" -> "ab")."""
    from helpers.tiny_tokenizers import BYTE_LEVEL_SPECIALS, byte_level_piece

    tokens = [*BYTE_LEVEL_SPECIALS, *(byte_level_piece(bytes([b])) for b in range(256))]
    letters = "abcdefghijklmnopqrstuvwxyz"
    pairs = [(first, second) for first in letters for second in letters]
    merges = [f"{first} {second}" for first, second in pairs[: vocab_size - len(tokens)]]
    tokens += [merge.replace(" ", "") for merge in merges]
    return tokens, merges


def _write_vocab(writer: gguf.GGUFWriter, tokens: list[str], merges: list[str]) -> None:
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    control = int(gguf.TokenType.CONTROL)
    writer.add_token_types([control] * 3 + [int(gguf.TokenType.NORMAL)] * (len(tokens) - 3))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_chat_template(CHAT_TEMPLATE)


def _add(
    writer: gguf.GGUFWriter,
    name: str,
    weight: np.ndarray,
    quantization: gguf.GGMLQuantizationType,
) -> None:
    weight = np.ascontiguousarray(weight, dtype=np.float32)
    if weight.ndim == 1 or quantization == gguf.GGMLQuantizationType.F32:
        writer.add_tensor(name, weight)
        return
    writer.add_tensor(name, gguf.quants.quantize(weight, quantization), raw_dtype=quantization)
