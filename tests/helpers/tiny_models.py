"""Tiny random HF models for tests, the reference side of every parity check: a model of any
config (``random_hf_model``), or of ``TINY_CONFIGS``, the small families most tests run."""

from __future__ import annotations

import json
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
    causal = _causal_architecture(architecture)
    # The config class the HF model class declares; two architectures' checkpoints name a
    # class transformers implements under another name (AutoModel picks it by model_type).
    model_class = getattr(transformers, causal, None)
    config_class = (
        model_class.config_class
        if model_class is not None
        else getattr(transformers, _CONFIGS_WITHOUT_A_CLASS[causal])
    )
    config = config_class(**config_kwargs)
    config.architectures = [architecture]
    torch.manual_seed(seed)
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
    if model_class is None:
        # Saved under the class transformers implements it as (Llama's); the checkpoints
        # name their own, and so does the model made here.
        config_file = path / "config.json"
        saved = json.loads(config_file.read_text())
        saved["architectures"] = [architecture]
        config_file.write_text(json.dumps(saved, indent=2))
    return path


_CONFIGS_WITHOUT_A_CLASS = {
    "InternLM3ForCausalLM": "InternLM3Config",
    "ExaoneForCausalLM": "ExaoneConfig",
}


def _causal_architecture(architecture: str) -> str:
    """The causal LM whose config a sequence classification model shares."""
    if architecture == "Gemma3TextForSequenceClassification":
        return "Gemma3ForCausalLM"
    return architecture.replace("ForSequenceClassification", "ForCausalLM")


TINY_CONFIGS = {
    "llama": dict(
        architectures=["LlamaForCausalLM"],
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        vocab_size=512,
        max_position_embeddings=512,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    ),
    "qwen2": dict(
        architectures=["Qwen2ForCausalLM"],
        hidden_size=256,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    ),
    "mistral": dict(
        architectures=["MistralForCausalLM"],
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=512,
        max_position_embeddings=512,
        sliding_window=None,
    ),
    # Llama 3's frequency-dependent RoPE scaling, with an original context short enough
    # that the test prompts reach the scaled frequencies.
    "llama3_rope": dict(
        architectures=["LlamaForCausalLM"],
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        vocab_size=512,
        max_position_embeddings=512,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    # Qwen3: per-head q/k norms; head_dim (64) is not hidden_size / heads (32); GQA.
    "qwen3": dict(
        architectures=["Qwen3ForCausalLM"],
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=512,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    ),
    "opt": dict(
        architectures=["OPTForCausalLM"],
        hidden_size=128,
        ffn_dim=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        vocab_size=512,
        max_position_embeddings=512,
        word_embed_proj_dim=128,
    ),
}

# YaRN (Qwen2.5's long-context setting) on the tiny Qwen2, with an original context short
# enough that the test prompts run past it: the context window becomes 64 x 4 = 256 positions.
TINY_CONFIGS["yarn_rope"] = dict(
    TINY_CONFIGS["qwen2"],
    rope_theta=1000000.0,
    rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
)

# Qwen3's small checkpoints tie the LM head to the embedding; attention_bias adds q/k/v
# and o_proj biases, which Qwen3 (unlike Qwen2) has only when the config says.
TINY_CONFIGS["qwen3_tied_bias"] = dict(
    TINY_CONFIGS["qwen3"], tie_word_embeddings=True, attention_bias=True
)


def make_tiny_model(family: str, path: Path, seed: int = 0) -> Path:
    """Save a randomly initialised HF model of ``TINY_CONFIGS[family]`` to ``path``
    (``random_hf_model``: weights drawn wide for tie-free greedy paths)."""
    return random_hf_model(TINY_CONFIGS[family], path, seed)
