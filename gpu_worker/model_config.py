"""What the engine needs to know about a model, read from its HF ``config.json``."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedserve.gpu_worker.layers.rope_config import (
    DYNAMIC_WINDOW_REASON,
    GEMMA3_LAYER_TYPES,
    NTK_ALPHA,
    SUPPORTED_ROPE_TYPES,
    layer_type_rope_parameters,
    long_rope_switch,
    olmo3_layer_rope_parameters,
    rope_context_window,
    rope_parameters,
)

# HF architecture name -> the model family implemented in gpu_worker/models.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    # Ministral 3: Mistral with Llama 4's attention temperature (queries scaled by position).
    "Ministral3ForCausalLM": "llama",
    # Llama 4's language model: chunked attention with RoPE and L2 q/k norms on most layers,
    # global attention without RoPE (and with a temperature) on every fourth, and a top-1
    # expert that scales its input by its sigmoid score beside a shared expert.
    "Llama4ForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama",
    "GraniteForCausalLM": "llama",
    "Phi3ForCausalLM": "llama",
    "SmolLM3ForCausalLM": "llama",
    "SeedOssForCausalLM": "llama",
    "Ernie4_5ForCausalLM": "llama",
    "Ernie4_5_MoeForCausalLM": "llama",
    # InternLM3: Llama's implementation (HF's too), its own names for the bias switches.
    "InternLM3ForCausalLM": "llama",
    "ArceeForCausalLM": "llama",
    # Mixture-of-experts members of the family: its attention, a sparse MLP (layers/moe.py).
    "MixtralForCausalLM": "llama",
    "Qwen2MoeForCausalLM": "llama",
    "Qwen3MoeForCausalLM": "llama",
    "GraniteMoeForCausalLM": "llama",
    "GraniteMoeSharedForCausalLM": "llama",
    "Glm4MoeForCausalLM": "llama",
    "Dots1ForCausalLM": "llama",
    "HunYuanDenseV1ForCausalLM": "llama",
    "HunYuanMoEV1ForCausalLM": "llama",
    "ExaoneForCausalLM": "llama",
    "OlmoeForCausalLM": "llama",
    # MiniMax-M2: OLMoE's whole-projection q/k norms, RoPE over part of each head, Mixtral's
    # experts under a sigmoid router whose learned bias only chooses.
    "MiniMaxM2ForCausalLM": "llama",
    "NemotronForCausalLM": "nemotron",
    "ApertusForCausalLM": "llama",
    "OPTForCausalLM": "opt",
    "Olmo2ForCausalLM": "olmo2",
    "Olmo3ForCausalLM": "olmo2",
    "Exaone4ForCausalLM": "olmo2",
    "Starcoder2ForCausalLM": "starcoder2",
    "CohereForCausalLM": "cohere",
    "Glm4ForCausalLM": "glm4",
    "Cohere2ForCausalLM": "cohere",
    "GemmaForCausalLM": "gemma",
    "Gemma2ForCausalLM": "gemma",
    "Gemma3ForCausalLM": "gemma",
    "GptOssForCausalLM": "gpt_oss",
    "DeepseekV2ForCausalLM": "deepseek",
    "DeepseekV3ForCausalLM": "deepseek",
    # GLM-4.7-Flash: DeepSeek-V3's attention and experts under GLM's names for the layers.
    "Glm4MoeLiteForCausalLM": "deepseek",
}

# Sequence classification models (HF's ``*ForSequenceClassification``): the family's decoder
# and a ``score`` head (a bias-free linear map of the final hidden state to one logit per
# label) in place of the LM head; read as the causal architecture beside them, with labels.
# (Gemma 3's text-only classifier is Gemma3TextForSequenceClassification:
# Gemma3ForSequenceClassification is the multimodal model's; HF has no Granite, Cohere,
# ERNIE 4.5 or InternLM3 classifier.)
_NO_CLASSIFIER_OF_THE_NAME = frozenset(
    {
        "Gemma3ForCausalLM",
        "GraniteForCausalLM",
        "GraniteMoeForCausalLM",
        "CohereForCausalLM",
        "Cohere2ForCausalLM",
        "Ernie4_5ForCausalLM",
        "InternLM3ForCausalLM",
        "Glm4MoeForCausalLM",
        "Dots1ForCausalLM",
        "Ernie4_5_MoeForCausalLM",
        "ApertusForCausalLM",
        "GraniteMoeSharedForCausalLM",
        "ExaoneForCausalLM",
        "OlmoeForCausalLM",
        "Glm4MoeLiteForCausalLM",
        "MiniMaxM2ForCausalLM",
        "Llama4ForCausalLM",
    }
)
CLASSIFIER_ARCHITECTURES = {
    name.replace("ForCausalLM", "ForSequenceClassification"): name
    for name in SUPPORTED_ARCHITECTURES
    if name not in _NO_CLASSIFIER_OF_THE_NAME
} | {"Gemma3TextForSequenceClassification": "Gemma3ForCausalLM"}


@dataclass(frozen=True)
class _VisionLanguageModel:
    """How a vision-language checkpoint's language model reads as a text model: its
    ``text_config``'s model_type -> the text architecture (``default_text_type`` when the
    text config names none), the outer config's ``tie_word_embeddings`` default (HF ties
    the LM head by the outer config's), and two of Qwen2.5-VL's ways: older checkpoints keep
    the text fields at the top level (``flat``), and a text config's tie counts too."""

    text_architectures: dict[str, str]
    default_text_type: str
    tie_default: bool
    flat: bool = False
    text_tie_counts: bool = False
    # The text config class's defaults where they differ from the text architecture's
    # (GLM-4V's text model rotates whole heads unless its config says otherwise, and its
    # heads are hidden_size / num_attention_heads: it has no head_dim field).
    text_defaults: tuple[tuple[str, Any], ...] = ()
    head_dim_from_heads: bool = False
    # What the language model's HF class fixes whatever its config says (Qwen3-VL-MoE's
    # router always renormalises its top-k weights).
    text_overrides: tuple[tuple[str, Any], ...] = ()


_LLAVA_TEXT_MODELS = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
# Vision-language checkpoints whose language model this engine serves on its own, for text
# (no image encoder: a request with an image is refused where it arrives). Qwen's M-RoPE
# gives a text token the same position in its three streams: plain RoPE.
VLM_TEXT_MODELS: dict[str, _VisionLanguageModel] = {
    "Gemma3ForConditionalGeneration": _VisionLanguageModel(
        {"gemma3_text": "Gemma3ForCausalLM"}, "gemma3_text", tie_default=True
    ),
    "Mistral3ForConditionalGeneration": _VisionLanguageModel(
        {"ministral3": "Ministral3ForCausalLM", "mistral": "MistralForCausalLM"},
        "mistral",
        tie_default=True,
    ),
    "Qwen2_5_VLForConditionalGeneration": _VisionLanguageModel(
        {"qwen2_5_vl_text": "Qwen2ForCausalLM"},
        "qwen2_5_vl_text",
        tie_default=False,
        flat=True,
        text_tie_counts=True,
    ),
    "Qwen3VLForConditionalGeneration": _VisionLanguageModel(
        {"qwen3_vl_text": "Qwen3ForCausalLM"}, "qwen3_vl_text", tie_default=False
    ),
    "Qwen3VLMoeForConditionalGeneration": _VisionLanguageModel(
        {"qwen3_vl_moe_text": "Qwen3MoeForCausalLM"},
        "qwen3_vl_moe_text",
        tie_default=False,
        text_overrides=(("norm_topk_prob", True),),
    ),
    # GLM-4.1V / 4.5V / 4.6V: GLM-4's and GLM-4.5's language models (M-RoPE over GLM's
    # interleaved pairs: plain for text).
    "Glm4vForConditionalGeneration": _VisionLanguageModel(
        {"glm4v_text": "Glm4ForCausalLM"},
        "glm4v_text",
        tie_default=False,
        text_defaults=(("partial_rotary_factor", 1.0),),
        head_dim_from_heads=True,
    ),
    "Glm4vMoeForConditionalGeneration": _VisionLanguageModel(
        {"glm4v_moe_text": "Glm4MoeForCausalLM"}, "glm4v_moe_text", tie_default=False
    ),
    # GLM-4.6V's own class (its Flash model): GLM-4V's language model.
    "Glm46VForConditionalGeneration": _VisionLanguageModel(
        {"glm4v_text": "Glm4ForCausalLM"},
        "glm4v_text",
        tie_default=False,
        text_defaults=(("partial_rotary_factor", 1.0),),
        head_dim_from_heads=True,
    ),
    # LLaVA (1.5, Pixtral 12B) and LLaVA-NeXT (1.6) over Llama, Mistral or Qwen2.
    "LlavaForConditionalGeneration": _VisionLanguageModel(
        _LLAVA_TEXT_MODELS, "llama", tie_default=False, text_tie_counts=True
    ),
    "LlavaNextForConditionalGeneration": _VisionLanguageModel(
        _LLAVA_TEXT_MODELS, "llama", tie_default=False
    ),
    "LlavaOnevisionForConditionalGeneration": _VisionLanguageModel(
        _LLAVA_TEXT_MODELS, "qwen2", tie_default=False, text_tie_counts=True
    ),
    # Llama 4 (Scout, Maverick): its language model, Llama4ForCausalLM.
    "Llama4ForConditionalGeneration": _VisionLanguageModel(
        {"llama4_text": "Llama4ForCausalLM"}, "llama4_text", tie_default=False
    ),
    # InternVL 3 / 3.5 in transformers' format (the "-hf" checkpoints).
    "InternVLForConditionalGeneration": _VisionLanguageModel(
        {**_LLAVA_TEXT_MODELS, "qwen3": "Qwen3ForCausalLM"}, "qwen2", tie_default=True
    ),
}

# The Gemma architectures with Gemma 2's layer (four norms, query_pre_attn_scalar, sliding
# layers, soft-capping fields).
_GEMMA2_LIKE = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# The architectures whose HF model rotates only part of each head (partial_rotary_factor).
_PARTIAL_ROTARY = (
    "Phi3ForCausalLM",
    "Glm4ForCausalLM",
    "Glm4MoeForCausalLM",
    "NemotronForCausalLM",
    "MiniMaxM2ForCausalLM",
)
# RoPE settings per layer type (sliding / full attention), not one for the model.
_PER_LAYER_TYPE_ROPE = ("Gemma3ForCausalLM", "Olmo3ForCausalLM")
_GEMMA_NAMES = {"Gemma2ForCausalLM": "Gemma 2", "Gemma3ForCausalLM": "Gemma 3"}

