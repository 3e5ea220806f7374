"""Prefix caching through the engine: same tokens, cached counts, reset, namespaces."""

from __future__ import annotations

import random

from pagedserve.frontend import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def shared_prefix_prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(512) for _ in range(70)]
    return [prefix + [rng.randrange(512) for _ in range(rng.randrange(1, 30))] for _ in range(6)]


def test_caching_on_and_off_give_identical_tokens(tiny_model_dirs):
    prompts = shared_prefix_prompts(0)
    cached = LLM(tiny_model_dirs["qwen2"], num_blocks=128, enable_prefix_caching=True)
    plain = LLM(tiny_model_dirs["qwen2"], num_blocks=128, enable_prefix_caching=False)
    # Run one first so the rest of the batch can hit its prefix blocks.
    first = cached.generate(prompts[:1], GREEDY)
    rest = cached.generate(prompts[1:], GREEDY)
    expected = plain.generate(prompts, GREEDY)
    got = [o.outputs[0].token_ids for o in first + rest]
    assert got == [o.outputs[0].token_ids for o in expected]
    assert all(o.num_cached_tokens == 64 for o in rest)  # 4 full blocks of 16
    assert all(o.num_cached_tokens == 0 for o in expected)
    stats = cached.stats()
    assert stats["prefix_cache_hits"] == 64 * 5
    assert stats["prefix_cache_queries"] == sum(len(p) - 1 for p in prompts)


def test_second_identical_request_reports_its_prompt_blocks_as_cached(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["llama"], num_blocks=64, block_size=8)
    prompt = list(range(1, 42))  # 41 tokens: 5 full blocks of 8
    first = llm.generate(prompt, GREEDY)[0]
    second = llm.generate(prompt, GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 40
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    llm.reset_prefix_cache()
    third = llm.generate(prompt, GREEDY)[0]
    assert third.num_cached_tokens == 0
    assert third.outputs[0].token_ids == first.outputs[0].token_ids


def test_namespaces_isolate_cached_prefixes(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["llama"], num_blocks=64, block_size=8)
    prompt = list(range(1, 42))
    llm.generate(prompt, GREEDY, cache_namespace="tenant-a")
    other = llm.generate(prompt, GREEDY, cache_namespace="tenant-b")[0]
    same = llm.generate(prompt, GREEDY, cache_namespace="tenant-a")[0]
    assert other.num_cached_tokens == 0
    assert same.num_cached_tokens == 40
