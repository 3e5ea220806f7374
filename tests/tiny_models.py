"""Tiny random HF models for tests: the reference side of every parity check."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def random_hf_model(config_kwargs: dict[str, Any], path: Path, seed: int = 0) -> Path:
    """Save a randomly initialised HF model to ``path``: ``config_kwargs`` are its config's
    fields, ``architectures`` (one name) included.

    Weights are drawn wider than HF's default (std 0.08, not 0.02): default-initialised
    tiny models give near-uniform logits, whose near-ties make greedy paths fragile.
    """
    import torch
    import transformers

    config_kwargs = dict(config_kwargs)
    architecture = config_kwargs.pop("architectures")[0]
    # Config classes by name, looked up only for the architecture asked for: an older
    # transformers (the GPU image's) lacks some of them.
    config_name = {
        "LlamaForCausalLM": "LlamaConfig",
        "MistralForCausalLM": "MistralConfig",
        "Qwen2ForCausalLM": "Qwen2Config",
        "Qwen3ForCausalLM": "Qwen3Config",
        "MixtralForCausalLM": "MixtralConfig",
        "Qwen2MoeForCausalLM": "Qwen2MoeConfig",
        "Qwen3MoeForCausalLM": "Qwen3MoeConfig",
        "OPTForCausalLM": "OPTConfig",
        "GemmaForCausalLM": "GemmaConfig",
        "Gemma2ForCausalLM": "Gemma2Config",
        "Gemma3ForCausalLM": "Gemma3TextConfig",
        "GraniteForCausalLM": "GraniteConfig",
        "GraniteMoeForCausalLM": "GraniteMoeConfig",
        "Phi3ForCausalLM": "Phi3Config",
        "SmolLM3ForCausalLM": "SmolLM3Config",
        "Olmo2ForCausalLM": "Olmo2Config",
        "Olmo3ForCausalLM": "Olmo3Config",
        "Starcoder2ForCausalLM": "Starcoder2Config",
        "CohereForCausalLM": "CohereConfig",
        "Glm4ForCausalLM": "Glm4Config",
        "Cohere2ForCausalLM": "Cohere2Config",
        "GptOssForCausalLM": "GptOssConfig",
        "SeedOssForCausalLM": "SeedOssConfig",
        "Ernie4_5ForCausalLM": "Ernie4_5Config",
        "InternLM3ForCausalLM": "InternLM3Config",
        "ArceeForCausalLM": "ArceeConfig",
        "Glm4MoeForCausalLM": "Glm4MoeConfig",
        "DeepseekV2ForCausalLM": "DeepseekV2Config",
        "DeepseekV3ForCausalLM": "DeepseekV3Config",
        "Glm4MoeLiteForCausalLM": "Glm4MoeLiteConfig",
        "MiniMaxM2ForCausalLM": "MiniMaxM2Config",
        "Ministral3ForCausalLM": "Ministral3Config",
        "Dots1ForCausalLM": "Dots1Config",
        "Ernie4_5_MoeForCausalLM": "Ernie4_5_MoeConfig",
        "Exaone4ForCausalLM": "Exaone4Config",
        "HunYuanDenseV1ForCausalLM": "HunYuanDenseV1Config",
        "HunYuanMoEV1ForCausalLM": "HunYuanMoEV1Config",
        "ApertusForCausalLM": "ApertusConfig",
        "GraniteMoeSharedForCausalLM": "GraniteMoeSharedConfig",
        "ExaoneForCausalLM": "ExaoneConfig",
        "OlmoeForCausalLM": "OlmoeConfig",
        "NemotronForCausalLM": "NemotronConfig",
        "Llama4ForCausalLM": "Llama4TextConfig",
    }[_causal_architecture(architecture)]
    config_class = getattr(transformers, config_name)
    config = config_class(**config_kwargs)
    config.architectures = [architecture]
    torch.manual_seed(seed)
    # InternLM3's checkpoints name a class transformers implements as Llama's.
    model_class = getattr(transformers, architecture, None)
    model = (
        model_class(config)
        if model_class is not None
        else transformers.AutoModelForCausalLM.from_config(config)
    )
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("e_score_correction_bias"):  # ERNIE 4.5's: a parameter
                parameter.normal_(0.0, 0.1)
            elif "norm" in name:
                parameter.uniform_(0.8, 1.2)
            elif name.endswith("bias"):
                parameter.normal_(0.0, 0.02)
            elif name.endswith("sinks"):  # gpt-oss: sinks large enough to move the tokens
                parameter.normal_(0.0, 1.0)
            else:
                parameter.normal_(0.0, 0.08)
        for name, buffer in model.named_buffers():
            # DeepSeek-V3's / GLM-4.5's router bias (a buffer): enough to change the choice.
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
    model.save_pretrained(path)
    return path


def _causal_architecture(architecture: str) -> str:
    """The causal LM whose config a sequence classification model shares."""
    if architecture == "Gemma3TextForSequenceClassification":
        return "Gemma3ForCausalLM"
    return architecture.replace("ForSequenceClassification", "ForCausalLM")