# GraniteConfig's: its attention scale defaults to 1.0, not 1/sqrt(head size).
_GRANITE_SCALARS = dict(
    embedding_multiplier=1.0,
    logits_scaling=1.0,
    residual_multiplier=1.0,
    attention_multiplier=1.0,
)
# The HF config class's defaults for fields a config.json may leave out, where they differ
# from what the engine would otherwise assume (Hub Gemma configs have no
# tie_word_embeddings, and Gemma 7B's head_dim is not hidden_size / num_attention_heads).
_CONFIG_DEFAULTS: dict[str, dict[str, Any]] = {
    # Llama4TextConfig's (Llama 4 Scout's shapes).
    "Llama4ForCausalLM": dict(
        rope_theta=500_000.0,
        rms_norm_eps=1e-5,
        head_dim=128,
        max_position_embeddings=131_072,
        intermediate_size=8192,
        intermediate_size_mlp=16384,
        num_local_experts=16,
        num_experts_per_tok=1,
        interleave_moe_layer_step=1,
        use_qk_norm=True,
        no_rope_layer_interval=4,
        attention_chunk_size=8192,
        attn_temperature_tuning=True,
        floor_scale=8192,
        attn_scale=0.1,
    ),
    "GemmaForCausalLM": dict(
        head_dim=256,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
        hidden_act="gelu_pytorch_tanh",
    ),
    "Gemma2ForCausalLM": dict(
        head_dim=256,
        num_key_value_heads=4,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=256,
        sliding_window=4096,
        final_logit_softcapping=30.0,
        attn_logit_softcapping=50.0,
    ),
    "Gemma3ForCausalLM": dict(
        head_dim=256,
        num_key_value_heads=4,
        tie_word_embeddings=True,
        max_position_embeddings=131_072,
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=256,
        sliding_window=4096,
    ),
    "Phi3ForCausalLM": dict(rms_norm_eps=1e-5, max_position_embeddings=4096),
    "Olmo2ForCausalLM": dict(rms_norm_eps=1e-5, max_position_embeddings=2048),
    "Olmo3ForCausalLM": dict(rms_norm_eps=1e-5, max_position_embeddings=2048, sliding_window=4096),
    "CohereForCausalLM": dict(
        rope_theta=500_000.0,
        logit_scale=0.0625,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
    ),
    "Cohere2ForCausalLM": dict(
        logit_scale=0.0625,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
        sliding_window=4096,
    ),
    # Glm4Config gives a config without the field partial_rotary_factor 0.5.
    "Glm4ForCausalLM": dict(
        partial_rotary_factor=0.5,
        rms_norm_eps=1.5625e-07,
        attention_bias=True,
        head_dim=128,
        max_position_embeddings=131072,
    ),
    # Glm4MoeConfig's (GLM-4.5's shapes): half of each head rotates, one shared expert.
    "Glm4MoeForCausalLM": dict(
        partial_rotary_factor=0.5,
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        n_routed_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=1408,
        n_shared_experts=1,
        routed_scaling_factor=1.0,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        norm_topk_prob=True,
    ),
    # DeepseekV2Config's (DeepSeek-V2's shapes, less its experts per token, which every
    # checkpoint gives) and DeepseekV3Config's.
    "DeepseekV2ForCausalLM": dict(
        rms_norm_eps=1e-6,
        max_position_embeddings=2048,
        kv_lora_rank=512,
        q_lora_rank=1536,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=64,
        n_shared_experts=2,
        moe_intermediate_size=1407,
        routed_scaling_factor=1.0,
        topk_method="greedy",
        first_k_dense_replace=0,
    ),
    "DeepseekV3ForCausalLM": dict(
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        kv_lora_rank=512,
        q_lora_rank=1536,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=256,
        n_shared_experts=1,
        num_experts_per_tok=8,
        moe_intermediate_size=2048,
        routed_scaling_factor=2.5,
        n_group=8,
        topk_group=4,
        first_k_dense_replace=3,
        norm_topk_prob=True,
        rope_interleave=True,
    ),
    # Glm4MoeLiteConfig's (GLM-4.7-Flash's shapes): heads of 192 + 64, values of 256; which
    # layers have experts is mlp_layer_types (by default all but the first).
    "Glm4MoeLiteForCausalLM": dict(
        rms_norm_eps=1e-5,
        max_position_embeddings=202752,
        intermediate_size=10240,
        kv_lora_rank=512,
        q_lora_rank=768,
        qk_nope_head_dim=192,
        qk_rope_head_dim=64,
        v_head_dim=256,
        n_routed_experts=64,
        n_shared_experts=1,
        num_experts_per_tok=4,
        moe_intermediate_size=1536,
        routed_scaling_factor=1.8,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        rope_interleave=True,
    ),
    # Ministral3Config's: YaRN over a 16k original context, and Llama 4's query scaling.
    "Ministral3ForCausalLM": dict(
        head_dim=128,
        rms_norm_eps=1e-5,
        max_position_embeddings=262144,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 1000000.0,
            "factor": 16.0,
            "original_max_position_embeddings": 16384,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale_all_dim": 1.0,
            "mscale": 1.0,
            "llama_4_scaling_beta": 0.1,
        },
    ),
    # MiniMaxM2Config's (MiniMax-M2's shapes; its RoPE base when the config gives none).
    "MiniMaxM2ForCausalLM": dict(
        head_dim=128,
        rms_norm_eps=1e-6,
        max_position_embeddings=196608,
        rope_theta=5_000_000.0,
        num_local_experts=256,
        num_experts_per_tok=8,
        intermediate_size=1536,
        tie_word_embeddings=False,
    ),
    # Dots1Config's: its windowed layers, from max_window_layers on, are none at 62 layers.
    "Dots1ForCausalLM": dict(
        rms_norm_eps=1e-6,
        max_position_embeddings=2048,
        sliding_window=4096,
        max_window_layers=62,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=0,
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
    ),
    # ApertusConfig's: xIELU, Llama 3's RoPE scaling over a base of 12M.
    "ApertusForCausalLM": dict(
        hidden_act="xielu",
        rms_norm_eps=1e-5,
        max_position_embeddings=65536,
        rope_theta=12_000_000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "original_max_position_embeddings": 8192,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
        },
    ),
    # NemotronConfig's: half of each head rotates, the squared ReLU.
    "NemotronForCausalLM": dict(
        partial_rotary_factor=0.5,
        norm_eps=1e-5,
        hidden_act="relu2",
        max_position_embeddings=4096,
    ),
    # OlmoeConfig's (OLMoE-1B-7B's experts).
    "OlmoeForCausalLM": dict(
        rms_norm_eps=1e-5,
        max_position_embeddings=4096,
        num_experts=64,
        num_experts_per_tok=8,
        norm_topk_prob=False,
    ),
    # ExaoneConfig's (EXAONE-3.0-7.8B's): Llama's with a RoPE base of 500000.
    "ExaoneForCausalLM": dict(
        rope_theta=500_000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=4096,
        num_key_value_heads=8,
        intermediate_size=14336,
    ),
    # HunYuanDenseV1Config's.
    "HunYuanDenseV1ForCausalLM": dict(rms_norm_eps=1e-5, max_position_embeddings=2048),
    "HunYuanMoEV1ForCausalLM": dict(
        rms_norm_eps=1e-5, max_position_embeddings=2048, num_experts=1, moe_topk=1
    ),
    # Exaone4Config's: three sliding-window layers to each global one, which has no RoPE.
    "Exaone4ForCausalLM": dict(
        rms_norm_eps=1e-5,
        max_position_embeddings=2048,
        sliding_window=4096,
        sliding_window_pattern=4,
    ),
    "Starcoder2ForCausalLM": dict(
        max_position_embeddings=4096, hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True
    ),
    "SmolLM3ForCausalLM": dict(
        tie_word_embeddings=True, max_position_embeddings=32768, rope_theta=2_000_000.0
    ),
    "GraniteForCausalLM": _GRANITE_SCALARS,
    "GraniteMoeForCausalLM": _GRANITE_SCALARS,
    "GraniteMoeSharedForCausalLM": _GRANITE_SCALARS,
    # Ernie4_5Config's: tied embeddings, heads of 128, a RoPE base of 500000.
    "Ernie4_5ForCausalLM": dict(
        rope_theta=500000.0,
        tie_word_embeddings=True,
        head_dim=128,
        use_bias=False,
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
    ),
    # Ernie4_5_MoeConfig's (ERNIE-4.5-21B-A3B's experts), the dense model's otherwise.
    "Ernie4_5_MoeForCausalLM": dict(
        rope_theta=500000.0,
        tie_word_embeddings=True,
        use_bias=False,
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        moe_num_experts=64,
        moe_k=6,
        moe_intermediate_size=1536,
        moe_num_shared_experts=2,
        moe_layer_start_index=1,
        moe_layer_end_index=-1,
        moe_layer_interval=1,
        moe_norm_min=1e-12,
    ),
    # ArceeConfig's: the squared ReLU.
    "ArceeForCausalLM": dict(hidden_act="relu2", rms_norm_eps=1e-5, max_position_embeddings=4096),
    # InternLM3Config's: heads of 128, no biases.
    "InternLM3ForCausalLM": dict(
        head_dim=128, attention_bias=False, mlp_bias=False, rms_norm_eps=1e-5
    ),
    # SeedOssConfig's: q/k/v biases (none on the output projection), heads of 128.
    "SeedOssForCausalLM": dict(
        attention_bias=True, attention_out_bias=False, head_dim=128, max_position_embeddings=524288
    ),
    # GptOssConfig's (gpt-oss-20b's shapes), YaRN included when neither RoPE field is given.
    "GptOssForCausalLM": dict(
        num_hidden_layers=36,
        num_local_experts=128,
        vocab_size=201088,
        hidden_size=2880,
        intermediate_size=2880,
        head_dim=64,
        num_attention_heads=64,
        num_key_value_heads=8,
        sliding_window=128,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        num_experts_per_tok=4,
        swiglu_alpha=1.702,
        swiglu_limit=7.0,
        attention_bias=True,
        rope_theta=150000.0,
        rope_scaling={
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
    ),
}


