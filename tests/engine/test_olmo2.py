"""AllenAI's OLMo 2 (``Olmo2ForCausalLM``): norms after each sublayer instead of before,
and an RMSNorm over the whole query and key projections. Greedy tokens identical to HF
transformers (float32) across block sizes, chunked prefill with prefix hits, and two
tensor-parallel ranks, whose q/k norms sum their squares over the ranks (also with one KV
head both ranks hold); bfloat16's first tokens agree with HF's bfloat16; its classifier
matches HF's (tests/engine/test_classification.py).
"""

from __future__ import annotations

import random
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
