"""Tiny sliding-window models (Mistral; Qwen2 and Qwen3 with windowed layers) and prompts
that run past their windows."""

from __future__ import annotations

import random
from pathlib import Path

from helpers.tiny_models import random_hf_model

# Windows of 12-20 tokens; prompts up to 130 tokens plus NEW_TOKENS (48) generated.
WINDOWED_CONFIGS = {
    # Every layer windowed; GQA (2 query heads per kv head).
    "mistral": dict(
        architectures=["MistralForCausalLM"],
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        vocab_size=512,
        max_position_embeddings=512,
        sliding_window=16,
    ),
    # Layers from max_window_layers (1) on are windowed: layer 0 full, layers 1 and 2 windowed.
    "qwen2": dict(
        architectures=["Qwen2ForCausalLM"],
        hidden_size=256,
        intermediate_size=384,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        use_sliding_window=True,
        sliding_window=12,
        max_window_layers=1,
    ),
    # layer_types given: it wins over max_window_layers (which would window layer 1 only).
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
        use_sliding_window=True,
        sliding_window=20,
        max_window_layers=1,
        layer_types=["sliding_attention", "full_attention"],
    ),
}
PROMPT_LENGTHS = [1, 9, 17, 40, 100, 130]


def make_windowed_model(family: str, path: Path, seed: int = 0) -> Path:
    """A randomly initialised HF model of ``WINDOWED_CONFIGS[family]`` saved to ``path``."""
    return random_hf_model(WINDOWED_CONFIGS[family], path, seed)


def windowed_prompts(seed: int = 1) -> list[list[int]]:
    """Random prompts of ``PROMPT_LENGTHS`` tokens: most run past every window."""
    rng = random.Random(seed)
    return [[rng.randrange(512) for _ in range(n)] for n in PROMPT_LENGTHS]