# Fields a family's configs name their own way (the HF config class's attribute_map): the
# config's name -> the one the engine reads.
_FIELD_ALIASES: dict[str, dict[str, str]] = {
    "InternLM3ForCausalLM": {"qkv_bias": "attention_bias", "bias": "mlp_bias"},
    "ExaoneForCausalLM": {
        "num_layers": "num_hidden_layers",
        "layer_norm_epsilon": "rms_norm_eps",
        "activation_function": "hidden_act",
    },
}


@dataclass(frozen=True)
class GroupedRouting:
    """DeepSeek's routers and GLM-4.5's: the experts fall in ``num_groups`` equal groups; each
    token keeps its ``top_k_groups`` best groups and picks its top-k experts among them; their
    weights are scaled by ``routed_scaling_factor``. All in float32, over a router weight kept
    in float32 (HF's ``_keep_in_fp32_modules_strict``).

    ``sigmoid`` (DeepSeek-V3's "noaux_tc", GLM-4.5): an expert's score is the sigmoid of its
    logit; a group ranks by the sum of its two best. Otherwise (DeepSeek-V2's "greedy", one
    group, and "group_limited_greedy"; ERNIE 4.5) the scores are the logits' softmax and a group
    ranks by its best. ``correction_bias`` (V3, GLM-4.5, ERNIE 4.5, MiniMax-M2): a learned bias
    per expert (``gate.e_score_correction_bias``) joins the scores that choose, not the weights.
    ``router_in_float32`` off (MiniMax-M2, one group): the router weight, its logits and the
    bias are in the model's dtype, the scores from them in float32, as HF's Mixtral-based
    router has them."""

    sigmoid: bool
    num_groups: int
    top_k_groups: int
    routed_scaling_factor: float
    correction_bias: bool = False
    router_in_float32: bool = True


