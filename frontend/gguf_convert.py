"""Convert a GGUF file (llama.cpp's architectures llama (and Mixtral, llama with experts),
qwen2, qwen3, qwen2moe, qwen3moe, gemma2, gemma3, phi3, granite, smollm3, olmo2, gpt-oss,
glm4moe (GLM-4.5), deepseek2 (DeepSeek-V2 and V3), dots1 (dots.llm1), ernie4_5-moe (ERNIE 4.5
MoE), exaone4 (EXAONE 4.0), olmoe (OLMoE), minimax-m2 (MiniMax-M2), ernie4_5 (ERNIE 4.5 dense),
hunyuan-dense and hunyuan-moe (Tencent's Hunyuan), nemotron (Nemotron-4, Minitron), apertus
(Apertus) and llama4 (Llama 4 Scout and Maverick's language model)) into a local Hugging Face
model directory.

The engine loads plain float32 HF directories, so a GGUF file is converted once:

    model.gguf ──read──> metadata ──> config.json, generation_config.json
              └─dequantize, un-permute Llama's Q/K, split stacked experts (or restack
                gpt-oss's and Llama 4's), un-shift Gemma's and Nemotron's norms, rejoin
                DeepSeek's kv_b, drop multi-token-prediction blocks, turn Apertus's xIELU
                metadata back into weights──>
                model.safetensors or shards of it (float32, HF names)
              └─transformers' GGUF tokenizer converter──> tokenizer.json, chat_template.jinja, ...

Everything is written into a temporary directory beside the target and renamed into place at
the end, so an interrupted conversion (error, Ctrl-C) never leaves a half-written model where
a reader would find it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from safetensors.numpy import save_file

logger = logging.getLogger(__name__)

# The float32 weights go into files of about this many bytes each, so a conversion holds one
# file's tensors in memory, not the whole model's.
SHARD_BYTES = 2 << 30
# Bump whenever the converter's output changes: the resolver keys its cache on it, so old
# conversions are redone instead of being served stale.
CONVERTER_VERSION = 1


@dataclass(frozen=True)
class _Family:
    """How one of llama.cpp's architectures maps onto an HF one."""

    hf_architecture: str
    model_type: str
    # llama.cpp rotates adjacent pairs for Llama and interleaves each head's Q/K rows to
    # match (see _undo_rope_permutation); the Qwen families rotate halves, as HF does, and
    # their rows are stored as HF has them.
    permuted_qk: bool
    # The HF config field saying whether q/k/v have biases (None: the HF class always has
    # them, or never), set from whether the GGUF has them.
    bias_field: str | None
    # Mixture-of-experts: the config's expert fields, the stacked experts split apart.
    has_experts: bool = False
    # Whether the top-k routing weights are renormalised when the GGUF does not say
    # (llama.cpp's graph for the architecture; HF's config default for it).
    default_renormalize: bool = False
    # Gemma: its config fields, and names for some norms of its own.
    gemma: bool = False
    # Gemma and Nemotron: llama.cpp stores every norm's weight as 1 + w (its norms multiply by
    # the weight; HF's Gemma norms and Nemotron's LayerNorm1P multiply by 1 + w).
    one_plus_norms: bool = False
    layer_names: tuple[tuple[str, str], ...] = ()
    # Where HF keeps expert E's projections, and their names (llama.cpp's stacked tensor ->
    # HF's projection).
    expert_format: str = "mlp.experts.{expert}.{projection}"
    expert_projections: tuple[tuple[str, str], ...] = (
        ("ffn_gate_exps", "gate_proj"),
        ("ffn_up_exps", "up_proj"),
        ("ffn_down_exps", "down_proj"),
    )
    # The family's own names for the tensors of _UNSUFFIXED_LAYER_TENSOR_NAMES and
    # _GLOBAL_TENSOR_NAMES (GGUF name -> HF name), which override those.
    unsuffixed_names: tuple[tuple[str, str], ...] = ()
    global_names: tuple[tuple[str, str], ...] = ()


def _gemma_family(hf_architecture: str, model_type: str) -> _Family:
    """Gemma 2 and 3 have four norms a layer: llama.cpp's ffn_norm is HF's pre-feed-forward
    norm, not the post-attention one."""
    return _Family(
        hf_architecture,
        model_type,
        permuted_qk=False,
        bias_field="attention_bias",
        gemma=True,
        one_plus_norms=True,
        layer_names=(
            ("post_attention_norm", "post_attention_layernorm"),
            ("ffn_norm", "pre_feedforward_layernorm"),
            ("post_ffw_norm", "post_feedforward_layernorm"),
        ),
    )


# The norms after each sublayer (OLMo 2, EXAONE 4), llama.cpp's post_attention_norm and
# post_ffw_norm.
_POST_NORM_NAMES = (
    ("post_attention_norm", "post_attention_layernorm"),
    ("post_ffw_norm", "post_feedforward_layernorm"),
)
_FAMILIES = {
    "llama": _Family("LlamaForCausalLM", "llama", permuted_qk=True, bias_field="attention_bias"),
    "qwen2": _Family("Qwen2ForCausalLM", "qwen2", permuted_qk=False, bias_field=None),
    "qwen3": _Family("Qwen3ForCausalLM", "qwen3", permuted_qk=False, bias_field="attention_bias"),
    "qwen2moe": _Family(
        "Qwen2MoeForCausalLM",
        "qwen2_moe",
        permuted_qk=False,
        bias_field="qkv_bias",
        has_experts=True,
    ),
    "qwen3moe": _Family(
        "Qwen3MoeForCausalLM",
        "qwen3_moe",
        permuted_qk=False,
        bias_field="attention_bias",
        has_experts=True,
        default_renormalize=True,
    ),
    "gemma2": _gemma_family("Gemma2ForCausalLM", "gemma2"),
    "gemma3": _gemma_family("Gemma3ForCausalLM", "gemma3_text"),
    # Phi-3 / Phi-4: HF's fused qkv_proj and gate_up_proj kept fused (attn_qkv, ffn_up), its
    # halves-rotating RoPE (no permutation); LongRoPE's factors as tensors.
    "phi3": _Family(
        "Phi3ForCausalLM",
        "phi3",
        permuted_qk=False,
        bias_field=None,
        layer_names=(("attn_qkv", "self_attn.qkv_proj"), ("ffn_up", "mlp.gate_up_proj")),
    ),
    # Granite: llama.cpp's Llama (Q/K interleaved) with µP's four scalars as metadata.
    "granite": _Family(
        "GraniteForCausalLM", "granite", permuted_qk=True, bias_field="attention_bias"
    ),
    # SmolLM3: llama.cpp's Llama; its RoPE-less layers are llama.cpp's fixed every fourth.
    "smollm3": _Family(
        "SmolLM3ForCausalLM", "smollm3", permuted_qk=True, bias_field="attention_bias"
    ),
    # OLMo 2: no norm before a sublayer, one after each; q/k norms over all heads.
    "olmo2": _Family(
        "Olmo2ForCausalLM",
        "olmo2",
        permuted_qk=False,
        bias_field="attention_bias",
        layer_names=_POST_NORM_NAMES,
    ),
    # EXAONE 4: OLMo 2's post-norm layers with q/k norms per head, RoPE on halves (llama.cpp's
    # NEOX, as HF: no permutation); its window and global layers: _exaone4_config.
    "exaone4": _Family(
        "Exaone4ForCausalLM",
        "exaone4",
        permuted_qk=False,
        bias_field=None,
        layer_names=_POST_NORM_NAMES,
    ),
    # OLMoE: Llama's layers with RMSNorms over the whole query and key projections (kept whole
    # by llama.cpp, as HF has them), RoPE on halves (llama.cpp's NEOX, as HF: no permutation),
    # and experts in every layer under Qwen's names (_olmoe_config).
    "olmoe": _Family("OlmoeForCausalLM", "olmoe", permuted_qk=False, bias_field="attention_bias"),
}
# gpt-oss: biases and a sink per head on the attention, a router with a bias; the experts'
# stacked gate, up (or fused gate_up) and down tensors, MXFP4 in OpenAI's files, are
# restacked as HF keeps them (_gpt_oss_experts).
_GPT_OSS = _Family(
    "GptOssForCausalLM",
    "gpt_oss",
    permuted_qk=False,
    bias_field="attention_bias",
    layer_names=(
        ("post_attention_norm", "post_attention_layernorm"),
        ("attn_sinks", "self_attn.sinks"),
        ("ffn_gate_inp", "mlp.router"),
        ("ffn_gate_exps", "mlp.experts.gate"),
        ("ffn_up_exps", "mlp.experts.up"),
        ("ffn_gate_up_exps", "mlp.experts.gate_up"),
        ("ffn_down_exps", "mlp.experts.down"),
    ),
    expert_projections=(),
)
_FAMILIES["gpt-oss"] = _GPT_OSS


def _shared_mlp_names(module: str) -> tuple[tuple[str, str], ...]:
    """llama.cpp's shared-expert projections (``ffn_*_shexp``) under the HF ``module`` that
    holds them."""
    return tuple(
        (f"ffn_{projection}_shexp", f"{module}.{projection}_proj")
        for projection in ("gate", "up", "down")
    )


