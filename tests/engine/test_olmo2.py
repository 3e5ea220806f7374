"""AllenAI's OLMo 2 (``Olmo2ForCausalLM``): norms after each sublayer instead of before, and
an RMSNorm over the whole query and key projections. Greedy tokens identical to HF
transformers (float32) across block sizes (the parity matrix), chunked prefill with prefix
hits, and two tensor-parallel ranks, whose q/k norms sum their squares over the ranks (also
with one KV head both ranks hold); bfloat16's first tokens agree with HF's bfloat16; its
classifier matches HF's (tests/engine/test_classification.py). OLMo 3: sliding and full
layers, each kind with its RoPE (YaRN on the full ones), as HF reads the Hub's configs.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.family_configs import OLMO2, OLMO3
from helpers.parity import check_bfloat16_first_tokens_agree_with_hf, hf_greedy
from helpers.tiny_family import (
    GREEDY,
    check_chunked_prefix_hits_and_two_ranks,
    prompts,
    rewritten,
    token_ids,
)
from helpers.tiny_models import random_hf_model
from pagedserve.frontend import LLM


@pytest.fixture(scope="module")
def model_dirs(family_models, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("olmo2")
    return {
        "gqa": family_models.model_dir(OLMO2),
        # One KV head: with two ranks both hold it, and its norm's sum counts it once.
        "one_kv_head": random_hf_model({**OLMO2, "num_key_value_heads": 1}, root / "one"),
    }


@pytest.fixture(scope="module")
def hf_references(model_dirs, family_models) -> dict[str, list[list[int]]]:
    return {
        "gqa": family_models.reference(OLMO2),
        "one_kv_head": hf_greedy(model_dirs["one_kv_head"], prompts()),
    }


def test_chunked_prefill_prefix_hits_and_two_ranks_match_hf(model_dirs, hf_references):
    check_chunked_prefix_hits_and_two_ranks(model_dirs["gqa"], hf_references["gqa"])


def test_one_kv_head_on_two_ranks_matches_hf(model_dirs, hf_references):
    # Both ranks hold the one KV head: its norm's sum of squares counts it once.
    llm = LLM(model_dirs["one_kv_head"], num_blocks=256, tensor_parallel_size=2)
    try:
        assert token_ids(llm.generate(prompts(), GREEDY)) == hf_references["one_kv_head"]
    finally:
        llm.shutdown()


def test_bfloat16_first_tokens_agree_with_hf_bfloat16(model_dirs):
    # Off float32 the norms run HF's own expression (scaled in float32, rounded once).
    check_bfloat16_first_tokens_agree_with_hf(model_dirs["gqa"])


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
def olmo3_dir(family_models, tmp_path_factory) -> Path:
    saved = family_models.model_dir(OLMO3)
    # As the Hub's configs write it: rope_theta and rope_scaling at the top.
    path = tmp_path_factory.mktemp("olmo3") / "model"
    return rewritten(saved, path, rope_parameters=None, **OLMO3_ROPE)


@pytest.fixture(scope="module")
def olmo3_reference(olmo3_dir) -> list[list[int]]:
    return hf_greedy(olmo3_dir, prompts())


def test_olmo3_matches_hf(olmo3_dir, olmo3_reference):
    """The sliding layers' window and plain RoPE, the full layer's YaRN (its attention
    factor too): greedy tokens as HF's, chunked with prefix hits too, and on two ranks."""
    llm = LLM(olmo3_dir, block_size=8, num_blocks=256)
    assert llm.model_config.layer_sliding_windows == (16, 16, 16, 0)
    assert llm.model_config.max_position_embeddings == 512  # YaRN's 128 x 4
    assert token_ids(llm.generate(prompts(), GREEDY)) == olmo3_reference
    check_chunked_prefix_hits_and_two_ranks(olmo3_dir, olmo3_reference)


@pytest.mark.parametrize(
    "change",
    [
        {"sliding_window": 4096},  # no window the prompts reach
        {"rope_scaling": None},  # no YaRN on the full layer
    ],
)
def test_the_window_and_the_full_layers_rope_change_hf_s_tokens(
    olmo3_dir, olmo3_reference, tmp_path, change
):
    # The parity test above fails on an engine that leaves either out.
    changed = rewritten(olmo3_dir, tmp_path / "changed", **change)
    assert hf_greedy(changed, prompts()) != olmo3_reference