@dataclass(frozen=True)
class ExpertsSpec:
    """A mixture-of-experts layer: a router scores ``num_experts`` gated MLPs for each
    token and sums the ``top_k`` best, weighted by their softmax probabilities (DeepSeek's,
    GLM-4.5's, ERNIE 4.5's and Hunyuan's routers: ``grouped``), plus a shared MLP where
    ``shared_intermediate_size`` says."""

    num_experts: int
    top_k: int
    # Each expert's intermediate features (and the config field that gives them).
    intermediate_size: int
    intermediate_field: str
    # Whether the top-k probabilities are rescaled to sum to 1 (Mixtral always; Qwen's
    # ``norm_topk_prob``).
    renormalize: bool
    # Mixtral weighs expert outputs in float32; Qwen rounds the weights to the model's
    # dtype first (the same numbers in float32, not in bfloat16).
    weights_in_float32: bool
    # Qwen2-MoE's shared expert, added to every token behind a sigmoid gate; 0: none.
    shared_intermediate_size: int = 0
    # Granite MoE weighs the top k by the softmax of their logits alone (the same numbers
    # as the others' renormalised top-k probabilities, not the same float32 bits).
    softmax_over_top_k: bool = False
    # gpt-oss: a router with a bias, experts with biases, and its clamped SwiGLU
    # ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``, g = ``min(gate, limit)``
    # (None: the plain gated MLP of ``hidden_act``).
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_alpha: float | None = None
    swiglu_limit: float | None = None
    # DeepSeek's and GLM-4.5's router (None: the ones above).
    grouped: GroupedRouting | None = None
    # Qwen2-MoE gates its shared expert by a sigmoid; DeepSeek's and GLM-4.5's shared experts
    # (``mlp.shared_experts``, ``n_shared_experts`` experts' rows as one MLP) are added as is.
    shared_expert_gated: bool = True
    # ERNIE 4.5's shared experts have biases when ``use_bias`` says (its experts never do).
    shared_expert_bias: bool = False
    # Llama 4: the top-k logits' sigmoids (in the model's dtype) weigh each expert's input,
    # not its output.
    sigmoid_scales_input: bool = False


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and special tokens of a model; ``hf_config`` keeps the raw fields that
    only one family reads (biases, RoPE scaling, OPT's projections), with the HF config
    class's defaults filled in where they matter (``_CONFIG_DEFAULTS``)."""

    path: Path
    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    max_position_embeddings: int
    eos_token_ids: frozenset[int]
    # Each layer's sliding window in tokens, 0 for full attention (see _layer_sliding_windows).
    layer_sliding_windows: tuple[int, ...]
    # Each layer's experts; None for a dense MLP (see _layer_experts).
    layer_experts: tuple[ExpertsSpec | None, ...]
    # Each layer's attention chunk in tokens, 0 where it attends to the whole context (see
    # _layer_attention_chunks).
    layer_attention_chunks: tuple[int, ...]
    hf_config: dict[str, Any] = field(repr=False, compare=False)
    # A sequence classification model's labels, in the order of its head's logits (its
    # ``id2label``); empty for a causal LM.
    labels: tuple[str, ...] = ()
    # The architecture config.json names (LlamaForSequenceClassification for a classifier
    # read as LlamaForCausalLM; the same as ``architecture`` for a causal LM).
    declared_architecture: str = ""

    @property
    def task(self) -> str:
        """``"classify"`` for a sequence classification model, else ``"generate"`` (a causal
        LM: generation and embeddings), as ``SchedulerConfig.model_task`` takes it."""
        return "classify" if self.labels else "generate"

    @property
    def context_window_reason(self) -> str:
        """Why ``max_position_embeddings`` is where the window stops though the RoPE scaling
        reaches further (a dynamic-NTK model's configured one); "" when it is not."""
        if self.architecture in _PER_LAYER_TYPE_ROPE:
            return ""
        rope_type = rope_parameters(self.hf_config)["rope_type"]
        if rope_type == "dynamic":
            return DYNAMIC_WINDOW_REASON
        return ""

    @property
    def long_rope_switch(self) -> int:
        """A LongRoPE model's original context, past which its long factors rotate (the
        rule: ``rope_config.long_rope_switch``); 0 for other models."""
        if self.architecture in _PER_LAYER_TYPE_ROPE:
            return 0
        return long_rope_switch(rope_parameters(self.hf_config))

    @property
    def has_experts(self) -> bool:
        return any(spec is not None for spec in self.layer_experts)

    @property
    def attention_window(self) -> int:
        """Tokens of context that every layer attends to at most, back from each query
        token (the largest layer window), or 0 when some layer attends to all of it: what
        the scheduler may free blocks behind (``SchedulerConfig.sliding_window``)."""
        windows = self.layer_sliding_windows
        return max(windows) if windows and min(windows) > 0 else 0

    @property
    def latent_attention(self) -> bool:
        """Whether the cache holds latents (DeepSeek's multi-head latent attention,
        ``layers/latent_attention.py``), which each step's ``latent_plans`` read."""
        return self.family == "deepseek"

    @property
    def attention_chunk_size(self) -> int:
        """Tokens per chunk of the layers of chunked attention (Llama 4's: each token
        attends only within its chunk; the others to the whole context), or 0 when no layer
        is chunked. What the step's ``AttentionMetadata.chunked`` view cuts at."""
        return max(self.layer_attention_chunks, default=0)

    @property
    def embedding_size(self) -> int:
        """Values in the model's output hidden state, what an embedding pools: the hidden
        size, or OPT's ``word_embed_proj_dim`` when it projects out."""
        return self.hf_config.get("word_embed_proj_dim") or self.hidden_size

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ValueError(f"model: {str(path)!r} has no config.json")
        hf_config = json.loads(config_file.read_text())
        architectures = hf_config.get("architectures") or []
        vlm = next((a for a in architectures if a in VLM_TEXT_MODELS), None)
        if vlm is not None:
            hf_config, architectures = _vlm_text_config(vlm, hf_config), [vlm]
        known = {
            **{name: name for name in SUPPORTED_ARCHITECTURES},
            **CLASSIFIER_ARCHITECTURES,
            **({vlm: hf_config["architectures"][0]} if vlm else {}),
        }
        declared = next((a for a in architectures if a in known), None)
        if declared is None:
            raise ValueError(
                f"model: architecture {architectures or hf_config.get('model_type')!r} in "
                f"{str(config_file)!r} is not supported; supported: "
                f"{', '.join(dict.fromkeys([*known, *VLM_TEXT_MODELS]))}"
            )
        architecture = known[declared]
        labels = _labels(hf_config) if declared in CLASSIFIER_ARCHITECTURES else ()
        family = SUPPORTED_ARCHITECTURES[architecture]
        for alias, field_name in _FIELD_ALIASES.get(architecture, {}).items():
            if alias in hf_config:  # as the HF config class's attribute_map reads it
                hf_config.setdefault(field_name, hf_config[alias])
        hf_config = {**_CONFIG_DEFAULTS.get(architecture, {}), **hf_config}
        if architecture in HUNYUAN:
            hf_config = _with_ntk_alpha_rope(hf_config)
        if architecture == "MiniMaxM2ForCausalLM" and hf_config.get("rotary_dim") is not None:
            # MiniMaxM2Config's reading: RoPE over the first rotary_dim values of each head.
            hf_config.setdefault(
                "partial_rotary_factor", hf_config["rotary_dim"] / hf_config["head_dim"]
            )
        _check_supported_fields(architecture, hf_config)
        num_heads = hf_config["num_attention_heads"]
        hidden_size = hf_config["hidden_size"]
        head_size = hf_config.get("head_dim") or hidden_size // num_heads
        num_kv_heads = hf_config.get("num_key_value_heads") or num_heads
        if family == "deepseek":
            head_size, num_kv_heads = latent_cache_head_size(hf_config), 1
        return cls(
            path=path,
            architecture=architecture,
            family=family,
            vocab_size=hf_config["vocab_size"],
            hidden_size=hidden_size,
            num_layers=hf_config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            max_position_embeddings=_max_positions(architecture, hf_config),
            eos_token_ids=_eos_token_ids(path, hf_config),
            layer_sliding_windows=_layer_sliding_windows(architecture, hf_config),
            layer_experts=_layer_experts(architecture, hf_config),
            layer_attention_chunks=_layer_attention_chunks(architecture, hf_config),
            hf_config=hf_config,
            labels=labels,
            declared_architecture=declared,
        )


def latent_cache_head_size(hf_config: dict[str, Any]) -> int:
    """The KV cache's head size for DeepSeek's multi-head latent attention, whose cache holds
    one latent per token and layer, ``kv_lora_rank + qk_rope_head_dim`` values, as one KV
    head whose key row holds the first half and whose value row the rest (rounded up:
    ``layers/latent_attention.py``), as HF caches it (DeepSeek-V3: 576 values, 288 a row)."""
    for name in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank"):
        value = hf_config.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"model: {name} must be a positive integer, got {value!r}")
    if hf_config["qk_rope_head_dim"] % 2:
        raise ValueError(
            f"model: qk_rope_head_dim={hf_config['qk_rope_head_dim']} must be even (RoPE "
            "rotates pairs)"
        )
    q_lora_rank = hf_config.get("q_lora_rank")
    if q_lora_rank is not None and (
        isinstance(q_lora_rank, bool) or not isinstance(q_lora_rank, int) or q_lora_rank < 1
    ):
        raise ValueError(
            f"model: q_lora_rank must be a positive integer or null, got {q_lora_rank!r}"
        )
    return -(-(hf_config["kv_lora_rank"] + hf_config["qk_rope_head_dim"]) // 2)


def _with_ntk_alpha_rope(hf_config: dict[str, Any]) -> dict[str, Any]:
    """Hunyuan's RoPE: its checkpoints label it "dynamic" with an ``alpha``, which HF's
    Hunyuan model runs as a fixed NTK stretch of the base (``ntk_alpha``: the same frequencies
    at every length), not as dynamic NTK."""
    parameters = rope_parameters(hf_config)
    if parameters["rope_type"] != "dynamic" or not parameters.get("alpha"):
        return hf_config
    alpha = parameters["alpha"]
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        raise ValueError(f"model: rope alpha must be a positive number, got {alpha!r}")
    return {**hf_config, "rope_parameters": {**parameters, "rope_type": NTK_ALPHA}}


def _labels(hf_config: dict[str, Any]) -> tuple[str, ...]:
    """A classifier's labels as HF's ``PretrainedConfig`` reads them: ``id2label`` (keys 0 to
    n - 1), else ``num_labels`` (default 2) labels named ``LABEL_<i>``."""
    id2label = hf_config.get("id2label")
    if id2label:
        if not isinstance(id2label, dict) or sorted(map(str, id2label)) != sorted(
            str(i) for i in range(len(id2label))
        ):
            raise ValueError(
                f"model: id2label must map the label ids 0 to n - 1 to names, got {id2label!r:.200}"
            )
        return tuple(str(id2label[str(i)]) for i in range(len(id2label)))
    num_labels = hf_config.get("num_labels", 2)
    if isinstance(num_labels, bool) or not isinstance(num_labels, int) or num_labels < 1:
        raise ValueError(f"model: num_labels must be an integer >= 1, got {num_labels!r}")
    return tuple(f"LABEL_{i}" for i in range(num_labels))


def _check_supported_fields(architecture: str, hf_config: dict[str, Any]) -> None:
    """Refuse config values the HF model honours but this engine's ops cannot (and check
    SmolLM3's RoPE layers here, before any weight loads)."""
    rope_layers(architecture, hf_config)
    _check_checkpoint_quantization(architecture, hf_config)
    if architecture not in _PER_LAYER_TYPE_ROPE:
        parameters = rope_parameters(hf_config)
        supported = SUPPORTED_ROPE_TYPES
        if architecture in HUNYUAN:
            supported = (*supported, NTK_ALPHA)
        if parameters["rope_type"] not in supported:
            raise ValueError(
                f"model: rope_type {parameters['rope_type']!r} is not supported yet; "
                f"supported: {', '.join(supported)}"
            )
        partial = parameters.get("partial_rotary_factor")
        if partial not in (None, 1, 1.0) and architecture not in _PARTIAL_ROTARY:
            raise ValueError(
                f"model: partial_rotary_factor={partial!r} is not supported for "
                f"{architecture} (RoPE over part of each head: {', '.join(_PARTIAL_ROTARY)}); "
                "supported: 1.0"
            )
    if architecture not in ("GemmaForCausalLM", *_GEMMA2_LIKE):
        return
    if hf_config.get("use_bidirectional_attention"):
        raise ValueError(
            f"model: use_bidirectional_attention={hf_config['use_bidirectional_attention']!r} "
            f"is not supported: the attention ops are causal; supported: false or null"
        )
    if architecture not in _GEMMA2_LIKE:
        return  # GemmaConfig has no soft-capping: HF ignores the fields below
    # HF divides by each cap whenever it is not None: 0 would make every logit NaN.
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        cap = hf_config.get(name)
        if cap is not None and (
            isinstance(cap, bool)
            or not isinstance(cap, (int, float))
            or not math.isfinite(cap)
            or cap <= 0
        ):
            raise ValueError(f"model: {name} must be a positive finite number or null, got {cap!r}")


def _check_checkpoint_quantization(architecture: str, hf_config: dict[str, Any]) -> None:
    """A checkpoint quantized ahead of time (``quantization_config``) loads only in the form
    the engine widens on loading: gpt-oss's MXFP4 experts. Others (AWQ, GPTQ, FP8, ...) are
    refused here, naming the method, rather than failing on their packed tensors' names."""
    quantization = hf_config.get("quantization_config")
    if quantization is None:
        return
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    if architecture == "GptOssForCausalLM" and method == "mxfp4":
        return
    raise ValueError(
        f"model: quantization_config quant_method {method!r} is not supported for "
        f"{architecture}; supported: mxfp4 (gpt-oss's experts, widened on loading). An "
        "unquantized checkpoint can be quantized as it loads (quantization='int8', CPU)"
    )


def _max_positions(architecture: str, hf_config: dict[str, Any]) -> int:
    max_positions = hf_config.get("max_position_embeddings", 2048)
    # Gemma 3's global layers carry its RoPE scaling; its sliding layers never scale.
    if architecture == "Gemma3ForCausalLM":
        parameters = layer_type_rope_parameters(hf_config, "full_attention")
    elif architecture == "Olmo3ForCausalLM":
        parameters = olmo3_layer_rope_parameters(hf_config, "full_attention")
    else:
        parameters = rope_parameters(hf_config)
    # YaRN extends the context past the configured positions (the original times the factor);
    # LongRoPE's is the configured one (its long factors past the original context). A
    # sliding window does not bound it: the attention ops honour each layer's window.
    return rope_context_window(parameters, max_positions)


def _layer_sliding_windows(architecture: str, hf_config: dict[str, Any]) -> tuple[int, ...]:
    """Each layer's sliding window in tokens (0: full attention), as HF transformers 5.x
    builds the model:

    - Mistral, Ministral 3, Mixtral, Phi-3 and StarCoder2: ``sliding_window`` (when set) on
      every layer;
      their configs ignore ``layer_types`` and ``use_sliding_window``.
    - Qwen2 / Qwen3 / Qwen2-MoE: ``sliding_window`` counts only with ``use_sliding_window``
      (default false); then the layers whose ``layer_types`` entry is ``"sliding_attention"``
      use it, and without ``layer_types`` the layers from ``max_window_layers`` (default 28)
      on do (Qwen2 / Qwen3), or the even-numbered layers below it (Qwen2-MoE).
    - Qwen3-MoE: with ``use_sliding_window``, every layer.
    - Gemma 2 and Gemma 3: ``sliding_window`` on the layers ``gemma_layer_types`` marks
      ``"sliding_attention"``.
    - OLMo 3: ``sliding_window`` (default 4096) on the layers ``olmo3_layer_types`` marks
      ``"sliding_attention"``.
    - Cohere2: ``sliding_window`` (default 4096) on the layers ``layer_types`` marks
      ``"sliding_attention"``, without it all but every ``sliding_window_pattern``-th (4).
    - gpt-oss: ``sliding_window`` (default 128) on the layers ``layer_types`` marks
      ``"sliding_attention"``, without it the even-numbered ones.
    - SmolLM3: with ``use_sliding_window``, the layers ``layer_types`` marks
      ``"sliding_attention"``; without ``layer_types``, its layers without RoPE.
    - Llama, OPT and Gemma have no sliding window.
    """
    num_layers = hf_config["num_hidden_layers"]
    window = hf_config.get("sliding_window") or 0
    if not isinstance(window, int) or isinstance(window, bool) or window < 0:
        raise ValueError(f"model: sliding_window must be a non-negative integer, got {window!r}")
    if architecture in (
        "MistralForCausalLM",
        "Ministral3ForCausalLM",
        "MixtralForCausalLM",
        "Phi3ForCausalLM",
        "Starcoder2ForCausalLM",
    ):
        return (window,) * num_layers
    if architecture in _GEMMA2_LIKE:
        layer_types = gemma_layer_types(architecture, hf_config)
        if window == 0 and "sliding_attention" in layer_types:
            # HF refuses a missing window and masks every key with a window of 0.
            raise ValueError(
                f"model: {_GEMMA_NAMES[architecture]}'s sliding_attention layers need a "
                f"sliding_window of at least 1 token, got {hf_config.get('sliding_window')!r}"
            )
        return tuple(window if kind == "sliding_attention" else 0 for kind in layer_types)
    if architecture == "Olmo3ForCausalLM":
        layer_types = olmo3_layer_types(hf_config)
        return tuple(window if kind == "sliding_attention" else 0 for kind in layer_types)
    if architecture == "Cohere2ForCausalLM":
        pattern = hf_config.get("sliding_window_pattern", 4)
        layer_types = hf_config.get("layer_types") or [
            "sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(num_layers)
        ]
        _check_layer_count(layer_types, num_layers)
        return tuple(window if kind == "sliding_attention" else 0 for kind in layer_types)
    if architecture == "Exaone4ForCausalLM":
        return tuple(
            window if kind == "sliding_attention" else 0 for kind in exaone4_layer_types(hf_config)
        )
    if architecture == "Dots1ForCausalLM":
        first_windowed = hf_config["max_window_layers"]
        layer_types = hf_config.get("layer_types") or [
            "sliding_attention" if window and i >= first_windowed else "full_attention"
            for i in range(num_layers)
        ]
        _check_layer_count(layer_types, num_layers)
        return tuple(window if kind == "sliding_attention" else 0 for kind in layer_types)
    if architecture == "GptOssForCausalLM":
        layer_types = hf_config.get("layer_types") or [
            "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)
        ]
        _check_layer_count(layer_types, num_layers)
        return tuple(window if kind == "sliding_attention" else 0 for kind in layer_types)
    if architecture == "SmolLM3ForCausalLM":
        if not hf_config.get("use_sliding_window", False):
            return (0,) * num_layers
        layer_types = hf_config.get("layer_types") or [
            "sliding_attention" if window and not rotates else "full_attention"
            for rotates in rope_layers(architecture, hf_config)
        ]
        _check_layer_count(layer_types, num_layers)
        return tuple(window if kind == "sliding_attention" else 0 for kind in layer_types)
    if architecture not in (
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "Qwen2MoeForCausalLM",
        "Qwen3MoeForCausalLM",
    ):
        return (0,) * num_layers
    if not hf_config.get("use_sliding_window", False):
        window = 0
    if architecture == "Qwen3MoeForCausalLM":
        return (window,) * num_layers
    layer_types = hf_config.get("layer_types")
    if layer_types is None:
        first_windowed = hf_config.get("max_window_layers", 28)
        if architecture == "Qwen2MoeForCausalLM":
            windowed = [i % 2 == 0 and i < first_windowed for i in range(num_layers)]
        else:
            windowed = [i >= first_windowed for i in range(num_layers)]
        layer_types = ["sliding_attention" if sliding else "full_attention" for sliding in windowed]
    _check_layer_count(layer_types, num_layers)
    return tuple(window if kind == "sliding_attention" else 0 for kind in layer_types)


def olmo3_layer_types(hf_config: dict[str, Any]) -> list[str]:
    """Each OLMo 3 layer's kind: ``layer_types``, else as Olmo3Config derives them (every
    fourth layer full attention, the others sliding)."""
    num_layers = hf_config["num_hidden_layers"]
    layer_types = hf_config.get("layer_types") or [
        "full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(num_layers)
    ]
    _check_layer_count(layer_types, num_layers)
    unknown = sorted(set(layer_types) - set(GEMMA3_LAYER_TYPES))
    if unknown:
        raise ValueError(
            f"model: layer_types holds {', '.join(map(repr, unknown))}, which OLMo 3 does not "
            f"have; supported: {', '.join(GEMMA3_LAYER_TYPES)}"
        )
    return list(layer_types)


def rope_layers(architecture: str, hf_config: dict[str, Any]) -> tuple[bool, ...]:
    """Whether each layer rotates its queries and keys: SmolLM3's and Llama 4's
    ``no_rope_layers`` (1: RoPE, 0: none; without it every ``no_rope_layer_interval``-th
    layer, default 4, has none, as their configs derive it; Llama 4's may be longer than
    the layers, and an empty list is none); EXAONE 4's windowed layers only, when it has any
    (``exaone4_layer_types``); every layer elsewhere."""
    num_layers = hf_config["num_hidden_layers"]
    if architecture == "Exaone4ForCausalLM":
        # EXAONE 4's global layers attend without RoPE when the model has windowed ones.
        if not hf_config.get("sliding_window"):
            return (True,) * num_layers
        return tuple(kind == "sliding_attention" for kind in exaone4_layer_types(hf_config))
    if architecture not in ("SmolLM3ForCausalLM", "Llama4ForCausalLM"):
        return (True,) * num_layers
    flags = hf_config.get("no_rope_layers")
    llama4 = architecture == "Llama4ForCausalLM"
    if llama4 and isinstance(flags, list) and len(flags) > num_layers:
        flags = flags[:num_layers]  # Llama4TextConfig reads one per layer, by index
    if flags is None or (llama4 and flags == []):
        interval = hf_config.get("no_rope_layer_interval", 4)
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(
                f"model: no_rope_layer_interval must be an integer >= 1, got {interval!r}"
            )
        flags = [int((i + 1) % interval != 0) for i in range(num_layers)]
    if (
        not isinstance(flags, list)
        or len(flags) != num_layers
        or any(f not in (0, 1) for f in flags)
    ):
        raise ValueError(
            f"model: no_rope_layers must hold one 0 or 1 per layer ({num_layers}), "
            f"got {flags!r:.200}"
        )
    return tuple(bool(flag) for flag in flags)


_LLAMA4_LAYER_TYPES = ("chunked_attention", "full_attention")


def _layer_attention_chunks(architecture: str, hf_config: dict[str, Any]) -> tuple[int, ...]:
    """Each layer's attention chunk (0: the whole context), as Llama4TextConfig derives it:
    ``layer_types``, else ``"chunked_attention"`` on the layers with RoPE when
    ``attention_chunk_size`` is set (null: no chunks); a chunked layer's tokens attend only
    to the earlier tokens of their own chunk of ``attention_chunk_size`` positions. Only
    Llama 4 has chunked layers."""
    num_layers = hf_config["num_hidden_layers"]
    if architecture != "Llama4ForCausalLM":
        return (0,) * num_layers
    chunk = hf_config.get("attention_chunk_size")
    layer_types = hf_config.get("layer_types") or [
        "chunked_attention" if rotates and chunk is not None else "full_attention"
        for rotates in rope_layers(architecture, hf_config)
    ]
    _check_layer_count(layer_types, num_layers)
    unknown = sorted(set(layer_types) - set(_LLAMA4_LAYER_TYPES))
    if unknown:
        raise ValueError(
            f"model: layer_types holds {', '.join(map(repr, unknown))}, which Llama 4 does not "
            f"have; supported: {', '.join(_LLAMA4_LAYER_TYPES)}"
        )
    if "chunked_attention" in layer_types and (
        isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1
    ):
        raise ValueError(
            "model: attention_chunk_size must be an integer >= 1 where layer_types has "
            f"chunked_attention layers, got {chunk!r}"
        )
    return tuple(chunk if kind == "chunked_attention" else 0 for kind in layer_types)


def exaone4_layer_types(hf_config: dict[str, Any]) -> list[str]:
    """Each EXAONE 4 layer's kind: none windowed without a ``sliding_window``; else the
    config's ``layer_types``, or every ``sliding_window_pattern``-th layer global and the
    others windowed (Exaone4Config's derivation)."""
    num_layers = hf_config["num_hidden_layers"]
    if not hf_config.get("sliding_window"):
        return ["full_attention"] * num_layers
    layer_types = hf_config.get("layer_types")
    if layer_types is None:
        pattern = hf_config["sliding_window_pattern"]
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise ValueError(
                "model: EXAONE 4 without layer_types needs sliding_window_pattern, an integer "
                f">= 1 (every pattern-th layer global), got {pattern!r}"
            )
        layer_types = [
            "sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(num_layers)
        ]
    _check_layer_count(layer_types, num_layers)
    unknown = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise ValueError(
            f"model: layer_types holds {', '.join(map(repr, unknown))}; supported: "
            "sliding_attention, full_attention"
        )
    return list(layer_types)


def gemma_layer_types(architecture: str, hf_config: dict[str, Any]) -> list[str]:
    """Each Gemma 2 or Gemma 3 layer's kind, ``"sliding_attention"`` or ``"full_attention"``:
    the config's ``layer_types``, else as the HF config class derives them (transformers 4
    configs have none): Gemma2Config makes the even-numbered layers sliding and the odd ones
    full; Gemma3TextConfig makes every ``sliding_window_pattern``-th layer (default 6) full
    and the others sliding."""
    num_layers = hf_config["num_hidden_layers"]
    layer_types = hf_config.get("layer_types")
    if layer_types is None and architecture == "Gemma2ForCausalLM":
        layer_types = [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)
        ]
    elif layer_types is None:
        pattern = hf_config.get("sliding_window_pattern", 6)
        layer_types = [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(num_layers)
        ]
    _check_layer_count(layer_types, num_layers)
    unknown = sorted(set(layer_types) - set(GEMMA3_LAYER_TYPES))
    if unknown:
        raise ValueError(
            f"model: layer_types holds {', '.join(map(repr, unknown))}, which "
            f"{_GEMMA_NAMES[architecture]} does not have; "
            f"supported: {', '.join(GEMMA3_LAYER_TYPES)}"
        )
    return list(layer_types)


