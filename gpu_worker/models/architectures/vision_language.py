"""Vision-language checkpoints whose language model this engine serves on its own, for text
(no image encoder: a request with an image is refused where it arrives): how each one's
config reads as its text architecture's. Qwen's M-RoPE gives a text token the same position
in its three streams: plain RoPE."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class VisionLanguageModel:
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
# Each vision-language architecture -> how its config reads.
VISION_LANGUAGE_MODELS: dict[str, VisionLanguageModel] = {
    "Gemma3ForConditionalGeneration": VisionLanguageModel(
        {"gemma3_text": "Gemma3ForCausalLM"}, "gemma3_text", tie_default=True
    ),
    "Mistral3ForConditionalGeneration": VisionLanguageModel(
        {"ministral3": "Ministral3ForCausalLM", "mistral": "MistralForCausalLM"},
        "mistral",
        tie_default=True,
    ),
    "Qwen2_5_VLForConditionalGeneration": VisionLanguageModel(
        {"qwen2_5_vl_text": "Qwen2ForCausalLM"},
        "qwen2_5_vl_text",
        tie_default=False,
        flat=True,
        text_tie_counts=True,
    ),
    "Qwen3VLForConditionalGeneration": VisionLanguageModel(
        {"qwen3_vl_text": "Qwen3ForCausalLM"}, "qwen3_vl_text", tie_default=False
    ),
    "Qwen3VLMoeForConditionalGeneration": VisionLanguageModel(
        {"qwen3_vl_moe_text": "Qwen3MoeForCausalLM"},
        "qwen3_vl_moe_text",
        tie_default=False,
        text_overrides=(("norm_topk_prob", True),),
    ),
    # GLM-4.1V / 4.5V / 4.6V: GLM-4's and GLM-4.5's language models (M-RoPE over GLM's
    # interleaved pairs: plain for text).
    "Glm4vForConditionalGeneration": VisionLanguageModel(
        {"glm4v_text": "Glm4ForCausalLM"},
        "glm4v_text",
        tie_default=False,
        text_defaults=(("partial_rotary_factor", 1.0),),
        head_dim_from_heads=True,
    ),
    "Glm4vMoeForConditionalGeneration": VisionLanguageModel(
        {"glm4v_moe_text": "Glm4MoeForCausalLM"}, "glm4v_moe_text", tie_default=False
    ),
    # GLM-4.6V's own class (its Flash model): GLM-4V's language model.
    "Glm46VForConditionalGeneration": VisionLanguageModel(
        {"glm4v_text": "Glm4ForCausalLM"},
        "glm4v_text",
        tie_default=False,
        text_defaults=(("partial_rotary_factor", 1.0),),
        head_dim_from_heads=True,
    ),
    # LLaVA (1.5, Pixtral 12B) and LLaVA-NeXT (1.6) over Llama, Mistral or Qwen2.
    "LlavaForConditionalGeneration": VisionLanguageModel(
        _LLAVA_TEXT_MODELS, "llama", tie_default=False, text_tie_counts=True
    ),
    "LlavaNextForConditionalGeneration": VisionLanguageModel(
        _LLAVA_TEXT_MODELS, "llama", tie_default=False
    ),
    "LlavaOnevisionForConditionalGeneration": VisionLanguageModel(
        _LLAVA_TEXT_MODELS, "qwen2", tie_default=False, text_tie_counts=True
    ),
    # Llama 4 (Scout, Maverick): its language model, Llama4ForCausalLM.
    "Llama4ForConditionalGeneration": VisionLanguageModel(
        {"llama4_text": "Llama4ForCausalLM"}, "llama4_text", tie_default=False
    ),
    # InternVL 3 / 3.5 in transformers' format (the "-hf" checkpoints).
    "InternVLForConditionalGeneration": VisionLanguageModel(
        {**_LLAVA_TEXT_MODELS, "qwen3": "Qwen3ForCausalLM"}, "qwen2", tie_default=True
    ),
}


def text_config(vlm: str, hf_config: dict[str, Any]) -> dict[str, Any]:
    """A vision-language checkpoint's language model as a text model's config: its
    ``text_config`` (``VISION_LANGUAGE_MODELS``), with the text architecture HF builds for it, the
    LM head tied as HF ties it, and M-RoPE read as the plain RoPE it is for text."""
    spec = VISION_LANGUAGE_MODELS[vlm]
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