# DeepSeek's and GLM-4.5's shared experts: one MLP of n_shared_experts experts' rows, ungated.
_SHARED_EXPERTS_NAMES = _shared_mlp_names("mlp.shared_experts")
# GLM-4.5: Llama's attention with q/k/v biases and per-head q/k norms, RoPE over the first part
# of each head on halves (llama.cpp's NEOX, as HF: no permutation); post_attention_norm is
# HF's post_attention_layernorm (the FFN's input norm). llama.cpp appends the checkpoint's
# multi-token-prediction layer as an extra block (nextn_predict_layers), which is dropped.
_FAMILIES["glm4moe"] = _Family(
    "Glm4MoeForCausalLM",
    "glm4_moe",
    permuted_qk=False,
    bias_field="attention_bias",
    layer_names=(
        ("post_attention_norm", "post_attention_layernorm"),
        *_SHARED_EXPERTS_NAMES,
    ),
)
# DeepSeek-V2 / V3, both llama.cpp's deepseek2: multi-head latent attention, RoPE on adjacent
# pairs in both (llama.cpp's NORM; HF's V2 and V3's rope_interleave: no permutation). Newer
# llama.cpp splits HF's kv_b_proj into attn_k_b (per head, transposed) and attn_v_b
# (_joined_kv_b puts them back). V3 is the file whose router scores by sigmoid.
_DEEPSEEK_LAYER_NAMES = (
    ("attn_q_a", "self_attn.q_a_proj"),
    ("attn_q_a_norm", "self_attn.q_a_layernorm"),
    ("attn_q_b", "self_attn.q_b_proj"),
    ("attn_kv_a_mqa", "self_attn.kv_a_proj_with_mqa"),
    ("attn_kv_a_norm", "self_attn.kv_a_layernorm"),
    ("attn_kv_b", "self_attn.kv_b_proj"),
    # Interim names, joined into kv_b_proj by _joined_kv_b.
    ("attn_k_b", "self_attn.k_b_proj"),
    ("attn_v_b", "self_attn.v_b_proj"),
    *_SHARED_EXPERTS_NAMES,
)
_DEEPSEEK_V2 = _Family(
    "DeepseekV2ForCausalLM",
    "deepseek_v2",
    permuted_qk=False,
    bias_field=None,
    layer_names=_DEEPSEEK_LAYER_NAMES,
)
_DEEPSEEK_V3 = _Family(
    "DeepseekV3ForCausalLM",
    "deepseek_v3",
    permuted_qk=False,
    bias_field=None,
    layer_names=_DEEPSEEK_LAYER_NAMES,
)
_FAMILIES["deepseek2"] = _DEEPSEEK_V2
# dots.llm1: Qwen3's attention (q/k norms per head, RoPE on halves as HF: no permutation) with
# DeepSeek-V3's experts (_dots1_config).
_FAMILIES["dots1"] = _Family(
    "Dots1ForCausalLM",
    "dots1",
    permuted_qk=False,
    bias_field="attention_bias",
    layer_names=_SHARED_EXPERTS_NAMES,
)
# ERNIE 4.5 MoE: RoPE on adjacent pairs in both llama.cpp (NORM) and HF, so no permutation;
# use_bias puts biases on the attention, the dense and shared MLPs and the LM head. The
# router's selection bias is HF's moe_statics, [1, experts] (_ernie4_5_moe_config).
_FAMILIES["ernie4_5-moe"] = _Family(
    "Ernie4_5_MoeForCausalLM",
    "ernie4_5_moe",
    permuted_qk=False,
    bias_field="use_bias",
    layer_names=_SHARED_EXPERTS_NAMES,
    unsuffixed_names=(("exp_probs_b.bias", "mlp.moe_statics.e_score_correction_bias"),),
    global_names=(("output.bias", "lm_head.bias"),),
)
# llama.cpp converts Mixtral as "llama" with experts: HF's Mixtral names, w1 / w3 / w2.
_MIXTRAL = _Family(
    "MixtralForCausalLM",
    "mixtral",
    permuted_qk=True,
    bias_field=None,
    has_experts=True,
    default_renormalize=True,
    layer_names=(("ffn_gate_inp", "block_sparse_moe.gate"),),
    expert_format="block_sparse_moe.experts.{expert}.{projection}",
    expert_projections=(("ffn_gate_exps", "w1"), ("ffn_up_exps", "w3"), ("ffn_down_exps", "w2")),
)
# MiniMax-M2: OLMoE's whole-projection q/k norms, RoPE on halves over the first
# rope.dimension_count values of each head (llama.cpp's NEOX, as HF: no permutation), and in
# every layer Mixtral's experts under a sigmoid router whose selection bias (exp_probs_b) is
# HF's block_sparse_moe.e_score_correction_bias (_minimax_m2_config).
_FAMILIES["minimax-m2"] = _Family(
    "MiniMaxM2ForCausalLM",
    "minimax_m2",
    permuted_qk=False,
    bias_field=None,
    layer_names=_MIXTRAL.layer_names,
    expert_format=_MIXTRAL.expert_format,
    expert_projections=_MIXTRAL.expert_projections,
    unsuffixed_names=(("exp_probs_b.bias", "block_sparse_moe.e_score_correction_bias"),),
)
# ERNIE 4.5 (the dense models): Llama whose RoPE rotates adjacent pairs in both llama.cpp (NORM)
# and HF, so no permutation; use_bias puts biases on every projection, not on the LM head
# (_check_ernie4_5_biases).
_FAMILIES["ernie4_5"] = _Family(
    "Ernie4_5ForCausalLM", "ernie4_5", permuted_qk=False, bias_field="use_bias"
)
# Hunyuan: Llama with an RMSNorm over each query and key head after RoPE, which rotates halves
# (llama.cpp's NEOX, as HF: no permutation); HF names the norms query_ / key_layernorm. The MoE
# models put experts beside a shared MLP in every layer, under HF's own router and shared-MLP
# names (_hunyuan_config).
_HUNYUAN_QK_NORM_NAMES = (
    ("attn_q_norm", "self_attn.query_layernorm"),
    ("attn_k_norm", "self_attn.key_layernorm"),
)
_FAMILIES["hunyuan-dense"] = _Family(
    "HunYuanDenseV1ForCausalLM",
    "hunyuan_v1_dense",
    permuted_qk=False,
    bias_field="attention_bias",
    layer_names=_HUNYUAN_QK_NORM_NAMES,
)
_FAMILIES["hunyuan-moe"] = _Family(
    "HunYuanMoEV1ForCausalLM",
    "hunyuan_v1_moe",
    permuted_qk=False,
    bias_field="attention_bias",
    layer_names=(
        *_HUNYUAN_QK_NORM_NAMES,
        ("ffn_gate_inp", "mlp.gate.wg"),
        *_shared_mlp_names("mlp.shared_mlp"),
    ),
)
# Nemotron: LayerNorm1P (a LayerNorm with a bias, scaled by 1 + w, which llama.cpp stores as
# 1 + w), RoPE on halves over the first rope.dimension_count values of each head (llama.cpp's
# NEOX, as HF: no permutation), an ungated squared-ReLU MLP (_nemotron_config).
_FAMILIES["nemotron"] = _Family(
    "NemotronForCausalLM",
    "nemotron",
    permuted_qk=False,
    bias_field="attention_bias",
    one_plus_norms=True,
    global_names=(("output_norm.bias", "model.norm.bias"),),
)
# Apertus: Llama with per-head q/k norms before RoPE on halves (llama.cpp's NEOX, as HF: no
# permutation), its norms under its own names, and an ungated MLP whose xIELU activation's
# scalars llama.cpp keeps as metadata, one per layer (_apertus_config, _xielu_tensors).
_FAMILIES["apertus"] = _Family(
    "ApertusForCausalLM",
    "apertus",
    permuted_qk=False,
    bias_field="attention_bias",
    layer_names=(("attn_norm", "attention_layernorm"), ("ffn_norm", "feedforward_layernorm")),
)
# Llama 4: RoPE on adjacent pairs in both llama.cpp (NORM) and HF, so no permutation; its
# feed-forward block under HF's feed_forward names: a dense MLP, or a sigmoid router over
# stacked experts beside one ungated shared expert. llama.cpp's converter splits HF's gate_up
# into gate and up and transposes both and the down; _llama4_experts restacks them
# (_llama4_config: what llama.cpp fixes rather than stores).
_LLAMA4 = _Family(
    "Llama4ForCausalLM",
    "llama4_text",
    permuted_qk=False,
    bias_field="attention_bias",
    layer_names=(
        ("ffn_gate", "feed_forward.gate_proj"),
        ("ffn_up", "feed_forward.up_proj"),
        ("ffn_down", "feed_forward.down_proj"),
        ("ffn_gate_inp", "feed_forward.router"),
        *_shared_mlp_names("feed_forward.shared_expert"),
        # Interim names, restacked by _llama4_experts.
        ("ffn_gate_exps", "feed_forward.experts.gate"),
        ("ffn_up_exps", "feed_forward.experts.up"),
        ("ffn_down_exps", "feed_forward.experts.down"),
    ),
    expert_projections=(),
)
_FAMILIES["llama4"] = _LLAMA4
SUPPORTED_ARCHITECTURES = tuple(_FAMILIES)
# The architectures whose RoPE may rotate part of each head (rope.dimension_count).
_PARTIAL_ROTARY = ("phi3", "glm4moe", "minimax-m2", "nemotron")
_HUNYUAN = ("hunyuan-dense", "hunyuan-moe")
# llama.cpp's expert_gating_func values: DeepSeek-V2's and OLMoE's softmax router (llama.cpp's
# default for deepseek2, and fixed for olmoe), DeepSeek-V3's, GLM-4.5's, MiniMax-M2's and
# Llama 4's sigmoid one.
_SOFTMAX = int(gguf.ExpertGatingFuncType.SOFTMAX)
_SIGMOID = int(gguf.ExpertGatingFuncType.SIGMOID)
_FAMILIES_BY_HF = {
    family.hf_architecture: family for family in (*_FAMILIES.values(), _MIXTRAL, _DEEPSEEK_V3)
}
_FAMILIES_BY_HF["Olmo3ForCausalLM"] = _FAMILIES["olmo2"]  # llama.cpp writes OLMo 3 as olmo2

# GGUF per-layer tensor name (after "blk.N.", before ".weight" / ".bias") -> HF name (after
# "model.layers.N.", likewise).
_LAYER_TENSOR_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    # Qwen3: an RMSNorm over each query and key head.
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # Mixture-of-experts: the router, and Qwen2-MoE's shared expert and its gate.
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# GGUF per-layer tensors whose HF name has no .weight / .bias: DeepSeek-V3's, GLM-4.5's and
# dots.llm1's router bias, which only steers the choice of experts (a buffer in HF).
_UNSUFFIXED_LAYER_TENSOR_NAMES = {"exp_probs_b.bias": "mlp.gate.e_score_correction_bias"}
# Llama 3's per-frequency RoPE divisors, which llama.cpp stores as a tensor.
_ROPE_FREQS_TENSOR = "rope_freqs.weight"
# Phi-3's LongRoPE factors (llama.cpp's rope_factors_long / _short), also no weights.
_ROPE_FACTOR_TENSORS = {
    "rope_factors_long.weight": "long_factor",
    "rope_factors_short.weight": "short_factor",
}
_GLOBAL_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclass(frozen=True)
class ConversionProgress:
    """One progress event: `stage` is reading, dequantizing, writing, tokenizer or done;
    `done`/`total` count tensors while dequantizing and are 0 otherwise."""

    stage: str
    done: int
    total: int
    elapsed_s: float

    def __str__(self) -> str:
        count = f" {self.done}/{self.total} tensors" if self.total else ""
        return f"{self.stage}{count} ({self.elapsed_s:.1f} s)"


ProgressCallback = Callable[[ConversionProgress], None]


class _Reporter:
    """Sends each progress event to the logger and to the caller's callback."""

    def __init__(self, gguf_name: str, callback: ProgressCallback | None) -> None:
        self._gguf_name = gguf_name
        self._callback = callback
        self._start = time.perf_counter()

    def __call__(self, stage: str, done: int = 0, total: int = 0) -> None:
        event = ConversionProgress(stage, done, total, time.perf_counter() - self._start)
        logger.info("converting %s: %s", self._gguf_name, event)
        if self._callback is not None:
            self._callback(event)


def convert_gguf(
    gguf_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    progress: ProgressCallback | None = None,
) -> Path:
    """Convert `gguf_path` into the HF model directory `out_dir` and return `out_dir`.

    `out_dir` must not exist yet; it appears complete or not at all. If another process
    finishes the same `out_dir` first, its result is kept and ours is discarded.
    Raises ValueError for a GGUF whose architecture or layout this converter does not support.
    """
    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    report = _Reporter(gguf_path.name, progress)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Dot-prefixed and uniquely suffixed: never a cache entry's name, and hidden from `ls`.
    partial_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    try:
        _convert_into(gguf_path, partial_dir, report)
        _publish(partial_dir, out_dir)
    finally:
        # BaseException included: a Ctrl-C mid-conversion must not leave the partial dir behind.
        shutil.rmtree(partial_dir, ignore_errors=True)
    report("done")
    return out_dir


def _convert_into(gguf_path: Path, out_dir: Path, report: _Reporter) -> None:
    report("reading")
    reader = gguf.GGUFReader(gguf_path)
    fields = {name: field.contents() for name, field in reader.fields.items()}
    rope_freqs = next(
        (tensor.data for tensor in reader.tensors if tensor.name == _ROPE_FREQS_TENSOR), None
    )
    rope_factors = {
        _ROPE_FACTOR_TENSORS[tensor.name]: [float(value) for value in tensor.data]
        for tensor in reader.tensors
        if tensor.name in _ROPE_FACTOR_TENSORS
    }
    config = _hf_config(fields, _tensor_shapes(reader), rope_freqs, rope_factors)
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", _generation_config(config, fields))
    _write_weights(_dequantized_tensors(reader, config, report), out_dir, report)

    report("tokenizer")
    _write_tokenizer(gguf_path, out_dir, fields, config["max_position_embeddings"])
    _make_readable(out_dir)


def _publish(partial_dir: Path, out_dir: Path) -> None:
    try:
        partial_dir.rename(out_dir)
    except OSError:
        # A concurrent conversion of the same file won the race; both results are identical.
        if not (out_dir / "config.json").is_file():
            raise
        logger.info("%s was converted concurrently; keeping that copy", out_dir)