def _check_layer_count(layer_types: list[str], num_layers: int) -> None:
    if len(layer_types) != num_layers:
        raise ValueError(
            f"model: layer_types has {len(layer_types)} entries but num_hidden_layers is "
            f"{num_layers}; they must match"
        )


def _layer_experts(architecture: str, hf_config: dict[str, Any]) -> tuple[ExpertsSpec | None, ...]:
    """Each layer's experts as HF transformers 5.x builds the model (absent fields take
    its config classes' defaults):

    - Mixtral: every layer; ``num_local_experts`` experts of ``intermediate_size``, top
      ``num_experts_per_tok`` (default 2), renormalised.
    - gpt-oss: every layer; ``num_local_experts`` (default 128) experts of
      ``intermediate_size``, top ``num_experts_per_tok`` (default 4) weighted by the softmax
      of their logits; a router bias, expert biases and the clamped SwiGLU.
    - Granite MoE: every layer; ``num_local_experts`` (default 8) experts of
      ``intermediate_size``, top ``num_experts_per_tok`` (default 2), weighted by the softmax
      of the top-k logits.
    - Qwen2-MoE / Qwen3-MoE: ``num_experts`` experts of ``moe_intermediate_size``, top
      ``num_experts_per_tok``, renormalised with ``norm_topk_prob``; sparse at the layers
      not in ``mlp_only_layers`` whose number + 1 is a multiple of ``decoder_sparse_step``,
      the others a dense MLP of ``intermediate_size``. Qwen2-MoE adds a shared expert of
      ``shared_expert_intermediate_size``.
    - OLMoE: every layer; ``num_experts`` (default 64) of ``intermediate_size``, top
      ``num_experts_per_tok`` (default 8), renormalised with ``norm_topk_prob``.
    - Granite MoE Shared: Granite MoE's, plus an ungated-add shared MLP of
      ``shared_intermediate_size``.
    - DeepSeek-V2 / V3, GLM-4.5, dots.llm1: ``_grouped_router_experts``; ERNIE 4.5 MoE:
      ``_ernie_experts``; Hunyuan MoE: ``_hunyuan_experts``.
    - MiniMax-M2: every layer; ``num_local_experts`` (default 256) of ``intermediate_size``, top
      ``num_experts_per_tok`` (default 8) by sigmoid scores plus ``e_score_correction_bias``,
      weighted by their scores renormalised (``GroupedRouting`` of one group, in the model's
      dtype).
    - Llama 4: ``_llama4_experts``.
    """
    num_layers = hf_config["num_hidden_layers"]
    if architecture == "Llama4ForCausalLM":
        return _llama4_experts(hf_config)
    if architecture == "GptOssForCausalLM":
        num_experts, num_experts_field = _num_experts(hf_config, 128)
        spec = _checked_experts(
            hf_config,
            num_experts=num_experts,
            num_experts_field=num_experts_field,
            top_k=hf_config.get("num_experts_per_tok", 4),
            intermediate_field="intermediate_size",
            renormalize=False,
            weights_in_float32=False,
            softmax_over_top_k=True,
        )
        for name in ("swiglu_alpha", "swiglu_limit"):
            value = hf_config[name]
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value <= 0
            ):
                raise ValueError(f"model: {name} must be a positive finite number, got {value!r}")
        spec = dataclasses.replace(
            spec,
            router_bias=True,
            expert_bias=True,
            swiglu_alpha=float(hf_config["swiglu_alpha"]),
            swiglu_limit=float(hf_config["swiglu_limit"]),
        )
        return (spec,) * num_layers
    if architecture in ("MixtralForCausalLM", *_GRANITE_MOE):
        num_experts, num_experts_field = _num_experts(hf_config, 8)
        mixtral = architecture == "MixtralForCausalLM"
        spec = _checked_experts(
            hf_config,
            num_experts=num_experts,
            num_experts_field=num_experts_field,
            top_k=hf_config.get("num_experts_per_tok", 2),
            intermediate_field="intermediate_size",
            renormalize=mixtral,
            weights_in_float32=mixtral,
            softmax_over_top_k=not mixtral,
        )
        if architecture == "GraniteMoeSharedForCausalLM":
            # Its shared MLP (gated, ``shared_intermediate_size``; 0: none) is added as is.
            shared = hf_config.get("shared_intermediate_size", 0)
            if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
                raise ValueError(
                    f"model: shared_intermediate_size must be an integer >= 0, got {shared!r}"
                )
            spec = dataclasses.replace(
                spec, shared_intermediate_size=shared, shared_expert_gated=False
            )
        return (spec,) * num_layers
    if architecture in _GROUPED_ROUTER_MOE:
        return _grouped_router_experts(architecture, hf_config)
    if architecture == "Ernie4_5_MoeForCausalLM":
        return _ernie_experts(hf_config)
    if architecture == "HunYuanMoEV1ForCausalLM":
        return _hunyuan_experts(hf_config)
    if architecture == "MiniMaxM2ForCausalLM":
        num_experts, num_experts_field = _num_experts(hf_config, 256)
        spec = _checked_experts(
            hf_config,
            num_experts=num_experts,
            num_experts_field=num_experts_field,
            top_k=hf_config["num_experts_per_tok"],
            intermediate_field="intermediate_size",
            renormalize=True,
            weights_in_float32=True,
        )
        if spec.num_experts < 2:
            raise ValueError(
                f"model: {num_experts_field}={spec.num_experts}: the sigmoid router needs at "
                "least 2 experts"
            )
        routing = GroupedRouting(True, 1, 1, 1.0, correction_bias=True, router_in_float32=False)
        return (dataclasses.replace(spec, grouped=routing),) * num_layers
    if architecture == "OlmoeForCausalLM":
        num_experts, num_experts_field = _num_experts(hf_config, 64)
        spec = _checked_experts(
            hf_config,
            num_experts=num_experts,
            num_experts_field=num_experts_field,
            top_k=hf_config["num_experts_per_tok"],
            intermediate_field="intermediate_size",
            renormalize=bool(hf_config["norm_topk_prob"]),
            weights_in_float32=False,
        )
        return (spec,) * num_layers
    if architecture not in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        return (None,) * num_layers
    qwen2 = architecture == "Qwen2MoeForCausalLM"
    num_experts, num_experts_field = _num_experts(hf_config, 60 if qwen2 else 128)
    if num_experts == 0:
        return (None,) * num_layers  # HF: no expert anywhere, every layer dense
    spec = _checked_experts(
        hf_config,
        num_experts=num_experts,
        num_experts_field=num_experts_field,
        top_k=hf_config.get("num_experts_per_tok", 4 if qwen2 else 8),
        intermediate_field="moe_intermediate_size",
        renormalize=bool(hf_config.get("norm_topk_prob", False)),
        weights_in_float32=False,
        shared_intermediate_size=hf_config.get("shared_expert_intermediate_size", 5632)
        if qwen2
        else 0,
    )
    step = hf_config.get("decoder_sparse_step", 1)
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"model: decoder_sparse_step must be a positive integer, got {step!r}")
    dense = set(hf_config.get("mlp_only_layers") or [])
    return tuple(
        spec if i not in dense and (i + 1) % step == 0 else None for i in range(num_layers)
    )


