"""RoPE frequencies and cos/sin scales equal transformers' own, bit for bit, for every
supported scaling (the parity tests then check whole models; this covers the parameter
combinations one tiny model cannot)."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3_apply_rotary_pos_emb

from pagedserve.gpu_worker.layers.rope_config import long_rope_switch
from pagedserve.gpu_worker.layers.rotary import (
    RotaryEmbedding,
    attention_factor,
    inverse_frequencies,
    long_frequencies,
    rope_context_window,
    rope_parameters,
)

HEAD_SIZE = 64
MAX_POSITIONS = 512

CASES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.5},
    # Dynamic NTK within max_position_embeddings: the plain frequencies, as HF starts with.
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 6.0},
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


@pytest.mark.parametrize("case", list(CASES))
def test_frequencies_are_computed_on_the_cpu_whatever_the_default_device(case):
    """A worker builds its model under ``torch.device(device)``: every rope type's frequencies
    are still computed on the CPU (as HF's, bit for bit), then moved. (The meta device stands
    in for CUDA here: a tensor made there beside one made on the CPU fails the same way.)"""
    parameters = rope_parameters(_hf_config(CASES[case]))
    with torch.device("meta"):
        frequencies = inverse_frequencies(HEAD_SIZE, parameters)
    assert frequencies.device.type == "cpu"
    assert torch.equal(frequencies, inverse_frequencies(HEAD_SIZE, parameters))


def test_longrope_frequencies_are_computed_on_the_cpu_whatever_the_default_device():
    parameters = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0 + i / 64 for i in range(HEAD_SIZE // 2)],
        "long_factor": [2.0] * (HEAD_SIZE // 2),
        "original_max_position_embeddings": 256,
    }
    with torch.device("meta"):
        frequencies = inverse_frequencies(HEAD_SIZE, parameters)
    assert frequencies.device.type == "cpu"


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
    with pytest.raises(NotImplementedError, match="'ntk_by_parts' is not supported yet.*longrope"):
        inverse_frequencies(HEAD_SIZE, rope_parameters(_hf_config({"rope_type": "ntk_by_parts"})))


@pytest.mark.parametrize(
    ("partial", "fields"),
    [
        (1.0, {}),  # Phi-3.5-mini: whole heads, the factor from the two contexts
        (0.75, {"attention_factor": 1.1}),  # Phi-4-mini's partial rotation; a set factor
        (0.5, {"factor": 2.0}),
    ],
)
def test_longrope_factors_and_scale_equal_transformers(partial, fields):
    """Phi-3's LongRoPE as HF's Phi3RotaryEmbedding builds it: the short factors within the
    original context, the long ones for a pass that reaches past it (the window is the
    whole ``max_position_embeddings``); the engine's table holds both, the long rotation
    ``long_offset`` rows on, bit for bit as HF rotates."""
    rotary_dim = int(HEAD_SIZE * partial)
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0 + i / rotary_dim for i in range(rotary_dim // 2)],
        "long_factor": [4.0 + i for i in range(rotary_dim // 2)],
        "partial_rotary_factor": partial,
        **fields,
    }
    hf_config = {**_hf_config(rope), "original_max_position_embeddings": 128}
    hf_rotary = Phi3RotaryEmbedding(transformers.Phi3Config(**hf_config))
    parameters = rope_parameters(hf_config)
    assert parameters["original_max_position_embeddings"] == 128
    assert rope_context_window(parameters, MAX_POSITIONS) == MAX_POSITIONS
    assert long_rope_switch(parameters) == 128
    assert torch.equal(inverse_frequencies(rotary_dim, parameters), hf_rotary.inv_freq)
    assert attention_factor(parameters) == hf_rotary.attention_scaling
    rotary = RotaryEmbedding(HEAD_SIZE, MAX_POSITIONS, parameters)
    assert rotary.long_offset == MAX_POSITIONS
    for positions, offset in [(torch.arange(0, 128), 0), (torch.arange(0, 300), MAX_POSITIONS)]:
        x = torch.zeros(1, 1, len(positions), HEAD_SIZE)
        cos, sin = hf_rotary(x, positions[None, :])  # a pass of len(positions) tokens
        half = rotary_dim // 2
        assert torch.equal(rotary.cos[positions + offset], cos[0, :, :half])
        assert torch.equal(rotary.sin[positions + offset], sin[0, :, :half])
    assert torch.equal(long_frequencies(rotary_dim, parameters), hf_rotary.inv_freq)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_partial_rotation_has_hf_s_bits(dtype):
    """RotaryEmbedding over three quarters of each head equals HF's Phi-3 rotation (cos and
    sin cast to the activations' dtype), the rest of each head untouched."""
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}
    hf_config = _hf_config(rope)
    rotary = RotaryEmbedding(HEAD_SIZE, MAX_POSITIONS, rope_parameters(hf_config))
    hf_rotary = Phi3RotaryEmbedding(transformers.Phi3Config(**hf_config))
    torch.manual_seed(0)
    num_tokens, num_heads, num_kv_heads = 7, 4, 2
    positions = torch.tensor([0, 1, 2, 50, 51, 300, 511])
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * HEAD_SIZE).to(dtype)
    query, key, _ = qkv.split(
        [num_heads * HEAD_SIZE, num_kv_heads * HEAD_SIZE, num_kv_heads * HEAD_SIZE], dim=-1
    )
    hf_query = query.reshape(1, num_tokens, num_heads, HEAD_SIZE).transpose(1, 2)
    hf_key = key.reshape(1, num_tokens, num_kv_heads, HEAD_SIZE).transpose(1, 2)
    cos, sin = hf_rotary(hf_query, positions[None, :])
    want_query, want_key = phi3_apply_rotary_pos_emb(hf_query, hf_key, cos, sin)
    rotary(positions, query, key)
    got_query = query.reshape(1, num_tokens, num_heads, HEAD_SIZE).transpose(1, 2)
    got_key = key.reshape(1, num_tokens, num_kv_heads, HEAD_SIZE).transpose(1, 2)
    assert torch.equal(got_query, want_query) and torch.equal(got_key, want_key)


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
