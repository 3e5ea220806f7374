"""A model whose every layer is windowed (Mistral) gives back the blocks behind each
sequence's window, so requests longer than the whole KV cache run; greedy tokens still equal
HF transformers' (float32): under recompute and swap preemption, prefix caching, the
gathered-prefill path (which reads the freed entries' positions as padding), speculative
decoding and a multi-process engine (the freed entries cross to the worker in the plan).

The Mistral model of test_sliding_window: window 16, blocks of 8, steps of 16 tokens: a
sequence never holds more than 5 blocks (15 window positions + 16 new ones), and its prompts
plus 48 generated tokens reach 178 tokens, 23 blocks.
"""

from __future__ import annotations

import random

import pytest

from helpers.parity import GREEDY, NEW_TOKENS, hf_greedy
from helpers.tiny_family import token_ids
from helpers.windowed_models import make_windowed_model, windowed_prompts
from pagedserve.frontend import LLM, SamplingParams
from pagedserve.gpu_worker.layers.gathered_prefill import PREFILL_ATTENTION_ENV
from pagedserve.gpu_worker.model_config import ModelConfig

# 8 blocks of 8 = 64 slots: any one step of any request fits, but no long request whole.
SMALL_CACHE = dict(block_size=8, num_blocks=8, max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory):
    return make_windowed_model("mistral", tmp_path_factory.mktemp("window_freeing") / "mistral")


@pytest.fixture(scope="module")
def reference(mistral_dir) -> list[list[int]]:
    return hf_greedy(mistral_dir, windowed_prompts())


def test_the_window_that_frees_is_the_one_every_layer_has(tmp_path):
    assert (
        ModelConfig.from_dir(make_windowed_model("mistral", tmp_path / "m")).attention_window == 16
    )
    # A full-attention layer reads every block: nothing may be freed.
    assert ModelConfig.from_dir(make_windowed_model("qwen2", tmp_path / "q")).attention_window == 0


def test_requests_longer_than_the_cache_match_hf(mistral_dir, reference):
    llm = LLM(mistral_dir, **SMALL_CACHE)
    prompts = windowed_prompts()
    assert max(len(p) for p in prompts) + NEW_TOKENS > 8 * 8
    assert token_ids(llm.generate(prompts, GREEDY)) == reference
    stats = llm.stats()
    # Six requests in 8 blocks: they took turns (recompute), and windows freed many blocks.
    assert stats["num_recompute_preemptions"] > 0, stats
    assert stats["num_window_freed_blocks"] > 23, stats


def test_swap_preemption_moves_only_the_window(mistral_dir, reference):
    llm = LLM(mistral_dir, **SMALL_CACHE, preemption_mode="swap")
    assert token_ids(llm.generate(windowed_prompts(), GREEDY)) == reference
    assert llm.stats()["num_swap_preemptions"] > 0


def test_gathered_prefill_masks_the_freed_positions(mistral_dir, reference, monkeypatch):
    monkeypatch.setenv(PREFILL_ATTENTION_ENV, "sdpa")
    llm = LLM(mistral_dir, **SMALL_CACHE)
    assert llm.worker.runner.gathered_prefill
    assert token_ids(llm.generate(windowed_prompts(), GREEDY)) == reference


def test_a_cached_prefix_is_read_from_its_window(mistral_dir):
    # A 70-token prefix (8 full blocks) cached by the first request; the next ones take only
    # the hit's blocks inside the window of their first computed token.
    rng = random.Random(5)
    prefix = [rng.randrange(512) for _ in range(70)]
    prompts = [prefix + [rng.randrange(512) for _ in range(n)] for n in (3, 11, 30)]
    llm = LLM(mistral_dir, block_size=8, num_blocks=32, max_num_batched_tokens=16)
    first = llm.generate(prompts[:1], GREEDY)
    rest = llm.generate(prompts[1:], GREEDY)
    assert [o.num_cached_tokens for o in rest] == [64, 64]
    assert token_ids(first + rest) == hf_greedy(mistral_dir, prompts)


def test_speculative_decoding_frees_behind_the_accepted_tokens(mistral_dir, reference):
    speculative = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    llm = LLM(mistral_dir, **SMALL_CACHE, speculative_config=speculative)
    assert token_ids(llm.generate(windowed_prompts(), GREEDY)) == reference
    assert llm.stats()["num_draft_tokens"] > 0


@pytest.mark.slow
def test_a_multiprocess_engine_matches_hf(mistral_dir, reference):
    llm = LLM(mistral_dir, **SMALL_CACHE, multiprocess=True)
    try:
        assert token_ids(llm.generate(windowed_prompts(), GREEDY)) == reference
        assert llm.stats()["num_window_freed_blocks"] > 0
    finally:
        llm.shutdown()


def test_what_cannot_run_behind_a_window_is_refused(mistral_dir, tmp_path):
    llm = LLM(mistral_dir, **SMALL_CACHE)
    prompt = list(range(100))
    # Two samples: a group preempted by recompute takes blocks for all its tokens at once.
    with pytest.raises(ValueError, match=r"x 2 sequences = 76 blocks of 8 tokens"):
        llm.generate([prompt], SamplingParams(n=2, max_tokens=200, temperature=1.0))
    # A model with a full-attention layer keeps every block.
    qwen2 = LLM(make_windowed_model("qwen2", tmp_path / "qwen2"), **SMALL_CACHE)
    with pytest.raises(ValueError, match=r"= 38 blocks of 8 tokens, but the whole KV cache has 8"):
        qwen2.generate([prompt], SamplingParams(max_tokens=200))
    # A step too wide for the cache with the window before it.
    with pytest.raises(ValueError, match=r"spans up to 9 blocks of 8 tokens, but the whole KV"):
        LLM(mistral_dir, block_size=8, num_blocks=8, max_num_batched_tokens=48).generate(
            [prompt], SamplingParams(max_tokens=200)
        )