def _llama4_experts(hf_config: dict[str, Any]) -> tuple[ExpertsSpec | None, ...]:
    """Llama 4's experts, at the layers in ``moe_layers``, else at every
    ``interleave_moe_layer_step``-th (default 1: all): ``num_local_experts`` (default 16) of
    ``intermediate_size``, the top ``num_experts_per_tok`` (default 1) by logit, each scaling
    its input by its logit's sigmoid, plus a shared expert of ``intermediate_size``; the
    other layers have a dense MLP of ``intermediate_size_mlp``."""
    num_layers = hf_config["num_hidden_layers"]
    num_experts, num_experts_field = _num_experts(hf_config, 16)
    spec = _checked_experts(
        hf_config,
        num_experts=num_experts,
        num_experts_field=num_experts_field,
        top_k=hf_config["num_experts_per_tok"],
        intermediate_field="intermediate_size",
        renormalize=False,
        weights_in_float32=False,
    )
    spec = dataclasses.replace(
        spec,
        shared_intermediate_size=spec.intermediate_size,
        shared_expert_gated=False,
        sigmoid_scales_input=True,
    )
    moe_layers = hf_config.get("moe_layers")
    if moe_layers is None:
        step = hf_config["interleave_moe_layer_step"]
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise ValueError(
                f"model: interleave_moe_layer_step must be an integer >= 1, got {step!r}"
            )
        moe_layers = list(range(step - 1, num_layers, step))
    if not isinstance(moe_layers, list) or any(
        isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers for i in moe_layers
    ):
        raise ValueError(
            f"model: moe_layers must list layer indices from 0 to {num_layers - 1}, "
            f"got {moe_layers!r:.200}"
        )
    sparse = set(moe_layers)
    dense_size = hf_config.get("intermediate_size_mlp")
    if len(sparse) < num_layers and (
        isinstance(dense_size, bool) or not isinstance(dense_size, int) or dense_size < 1
    ):
        raise ValueError(
            f"model: intermediate_size_mlp must be an integer >= 1, got {dense_size!r}"
        )
    return tuple(spec if i in sparse else None for i in range(num_layers))


# Tencent's Hunyuan: dense, and with experts beside a shared MLP.
HUNYUAN = ("HunYuanDenseV1ForCausalLM", "HunYuanMoEV1ForCausalLM")
# IBM's Granite MoE, and with a shared MLP beside the experts.
_GRANITE_MOE = ("GraniteMoeForCausalLM", "GraniteMoeSharedForCausalLM")
# DeepSeek's mixtures of experts and GLM-4.5's (``GroupedRouting``).
_GROUPED_ROUTER_MOE = (
    "Glm4MoeForCausalLM",
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "Dots1ForCausalLM",
    "Glm4MoeLiteForCausalLM",
)
_DEEPSEEK_V2_TOPK_METHODS = ("greedy", "group_limited_greedy")


def _grouped_router_experts(
    architecture: str, hf_config: dict[str, Any]
) -> tuple[ExpertsSpec | None, ...]:
    """DeepSeek-V2 / V3, GLM-4.5, GLM-4.7-Flash and dots.llm1: ``n_routed_experts`` experts of
    ``moe_intermediate_size`` at each layer from ``first_k_dense_replace`` on (a dense MLP of
    ``intermediate_size`` before it; GLM-4.7-Flash: at the "sparse" layers of
    ``mlp_layer_types``), the top ``num_experts_per_tok`` of the grouped router
    (``GroupedRouting``:
    V2's ``topk_method``, the others' sigmoid scores), plus ``n_shared_experts``
    experts' rows as one shared MLP; all but V2's weights renormalised when
    ``norm_topk_prob`` says, V2's never (its router ignores the field)."""
    num_layers = hf_config["num_hidden_layers"]
    v2 = architecture == "DeepseekV2ForCausalLM"
    method = hf_config.get("topk_method", "greedy") if v2 else "noaux_tc"
    if v2 and method not in _DEEPSEEK_V2_TOPK_METHODS:
        raise ValueError(
            f"model: topk_method={method!r} is not a DeepSeek-V2 router; "
            f"supported: {', '.join(_DEEPSEEK_V2_TOPK_METHODS)}"
        )
    num_experts = hf_config.get("n_routed_experts")
    shared = hf_config.get("n_shared_experts")
    if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
        raise ValueError(f"model: n_shared_experts must be an integer >= 0, got {shared!r}")
    spec = _checked_experts(
        hf_config,
        num_experts=num_experts,
        num_experts_field="n_routed_experts",
        top_k=hf_config.get("num_experts_per_tok"),
        intermediate_field="moe_intermediate_size",
        renormalize=not v2 and bool(hf_config.get("norm_topk_prob")),
        weights_in_float32=True,
    )
    if method == "greedy":
        num_groups = top_k_groups = 1
    else:
        num_groups, top_k_groups = hf_config.get("n_group"), hf_config.get("topk_group")
        for name, value in (("n_group", num_groups), ("topk_group", top_k_groups)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"model: {name} must be an integer >= 1, got {value!r}")
        if num_experts % num_groups:
            raise ValueError(
                f"model: n_routed_experts={num_experts} must divide into n_group={num_groups} "
                "equal groups"
            )
        if top_k_groups > num_groups:
            raise ValueError(f"model: topk_group={top_k_groups} exceeds n_group={num_groups}")
        per_group = num_experts // num_groups
        if method == "noaux_tc" and per_group < 2:
            raise ValueError(
                f"model: n_routed_experts / n_group = {per_group}: each group needs at least "
                "2 experts (a group ranks by the sum of its two best)"
            )
        if spec.top_k > top_k_groups * per_group:
            raise ValueError(
                f"model: num_experts_per_tok={spec.top_k} exceeds the {top_k_groups * per_group} "
                f"experts of topk_group={top_k_groups} groups of {per_group}"
            )
    scale = hf_config.get("routed_scaling_factor")
    if (
        isinstance(scale, bool)
        or not isinstance(scale, (int, float))
        or not math.isfinite(scale)
        or scale <= 0
    ):
        raise ValueError(f"model: routed_scaling_factor must be a positive number, got {scale!r}")
    spec = dataclasses.replace(
        spec,
        shared_intermediate_size=spec.intermediate_size * shared,
        shared_expert_gated=False,
        grouped=GroupedRouting(
            sigmoid=not v2,
            num_groups=num_groups,
            top_k_groups=top_k_groups,
            routed_scaling_factor=float(scale),
            correction_bias=not v2,
        ),
    )
    if architecture == "Glm4MoeLiteForCausalLM":
        return tuple(spec if sparse else None for sparse in _mlp_layer_types(hf_config))
    first_dense = hf_config.get("first_k_dense_replace")
    if isinstance(first_dense, bool) or not isinstance(first_dense, int) or first_dense < 0:
        raise ValueError(
            f"model: first_k_dense_replace must be an integer >= 0, got {first_dense!r}"
        )
    return tuple(spec if i >= first_dense else None for i in range(num_layers))


