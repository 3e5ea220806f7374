"""RoPE frequencies and cos/sin scales equal transformers' own, bit for bit, for every
supported scaling (the parity tests then check whole models; this covers the parameter
combinations one tiny model cannot)."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from pagedserve.gpu_worker.layers.rotary import (
    attention_factor,
    inverse_frequencies,
    rope_context_window,
    rope_parameters,
)

HEAD_SIZE = 64
MAX_POSITIONS = 512

CASES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.5},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "llama3-no-original": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
    },
    "yarn": {
        "rope_type": "yarn",
        "rope_theta": 1000000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 128,
    },
    "yarn-int-factor-betas-no-truncate": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 3,
        "original_max_position_embeddings": 100,
        "beta_fast": 16,
        "beta_slow": 2,
        "truncate": False,
    },
    "yarn-mscale": {  # DeepSeek style
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 40.0,
        "original_max_position_embeddings": 64,
        "mscale": 0.707,
        "mscale_all_dim": 1.0,
    },
    "yarn-attention-factor": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 2.0,
        "original_max_position_embeddings": 256,
        "attention_factor": 1.25,
    },
    "yarn-no-factor": {  # the factor from max_position_embeddings / original
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": None,
        "original_max_position_embeddings": 128,
    },
}


def _hf_config(rope: dict) -> dict:
    return {
        "hidden_size": 4 * HEAD_SIZE,
        "num_attention_heads": 4,
        "head_dim": HEAD_SIZE,
        "max_position_embeddings": MAX_POSITIONS,
        "rope_parameters": dict(rope),
    }


@pytest.mark.parametrize("case", list(CASES))
def test_frequencies_and_scale_equal_transformers(case):
    hf_config = _hf_config(CASES[case])
    # HF's rotary module, built as its Llama builds it: the frequencies and cos/sin scale
    # it will use.
    hf_rotary = LlamaRotaryEmbedding(transformers.LlamaConfig(**hf_config))
    parameters = rope_parameters(hf_config)
    assert torch.equal(inverse_frequencies(HEAD_SIZE, parameters), hf_rotary.inv_freq)
    assert attention_factor(parameters) == hf_rotary.attention_scaling


def test_yarn_extends_the_context_window():
    yarn = rope_parameters(_hf_config(CASES["yarn"]))
    assert rope_context_window(yarn, MAX_POSITIONS) == 4 * 128
    deepseek = rope_parameters(_hf_config(CASES["yarn-no-factor"]))
    assert rope_context_window(deepseek, MAX_POSITIONS) == MAX_POSITIONS
    llama3 = rope_parameters(_hf_config(CASES["llama3"]))
    assert rope_context_window(llama3, MAX_POSITIONS) == MAX_POSITIONS


def test_legacy_rope_scaling_keys_are_read():
    legacy = {
        "max_position_embeddings": 512,
        "rope_theta": 5e5,
        "rope_scaling": {"type": "yarn", "factor": 2.0},
    }
    parameters = rope_parameters(legacy)
    assert parameters["rope_type"] == "yarn"
    assert parameters["original_max_position_embeddings"] == 512
    assert parameters["rope_theta"] == 5e5


def test_unsupported_rope_type_names_the_supported_ones():
    with pytest.raises(NotImplementedError, match="'longrope' is not supported yet.*yarn"):
        inverse_frequencies(HEAD_SIZE, rope_parameters(_hf_config({"rope_type": "longrope"})))


@pytest.mark.parametrize(
    ("rope", "message"),
    [
        (
            {"factor": 0.5, "original_max_position_embeddings": 64},
            "rope factor must be a number >= 1 for YaRN, got 0.5",
        ),
        (
            {"factor": "4", "original_max_position_embeddings": 64},
            "rope factor must be a number >= 1 for YaRN, got '4'",
        ),
        (
            {"factor": 4.0, "original_max_position_embeddings": 0},
            "original_max_position_embeddings must be an integer >= 1 for YaRN, got 0",
        ),
    ],
)
def test_bad_yarn_settings_are_named(rope, message):
    with pytest.raises(ValueError, match=message):
        rope_parameters(_hf_config({"rope_type": "yarn", "rope_theta": 1e4, **rope}))
