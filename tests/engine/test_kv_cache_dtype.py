"""Float8 KV caches (CPU; ``kv_cache_dtype="fp8"`` = ``"fp8_e4m3"``, and ``"fp8_e5m2"``):
greedy tokens equal HF transformers' (float32) when HF's cache rounds its keys and values to
the same float8 the same way, through chunked prefill, prefix caching, preemption by swap, the
gathered (SDPA) prefill, a multi-process and a two-rank engine; the same bytes hold four times
the float32 cache's tokens; an unknown value or a GPU is refused by name."""

from __future__ import annotations

import subprocess
import sys
from contextlib import contextmanager

import pytest
import torch
from transformers.cache_utils import DynamicLayer

from helpers.parity import GREEDY, hf_greedy, random_prompts
from pagedserve.frontend import LLM
from pagedserve.gpu_worker.layers.gathered_prefill import PREFILL_ATTENTION_ENV

# Each kv_cache_dtype and what the cache tensor holds.
FLOAT8 = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def rounded(x: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    """``x`` as the engine's cache stores it and reads it back (e4m3 saturates at +-448)."""
    clamped = x.clamp(-448, 448) if fp8 == torch.float8_e4m3fn else x
    return clamped.to(fp8).to(x.dtype)


@contextmanager
def hf_cache_rounds_to(fp8: torch.dtype):
    """HF's dynamic cache stores each new key and value rounded to ``fp8`` (and attends over
    what it stores, the new tokens' own included), as the engine's float8 cache does."""
    original = DynamicLayer.update

    def update(self, key_states, value_states, *args, **kwargs):
        key_states, value_states = rounded(key_states, fp8), rounded(value_states, fp8)
        return original(self, key_states, value_states, *args, **kwargs)

    DynamicLayer.update = update
    try:
        yield
    finally:
        DynamicLayer.update = original


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def rounded_references(tiny_model_dirs) -> dict[tuple[str, str], list[list[int]]]:
    """HF's greedy tokens with its cache rounded, by (kv_cache_dtype, family)."""
    references = {}
    for kv_cache_dtype, fp8 in FLOAT8.items():
        with hf_cache_rounds_to(fp8):
            for family in ("llama", "qwen2"):
                references[kv_cache_dtype, family] = hf_greedy(
                    tiny_model_dirs[family], random_prompts(1, 512)
                )
    return references


@pytest.mark.parametrize("kv_cache_dtype", FLOAT8)
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_tokens_equal_hf_with_a_rounding_cache(
    tiny_model_dirs, rounded_references, family, kv_cache_dtype
):
    llm = LLM(tiny_model_dirs[family], num_blocks=256, kv_cache_dtype=kv_cache_dtype)
    assert llm.worker.kv_cache.dtype == FLOAT8[kv_cache_dtype]
    got = token_ids(llm.generate(random_prompts(1, 512), GREEDY))
    assert got == rounded_references[kv_cache_dtype, family]
    # The rounding matters: HF's plain float32 cache gives other tokens somewhere.
    assert got != hf_greedy(tiny_model_dirs[family], random_prompts(1, 512))


def test_fp8_e4m3_is_fp8(tiny_model_dirs, rounded_references):
    # vLLM's two names for one cache.
    llm = LLM(tiny_model_dirs["llama"], num_blocks=256, kv_cache_dtype="fp8_e4m3")
    assert llm.worker.kv_cache.dtype == torch.float8_e4m3fn
    got = token_ids(llm.generate(random_prompts(1, 512), GREEDY))
    assert got == rounded_references["fp8", "llama"]


@pytest.mark.parametrize("kv_cache_dtype", FLOAT8)
def test_chunks_prefix_hits_and_swaps_read_the_same_cache(
    tiny_model_dirs, rounded_references, kv_cache_dtype
):
    # A small cache and 32-token steps: long prompts prefill in chunks over float8 context,
    # sequences swap out and back (whole float8 blocks), and later prompts hit cached blocks.
    prompts = random_prompts(1, 512)
    llm = LLM(
        tiny_model_dirs["llama"],
        block_size=8,
        num_blocks=40,
        max_num_batched_tokens=32,
        preemption_mode="swap",
        kv_cache_dtype=kv_cache_dtype,
    )
    assert token_ids(llm.generate(prompts, GREEDY)) == rounded_references[kv_cache_dtype, "llama"]
    assert llm.stats()["num_swap_preemptions"] > 0
    # The longest prompt again, twice: the second run reads its prefix from float8 blocks.
    llm.generate(prompts[-1:], GREEDY)
    again = llm.generate(prompts[-1:], GREEDY)
    assert again[0].num_cached_tokens > 0
    assert token_ids(again) == rounded_references[kv_cache_dtype, "llama"][-1:]


@pytest.mark.parametrize("kv_cache_dtype", FLOAT8)
def test_gathered_prefill_widens_the_float8_rows(
    tiny_model_dirs, rounded_references, monkeypatch, kv_cache_dtype
):
    monkeypatch.setenv(PREFILL_ATTENTION_ENV, "sdpa")
    llm = LLM(tiny_model_dirs["qwen2"], num_blocks=256, kv_cache_dtype=kv_cache_dtype)
    assert llm.worker.runner.gathered_prefill
    got = token_ids(llm.generate(random_prompts(1, 512), GREEDY))
    assert got == rounded_references[kv_cache_dtype, "qwen2"]


@pytest.mark.slow
def test_multiprocess_and_two_ranks(tiny_model_dirs, rounded_references):
    # One float8 cache each way: the worker processes build the cache from the name.
    for kv_cache_dtype, options in (
        ("fp8_e5m2", dict(multiprocess=True)),
        ("fp8", dict(tensor_parallel_size=2)),
    ):
        llm = LLM(
            tiny_model_dirs["llama"], num_blocks=128, kv_cache_dtype=kv_cache_dtype, **options
        )
        try:
            got = token_ids(llm.generate(random_prompts(1, 512), GREEDY))
            assert got == rounded_references[kv_cache_dtype, "llama"], options
        finally:
            llm.shutdown()


def test_the_same_bytes_hold_four_times_the_float32_tokens(tiny_model_dirs):
    kv_cache_bytes = 8 << 20
    plain = LLM(tiny_model_dirs["llama"], kv_cache_bytes=kv_cache_bytes)
    fp8 = LLM(tiny_model_dirs["llama"], kv_cache_bytes=kv_cache_bytes, kv_cache_dtype="fp8_e5m2")
    assert plain.bytes_per_block == 4 * fp8.bytes_per_block
    assert fp8.num_blocks == 4 * plain.num_blocks
    bf16 = LLM(tiny_model_dirs["llama"], dtype="bfloat16", kv_cache_bytes=kv_cache_bytes)
    for kv_cache_dtype in FLOAT8:
        bf16_fp8 = LLM(
            tiny_model_dirs["llama"],
            dtype="bfloat16",
            kv_cache_bytes=kv_cache_bytes,
            kv_cache_dtype=kv_cache_dtype,
        )
        assert bf16_fp8.num_blocks == 2 * bf16.num_blocks
        # A bfloat16 model over a float8 cache runs too (its own parity is HF's bfloat16's).
        assert len(bf16_fp8.generate([[1, 2, 3]], GREEDY)[0].outputs[0].token_ids) == 48


def test_unknown_values_and_a_gpu_are_refused_by_name(tiny_model_dirs):
    with pytest.raises(
        ValueError,
        match=r"kv_cache_dtype must be one of auto, fp8, fp8_e4m3, fp8_e5m2, got 'fp8_e4m3fn'",
    ):
        LLM(tiny_model_dirs["llama"], num_blocks=64, kv_cache_dtype="fp8_e4m3fn")
    with pytest.raises(
        ValueError, match=r"kv_cache_dtype='fp8' runs on CPU only .* got device='cuda'"
    ):
        LLM(tiny_model_dirs["llama"], num_blocks=64, kv_cache_dtype="fp8", device="cuda")
    result = subprocess.run(
        [sys.executable, "-m", "pagedserve.frontend.cli", "generate", "--kv-cache-dtype", "int4"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "--kv-cache-dtype: invalid choice: 'int4'" in result.stderr