def _mlp_layer_types(hf_config: dict[str, Any]) -> list[bool]:
    """Whether each layer's MLP is a sparse one, from Glm4MoeLiteConfig's ``mlp_layer_types``
    ("dense" / "sparse" per layer; HF's default: the first dense, the rest sparse; HF reads
    no ``first_k_dense_replace`` for this model)."""
    num_layers = hf_config["num_hidden_layers"]
    types = hf_config.get("mlp_layer_types")
    if types is None:
        return [index > 0 for index in range(num_layers)]
    if (
        not isinstance(types, list)
        or len(types) != num_layers
        or not set(types) <= {"dense", "sparse"}
    ):
        raise ValueError(
            f"model: mlp_layer_types must list 'dense' or 'sparse' for each of the "
            f"{num_layers} layers, got {types!r:.200}"
        )
    return [kind == "sparse" for kind in types]


def _hunyuan_experts(hf_config: dict[str, Any]) -> tuple[ExpertsSpec | None, ...]:
    """Hunyuan's MoE models: every layer ``num_experts`` experts of ``intermediate_size``, top
    ``moe_topk`` by a float32 softmax, renormalised, beside a shared MLP of the same size.
    Per-layer lists of the two are taken when all their entries agree."""
    num_layers = hf_config["num_hidden_layers"]
    fields = {}
    for name in ("num_experts", "moe_topk"):
        value = hf_config[name]
        if isinstance(value, list):
            if len(value) != num_layers or len(set(value)) != 1:
                raise ValueError(
                    f"model: {name} per layer must hold one value for all {num_layers} layers, "
                    f"got {value!r:.200}"
                )
            value = value[0]
        fields[name] = value
    spec = _checked_experts(
        hf_config,
        num_experts=fields["num_experts"],
        num_experts_field="num_experts",
        top_k=fields["moe_topk"],
        intermediate_field="intermediate_size",
        renormalize=True,
        weights_in_float32=True,
    )
    spec = dataclasses.replace(
        spec,
        shared_intermediate_size=spec.intermediate_size,
        shared_expert_gated=False,
        grouped=GroupedRouting(
            sigmoid=False, num_groups=1, top_k_groups=1, routed_scaling_factor=1.0
        ),
    )
    return (spec,) * num_layers


def _ernie_experts(hf_config: dict[str, Any]) -> tuple[ExpertsSpec | None, ...]:
    """ERNIE 4.5's MoE models: ``moe_num_experts`` experts of ``moe_intermediate_size``, top
    ``moe_k`` by their softmax probabilities plus a learned bias per expert (which only
    chooses), renormalised and rounded to the model's dtype, beside ``moe_num_shared_experts``
    experts' rows as one shared MLP; sparse at layers ``moe_layer_start_index`` to
    ``moe_layer_end_index`` (-1: the last) whose number + 1 is a multiple of
    ``moe_layer_interval``, dense (``intermediate_size``) elsewhere."""
    num_layers = hf_config["num_hidden_layers"]
    num_experts_field = "num_experts" if "num_experts" in hf_config else "moe_num_experts"
    spec = _checked_experts(
        hf_config,
        num_experts=hf_config[num_experts_field],
        num_experts_field=num_experts_field,
        top_k=hf_config.get("num_experts_per_tok", hf_config["moe_k"]),
        intermediate_field="moe_intermediate_size",
        renormalize=True,
        weights_in_float32=False,
    )
    fields = {}
    for name in ("moe_num_shared_experts", "moe_layer_start_index", "moe_layer_interval"):
        value = hf_config[name]
        low = 1 if name == "moe_layer_interval" else 0
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"model: {name} must be an integer >= {low}, got {value!r}")
        fields[name] = value
    end = hf_config["moe_layer_end_index"]
    if isinstance(end, bool) or not isinstance(end, int) or end < -1:
        raise ValueError(f"model: moe_layer_end_index must be an integer >= -1, got {end!r}")
    end = num_layers - 1 if end == -1 else end
    spec = dataclasses.replace(
        spec,
        shared_intermediate_size=spec.intermediate_size * fields["moe_num_shared_experts"],
        shared_expert_gated=False,
        shared_expert_bias=bool(hf_config.get("use_bias")),
        grouped=GroupedRouting(
            sigmoid=False,
            num_groups=1,
            top_k_groups=1,
            routed_scaling_factor=1.0,
            correction_bias=True,
        ),
    )
    start, interval = fields["moe_layer_start_index"], fields["moe_layer_interval"]
    return tuple(
        spec if start <= i <= end and (i + 1) % interval == 0 else None for i in range(num_layers)
    )


def _num_experts(hf_config: dict[str, Any], default: int) -> tuple[Any, str]:
    """(the expert count, the field that gave it): HF treats ``num_experts`` and
    ``num_local_experts`` as one attribute, and checkpoints write either."""
    for name in ("num_experts", "num_local_experts"):
        if name in hf_config:
            return hf_config[name], name
    return default, "num_experts"


def _checked_experts(
    hf_config: dict[str, Any],
    num_experts: Any,
    num_experts_field: str,
    top_k: Any,
    intermediate_field: str,
    renormalize: bool,
    weights_in_float32: bool,
    shared_intermediate_size: Any = 0,
    softmax_over_top_k: bool = False,
) -> ExpertsSpec:
    intermediate_size = hf_config.get(intermediate_field)
    for name, value, low in (
        (num_experts_field, num_experts, 1),
        ("num_experts_per_tok", top_k, 1),
        (intermediate_field, intermediate_size, 1),
        ("shared_expert_intermediate_size", shared_intermediate_size, 0),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"model: {name} must be an integer >= {low}, got {value!r}")
    if top_k > num_experts:
        raise ValueError(
            f"model: num_experts_per_tok={top_k} exceeds {num_experts_field}={num_experts}"
        )
    return ExpertsSpec(
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=intermediate_size,
        intermediate_field=intermediate_field,
        renormalize=renormalize,
        weights_in_float32=weights_in_float32,
        shared_intermediate_size=shared_intermediate_size,
        softmax_over_top_k=softmax_over_top_k,
    )


def _eos_token_ids(path: Path, hf_config: dict[str, Any]) -> frozenset[int]:
    """EOS ids from generation_config.json (what HF generate stops on), else config.json."""
    eos: Any = None
    generation_file = path / "generation_config.json"
    if generation_file.is_file():
        eos = json.loads(generation_file.read_text()).get("eos_token_id")
    if eos is None:
        eos = hf_config.get("eos_token_id")
    if eos is None:
        return frozenset()
    return frozenset(eos if isinstance(eos, list) else [eos])


