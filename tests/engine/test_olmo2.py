"""AllenAI's OLMo 2 (``Olmo2ForCausalLM``): norms after each sublayer instead of before,
and an RMSNorm over the whole query and key projections. Greedy tokens identical to HF
transformers (float32) across block sizes, chunked prefill with prefix hits, and two
tensor-parallel ranks, whose q/k norms sum their squares over the ranks (also with one KV
head both ranks hold); bfloat16's first tokens agree with HF's bfloat16; its classifier
matches HF's (tests/engine/test_classification.py). OLMo 3: sliding and full layers, each
kind with its RoPE (YaRN on the full ones), as HF reads the Hub's configs.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from engine.test_parity import NEW_TOKENS, check_bfloat16_first_tokens_agree_with_hf, hf_greedy
from tiny_models import random_hf_model

from pagedserve.frontend import LLM, SamplingParams

PROMPT_LENGTHS = [1, 17, 40, 100, 150]
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
OLMO2 = dict(
    architectures=["Olmo2ForCausalLM"],
    hidden_size=256,
    intermediate_size=384,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=512,
    rope_theta=10000.0,
    pad_token_id=1,
    eos_token_id=2,
)


def prompts(seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(512) for _ in range(n)] for n in PROMPT_LENGTHS]


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("olmo2")
    return {
        "gqa": random_hf_model(OLMO2, root / "gqa"),
        # One KV head: with two ranks both hold it, and its norm's sum counts it once.
        "one_kv_head": random_hf_model({**OLMO2, "num_key_value_heads": 1}, root / "one"),
    }


@pytest.fixture(scope="module")
def hf_references(model_dirs) -> dict[str, list[list[int]]]:
    return {name: hf_greedy(path, prompts()) for name, path in model_dirs.items()}


@pytest.mark.parametrize("block_size", [8, 16])
def test_olmo2_matches_hf(model_dirs, hf_references, block_size):
    llm = LLM(model_dirs["gqa"], block_size=block_size, num_blocks=256)
    assert token_ids(llm.generate(prompts(), GREEDY)) == hf_references["gqa"]


def test_chunked_prefill_and_prefix_caching_match_hf(model_dirs, hf_references):
    llm = LLM(
        model_dirs["gqa"],
        block_size=16,
        num_blocks=256,
        enable_chunked_prefill=True,
        max_num_batched_tokens=24,
        enable_prefix_caching=True,
    )
    llm.generate(prompts(), GREEDY)
    assert token_ids(llm.generate(prompts(), GREEDY)) == hf_references["gqa"]


@pytest.mark.parametrize("name", ["gqa", "one_kv_head"])
def test_two_tensor_parallel_ranks_match_hf(model_dirs, hf_references, name):
    llm = LLM(model_dirs[name], num_blocks=256, tensor_parallel_size=2)
    try:
        assert token_ids(llm.generate(prompts(), GREEDY)) == hf_references[name]
    finally:
        llm.shutdown()


def test_bfloat16_first_tokens_agree_with_hf_bfloat16(model_dirs):
    # Off float32 the norms run HF's own expression (scaled in float32, rounded once).
    check_bfloat16_first_tokens_agree_with_hf(model_dirs["gqa"])


# OLMo 3: four layers, three sliding (a 16-token window the longer prompts pass) and a full
# one, whose RoPE is YaRN's over an original context of 128 (the sliding ones plain), as
# the Hub's long-context configs write it (transformers 4's rope_scaling and rope_theta).
OLMO3 = dict(
    OLMO2,
    architectures=["Olmo3ForCausalLM"],
    num_hidden_layers=4,
    sliding_window=16,
)
OLMO3_ROPE = dict(
    rope_theta=500_000.0,
    rope_scaling={
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 128,
        "attention_factor": 1.2,
    },
)


@pytest.fixture(scope="module")
def olmo3_dir(tmp_path_factory) -> Path:
    saved = random_hf_model(OLMO3, tmp_path_factory.mktemp("olmo3_saved"))
    path = tmp_path_factory.mktemp("olmo3") / "model"
    shutil.copytree(saved, path)
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    config.pop("rope_parameters", None)
    config.update(OLMO3_ROPE)
    config_file.write_text(json.dumps(config))
    return path


def test_olmo3_matches_hf(olmo3_dir):
    """The sliding layers' window and plain RoPE, the full layer's YaRN (its attention
    factor too): greedy tokens as HF's, chunked with prefix hits too, and on two ranks."""
    expected = hf_greedy(olmo3_dir, prompts())
    llm = LLM(olmo3_dir, block_size=8, num_blocks=256)
    assert llm.model_config.layer_sliding_windows == (16, 16, 16, 0)
    assert llm.model_config.max_position_embeddings == 512  # YaRN's 128 x 4
    assert token_ids(llm.generate(prompts(), GREEDY)) == expected
    chunked = LLM(
        olmo3_dir, block_size=16, num_blocks=256, max_num_batched_tokens=24,
        enable_chunked_prefill=True, enable_prefix_caching=True,
    )  # fmt: skip
    chunked.generate(prompts(), GREEDY)
    assert token_ids(chunked.generate(prompts(), GREEDY)) == expected
    parallel = LLM(olmo3_dir, num_blocks=256, tensor_parallel_size=2)
    try:
        assert token_ids(parallel.generate(prompts(), GREEDY)) == expected
    finally:
        parallel.shutdown()


@pytest.mark.parametrize(
    "change",
    [
        {"sliding_window": 4096},  # no window the prompts reach
        {"rope_scaling": None},  # no YaRN on the full layer
    ],
)
def test_the_window_and_the_full_layers_rope_change_hf_s_tokens(olmo3_dir, tmp_path, change):
    # The parity test above fails on an engine that leaves either out.
    changed = tmp_path / "changed"
    shutil.copytree(olmo3_dir, changed)
    config_file = changed / "config.json"
    config = json.loads(config_file.read_text())
    for name, value in change.items():
        if value is None:
            config.pop(name)
        else:
            config[name] = value
    config_file.write_text(json.dumps(config))
    assert hf_greedy(changed, prompts()) != hf_greedy(olmo3_dir, prompts())
