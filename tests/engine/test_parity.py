"""Greedy tokens identical to HF transformers on the same weights (float32; in bfloat16,
within its rounding)."""

from __future__ import annotations

import pytest

from helpers.parity import (
    EMBEDDED_PROMPTS,
    GREEDY,
    check_bfloat16_first_tokens_agree_with_hf,
    hf_greedy,
    random_prompts,
)
from pagedserve.frontend import LLM


@pytest.fixture(scope="module")
def hf_references(tiny_model_dirs):
    return {
        family: hf_greedy(path, random_prompts(1, 512)) for family, path in tiny_model_dirs.items()
    }


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "opt"])
@pytest.mark.parametrize("block_size", [32])  # 8 and 16: the parity matrix, other prompts
def test_tiny_models_match_hf(tiny_model_dirs, hf_references, family, block_size):
    llm = LLM(tiny_model_dirs[family], block_size=block_size, num_blocks=256)
    outputs = llm.generate(random_prompts(1, 512), GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == hf_references[family]
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)


@pytest.mark.parametrize("family", ["mistral", "llama3_rope", "yarn_rope", "qwen3_tied_bias"])
def test_more_llama_family_configs_match_hf(tiny_model_dirs, hf_references, family):
    llm = LLM(tiny_model_dirs[family], num_blocks=256)
    outputs = llm.generate(random_prompts(1, 512), GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == hf_references[family]
    if family == "yarn_rope":
        assert llm.model_config.max_position_embeddings == 64 * 4  # YaRN's extended window


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("family", ["llama", "opt"])
def test_tiny_cache_forces_preemption_and_tokens_still_match(
    tiny_model_dirs, hf_references, family, mode
):
    # The longest request needs 13 blocks of 16; all eight together need 52. With 16
    # blocks, requests queue for blocks and running ones are preempted.
    llm = LLM(
        tiny_model_dirs[family],
        block_size=16,
        num_blocks=16,
        max_num_batched_tokens=64,
        preemption_mode=mode,
    )
    outputs = llm.generate(random_prompts(1, 512), GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == hf_references[family]
    assert llm.stats()[f"num_{mode}_preemptions"] > 0


def test_small_host_pool_falls_back_to_recompute(tiny_model_dirs, hf_references):
    llm = LLM(
        tiny_model_dirs["llama"],
        num_blocks=16,
        max_num_batched_tokens=64,
        preemption_mode="swap",
        swap_space_bytes=1,  # holds no block: every swap falls back
    )
    outputs = llm.generate(random_prompts(1, 512), GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == hf_references["llama"]
    stats = llm.stats()
    assert stats["num_swap_preemptions"] == 0 and stats["num_recompute_preemptions"] > 0


@pytest.mark.parametrize("chunked", [True, False])
def test_chunked_prefill_on_and_off_match_hf(tiny_model_dirs, hf_references, chunked):
    llm = LLM(
        tiny_model_dirs["qwen2"],
        num_blocks=128,
        enable_chunked_prefill=chunked,
        max_num_batched_tokens=40 if chunked else 512,
    )
    outputs = llm.generate(random_prompts(1, 512), GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == hf_references["qwen2"]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_bfloat16_first_tokens_agree_with_hf_bfloat16(tiny_model_dirs, family):
    check_bfloat16_first_tokens_agree_with_hf(tiny_model_dirs[family])


@pytest.mark.slow
def test_embedded_model_matches_hf(embedded_hf_greedy):
    prompts, expected = embedded_hf_greedy
    llm = LLM(kv_cache_bytes=256 << 20)
    assert prompts == [llm.tokenizer.encode(text) for text in EMBEDDED_PROMPTS]
    assert len({len(p) for p in prompts}) >= 6
    outputs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert outputs[0].outputs[0].text.startswith(" Paris.")