def check_tensor_parallel_size(config: ModelConfig, size: int) -> None:
    """Raise ``ValueError`` naming the field, its value and the limit if the model cannot
    be split over ``size`` ranks: query heads and the MLP's intermediate rows must divide
    evenly; KV heads must divide evenly, or divide ``size`` (then they are replicated).
    The vocabulary needs nothing: its last shard is padded."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {size!r}")
    _check_divisible("num_attention_heads", config.num_heads, size)
    if config.num_kv_heads >= size:
        _check_divisible("num_key_value_heads", config.num_kv_heads, size)
    elif size % config.num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size={size}: the model's num_key_value_heads="
            f"{config.num_kv_heads} is below it, so each KV head is replicated on "
            f"tensor_parallel_size / num_key_value_heads ranks, which must be a whole "
            f"number; use a multiple of {config.num_kv_heads} or a size at most it"
        )
    if config.family == "opt":
        _check_divisible("ffn_dim", config.hf_config["ffn_dim"], size)
        return
    # Each rank holds 1/size of every MLP's intermediate rows, every expert's included.
    if None in config.layer_experts:
        # Llama 4's dense layers have their own width.
        dense = "intermediate_size_mlp" if config.architecture == "Llama4ForCausalLM" else None
        dense = dense or "intermediate_size"
        _check_divisible(dense, config.hf_config[dense], size)
    for spec in set(config.layer_experts) - {None}:
        _check_divisible(spec.intermediate_field, spec.intermediate_size, size)
        if spec.shared_intermediate_size:
            _check_divisible("shared_expert_intermediate_size", spec.shared_intermediate_size, size)


def check_cuda_graph_support(config: ModelConfig) -> None:
    """Raise ``ValueError`` for a model whose decode step cannot be captured as a CUDA
    graph: a mixture-of-experts layer reads its experts' row counts on the host, and the
    captured decode has no chunked view of the step (``AttentionMetadata.chunked``)."""
    if config.has_experts:
        raise ValueError(
            f"cuda_graphs: {config.architecture} routes tokens to experts by data, which a "
            "captured graph cannot replay; drop cuda_graphs for this model"
        )
    if config.attention_chunk_size or config.latent_attention:
        kind = "chunked attention" if config.attention_chunk_size else "latent attention"
        raise ValueError(
            f"cuda_graphs: {config.architecture}'s {kind} layers are not captured yet; drop "
            "cuda_graphs for this model"
        )


# The architectures whose checkpoints carry DeepSeek-V3's multi-token-prediction layers,
# which speculative decoding's method "mtp" drafts with (models/multi_token_predictor.py).
NEXT_TOKEN_PREDICTION_ARCHITECTURES = (
    "DeepseekV3ForCausalLM",
    "Glm4MoeForCausalLM",
    "Glm4MoeLiteForCausalLM",
)


def next_token_layer_config(config: ModelConfig) -> ModelConfig:
    """The model's first multi-token-prediction layer (the one after its
    ``num_hidden_layers`` decoder layers) as a one-layer model: its experts as a decoder
    layer at that index would have them, full attention, the target's cache head. Raises
    ``ValueError`` naming why for a model without such a layer."""
    if config.architecture not in NEXT_TOKEN_PREDICTION_ARCHITECTURES:
        raise ValueError(
            f"speculative_config.method 'mtp' drafts with a model's multi-token-prediction "
            f"layers, which {config.architecture} has none of; models with them: "
            f"{', '.join(NEXT_TOKEN_PREDICTION_ARCHITECTURES)}"
        )
    count = config.hf_config.get("num_nextn_predict_layers")
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(
            f"speculative_config.method 'mtp': {str(config.path / 'config.json')!r} has "
            f"num_nextn_predict_layers={count!r}, so its checkpoint has no "
            "multi-token-prediction layer (it must be an integer >= 1)"
        )
    index = config.num_layers
    extended = {**config.hf_config, "num_hidden_layers": index + 1}
    if isinstance(extended.get("mlp_layer_types"), list):  # GLM-4.7-Flash: its layer is sparse
        extended["mlp_layer_types"] = [*extended["mlp_layer_types"], "sparse"]
    experts = _layer_experts(config.architecture, extended)[index]
    return dataclasses.replace(
        config,
        num_layers=1,
        layer_sliding_windows=(0,),
        layer_experts=(experts,),
        layer_attention_chunks=(0,),
    )


def check_attention_chunk_size(config: ModelConfig, block_size: int) -> None:
    """Raise ``ValueError`` when the model's attention chunks do not start on block
    boundaries: the chunked view of a step starts each chunk's block table at a block."""
    chunk = config.attention_chunk_size
    if chunk % block_size:
        raise ValueError(
            f"block_size={block_size} must divide {config.architecture}'s "
            f"attention_chunk_size={chunk} (its chunked layers' chunks start on block "
            "boundaries)"
        )


def _vlm_text_config(vlm: str, hf_config: dict[str, Any]) -> dict[str, Any]:
    """A vision-language checkpoint's language model as a text model's config: its
    ``text_config`` (``VLM_TEXT_MODELS``), with the text architecture HF builds for it, the
    LM head tied as HF ties it, and M-RoPE read as the plain RoPE it is for text."""
    spec = VLM_TEXT_MODELS[vlm]
    text = hf_config.get("text_config")
    if text is None and spec.flat:
        text = {k: v for k, v in hf_config.items() if k not in ("vision_config", "model_type")}
    if not isinstance(text, dict):
        raise ValueError(f"model: {vlm}'s config.json has no text_config object, got {text!r}")
    model_type = text.get("model_type") or spec.default_text_type
    if model_type not in spec.text_architectures:
        raise ValueError(
            f"model: {vlm}'s text_config.model_type {model_type!r} is not supported; "
            f"supported: {', '.join(spec.text_architectures)}"
        )
    if spec.head_dim_from_heads and isinstance(text.get("num_attention_heads"), int):
        text = {"head_dim": text.get("hidden_size", 0) // text["num_attention_heads"], **text}
    tie = bool(hf_config.get("tie_word_embeddings", spec.tie_default))
    if spec.text_tie_counts and text.get("tie_word_embeddings"):
        tie = True
    text = {
        **dict(spec.text_defaults),
        **text,
        "architectures": [spec.text_architectures[model_type]],
        "tie_word_embeddings": tie,
        **dict(spec.text_overrides),
    }
    for field_name in ("rope_parameters", "rope_scaling"):
        parameters = text.get(field_name)
        if isinstance(parameters, dict) and "mrope" in (
            parameters.get("rope_type"),
            parameters.get("type"),
        ):
            text[field_name] = {**parameters, "rope_type": "default", "type": "default"}
    return text


def llama4_query_scaling(config: ModelConfig) -> tuple[float, int] | None:
    """Llama 4's attention temperature as Ministral 3 configures it: (``beta``, the original
    context ``L``), each query scaled by ``1 + beta * log(1 + floor(position / L))`` after
    RoPE, so queries far past the original context sharpen their attention; None for other
    models. Both come from ``rope_parameters`` (``llama_4_scaling_beta``,
    ``original_max_position_embeddings``), which HF requires."""
    if config.architecture != "Ministral3ForCausalLM":
        return None
    parameters = rope_parameters(config.hf_config)
    beta = parameters.get("llama_4_scaling_beta")
    original = parameters.get("original_max_position_embeddings")
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not math.isfinite(beta):
        raise ValueError(
            f"model: rope_parameters.llama_4_scaling_beta must be a finite number, got {beta!r}"
        )
    if isinstance(original, bool) or not isinstance(original, int) or original < 1:
        raise ValueError(
            "model: rope_parameters.original_max_position_embeddings must be an integer >= 1 "
            f"(Llama 4's query scaling divides positions by it), got {original!r}"
        )
    return float(beta), original


def llama4_nope_temperature(config: ModelConfig, rotates: bool) -> tuple[float, int] | None:
    """Llama 4's attention temperature on its layers without RoPE (``attn_temperature_tuning``):
    (``attn_scale``, ``floor_scale``), each query scaled by
    ``1 + attn_scale * log(1 + floor((position + 1) / floor_scale))`` so that queries far
    into a long context sharpen their global attention; None for a layer with RoPE and for
    other models."""
    hf = config.hf_config
    if config.architecture != "Llama4ForCausalLM" or rotates or not hf["attn_temperature_tuning"]:
        return None
    scale, floor_scale = hf["attn_scale"], hf["floor_scale"]
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"model: attn_scale must be a finite number, got {scale!r}")
    if isinstance(floor_scale, bool) or not isinstance(floor_scale, int) or floor_scale < 1:
        raise ValueError(f"model: floor_scale must be an integer >= 1, got {floor_scale!r}")
    return float(scale), floor_scale


def check_draft_model(target: ModelConfig, draft: ModelConfig, tensor_parallel_size: int) -> None:
    """Raise ``ValueError`` naming what does not fit if ``draft`` cannot guess tokens for
    ``target`` (speculative decoding with a draft model, ``draft_model.py``): both must be
    causal LMs, the draft must split over the same ranks, and where the target frees
    blocks behind its window the draft must attend no further back than that. (It must
    also share the target's tokenizer, which only the acceptance rate shows: a guess is
    any token id, checked by the target.)"""
    where = f"speculative_config.model ({draft.architecture})"
    if target.task != "generate" or draft.task != "generate":
        model = "the draft model" if draft.task != "generate" else f"the {target.architecture}"
        raise ValueError(
            f"{where}: speculative decoding needs causal LMs, but {model} is a classification model"
        )
    try:
        check_tensor_parallel_size(draft, tensor_parallel_size)
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None
    window = target.attention_window
    if window and not 0 < draft.attention_window <= window:
        draft_reach = (
            f"a {draft.attention_window}-token window" if draft.attention_window else "every token"
        )
        raise ValueError(
            f"{where}: every layer of {target.architecture} attends {window} tokens back, so "
            f"the engine frees the blocks behind that window, but the draft model attends to "
            f"{draft_reach}; use a draft model whose layers all have a window of at most "
            f"{window} tokens"
        )


def _check_divisible(field: str, value: int, size: int) -> None:
    if value % size:
        divisors = [d for d in range(1, value + 1) if value % d == 0]
        raise ValueError(
            f"tensor_parallel_size={size} does not divide the model's {field}={value} "
            f"(each rank holds {field} / tensor_parallel_size of them); "
            f"sizes that do: {', '.join(map(str, divisors))}"
        )


# The weight and KV cache dtypes a worker runs (gpu_worker/worker.py maps them to torch's).
DTYPE_NAMES = ("float32", "bfloat16", "float16")


# Weight-only quantizations of the linear layers, done on CPU as the model loads
# (layers/packed_weights.py, ``Int8PanelWeight``): int8 values, one scale per output feature.
QUANTIZATION_NAMES = ("int8",)


def check_quantization_name(quantization: str | None, device: str = "cpu") -> None:
    """Raise ``ValueError`` naming the value and the choices for an unknown quantization,
    or one asked for on a device it does not run on."""
    if quantization is None:
        return
    if quantization not in QUANTIZATION_NAMES:
        raise ValueError(
            f"quantization must be one of {', '.join(QUANTIZATION_NAMES)} or None, "
            f"got {quantization!r}"
        )
    if not str(device).startswith("cpu"):
        raise ValueError(f"quantization={quantization!r} runs on CPU only, got device={device!r}")


# vLLM's kv_cache_dtype values that this engine runs: "auto" keeps the cache in the model's
# dtype; "fp8" (as in vLLM, the same as "fp8_e4m3") stores float8 e4m3, saturating at +-448
# with no scales; "fp8_e5m2" stores float8 e5m2 (both CPU only; csrc/ops.h).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")


def check_kv_cache_dtype(kv_cache_dtype: str, device: str = "cpu") -> None:
    """Raise ``ValueError`` naming the value and the choices for a cache dtype this engine
    does not run, or one asked for on a device it does not run on."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}"
        )
    if kv_cache_dtype != "auto" and not str(device).startswith("cpu"):
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} runs on CPU only (the CUDA kernels keep the "
            f"cache in the model's dtype), got device={device!r}"
        )


def check_dtype_name(dtype: str) -> None:
    """Raise ``ValueError`` naming the value and the choices for an unknown dtype."""
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {dtype!r}")