def _hf_config(
    fields: dict[str, Any],
    tensor_shapes: dict[str, tuple[int, ...]],
    rope_freqs: np.ndarray | None = None,
    rope_factors: dict[str, list[float]] | None = None,
) -> dict[str, Any]:
    """config.json from the GGUF's metadata, and from its tensors where llama.cpp keeps a
    setting only in their presence or shape (biases, a tied LM head, experts) or values
    (Llama 3's RoPE divisors, Phi-3's LongRoPE factors)."""
    architecture = fields.get("general.architecture")
    if architecture not in _FAMILIES:
        raise ValueError(
            f"GGUF architecture {architecture!r} is not supported; "
            f"supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    family = _FAMILIES[architecture]
    if architecture == "llama" and any(
        name.endswith(".ffn_gate_inp.weight") for name in tensor_shapes
    ):
        family = _MIXTRAL

    def key(name: str, default: Any = None) -> Any:
        return fields.get(f"{architecture}.{name}", default)

    if architecture == "deepseek2" and key("expert_gating_func") == _SIGMOID:
        family = _DEEPSEEK_V3
    hidden_size = int(key("embedding_length"))
    num_heads = int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", hidden_size // num_heads))
    rope_dim = int(key("rope.dimension_count", head_dim))
    # deepseek2's key_length is no head's size (_deepseek2_config reads its sizes).
    if rope_dim != head_dim and architecture not in (*_PARTIAL_ROTARY, "deepseek2"):
        raise ValueError(
            f"GGUF rope.dimension_count={rope_dim} differs from head_dim={head_dim}; partial "
            f"rotary embeddings are supported for {', '.join(_PARTIAL_ROTARY)} only, not "
            f"{architecture}"
        )
    # The embedding's rows: llama.cpp drops Gemma 3's rows past the tokenizer's vocabulary.
    vocab_size = tensor_shapes["token_embd.weight"][0]
    rope_theta = _float32_value(key("rope.freq_base", 10000.0))
    # llama.cpp appends a checkpoint's multi-token-prediction layers as the last blocks.
    num_layers = int(key("block_count")) - int(key("nextn_predict_layers", 0))
    config: dict[str, Any] = {
        "architectures": [family.hf_architecture],
        "model_type": family.model_type,
        "vocab_size": int(vocab_size),
        "hidden_size": hidden_size,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(key("attention.head_count_kv", num_heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(key("context_length")),
        "rms_norm_eps": _float32_value(key("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": rope_theta,
    }
    if family.bias_field is not None:
        config[family.bias_field] = "blk.0.attn_q.bias" in tensor_shapes
    if architecture == "llama":
        config["mlp_bias"] = False
    if family is _MIXTRAL:
        config.update(_mixtral_config(key, tensor_shapes))
    elif family.has_experts:
        config.update(_experts_config(family, key, tensor_shapes, num_layers))
    if family.gemma:
        config.update(_gemma_config(architecture, key, config))
    if architecture == "phi3":
        config.update(_phi3_config(key, rope_dim, head_dim))
    if architecture == "granite":
        config.update(_granite_config(key, head_dim))
    if architecture == "smollm3":
        # llama.cpp fixes SmolLM3's step of RoPE-less layers (n_no_rope_layer_step) at 4.
        config.update(no_rope_layer_interval=4, use_sliding_window=False)
    if architecture == "olmo2" and key("attention.sliding_window") is not None:
        # OLMo 3, which llama.cpp writes as olmo2 with its window and which layers slide.
        config.update(_olmo3_config(key, num_layers))
    if architecture == "gpt-oss":
        config.update(_gpt_oss_config(key, tensor_shapes))
    if architecture == "glm4moe":
        config.update(_glm4_moe_config(key, tensor_shapes, num_layers, rope_dim, head_dim))
    if architecture == "deepseek2":
        config.update(_deepseek2_config(family, key, tensor_shapes, num_layers, num_heads))
    if architecture == "dots1":
        config.update(_dots1_config(key, tensor_shapes, num_layers))
    if architecture == "ernie4_5-moe":
        config.update(_ernie4_5_moe_config(key, tensor_shapes, num_layers))
    if architecture == "exaone4":
        config.update(_exaone4_config(key, num_layers))
    if architecture == "olmoe":
        config.update(_olmoe_config(key, tensor_shapes, num_layers))
    if architecture == "minimax-m2":
        config.update(_minimax_m2_config(key, tensor_shapes, num_layers, rope_dim))
    if architecture == "ernie4_5":
        _check_ernie4_5_biases(tensor_shapes, num_layers)
    if architecture in _HUNYUAN:
        config.update(_hunyuan_config(architecture, key, tensor_shapes, num_layers, head_dim))
    if architecture == "nemotron":
        # LayerNorms, whose epsilon is norm_eps (_nemotron_config), not an RMSNorm's.
        del config["rms_norm_eps"]
        config.update(_nemotron_config(key, tensor_shapes, num_layers, rope_dim, head_dim))
    if architecture == "apertus":
        config.update(_apertus_config(fields, tensor_shapes, num_layers, head_dim))
    if architecture == "llama4":
        config.update(_llama4_config(key, tensor_shapes, num_layers, rope_theta))
    config.update(
        {
            # Without output.weight, llama.cpp reuses the embedding matrix as the LM head.
            "tie_word_embeddings": "output.weight" not in tensor_shapes,
            "bos_token_id": _optional_int(fields.get("tokenizer.ggml.bos_token_id")),
            "eos_token_id": _optional_int(fields.get("tokenizer.ggml.eos_token_id")),
            "pad_token_id": _optional_int(fields.get("tokenizer.ggml.padding_token_id")),
            # transformers 5 reads "dtype"; older readers (and other engines) read
            # "torch_dtype".
            "torch_dtype": "float32",
            "dtype": "float32",
        }
    )
    if config["architectures"] == ["Olmo3ForCausalLM"]:
        # The full layers' scaling, as the Hub's OLMo 3 configs write it (top-level
        # rope_scaling and rope_theta; Olmo3Config gives the sliding layers plain RoPE).
        rope_scaling = _rope_scaling(key)
        if rope_scaling is not None:
            # llama.cpp's OLMo 3 converter writes the config's YaRN attention factor.
            attention_factor = key("rope.scaling.attn_factor")
            if attention_factor is not None:
                rope_scaling["attention_factor"] = _float32_value(attention_factor)
            config["rope_scaling"] = rope_scaling
        return config
    if architecture == "gpt-oss":
        # llama.cpp writes YaRN's factor and original context, and fixes the rest to
        # gpt-oss's (its config's beta_fast 32, beta_slow 1, no truncation).
        rope_scaling = {
            **(_rope_scaling(key) or {}),
            "beta_fast": _float32_value(key("rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": _float32_value(key("rope.scaling.yarn_beta_slow", 1.0)),
            "truncate": False,
        }
    elif architecture == "deepseek2":
        rope_scaling = _deepseek2_rope_scaling(key)
    elif rope_freqs is not None:
        rope_scaling = _llama3_rope_scaling(architecture, rope_freqs, rope_theta, head_dim)
    elif rope_factors:
        rope_scaling = _longrope_scaling(architecture, rope_factors)
    elif architecture in _HUNYUAN:
        rope_scaling = _hunyuan_rope_scaling(architecture, key)
    else:
        rope_scaling = _rope_scaling(key)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    # transformers 5 keeps RoPE settings in rope_parameters; the legacy keys above stay for
    # readers that predate it.
    config["rope_parameters"] = {
        "rope_type": "default",
        **(rope_scaling or {}),
        "rope_theta": rope_theta,
    }
    if architecture == "glm4moe":
        # transformers 5 reads the rotated share there; older readers at the top level.
        config["rope_parameters"]["partial_rotary_factor"] = config["partial_rotary_factor"]
    if architecture == "minimax-m2":
        # As transformers 5 saves MiniMax-M2's: the share there, rotary_dim at the top level.
        config["rope_parameters"]["partial_rotary_factor"] = rope_dim / head_dim
    if architecture == "nemotron":
        # transformers 5 reads the rotated share there; older readers at the top level.
        config["rope_parameters"]["partial_rotary_factor"] = config["partial_rotary_factor"]
    if architecture == "gemma3":
        # Gemma 3's global layers take the GGUF's RoPE base and scaling; llama.cpp gives its
        # sliding layers a base of 10000 and no scaling, as HF's Gemma 3 does by default.
        config["rope_local_base_freq"] = _GEMMA3_LOCAL_ROPE_THETA
        config["rope_parameters"] = {
            "full_attention": config["rope_parameters"],
            "sliding_attention": {"rope_type": "default", "rope_theta": _GEMMA3_LOCAL_ROPE_THETA},
        }
    return config


# What llama.cpp fixes for Gemma 2 / 3 rather than reading from the file (llama-model.cpp):
# the 27B models (46 and 62 layers) scale attention by (hidden / heads) ** -0.5, the others by
# head_dim ** -0.5; Gemma 2 alternates sliding and global layers, Gemma 3 makes every sixth
# global; Gemma 3's sliding layers rotate with base 10000.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_GEMMA3_GLOBAL_EVERY = 6
_GEMMA3_LOCAL_ROPE_THETA = 10000.0


def _gemma_config(
    architecture: str, key: Callable[..., Any], config: dict[str, Any]
) -> dict[str, Any]:
    gelu = "gelu_pytorch_tanh"
    num_layers = config["num_hidden_layers"]
    query_pre_attn_scalar = config["head_dim"]
    if num_layers == _GEMMA_27B_LAYERS[architecture]:
        query_pre_attn_scalar = config["hidden_size"] // config["num_attention_heads"]
    if architecture == "gemma2":
        layer_types = [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)
        ]
    else:
        layer_types = [
            "full_attention" if (i + 1) % _GEMMA3_GLOBAL_EVERY == 0 else "sliding_attention"
            for i in range(num_layers)
        ]
    sliding_window = key("attention.sliding_window")
    if sliding_window is None:
        raise ValueError(
            f"GGUF has no {architecture}.attention.sliding_window, which every "
            f"{architecture} model has (its sliding layers' window)"
        )
    soft_caps = {
        name: None if key(name) is None else _float32_value(key(name))
        for name in ("attn_logit_softcapping", "final_logit_softcapping")
    }
    return {
        "hidden_act": gelu,
        "hidden_activation": gelu,
        "query_pre_attn_scalar": query_pre_attn_scalar,
        "sliding_window": int(sliding_window),
        "layer_types": layer_types,
        **soft_caps,
    }


def _phi3_config(key: Callable[..., Any], rope_dim: int, head_dim: int) -> dict[str, Any]:
    """What llama.cpp's Phi-3 converter writes besides Llama's keys: the pretraining context
    (LongRoPE's original), the rotated share of each head, and the sliding window (0 for
    Phi-4, which has none)."""
    config: dict[str, Any] = {
        "original_max_position_embeddings": int(
            key("rope.scaling.original_context_length", key("context_length"))
        ),
        "sliding_window": int(key("attention.sliding_window", 0)) or None,
    }
    if rope_dim != head_dim:
        config["partial_rotary_factor"] = rope_dim / head_dim
    return config


def _olmo3_config(key: Callable[..., Any], num_layers: int) -> dict[str, Any]:
    """An olmo2 file with a sliding window is OLMo 3: its window and the layers that slide."""
    return {
        "architectures": ["Olmo3ForCausalLM"],
        "model_type": "olmo3",
        "sliding_window": int(key("attention.sliding_window")),
        "layer_types": _sliding_layer_types("olmo2", key, num_layers),
    }


def _exaone4_config(key: Callable[..., Any], num_layers: int) -> dict[str, Any]:
    """EXAONE 4: with a window (EXAONE 4.0 32B), the layers that slide; the others are global
    and rotate nothing, which HF's Exaone4 (and the engine) derive from the window being set.
    Without one (1.2B) every layer attends in full and rotates. The window and layer kinds
    written here are what llama.cpp's converter recorded from the HF config; llama.cpp itself
    windows only a 64-layer model (every fourth layer global) and rotates every layer of the
    others, whatever the file says."""
    window = key("attention.sliding_window")
    if window is None:
        return {"sliding_window": None, "layer_types": ["full_attention"] * num_layers}
    return {
        "sliding_window": int(window),
        "layer_types": _sliding_layer_types("exaone4", key, num_layers),
    }


def _sliding_layer_types(architecture: str, key: Callable[..., Any], num_layers: int) -> list[str]:
    """HF's layer_types from llama.cpp's sliding_window_pattern: one flag per layer, true for
    the layers that slide, as llama.cpp's converters write it from HF's layer_types."""
    pattern = key("attention.sliding_window_pattern")
    if not isinstance(pattern, list) or len(pattern) != num_layers:
        raise ValueError(
            f"GGUF {architecture} file with a sliding window needs "
            f"attention.sliding_window_pattern, one flag per layer ({num_layers}), "
            f"got {pattern!r:.100}"
        )
    return ["sliding_attention" if sliding else "full_attention" for sliding in pattern]


def _granite_config(key: Callable[..., Any], head_dim: int) -> dict[str, Any]:
    """Granite's four scalars, which llama.cpp names *_scale and writes only when set; an
    attention scale it lacks means 1/sqrt(head size) to llama.cpp (HF's default is 1.0)."""
    attention_scale = key("attention.scale")
    return {
        "attention_multiplier": (
            _float32_value(attention_scale) if attention_scale else head_dim**-0.5
        ),
        "embedding_multiplier": _float32_value(key("embedding_scale") or 1.0),
        "residual_multiplier": _float32_value(key("residual_scale") or 1.0),
        "logits_scaling": _float32_value(key("logit_scale") or 1.0),
        "mlp_bias": False,
    }


def _longrope_scaling(architecture: str, factors: dict[str, list[float]]) -> dict[str, Any]:
    """Phi-3's LongRoPE from llama.cpp's factor tensors (both or neither); the attention
    factor is left for the reader to derive from the two contexts, as HF does."""
    if architecture != "phi3" or set(factors) != {"long_factor", "short_factor"}:
        raise ValueError(
            f"GGUF rope factor tensors ({', '.join(sorted(factors))}) are supported for phi3 "
            f"with both rope_factors_long and rope_factors_short, not {architecture}"
        )
    return {
        "rope_type": "longrope",
        "long_factor": [_float32_value(value) for value in factors["long_factor"]],
        "short_factor": [_float32_value(value) for value in factors["short_factor"]],
    }


def _experts_config(
    family: _Family,
    key: Callable[..., Any],
    tensor_shapes: dict[str, tuple[int, ...]],
    num_layers: int,
) -> dict[str, Any]:
    """Qwen2-MoE / Qwen3-MoE's expert fields. The sizes come from the tensors (a layer with
    a router is sparse; llama.cpp has no key for dense layers), the routing from the keys."""
    sparse = [i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" in tensor_shapes]
    if not sparse:
        raise ValueError(
            f"GGUF architecture {family.model_type!r} has no expert router (ffn_gate_inp) in "
            "any layer"
        )
    top_k = key("expert_used_count")
    if top_k is None:
        raise ValueError("GGUF has experts but no expert_used_count (the experts per token)")
    num_experts, moe_intermediate_size, _ = tensor_shapes[f"blk.{sparse[0]}.ffn_gate_exps.weight"]
    config: dict[str, Any] = {
        "num_experts": num_experts,
        "num_experts_per_tok": int(top_k),
        "moe_intermediate_size": moe_intermediate_size,
        "norm_topk_prob": bool(key("expert_weights_norm", family.default_renormalize)),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(num_layers) if i not in sparse],
    }
    shared_gate = tensor_shapes.get(f"blk.{sparse[0]}.ffn_gate_shexp.weight")
    if shared_gate is not None:
        config["shared_expert_intermediate_size"] = shared_gate[0]
    return config


def _glm4_moe_config(
    key: Callable[..., Any],
    tensor_shapes: dict[str, tuple[int, ...]],
    num_layers: int,
    rope_dim: int,
    head_dim: int,
) -> dict[str, Any]:
    """GLM-4.5: RoPE over rope.dimension_count of each head, q/k norms when the file has them,
    and its sigmoid router (llama.cpp's default for glm4moe); the multi-token-prediction layer
    is not converted."""
    gating = key("expert_gating_func", _SIGMOID)
    if gating != _SIGMOID:
        raise ValueError(
            f"GGUF glm4moe expert_gating_func={gating} is not supported; supported: "
            f"{_SIGMOID} (sigmoid, GLM-4.5's router)"
        )
    return {
        "partial_rotary_factor": rope_dim / head_dim,
        "use_qk_norm": "blk.0.attn_q_norm.weight" in tensor_shapes,
        "num_nextn_predict_layers": 0,
        **_routed_experts_config("glm4moe", key, tensor_shapes, num_layers, sigmoid=True),
    }


def _deepseek2_config(
    family: _Family,
    key: Callable[..., Any],
    tensor_shapes: dict[str, tuple[int, ...]],
    num_layers: int,
    num_heads: int,
) -> dict[str, Any]:
    """DeepSeek-V2 / V3: the latent attention's sizes and the router. Since its MLA support
    llama.cpp writes the heads' sizes as key_length_mla / value_length_mla (key_length and
    value_length then describe the latent it caches, and head_count_kv is 1); older files
    give them as key_length / value_length. V3 routes by sigmoid over groups, V2 by softmax
    (llama.cpp's default when the file does not say), over groups when it has more than one."""
    rope_dim = int(key("rope.dimension_count"))
    kv_lora_rank = int(key("attention.kv_lora_rank"))
    if key("attention.key_length_mla") is not None:
        key_dim = int(key("attention.key_length_mla"))
        value_dim = int(key("attention.value_length_mla"))
    else:
        key_dim, value_dim = int(key("attention.key_length")), int(key("attention.value_length"))
    latent_rows = tensor_shapes["blk.0.attn_kv_a_mqa.weight"][0]
    if latent_rows != kv_lora_rank + rope_dim:
        raise ValueError(
            f"GGUF deepseek2 attn_kv_a_mqa has {latent_rows} rows; expected kv_lora_rank "
            f"{kv_lora_rank} + rope.dimension_count {rope_dim}"
        )
    gating = key("expert_gating_func")
    if gating not in (None, _SOFTMAX, _SIGMOID):
        raise ValueError(
            f"GGUF deepseek2 expert_gating_func={gating} is not supported; supported: "
            f"{_SOFTMAX} (softmax, DeepSeek-V2) and {_SIGMOID} (sigmoid, DeepSeek-V3)"
        )
    low_rank_query = tensor_shapes.get("blk.0.attn_q_a.weight")
    v3 = family is _DEEPSEEK_V3
    config: dict[str, Any] = {
        # HF expands a key and a value per head from the latent.
        "num_key_value_heads": num_heads,
        # HF's DeepSeek configs: the rotated part's size, which their RoPE reads.
        "head_dim": rope_dim,
        "q_lora_rank": None if low_rank_query is None else low_rank_query[0],
        "kv_lora_rank": kv_lora_rank,
        "qk_nope_head_dim": key_dim - rope_dim,
        "qk_rope_head_dim": rope_dim,
        "v_head_dim": value_dim,
        # HF's attention_bias: biases on q_a_proj, kv_a_proj_with_mqa and o_proj (llama.cpp's
        # converter writes none; a file that has them gets them as HF names them).
        "attention_bias": "blk.0.attn_kv_a_mqa.bias" in tensor_shapes,
        **_routed_experts_config("deepseek2", key, tensor_shapes, num_layers, sigmoid=v3),
    }
    if v3:
        config.update(rope_interleave=True, num_nextn_predict_layers=0)
    else:
        config["topk_method"] = "group_limited_greedy" if config["n_group"] > 1 else "greedy"
    return config


def _dots1_config(
    key: Callable[..., Any], tensor_shapes: dict[str, tuple[int, ...]], num_layers: int
) -> dict[str, Any]:
    """dots.llm1: DeepSeek-V3's experts (_routed_experts_config) under a sigmoid router with a
    selection bias, the only router HF's Dots1 has, so a file that does not name its gating
    function is read as that one (llama.cpp's first dots1 converter wrote it; llama.cpp will
    not run a dots1 file without it). No layer slides: llama.cpp's converter keeps no window
    for dots1 and llama.cpp attends in full everywhere, so the config says so explicitly
    (Dots1Config's defaults would window the layers from max_window_layers on)."""
    gating = key("expert_gating_func", _SIGMOID)
    if gating != _SIGMOID:
        raise ValueError(
            f"GGUF dots1 expert_gating_func={gating} is not supported; supported: {_SIGMOID} "
            "(sigmoid, dots.llm1's router)"
        )
    return {
        "sliding_window": None,
        "max_window_layers": num_layers,
        "layer_types": ["full_attention"] * num_layers,
        **_routed_experts_config("dots1", key, tensor_shapes, num_layers, sigmoid=True),
    }


def _ernie4_5_moe_config(
    key: Callable[..., Any], tensor_shapes: dict[str, tuple[int, ...]], num_layers: int
) -> dict[str, Any]:
    """ERNIE 4.5 MoE: experts at the layers from leading_dense_block_count (HF's
    moe_layer_start_index) whose number + 1 is a multiple of interleave_moe_layer_step
    (moe_layer_interval), up to the last layer with a router (llama.cpp keeps no
    moe_layer_end_index; the tensors show where the experts stop); a softmax router with a
    selection bias per expert, top-k renormalised (llama.cpp fixes that router for ERNIE);
    beside the experts expert_shared_count experts' rows as one shared MLP. The shared size
    llama.cpp writes (intermediate_size / KV heads) is not read: the tensors give it."""
    start, interval = key("leading_dense_block_count"), key("interleave_moe_layer_step")
    if start is None or interval is None or int(interval) < 1:
        raise ValueError(
            "GGUF ernie4_5-moe needs leading_dense_block_count and interleave_moe_layer_step "
            f">= 1 (where the experts are), got {start!r} and {interval!r}"
        )
    start, interval = int(start), int(interval)
    sparse = [i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" in tensor_shapes]
    last = sparse[-1] if sparse else -1
    expected = [i for i in range(start, last + 1) if (i + 1) % interval == 0]
    if not sparse or sparse != expected:
        raise ValueError(
            f"GGUF ernie4_5-moe has an expert router (ffn_gate_inp) in layers {sparse}; "
            f"expected the layers from leading_dense_block_count={start} whose number + 1 is "
            f"a multiple of interleave_moe_layer_step={interval}"
        )
    unbiased = [i for i in sparse if f"blk.{i}.exp_probs_b.bias" not in tensor_shapes]
    if unbiased:
        raise ValueError(
            f"GGUF ernie4_5-moe has no router selection bias (exp_probs_b) in layers "
            f"{unbiased}; every ERNIE 4.5 router has one"
        )
    top_k = key("expert_used_count")
    if top_k is None:
        raise ValueError("GGUF has experts but no expert_used_count (the experts per token)")
    first = sparse[0]
    num_experts, moe_intermediate_size, _ = tensor_shapes[f"blk.{first}.ffn_gate_exps.weight"]
    num_shared = int(key("expert_shared_count", 0))
    shared_rows = tensor_shapes.get(f"blk.{first}.ffn_gate_shexp.weight", (0,))[0]
    if shared_rows != num_shared * moe_intermediate_size:
        raise ValueError(
            f"GGUF ernie4_5-moe shared experts (ffn_gate_shexp) have {shared_rows} rows; "
            f"expected expert_shared_count={num_shared} x {moe_intermediate_size}"
        )
    biased = "blk.0.attn_q.bias" in tensor_shapes
    if ("output.bias" in tensor_shapes) != biased:
        raise ValueError(
            f"GGUF ernie4_5-moe has {'' if biased else 'no '}attention biases but "
            f"{'no' if biased else 'an'} LM-head bias (output.bias); HF's use_bias gives "
            "both or neither"
        )
    return {
        "moe_num_experts": num_experts,
        "moe_k": int(top_k),
        "moe_intermediate_size": moe_intermediate_size,
        "moe_num_shared_experts": num_shared,
        "moe_layer_start_index": start,
        "moe_layer_end_index": last,
        "moe_layer_interval": interval,
    }


def _routed_experts_config(
    architecture: str,
    key: Callable[..., Any],
    tensor_shapes: dict[str, tuple[int, ...]],
    num_layers: int,
    sigmoid: bool,
) -> dict[str, Any]:
    """GLM-4.5's, DeepSeek's and dots.llm1's experts: dense layers up to
    leading_dense_block_count, then a router (with a selection bias, exp_probs_b, when it
    scores by sigmoid) over experts whose sizes the tensors give, its weights scaled by
    expert_weights_scale and renormalised when expert_weights_norm says, in
    expert_group_count groups; beside them expert_shared_count experts' rows as one shared
    MLP."""
    first_dense = int(key("leading_dense_block_count", 0))
    sparse = [i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" in tensor_shapes]
    if not sparse or sparse != list(range(first_dense, num_layers)):
        raise ValueError(
            f"GGUF {architecture} has an expert router (ffn_gate_inp) in layers {sparse}; "
            f"expected every layer from leading_dense_block_count={first_dense} to "
            f"{num_layers - 1}"
        )
    if (f"blk.{first_dense}.exp_probs_b.bias" in tensor_shapes) != sigmoid:
        raise ValueError(
            f"GGUF {architecture}: a router scoring by "
            f"{'sigmoid' if sigmoid else 'softmax'} "
            f"{'without' if sigmoid else 'with'} a selection bias (exp_probs_b) is not "
            "supported; supported: sigmoid with the bias (DeepSeek-V3, GLM-4.5, dots.llm1), "
            "softmax without it (DeepSeek-V2)"
        )
    top_k = key("expert_used_count")
    if top_k is None:
        raise ValueError("GGUF has experts but no expert_used_count (the experts per token)")
    num_experts, moe_intermediate_size, _ = tensor_shapes[f"blk.{first_dense}.ffn_gate_exps.weight"]
    num_shared = int(key("expert_shared_count", 0))
    shared_rows = tensor_shapes.get(f"blk.{first_dense}.ffn_gate_shexp.weight", (0,))[0]
    if shared_rows != num_shared * moe_intermediate_size:
        raise ValueError(
            f"GGUF {architecture} shared experts (ffn_gate_shexp) have {shared_rows} rows; "
            f"expected expert_shared_count={num_shared} x {moe_intermediate_size}"
        )
    return {
        "n_routed_experts": num_experts,
        "num_experts_per_tok": int(top_k),
        "moe_intermediate_size": moe_intermediate_size,
        "n_shared_experts": num_shared,
        "first_k_dense_replace": first_dense,
        # llama.cpp scales by nothing without the key (DeepSeek-V2 files may lack it).
        "routed_scaling_factor": _float32_value(key("expert_weights_scale") or 1.0),
        "norm_topk_prob": bool(key("expert_weights_norm", False)),
        "n_group": int(key("expert_group_count", 1)),
        "topk_group": int(key("expert_group_used_count", 1)),
    }


def _gpt_oss_config(
    key: Callable[..., Any], tensor_shapes: dict[str, tuple[int, ...]]
) -> dict[str, Any]:
    """gpt-oss: every layer sparse (the router's rows are the experts), the experts' size,
    top-k, the window on the even layers (llama.cpp's fixed pattern, HF's default)."""
    top_k = key("expert_used_count")
    if top_k is None:
        raise ValueError("GGUF has experts but no expert_used_count (the experts per token)")
    window = key("attention.sliding_window")
    if window is None:
        raise ValueError("GGUF gpt-oss has no attention.sliding_window")
    intermediate = key("expert_feed_forward_length", key("feed_forward_length"))
    return {
        "num_local_experts": tensor_shapes["blk.0.ffn_gate_inp.weight"][0],
        "num_experts_per_tok": int(top_k),
        "intermediate_size": int(intermediate),
        "sliding_window": int(window),
    }


def _mixtral_config(
    key: Callable[..., Any], tensor_shapes: dict[str, tuple[int, ...]]
) -> dict[str, Any]:
    """Mixtral: every layer sparse, the experts' size is the intermediate size, top-k
    renormalised (no field: always)."""
    top_k = key("expert_used_count")
    if top_k is None:
        raise ValueError("GGUF has experts but no expert_used_count (the experts per token)")
    num_experts, intermediate_size, _ = tensor_shapes["blk.0.ffn_gate_exps.weight"]
    return {
        "num_local_experts": num_experts,
        "num_experts_per_tok": int(top_k),
        "intermediate_size": intermediate_size,
        "sliding_window": None,
    }


def _olmoe_config(
    key: Callable[..., Any], tensor_shapes: dict[str, tuple[int, ...]], num_layers: int
) -> dict[str, Any]:
    """OLMoE: experts of intermediate_size in every layer under a softmax router whose top-k
    weights are not renormalised, which llama.cpp's OLMoE graph fixes (its converter writes
    neither); q/k norms over the whole projections; no clamp: llama.cpp's converter drops
    HF's clip_qkv and its graph clamps nothing."""
    _check_fixed_router("olmoe", key, _SOFTMAX, renormalize=False)
    clamp = key("attention.clamp_kqv")
    if clamp is not None:
        raise ValueError(
            f"GGUF olmoe attention.clamp_kqv={clamp} is not supported (llama.cpp's OLMoE "
            "graph clamps nothing); supported: none"
        )
    _check_whole_projection_norms("olmoe", tensor_shapes, num_layers)
    num_experts, intermediate_size, top_k = _experts_in_every_layer(
        "olmoe", key, tensor_shapes, num_layers
    )
    return {
        "num_experts": num_experts,
        "num_experts_per_tok": top_k,
        "intermediate_size": intermediate_size,
        "norm_topk_prob": False,
        "clip_qkv": None,
    }


def _minimax_m2_config(
    key: Callable[..., Any],
    tensor_shapes: dict[str, tuple[int, ...]],
    num_layers: int,
    rope_dim: int,
) -> dict[str, Any]:
    """MiniMax-M2: RoPE over the first rope.dimension_count values of each head (HF's
    rotary_dim), q/k norms over the whole projections, and experts of intermediate_size in
    every layer under a sigmoid router with a selection bias (exp_probs_b) and its top-k
    weights renormalised: HF's only MiniMax-M2 router, and llama.cpp's graph's, so a file that
    does not name its gating function is read as that one (llama.cpp's converter writes it
    from the checkpoint's scoring_func)."""
    _check_fixed_router("minimax-m2", key, _SIGMOID, renormalize=True)
    _check_whole_projection_norms("minimax-m2", tensor_shapes, num_layers)
    unbiased = [i for i in range(num_layers) if f"blk.{i}.exp_probs_b.bias" not in tensor_shapes]
    if unbiased:
        raise ValueError(
            f"GGUF minimax-m2 has no router selection bias (exp_probs_b) in layers {unbiased}; "
            "every MiniMax-M2 router has one"
        )
    num_experts, intermediate_size, top_k = _experts_in_every_layer(
        "minimax-m2", key, tensor_shapes, num_layers
    )
    return {
        "num_local_experts": num_experts,
        "num_experts_per_tok": top_k,
        "intermediate_size": intermediate_size,
        "rotary_dim": rope_dim,
    }


def _check_fixed_router(
    architecture: str, key: Callable[..., Any], gating: int, renormalize: bool
) -> None:
    """OLMoE's, MiniMax-M2's, Hunyuan MoE's and Llama 4's routers, whose scoring and
    renormalisation llama.cpp's graphs (and HF's classes) fix: the keys a file may carry about
    them must agree, and none scales its weights or groups its experts."""
    names = {_SOFTMAX: "softmax", _SIGMOID: "sigmoid"}
    fixed = {
        "expert_gating_func": (gating, f"{gating} ({names[gating]})"),
        "expert_weights_norm": (renormalize, str(renormalize).lower()),
        "expert_weights_scale": (1.0, "1"),
        "expert_group_count": (1, "1"),
        "expert_group_used_count": (1, "1"),
    }
    for name, (value, spelled) in fixed.items():
        found = key(name)
        if found is not None and found != value:
            raise ValueError(
                f"GGUF {architecture} {name}={found} is not supported (llama.cpp's graph and "
                f"HF's model fix the router); supported: {spelled} or none"
            )


def _check_whole_projection_norms(
    architecture: str, tensor_shapes: dict[str, tuple[int, ...]], num_layers: int
) -> None:
    """OLMoE's and MiniMax-M2's q/k norms: in every layer, over the whole query and key
    projections (a weight per row of each, all heads at once, as both llama.cpp and HF keep
    them), not one head's."""
    for layer in range(num_layers):
        for projection in ("attn_q", "attn_k"):
            rows = tensor_shapes[f"blk.{layer}.{projection}.weight"][0]
            shape = tensor_shapes.get(f"blk.{layer}.{projection}_norm.weight")
            if shape != (rows,):
                found = "no such tensor" if shape is None else f"shape {shape}"
                raise ValueError(
                    f"GGUF {architecture} blk.{layer}.{projection}_norm: {found}; expected "
                    f"({rows},), a norm over the whole {projection} projection"
                )


def _experts_in_every_layer(
    architecture: str,
    key: Callable[..., Any],
    tensor_shapes: dict[str, tuple[int, ...]],
    num_layers: int,
) -> tuple[int, int, int]:
    """(experts, their intermediate size, experts per token) of a model whose every layer is
    sparse (OLMoE, MiniMax-M2, Hunyuan MoE), the sizes from the tensors: llama.cpp's graphs for
    those need a router and experts in each layer."""
    dense = [i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_shapes]
    if dense:
        raise ValueError(
            f"GGUF {architecture} has no expert router (ffn_gate_inp) in layers {dense}; every "
            f"{architecture} layer has experts"
        )
    top_k = key("expert_used_count")
    if top_k is None:
        raise ValueError("GGUF has experts but no expert_used_count (the experts per token)")
    num_experts, intermediate_size, _ = tensor_shapes["blk.0.ffn_gate_exps.weight"]
    return num_experts, intermediate_size, int(top_k)


# The projections HF's attention_bias gives a bias (llama.cpp's names), and ERNIE 4.5's use_bias.
_ATTENTION_PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output")
_ERNIE4_5_BIASED = (*_ATTENTION_PROJECTIONS, "ffn_gate", "ffn_up", "ffn_down")


def _biases_switched(
    architecture: str,
    field: str,
    projections: tuple[str, ...],
    tensor_shapes: dict[str, tuple[int, ...]],
    num_layers: int,
) -> bool:
    """Whether the file has the biases HF's one switch ``field`` gives ``projections`` in
    every layer: all of them, or none (a file with some is another model)."""
    names = [f"blk.{i}.{projection}.bias" for i in range(num_layers) for projection in projections]
    present = [name for name in names if name in tensor_shapes]
    if present and len(present) < len(names):
        missing = [name for name in names if name not in tensor_shapes]
        raise ValueError(
            f"GGUF {architecture} has {_listed(present)} but not {_listed(missing)}; HF's "
            f"{field} gives {', '.join(projections)} a bias in every layer, or none"
        )
    return bool(present)


def _listed(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" (and {len(names) - 3} more)" if len(names) > 3 else "")


def _check_ernie4_5_biases(tensor_shapes: dict[str, tuple[int, ...]], num_layers: int) -> None:
    """ERNIE 4.5's use_bias: a bias on every projection of every layer, or none; never on the
    LM head of the dense model (HF's Ernie4_5ForCausalLM has none, unlike the MoE model's)."""
    _biases_switched("ernie4_5", "use_bias", _ERNIE4_5_BIASED, tensor_shapes, num_layers)
    if "output.bias" in tensor_shapes:
        raise ValueError(
            "GGUF ernie4_5 has an LM-head bias (output.bias), which HF's dense ERNIE 4.5 does "
            "not have; supported: none"
        )


def _check_per_head_qk_norms(
    architecture: str, tensor_shapes: dict[str, tuple[int, ...]], num_layers: int, head_dim: int
) -> None:
    """Hunyuan's and Apertus's q/k norms: in every layer, one weight per value of a head,
    shared by all heads (llama.cpp's graphs need them; HF's models always have them)."""
    for layer in range(num_layers):
        for projection in ("attn_q", "attn_k"):
            shape = tensor_shapes.get(f"blk.{layer}.{projection}_norm.weight")
            if shape != (head_dim,):
                found = "no such tensor" if shape is None else f"shape {shape}"
                raise ValueError(
                    f"GGUF {architecture} blk.{layer}.{projection}_norm: {found}; expected "
                    f"({head_dim},), a norm over each head"
                )


def _check_ungated(
    architecture: str, tensor_shapes: dict[str, tuple[int, ...]], num_layers: int
) -> None:
    """Nemotron's and Apertus's MLPs: down(act(up(x))), no gate in HF's model or llama.cpp's
    graph."""
    gated = [i for i in range(num_layers) if f"blk.{i}.ffn_gate.weight" in tensor_shapes]
    if gated:
        raise ValueError(
            f"GGUF {architecture} has a gated MLP (ffn_gate) in layers {gated}; "
            f"{architecture}'s MLP is ungated"
        )


def _hunyuan_config(
    architecture: str,
    key: Callable[..., Any],
    tensor_shapes: dict[str, tuple[int, ...]],
    num_layers: int,
    head_dim: int,
) -> dict[str, Any]:
    """Hunyuan: per-head q/k norms in every layer, the attention's biases all or none
    (attention_bias, set from the tensors); the MoE models' experts (_hunyuan_moe_config). The
    RoPE: _hunyuan_rope_scaling. HunyuanVL's XD-RoPE sections are another model."""
    _check_per_head_qk_norms(architecture, tensor_shapes, num_layers, head_dim)
    _biases_switched(
        architecture, "attention_bias", _ATTENTION_PROJECTIONS, tensor_shapes, num_layers
    )
    sections = key("rope.dimension_sections")
    if sections is not None and any(sections):
        raise ValueError(
            f"GGUF {architecture} rope.dimension_sections={list(sections)} is not supported "
            "(HunyuanVL's XD-RoPE); supported: none"
        )
    if architecture == "hunyuan-dense":
        return {}
    return _hunyuan_moe_config(key, tensor_shapes, num_layers)


def _hunyuan_moe_config(
    key: Callable[..., Any], tensor_shapes: dict[str, tuple[int, ...]], num_layers: int
) -> dict[str, Any]:
    """Hunyuan MoE: in every layer experts under a softmax router, top-k renormalised (fixed by
    llama.cpp's graph and HF's model), beside one shared MLP. HF gives the experts and the
    shared MLP both intermediate_size rows (its config's moe_intermediate_size and
    num_shared_expert unread), so the tensors must agree; llama.cpp's expert and shared sizes
    (expert_feed_forward_length, expert_shared_feed_forward_length) are not read: the
    tensors give them."""
    _check_fixed_router("hunyuan-moe", key, _SOFTMAX, renormalize=True)
    num_experts, intermediate_size, top_k = _experts_in_every_layer(
        "hunyuan-moe", key, tensor_shapes, num_layers
    )
    for layer in range(num_layers):
        for projection in ("ffn_gate_exps", "ffn_gate_shexp"):
            shape = tensor_shapes.get(f"blk.{layer}.{projection}.weight")
            rows = None if shape is None else shape[-2]
            if rows != intermediate_size:
                found = "no such tensor" if shape is None else f"{rows} rows"
                raise ValueError(
                    f"GGUF hunyuan-moe blk.{layer}.{projection}: {found}; expected "
                    f"{intermediate_size} (HF's experts and shared MLP all have "
                    "intermediate_size rows)"
                )
    return {"num_experts": num_experts, "moe_topk": top_k, "intermediate_size": intermediate_size}


def _hunyuan_rope_scaling(architecture: str, key: Callable[..., Any]) -> dict[str, Any] | None:
    """Hunyuan's NTK-alpha RoPE. llama.cpp's converter folds HF's alpha into the base (base x
    alpha ** (d / (d - 2)), written as rope.freq_base, no scaling), which is plain RoPE with
    that base to HF as well. A hunyuan-dense file may instead keep the alpha apart
    (rope.scaling.alpha, HunyuanVL's way), which llama.cpp's hunyuan-dense folds in when
    loading: HF's "dynamic" RoPE with that alpha, as Hunyuan's checkpoints write it. llama.cpp's
    hunyuan-moe ignores the key, so a file with one is refused there, as is an alpha beside
    another scaling."""
    scaling = _rope_scaling(key)
    alpha = key("rope.scaling.alpha")
    if not alpha:  # absent, or 0: llama.cpp folds nothing in
        return scaling
    if architecture != "hunyuan-dense" or scaling is not None:
        beside = "" if scaling is None else f" beside rope.scaling.type {scaling['rope_type']}"
        raise ValueError(
            f"GGUF {architecture} rope.scaling.alpha={alpha}{beside} is not supported; "
            "supported: hunyuan-dense's alpha without another scaling, or none"
        )
    return {"rope_type": "dynamic", "factor": 1.0, "alpha": _float32_value(alpha)}


def _nemotron_config(
    key: Callable[..., Any],
    tensor_shapes: dict[str, tuple[int, ...]],
    num_layers: int,
    rope_dim: int,
    head_dim: int,
) -> dict[str, Any]:
    """Nemotron: LayerNorm1P with its epsilon (attention.layer_norm_epsilon) and a bias in
    every norm (both required by llama.cpp's graph, and HF's), RoPE over rope.dimension_count
    of each head (HF's partial_rotary_factor), the ungated squared-ReLU MLP, and biases on the
    attention (attention_bias) and on the MLP (mlp_bias), each all or none."""
    eps = key("attention.layer_norm_epsilon")
    if eps is None:
        raise ValueError(
            "GGUF nemotron has no attention.layer_norm_epsilon (its LayerNorms' epsilon, "
            "which llama.cpp requires)"
        )
    norm_biases = [
        "output_norm.bias",
        *(f"blk.{i}.{norm}.bias" for i in range(num_layers) for norm in ("attn_norm", "ffn_norm")),
    ]
    missing = [name for name in norm_biases if name not in tensor_shapes]
    if missing:
        raise ValueError(
            f"GGUF nemotron has no {_listed(missing)}; every Nemotron LayerNorm1P has a bias"
        )
    _check_ungated("nemotron", tensor_shapes, num_layers)
    _biases_switched(
        "nemotron", "attention_bias", _ATTENTION_PROJECTIONS, tensor_shapes, num_layers
    )
    mlp_bias = _biases_switched(
        "nemotron", "mlp_bias", ("ffn_up", "ffn_down"), tensor_shapes, num_layers
    )
    return {
        "hidden_act": "relu2",
        "norm_eps": _float32_value(eps),
        "partial_rotary_factor": rope_dim / head_dim,
        "mlp_bias": mlp_bias,
    }


# Apertus's xIELU scalars: llama.cpp's metadata key (one value per layer, each as HF stores
# it: alpha_p and alpha_n before their softplus, which both apply) -> HF's tensor and shape.
_XIELU = {
    "alpha_p": (gguf.Keys.xIELU.ALPHA_P, (1,)),
    "alpha_n": (gguf.Keys.xIELU.ALPHA_N, (1,)),
    "beta": (gguf.Keys.xIELU.BETA, ()),
    "eps": (gguf.Keys.xIELU.EPS, ()),
}


def _apertus_config(
    fields: dict[str, Any],
    tensor_shapes: dict[str, tuple[int, ...]],
    num_layers: int,
    head_dim: int,
) -> dict[str, Any]:
    """Apertus: xIELU (its scalars: _xielu_values), per-head q/k norms in every layer, the
    ungated MLP, the attention's biases all or none (attention_bias)."""
    _xielu_values(fields, num_layers)
    _check_per_head_qk_norms("apertus", tensor_shapes, num_layers, head_dim)
    _check_ungated("apertus", tensor_shapes, num_layers)
    _biases_switched("apertus", "attention_bias", _ATTENTION_PROJECTIONS, tensor_shapes, num_layers)
    return {"hidden_act": "xielu"}


def _xielu_values(fields: dict[str, Any], num_layers: int) -> dict[str, list[float]]:
    """Apertus's xIELU scalars by name, one per layer, as llama.cpp's converter keeps them
    (metadata arrays, which its graph reads per layer)."""
    values = {}
    for name, (gguf_key, _) in _XIELU.items():
        found = fields.get(gguf_key)
        if not isinstance(found, list) or len(found) != num_layers:
            raise ValueError(
                f"GGUF apertus needs {gguf_key}, one value per layer ({num_layers}), "
                f"got {found!r:.100}"
            )
        values[name] = [float(value) for value in found]
    return values


def _xielu_tensors(
    values: dict[str, list[float]], num_layers: int
) -> Iterator[tuple[str, np.ndarray]]:
    """Apertus's xIELU scalars as HF's weights: model.layers.N.mlp.act_fn.alpha_p and alpha_n
    of one value, beta and eps of none (scalars)."""
    for layer in range(num_layers):
        for name, (_, shape) in _XIELU.items():
            value = np.full(shape, values[name][layer], dtype=np.float32)
            yield f"model.layers.{layer}.mlp.act_fn.{name}", value


# What llama.cpp fixes for Llama 4 rather than reading from the file (its llama4 hparams):
# attention in chunks of 8192 positions on the first three layers of every four (the chunk
# is no key; a sliding_window of 0 turns the chunks off and RoPE on in every layer), no RoPE
# on every fourth layer, whose queries it scales by 1 + 0.1 * log(1 + floor((position + 1) /
# 8192)), and q/k norms unless the model has 128 experts (Maverick's have none).
_LLAMA4_CHUNK = 8192
_LLAMA4_NO_ROPE_EVERY = 4
_LLAMA4_FLOOR_SCALE = 8192
_LLAMA4_ATTN_SCALE = 0.1
_LLAMA4_EXPERTS_WITHOUT_QK_NORM = 128


def _llama4_config(
    key: Callable[..., Any],
    tensor_shapes: dict[str, tuple[int, ...]],
    num_layers: int,
    rope_theta: float,
) -> dict[str, Any]:
    """Llama 4: experts at every interleave_moe_layer_step-th layer (the only way llama.cpp
    places them, so the file's routers must be there), each of the size the tensors give
    beside a shared expert of that size, the top expert_used_count by a sigmoid that scales
    their input, unrenormalised (llama.cpp's graph and HF's model fix that router); dense
    layers of feed_forward_length (HF's intermediate_size_mlp); the layers' chunks, RoPE,
    temperature and q/k norms as llama.cpp fixes them (_LLAMA4_CHUNK and the rest), written
    out per layer (layer_types, no_rope_layers, moe_layers), as HF's config holds them."""
    _check_fixed_router("llama4", key, _SIGMOID, renormalize=False)
    step = key("interleave_moe_layer_step")
    if step is None or int(step) < 1:
        raise ValueError(
            "GGUF llama4 needs interleave_moe_layer_step >= 1 (the experts are at every "
            f"step-th layer, where llama.cpp puts them), got {step!r}"
        )
    step = int(step)
    sparse = [i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" in tensor_shapes]
    expected = [i for i in range(num_layers) if (i + 1) % step == 0]
    if not sparse or sparse != expected:
        raise ValueError(
            f"GGUF llama4 has an expert router (ffn_gate_inp) in layers {sparse}; expected "
            f"the layers whose number + 1 is a multiple of interleave_moe_layer_step={step} "
            f"({expected}), and llama.cpp's llama4 needs experts"
        )
    top_k = key("expert_used_count")
    if top_k is None:
        raise ValueError("GGUF has experts but no expert_used_count (the experts per token)")
    num_experts, intermediate_size, _ = tensor_shapes[f"blk.{sparse[0]}.ffn_gate_exps.weight"]
    for layer in sparse:
        shape = tensor_shapes.get(f"blk.{layer}.ffn_gate_shexp.weight")
        if shape is None or shape[0] != intermediate_size:
            found = "no such tensor" if shape is None else f"{shape[0]} rows"
            raise ValueError(
                f"GGUF llama4 blk.{layer}.ffn_gate_shexp: {found}; expected {intermediate_size} "
                "(HF's and llama.cpp's shared expert has the experts' intermediate_size rows)"
            )
    chunked = _llama4_chunked(key, rope_theta)
    # Newer llama.cpp reads the chunked layers' period from the file (not the RoPE-less
    # layers' step, which stays 4); its converter writes none.
    period = key("attention.sliding_window_pattern", _LLAMA4_NO_ROPE_EVERY)
    if isinstance(period, list) or int(period) < 1:
        raise ValueError(
            f"GGUF llama4 attention.sliding_window_pattern={period!r:.100} is not supported; "
            "supported: an integer >= 1 (every period-th layer attends in full), or none (4)"
        )
    period = int(period)
    return {
        "intermediate_size": intermediate_size,
        "intermediate_size_mlp": int(key("feed_forward_length")),
        "num_local_experts": num_experts,
        "num_experts_per_tok": int(top_k),
        "interleave_moe_layer_step": step,
        "moe_layers": sparse,
        "use_qk_norm": num_experts != _LLAMA4_EXPERTS_WITHOUT_QK_NORM,
        "no_rope_layer_interval": _LLAMA4_NO_ROPE_EVERY,
        "no_rope_layers": [
            int(not chunked or (i + 1) % _LLAMA4_NO_ROPE_EVERY != 0) for i in range(num_layers)
        ],
        "attention_chunk_size": _LLAMA4_CHUNK if chunked else None,
        "layer_types": [
            "chunked_attention" if chunked and i % period < period - 1 else "full_attention"
            for i in range(num_layers)
        ],
        # Without chunks llama.cpp scales no query (and every layer rotates).
        "attn_temperature_tuning": chunked,
        "floor_scale": _LLAMA4_FLOOR_SCALE,
        "attn_scale": _LLAMA4_ATTN_SCALE,
    }


def _llama4_chunked(key: Callable[..., Any], rope_theta: float) -> bool:
    """Whether llama.cpp runs the file with Llama 4's chunks (and RoPE-less layers): unless
    attention.sliding_window is 0 (llama.cpp's converter writes 0 for a config whose layers
    all attend in full, MobileLLM-R1's). Any other window it ignores for 8192, so only that
    one is read; a separate RoPE base for the chunked layers (rope.freq_base_swa) is one HF's
    Llama 4 does not have."""
    window = key("attention.sliding_window")
    if window is not None and int(window) not in (0, _LLAMA4_CHUNK):
        raise ValueError(
            f"GGUF llama4 attention.sliding_window={window} is not supported (llama.cpp chunks "
            f"by {_LLAMA4_CHUNK} whatever a nonzero window says); supported: 0 (no chunks), "
            f"{_LLAMA4_CHUNK} or none"
        )
    base = key("rope.freq_base_swa")
    if base is not None and _float32_value(base) != rope_theta:
        raise ValueError(
            f"GGUF llama4 rope.freq_base_swa={base} differs from rope.freq_base={rope_theta}; "
            "HF's Llama 4 rotates every layer with one base"
        )
    return window is None or int(window) != 0


# Llama 3's RoPE scaling besides its factor: every Llama 3.x model's values, and those
# llama.cpp assumes when a config leaves them out.
_LLAMA3_ROPE = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
# Llama 4 Scout's: no band between the kept and the stretched wavelengths (Maverick has no
# scaling).
_LLAMA4_ROPE = {**_LLAMA3_ROPE, "high_freq_factor": 1.0}


def _llama3_rope_scaling(
    architecture: str, rope_freqs: np.ndarray, rope_theta: float, head_dim: int
) -> dict[str, Any]:
    """HF's llama3 rope_scaling for a GGUF's rope_freqs tensor. llama.cpp's converter turns
    HF's settings into one divisor per frequency (1 for short wavelengths, the factor for long
    ones, a blend between); the factor is the largest divisor, and the other settings are
    Llama 3's or Llama 4 Scout's if, and only if, they give back every divisor (the
    architecture's own first: where no frequency falls in Llama 3's band, both do, alike)."""
    factors = np.asarray(rope_freqs, dtype=np.float64).reshape(-1)
    if factors.shape != (head_dim // 2,):
        raise ValueError(
            f"GGUF rope_freqs has {factors.size} values; expected head_dim / 2 = {head_dim // 2}"
        )
    candidates = (_LLAMA3_ROPE, _LLAMA4_ROPE)
    for settings in reversed(candidates) if architecture == "llama4" else candidates:
        scaling = {"rope_type": "llama3", "factor": _float32_value(factors.max()), **settings}
        expected = _llama3_divisors(scaling, rope_theta, head_dim)
        if np.allclose(factors, expected, rtol=1e-5, atol=0):
            return scaling
    raise ValueError(
        "GGUF rope_freqs is not Llama 3's RoPE scaling with factor "
        f"{_float32_value(factors.max())}, low_freq_factor 1, high_freq_factor 4 (Llama 4 "
        "Scout's: 1) and original_max_position_embeddings 8192, the only llama3 settings this "
        "converter reads from a GGUF"
    )


def _llama3_divisors(scaling: dict[str, Any], rope_theta: float, head_dim: int) -> np.ndarray:
    """What each RoPE frequency is divided by under llama3 scaling (HF's and llama.cpp's)."""
    frequencies = 1.0 / rope_theta ** (np.arange(0, head_dim, 2) / head_dim)
    wavelengths = 2 * np.pi / frequencies
    original = scaling["original_max_position_embeddings"]
    low, high, factor = scaling["low_freq_factor"], scaling["high_freq_factor"], scaling["factor"]
    # Without a band (Llama 4 Scout's high_freq_factor = low_freq_factor) every wavelength is
    # kept or stretched below.
    band = high - low
    smooth = (original / wavelengths - low) / band if band else np.zeros_like(wavelengths)
    divisors = 1 / ((1 - smooth) / factor + smooth)
    divisors[wavelengths < original / high] = 1.0
    divisors[wavelengths > original / low] = factor
    return divisors


def _rope_scaling(key: Callable[[str], Any]) -> dict[str, Any] | None:
    scaling_type = key("rope.scaling.type")
    if scaling_type in (None, "none"):
        return None
    if scaling_type not in ("linear", "yarn"):
        raise ValueError(
            f"GGUF rope.scaling.type {scaling_type!r} is not supported; supported: none, "
            "linear, yarn"
        )
    scaling: dict[str, Any] = {
        "rope_type": scaling_type,
        "factor": _float32_value(key("rope.scaling.factor")),
    }
    original_context = key("rope.scaling.original_context_length")
    if original_context is not None:
        scaling["original_max_position_embeddings"] = int(original_context)
    return scaling


def _deepseek2_rope_scaling(key: Callable[..., Any]) -> dict[str, Any] | None:
    """DeepSeek's YaRN as HF has it. llama.cpp's converter stores HF's mscale_all_dim as
    yarn_log_multiplier = 0.1 x it; llama.cpp scales every query-key product by that factor
    squared (HF's yarn_apply_mscale) and rotates without changing magnitudes: HF's attention
    factor when mscale equals mscale_all_dim, as in every DeepSeek checkpoint (1 without
    it). beta_fast / beta_slow are 32 / 1 where the file does not say, in both."""
    scaling = _rope_scaling(key)
    if scaling is None or scaling["rope_type"] != "yarn":
        return scaling
    attention_factor = key("rope.scaling.yarn_attn_factor")
    if attention_factor not in (None, 1.0):
        raise ValueError(
            f"GGUF deepseek2 rope.scaling.yarn_attn_factor={attention_factor} is not "
            "supported (llama.cpp applies it to the rotation and the softmax scale alike); "
            "supported: 1 or none"
        )
    scaling["beta_fast"] = _float32_value(key("rope.scaling.yarn_beta_fast", 32.0))
    scaling["beta_slow"] = _float32_value(key("rope.scaling.yarn_beta_slow", 1.0))
    mscale = _float32_value(float(key("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1)
    if mscale:
        scaling.update(mscale=mscale, mscale_all_dim=mscale)
    else:
        scaling["attention_factor"] = 1.0
    return scaling


def _float32_value(value: float) -> float:
    # GGUF stores these as float32; the shortest float32 repr keeps 1e-5 reading as 1e-05 in
    # config.json instead of 9.999999747378752e-06 (the same float32 either way).
    return float(str(np.float32(value)))


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _generation_config(config: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    # llama.cpp ends a generation at EOS and at the end-of-turn / end-of-message tokens a chat
    # model closes its turn with (Gemma's <end_of_turn>, Llama 3's <|eot_id|>), as the HF
    # model's own generation_config lists them.
    stops = [config["eos_token_id"]]
    stops += [
        _optional_int(fields.get(f"tokenizer.ggml.{kind}_token_id")) for kind in ("eot", "eom")
    ]
    eos = list(dict.fromkeys(token for token in stops if token is not None))
    return {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "pad_token_id": config["pad_token_id"],
    }


def _hf_tensor_names(gguf_name: str, family: _Family, num_experts: int) -> list[str]:
    """The HF names of a GGUF tensor: one, or one per expert for a stacked expert tensor."""
    global_names = {**_GLOBAL_TENSOR_NAMES, **dict(family.global_names)}
    if gguf_name in global_names:
        return [global_names[gguf_name]]
    prefix, _, rest = gguf_name.partition(".")
    layer, _, suffix = rest.partition(".")
    base, _, kind = suffix.rpartition(".")
    layer_names = {**_LAYER_TENSOR_NAMES, **dict(family.layer_names)}
    unsuffixed_names = {**_UNSUFFIXED_LAYER_TENSOR_NAMES, **dict(family.unsuffixed_names)}
    if prefix == "blk" and layer.isdigit() and kind in ("weight", "bias"):
        if suffix in unsuffixed_names:
            return [f"model.layers.{layer}.{unsuffixed_names[suffix]}"]
        if base in layer_names:
            return [f"model.layers.{layer}.{layer_names[base]}.{kind}"]
        # llama.cpp stacks a layer's experts into one [num_experts, rows, columns] tensor per
        # projection; HF has one matrix per expert.
        stacked = dict(family.expert_projections)
        if base in stacked and kind == "weight":
            return [
                f"model.layers.{layer}.{family.expert_format}.weight".format(
                    expert=expert, projection=stacked[base]
                )
                for expert in range(num_experts)
            ]
    raise ValueError(f"GGUF tensor {gguf_name!r} has no HF equivalent in this converter")


def _tensor_shapes(reader: gguf.GGUFReader) -> dict[str, tuple[int, ...]]:
    # GGUF lists dimensions fastest-first; torch wants them slowest-first.
    return {
        tensor.name: tuple(int(dim) for dim in reversed(tensor.shape)) for tensor in reader.tensors
    }


def _dequantized_tensors(
    reader: gguf.GGUFReader, config: dict[str, Any], report: _Reporter
) -> Iterator[tuple[str, np.ndarray]]:
    """Each HF tensor in float32, one GGUF tensor at a time."""
    family = _FAMILIES_BY_HF[config["architectures"][0]]
    num_tensors = len(reader.tensors)
    report_every = max(1, num_tensors // 10)
    skipped = _tensors_without_weights(
        [tensor.name for tensor in reader.tensors], config["num_hidden_layers"]
    )

    def each_tensor() -> Iterator[tuple[str, np.ndarray]]:
        for index, tensor in enumerate(reader.tensors, start=1):
            if tensor.name not in skipped:
                yield from _hf_tensors(tensor, family, config)
            if index % report_every == 0 or index == num_tensors:
                report("dequantizing", index, num_tensors)

    if family is _GPT_OSS:
        yield from _gpt_oss_experts(each_tensor())
    elif family is _LLAMA4:
        yield from _llama4_experts(each_tensor())
    elif family in (_DEEPSEEK_V2, _DEEPSEEK_V3):
        yield from _joined_kv_b(each_tensor(), config)
    else:
        yield from each_tensor()
    if family is _FAMILIES["apertus"]:
        # Not tensors in the GGUF: llama.cpp keeps them as metadata (_apertus_config).
        fields = {
            gguf_key: reader.fields[gguf_key].contents()
            for gguf_key, _ in _XIELU.values()
            if gguf_key in reader.fields
        }
        values = _xielu_values(fields, config["num_hidden_layers"])
        yield from _xielu_tensors(values, config["num_hidden_layers"])


def _tensors_without_weights(names: list[str], num_layers: int) -> set[str]:
    """The GGUF tensors that become no HF weight: rope_freqs and the rope factors, which the
    config's rope_scaling holds (_llama3_rope_scaling, _longrope_scaling); the
    multi-token-prediction blocks llama.cpp appends past the model's layers (HF's model
    skips them too); DeepSeek's attn_k_b / attn_v_b in a layer that keeps the attn_kv_b they
    were split from."""
    with_kv_b = {_layer_of(name) for name in names if name.endswith(".attn_kv_b.weight")}
    skipped = {_ROPE_FREQS_TENSOR, *_ROPE_FACTOR_TENSORS}
    for name in names:
        layer = _layer_of(name)
        if layer is None:
            continue
        split_kv_b = name.endswith((".attn_k_b.weight", ".attn_v_b.weight"))
        if layer >= num_layers or (split_kv_b and layer in with_kv_b):
            skipped.add(name)
    return skipped


def _layer_of(gguf_name: str) -> int | None:
    """N for a tensor of block N ("blk.N. ..."), None for a global one."""
    prefix, _, rest = gguf_name.partition(".")
    layer = rest.partition(".")[0]
    return int(layer) if prefix == "blk" and layer.isdigit() else None


def _joined_kv_b(
    tensors: Iterator[tuple[str, np.ndarray]], config: dict[str, Any]
) -> Iterator[tuple[str, np.ndarray]]:
    """DeepSeek's ``kv_b_proj`` from llama.cpp's split of it: ``attn_k_b`` [heads,
    kv_lora_rank, qk_nope_head_dim] (each head's key rows, transposed) and ``attn_v_b``
    [heads, v_head_dim, kv_lora_rank]. HF's rows are, head by head, its key rows then its
    value rows:

        kv_b_proj [heads x (qk_nope_head_dim + v_head_dim), kv_lora_rank]
          = | k_b[0]^T | v_b[0] | k_b[1]^T | v_b[1] | ...
    """
    heads, rank = config["num_attention_heads"], config["kv_lora_rank"]
    nope = config["qk_nope_head_dim"]
    halves: dict[str, dict[str, np.ndarray]] = {}
    for name, tensor in tensors:
        stem, _, projection = name.rpartition(".self_attn.")
        if projection not in ("k_b_proj.weight", "v_b_proj.weight"):
            yield name, tensor
            continue
        pair = halves.setdefault(stem, {})
        pair[projection] = tensor
        if len(pair) < 2:
            continue
        del halves[stem]
        keys = pair["k_b_proj.weight"].reshape(heads, rank, nope).swapaxes(1, 2)
        values = pair["v_b_proj.weight"].reshape(heads, -1, rank)
        kv_b = np.concatenate([keys, values], axis=1).reshape(-1, rank)
        yield f"{stem}.self_attn.kv_b_proj.weight", kv_b
    if halves:
        raise ValueError(
            "GGUF deepseek2 has attn_k_b or attn_v_b without the other in "
            f"{', '.join(sorted(halves))}"
        )


def _gpt_oss_experts(
    tensors: Iterator[tuple[str, np.ndarray]],
) -> Iterator[tuple[str, np.ndarray]]:
    """gpt-oss's experts as HF stacks them: llama.cpp's gate and up ([experts, intermediate,
    hidden] each, or one gate_up of gate rows then up rows) interleaved column by column into
    ``gate_up_proj`` [experts, hidden, 2 x intermediate] (biases likewise), its down
    [experts, hidden, intermediate] transposed into ``down_proj``; the sinks unsuffixed."""
    halves: dict[tuple[str, str], dict[str, np.ndarray]] = {}
    for name, tensor in tensors:
        if name.endswith(".self_attn.sinks.weight"):
            yield name.removesuffix(".weight"), tensor
            continue
        stem, _, rest = name.partition(".mlp.experts.")
        if not rest:
            yield name, tensor
            continue
        projection, kind = rest.split(".")
        prefix = f"{stem}.mlp.experts."
        bias = "_bias" if kind == "bias" else ""
        if projection == "down":
            yield (
                prefix + "down_proj" + bias,
                np.ascontiguousarray(tensor.swapaxes(-1, -2) if not bias else tensor),
            )
            continue
        if projection == "gate_up":
            gate, up = np.split(tensor, 2, axis=1 if not bias else -1)
            pair = {"gate": gate, "up": up}
        else:
            pair = halves.setdefault((prefix, kind), {})
            pair[projection] = tensor
            if len(pair) < 2:
                continue
            del halves[(prefix, kind)]
        gate, up = pair["gate"], pair["up"]
        if not bias:  # [experts, rows, hidden] -> HF's [experts, hidden, rows]
            gate, up = gate.swapaxes(-1, -2), up.swapaxes(-1, -2)
        interleaved = np.empty((*gate.shape[:-1], 2 * gate.shape[-1]), dtype=gate.dtype)
        interleaved[..., 0::2], interleaved[..., 1::2] = gate, up
        yield prefix + "gate_up_proj" + bias, interleaved
    if halves:
        missing = ", ".join(
            f"{prefix}{kind}: {sorted(pair)}" for (prefix, kind), pair in halves.items()
        )
        raise ValueError(
            f"GGUF gpt-oss has an expert gate or up tensor without the other: {missing}"
        )


def _llama4_experts(
    tensors: Iterator[tuple[str, np.ndarray]],
) -> Iterator[tuple[str, np.ndarray]]:
    """Llama 4's experts as HF stacks them: llama.cpp's gate and up ([experts, intermediate,
    hidden] each, HF's gate_up split in halves and transposed) side by side into
    ``gate_up_proj`` [experts, hidden, 2 x intermediate], gate columns first (HF's
    ``chunk(2)``); its down [experts, hidden, intermediate] transposed into ``down_proj``
    [experts, intermediate, hidden]. HF's names for both have no .weight."""
    halves: dict[str, dict[str, np.ndarray]] = {}
    for name, tensor in tensors:
        stem, _, rest = name.partition(".feed_forward.experts.")
        if not rest:
            yield name, tensor
            continue
        projection = rest.removesuffix(".weight")
        prefix = f"{stem}.feed_forward.experts."
        if projection == "down":
            yield prefix + "down_proj", np.ascontiguousarray(tensor.swapaxes(1, 2))
            continue
        pair = halves.setdefault(prefix, {})
        pair[projection] = tensor
        if len(pair) < 2:
            continue
        del halves[prefix]
        gate_up = np.concatenate([pair["gate"], pair["up"]], axis=1).swapaxes(1, 2)
        # C order: safetensors writes the array's memory as it lies.
        yield prefix + "gate_up_proj", np.ascontiguousarray(gate_up)
    if halves:
        missing = ", ".join(f"{prefix}: {sorted(pair)}" for prefix, pair in halves.items())
        raise ValueError(
            f"GGUF llama4 has an expert gate or up tensor without the other: {missing}"
        )


def _hf_tensors(
    tensor: Any, family: _Family, config: dict[str, Any]
) -> Iterator[tuple[str, np.ndarray]]:
    """One GGUF tensor as HF tensors: dequantized, renamed, and undone what llama.cpp did."""
    num_experts = (
        config.get("num_experts")
        or config.get("num_local_experts")
        or config.get("n_routed_experts")
        or config.get("moe_num_experts", 0)
    )
    names = _hf_tensor_names(tensor.name, family, num_experts)
    torch_shape = tuple(int(dim) for dim in reversed(tensor.shape))
    weight = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    weight = weight.astype(np.float32, copy=False).reshape(torch_shape)
    if len(names) > 1:  # stacked experts: [num_experts, rows, columns]
        for name, expert_weight in zip(names, weight, strict=True):
            yield name, np.ascontiguousarray(expert_weight)
        return
    name = names[0]
    if family.permuted_qk and ".q_proj." in name:
        weight = _undo_rope_permutation(weight, config["num_attention_heads"])
    elif family.permuted_qk and ".k_proj." in name:
        weight = _undo_rope_permutation(weight, config["num_key_value_heads"])
    elif family.one_plus_norms and name.endswith("norm.weight"):
        weight = weight - 1.0
    elif name.endswith("shared_expert_gate.weight"):
        weight = weight.reshape(1, -1)  # llama.cpp drops HF's leading 1
    elif name.endswith("moe_statics.e_score_correction_bias"):
        # HF's [1, experts], which llama.cpp keeps; a file with the 1 squeezed out converts alike.
        weight = weight.reshape(1, -1)
    yield name, np.ascontiguousarray(weight)


def _write_weights(
    tensors: Iterator[tuple[str, np.ndarray]], out_dir: Path, report: _Reporter
) -> None:
    """Writes the tensors as HF does: model.safetensors, or shards of about SHARD_BYTES
    (model-00001-of-00003.safetensors, ...) listed in model.safetensors.index.json. Only
    one shard is ever held in memory."""
    shard_paths: list[Path] = []
    shard_names: list[list[str]] = []
    shard: dict[str, np.ndarray] = {}
    shard_bytes = total_bytes = 0

    def write_shard() -> None:
        # Numbered once the count is known; the directory is not published before then.
        path = out_dir / f"shard-{len(shard_paths)}.partial"
        report("writing")
        save_file(shard, path, metadata={"format": "pt"})
        shard_paths.append(path)
        shard_names.append(list(shard))
        shard.clear()

    for name, weight in tensors:
        if shard and shard_bytes + weight.nbytes > SHARD_BYTES:
            write_shard()
            shard_bytes = 0
        shard[name] = weight
        shard_bytes += weight.nbytes
        total_bytes += weight.nbytes
    write_shard()
    if len(shard_paths) == 1:
        shard_paths[0].rename(out_dir / "model.safetensors")
        return
    weight_map = {}
    for index, (path, names) in enumerate(zip(shard_paths, shard_names, strict=True), start=1):
        file_name = f"model-{index:05d}-of-{len(shard_paths):05d}.safetensors"
        path.rename(out_dir / file_name)
        weight_map.update(dict.fromkeys(names, file_name))
    index_json = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    _write_json(out_dir / "model.safetensors.index.json", index_json)


def _undo_rope_permutation(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order so HF's rotate-half RoPE applies to the weights.

    llama.cpp rotates adjacent pairs (x0, x1), (x2, x3), ...; HF rotates the two halves of each
    head. llama.cpp's converter therefore interleaves each head's rows: for head h it stores
    rows [r0, r(d/2), r1, r(d/2+1), ...]. Viewing the rows as (head, pair, half) and swapping
    the last two axes restores [r0, r1, ..., r(d/2), ...].
    """
    rows = weight.shape[0]
    half_head_dim = rows // num_heads // 2
    # A bias permutes as a matrix of one column.
    by_head = weight.reshape(num_heads, half_head_dim, 2, -1)
    return by_head.swapaxes(1, 2).reshape(weight.shape)


def _write_tokenizer(
    gguf_path: Path, out_dir: Path, fields: dict[str, Any], context_length: int
) -> None:
    # Imported here: transformers is slow to import and only this stage needs it.
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    if fields.get("general.architecture") in GGUF_SUPPORTED_ARCHITECTURES:
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    else:
        # transformers reads no model config from such a file (Granite's), which
        # AutoTokenizer wants for the tokenizer's class: the vocabulary alone makes the
        # generic fast tokenizer, built from the same GGUF keys.
        tokenizer = PreTrainedTokenizerFast.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name
        )
    chat_template = fields.get("tokenizer.chat_template")
    if chat_template is not None and not tokenizer.chat_template:
        # Without it apply_chat_template fails after the directory is reloaded.
        tokenizer.chat_template = chat_template
    # The GGUF conversion leaves this "unlimited"; the model's context is the real limit.
    tokenizer.model_max_length = context_length
    tokenizer.save_pretrained(out_dir)


def _make_readable(out_dir: Path) -> None:
    # mkdtemp creates the directory 0700 and safetensors writes 0600; a cache shared with
    # another user (a service account, a container) must still be able to read the model.
    out_dir.chmod(0o755)
    for path in out_dir.iterdir():
        path.chmod(0o644)


def _write_json(path: Path, content: dict[str, Any]) -> None:
    path.write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")
