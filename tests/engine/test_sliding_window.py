"""Sliding-window models (Mistral, Qwen2 / Qwen3 with windowed layers) run to their full
max_position_embeddings, with greedy tokens identical to HF transformers (float32) on prompts and
generations far past the window: across block sizes, chunked prefill, prefix caching, the
gathered-prefill path and two tensor-parallel ranks.

HF's semantics: a query at position i of a windowed layer sees keys i - W < j <= i
(masking_utils); Qwen2 / Qwen3 window the layers ``layer_types`` marks "sliding_attention"
(derived from ``use_sliding_window`` and ``max_window_layers`` when absent).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from helpers.parity import NEW_TOKENS, hf_greedy
from helpers.windowed_models import WINDOWED_CONFIGS, make_windowed_model, windowed_prompts
from pagedserve.frontend import LLM, SamplingParams
from pagedserve.gpu_worker.layers.gathered_prefill import PREFILL_ATTENTION_ENV
from pagedserve.gpu_worker.model_config import ModelConfig

EXPECTED_LAYER_WINDOWS = {"mistral": (16, 16), "qwen2": (0, 12, 12), "qwen3": (20, 0)}
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def windowed_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("windowed_models")
    return {family: make_windowed_model(family, root / family) for family in WINDOWED_CONFIGS}


@pytest.fixture(scope="module")
def hf_references(windowed_dirs) -> dict[str, list[list[int]]]:
    return {family: hf_greedy(path, windowed_prompts()) for family, path in windowed_dirs.items()}


def test_config_reads_each_layers_window_and_keeps_the_full_context(windowed_dirs):
    for family, path in windowed_dirs.items():
        config = ModelConfig.from_dir(path)
        assert config.layer_sliding_windows == EXPECTED_LAYER_WINDOWS[family], family
        # The window no longer caps the context: the ops honour it.
        assert config.max_position_embeddings == 512, family


def _config_dir(tmp_path: Path, **fields) -> Path:
    config = dict(
        hidden_size=128, num_hidden_layers=4, num_attention_heads=2, vocab_size=512, **fields
    )
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize(
    ("fields", "windows"),
    [
        # An old Qwen2 checkpoint (no layer_types): the window counts only with
        # use_sliding_window, from layer max_window_layers on.
        (dict(architectures=["Qwen2ForCausalLM"], sliding_window=4096), (0, 0, 0, 0)),
        (
            dict(
                architectures=["Qwen2ForCausalLM"],
                sliding_window=64,
                use_sliding_window=True,
                max_window_layers=2,
            ),
            (0, 0, 64, 64),
        ),
        # max_window_layers defaults to 28: no layer of a 4-layer model is windowed.
        (
            dict(architectures=["Qwen3ForCausalLM"], sliding_window=64, use_sliding_window=True),
            (0, 0, 0, 0),
        ),
        # layer_types wins over max_window_layers.
        (
            dict(
                architectures=["Qwen3ForCausalLM"],
                sliding_window=64,
                use_sliding_window=True,
                max_window_layers=0,
                layer_types=["full_attention", "sliding_attention"] * 2,
            ),
            (0, 64, 0, 64),
        ),
        # Mistral windows every layer; use_sliding_window and layer_types are not its fields.
        (
            dict(
                architectures=["MistralForCausalLM"],
                sliding_window=32,
                use_sliding_window=False,
                layer_types=["full_attention"] * 4,
            ),
            (32, 32, 32, 32),
        ),
        (dict(architectures=["MistralForCausalLM"], sliding_window=None), (0, 0, 0, 0)),
        # Llama has no sliding window, whatever the config holds.
        (dict(architectures=["LlamaForCausalLM"], sliding_window=32), (0, 0, 0, 0)),
    ],
)
def test_layer_windows_follow_hf_configs(tmp_path, fields, windows):
    config = ModelConfig.from_dir(_config_dir(tmp_path, max_position_embeddings=4096, **fields))
    assert config.layer_sliding_windows == windows
    assert config.max_position_embeddings == 4096


def test_bad_window_fields_are_refused_naming_them(tmp_path):
    qwen2 = dict(architectures=["Qwen2ForCausalLM"], sliding_window=8, use_sliding_window=True)
    with pytest.raises(ValueError, match="layer_types has 2 entries but num_hidden_layers is 4"):
        ModelConfig.from_dir(_config_dir(tmp_path, layer_types=["full_attention"] * 2, **qwen2))
    mistral = dict(architectures=["MistralForCausalLM"], sliding_window=-8)
    with pytest.raises(ValueError, match="sliding_window must be a non-negative integer, got -8"):
        ModelConfig.from_dir(_config_dir(tmp_path, **mistral))


def test_llm_accepts_prompts_and_generations_past_the_window(windowed_dirs, hf_references):
    llm = LLM(windowed_dirs["mistral"], num_blocks=256)
    assert llm.model_config.max_position_embeddings == 512
    prompts = windowed_prompts()
    assert token_ids(llm.generate(prompts, GREEDY)) == hf_references["mistral"]
    # The last prompt and its generation reach 178 positions: 11 windows of 16.
    assert len(prompts[-1]) + NEW_TOKENS > 10 * 16
    # max_model_len may go to max_position_embeddings (it was capped at the window), no further.
    LLM(windowed_dirs["mistral"], num_blocks=64, max_model_len=512)
    with pytest.raises(
        ValueError, match="max_model_len=513 exceeds the model's context window 512"
    ):
        LLM(windowed_dirs["mistral"], num_blocks=64, max_model_len=513)


def test_the_window_changes_hf_s_tokens(windowed_dirs, hf_references, tmp_path):
    # Without this the parity tests could pass with the window ignored: the same weights with
    # full attention give other tokens on the long prompts.
    full = tmp_path / "mistral_full"
    full.mkdir()
    for item in windowed_dirs["mistral"].iterdir():
        (full / item.name).write_bytes(item.read_bytes())
    config = json.loads((full / "config.json").read_text())
    config["sliding_window"] = None
    (full / "config.json").write_text(json.dumps(config))
    assert ModelConfig.from_dir(full).layer_sliding_windows == (0, 0)
    long_prompts = windowed_prompts()[-2:]
    assert hf_greedy(full, long_prompts) != hf_references["mistral"][-2:]


@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("block_size", [8, 16])
def test_windowed_models_match_hf(windowed_dirs, hf_references, family, block_size):
    llm = LLM(windowed_dirs[family], block_size=block_size, num_blocks=256)
    assert token_ids(llm.generate(windowed_prompts(), GREEDY)) == hf_references[family]


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_chunked_prefill_matches_hf(windowed_dirs, hf_references, family):
    # 24-token steps: long prompts prefill in chunks whose windows reach into cached context.
    llm = LLM(
        windowed_dirs[family],
        block_size=8,
        num_blocks=256,
        enable_chunked_prefill=True,
        max_num_batched_tokens=24,
    )
    assert token_ids(llm.generate(windowed_prompts(), GREEDY)) == hf_references[family]


def test_prefix_caching_matches_hf(windowed_dirs):
    # A 70-token shared prefix (4 windows of 16) cached in blocks of 16: the second and later
    # requests prefill only their suffix over the cached blocks.
    rng = random.Random(3)
    prefix = [rng.randrange(512) for _ in range(70)]
    prompts = [prefix + [rng.randrange(512) for _ in range(n)] for n in (3, 11, 30)]
    model_dir = windowed_dirs["mistral"]
    llm = LLM(model_dir, block_size=16, num_blocks=128, enable_prefix_caching=True)
    first = llm.generate(prompts[:1], GREEDY)
    rest = llm.generate(prompts[1:], GREEDY)
    assert all(o.num_cached_tokens == 64 for o in rest)
    assert token_ids(first + rest) == hf_greedy(model_dir, prompts)


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_gathered_prefill_matches_hf(windowed_dirs, hf_references, monkeypatch, family):
    # Prefill as one SDPA call over gathered K/V (a GPU's default), with a per-layer window mask.
    monkeypatch.setenv(PREFILL_ATTENTION_ENV, "sdpa")
    llm = LLM(windowed_dirs[family], block_size=8, num_blocks=256, max_num_batched_tokens=64)
    assert llm.worker.runner.gathered_prefill
    assert token_ids(llm.generate(windowed_prompts(), GREEDY)) == hf_references[family]


def test_two_tensor_parallel_ranks_match_hf(windowed_dirs, hf_references):
    # Each rank holds half the heads of every layer and applies that layer's window.
    llm = LLM(windowed_dirs["qwen2"], num_blocks=256, tensor_parallel_size=2)
    try:
        assert token_ids(llm.generate(windowed_prompts(), GREEDY)) == hf_references["qwen2"]
    finally:
        llm.shutdown()
