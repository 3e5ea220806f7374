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
    config_class = {
        "LlamaForCausalLM": transformers.LlamaConfig,
        "MistralForCausalLM": transformers.MistralConfig,
        "Qwen2ForCausalLM": transformers.Qwen2Config,
        "Qwen3ForCausalLM": transformers.Qwen3Config,
        "MixtralForCausalLM": transformers.MixtralConfig,
        "Qwen2MoeForCausalLM": transformers.Qwen2MoeConfig,
        "Qwen3MoeForCausalLM": transformers.Qwen3MoeConfig,
        "OPTForCausalLM": transformers.OPTConfig,
        "GemmaForCausalLM": transformers.GemmaConfig,
        "Gemma2ForCausalLM": transformers.Gemma2Config,
        "Gemma3ForCausalLM": transformers.Gemma3TextConfig,
        "GraniteForCausalLM": transformers.GraniteConfig,
        "GraniteMoeForCausalLM": transformers.GraniteMoeConfig,
        "Phi3ForCausalLM": transformers.Phi3Config,
        "SmolLM3ForCausalLM": transformers.SmolLM3Config,
        "Olmo2ForCausalLM": transformers.Olmo2Config,
        "Olmo3ForCausalLM": transformers.Olmo3Config,
        "Starcoder2ForCausalLM": transformers.Starcoder2Config,
        "CohereForCausalLM": transformers.CohereConfig,
        "Glm4ForCausalLM": transformers.Glm4Config,
        "Cohere2ForCausalLM": transformers.Cohere2Config,
        "GptOssForCausalLM": transformers.GptOssConfig,
        "SeedOssForCausalLM": transformers.SeedOssConfig,
        "Ernie4_5ForCausalLM": transformers.Ernie4_5Config,
        "InternLM3ForCausalLM": transformers.InternLM3Config,
        "ArceeForCausalLM": transformers.ArceeConfig,
        "Glm4MoeForCausalLM": transformers.Glm4MoeConfig,
        "DeepseekV2ForCausalLM": transformers.DeepseekV2Config,
        "DeepseekV3ForCausalLM": transformers.DeepseekV3Config,
        "Glm4MoeLiteForCausalLM": transformers.Glm4MoeLiteConfig,
        "MiniMaxM2ForCausalLM": transformers.MiniMaxM2Config,
        "Ministral3ForCausalLM": transformers.Ministral3Config,
        "Dots1ForCausalLM": transformers.Dots1Config,
        "Ernie4_5_MoeForCausalLM": transformers.Ernie4_5_MoeConfig,
        "Exaone4ForCausalLM": transformers.Exaone4Config,
        "HunYuanDenseV1ForCausalLM": transformers.HunYuanDenseV1Config,
        "HunYuanMoEV1ForCausalLM": transformers.HunYuanMoEV1Config,
        "ApertusForCausalLM": transformers.ApertusConfig,
        "GraniteMoeSharedForCausalLM": transformers.GraniteMoeSharedConfig,
        "ExaoneForCausalLM": transformers.ExaoneConfig,
        "OlmoeForCausalLM": transformers.OlmoeConfig,
        "NemotronForCausalLM": transformers.NemotronConfig,
        "Llama4ForCausalLM": transformers.Llama4TextConfig,
    }[_causal_architecture(architecture)]
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
