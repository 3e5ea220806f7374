"""The engine with prefill as one SDPA call over gathered K/V (the CUDA default), run on the
CPU: greedy tokens identical to HF transformers, with chunked prefill and prefix caching."""

from __future__ import annotations

import pytest

from helpers.parity import GREEDY, hf_greedy, random_prompts
from pagedserve.frontend import LLM, SamplingParams
from pagedserve.gpu_worker.layers.gathered_prefill import PREFILL_ATTENTION_ENV


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_engine_with_gathered_prefill_matches_hf(tiny_model_dirs, monkeypatch, family):
    monkeypatch.setenv(PREFILL_ATTENTION_ENV, "sdpa")
    prompts = random_prompts(1, 512)
    # Chunked prefill (16-token chunks) puts cached context under most prefill steps.
    llm = LLM(tiny_model_dirs[family], block_size=8, num_blocks=256, max_num_batched_tokens=64)
    assert llm.worker.runner.gathered_prefill
    outputs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(tiny_model_dirs[family], prompts)


def test_engine_with_gathered_prefill_and_prefix_cache(tiny_model_dirs, monkeypatch):
    monkeypatch.setenv(PREFILL_ATTENTION_ENV, "sdpa")
    prompt = list(range(1, 42))
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    llm = LLM(tiny_model_dirs["llama"], num_blocks=64, block_size=8)
    first = llm.generate(prompt, params)[0]
    second = llm.generate(prompt, params)[0]  # prefills 1 token over 40 cached
    assert second.num_cached_tokens == 40
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
