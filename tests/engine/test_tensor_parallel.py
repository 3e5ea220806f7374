"""Tensor parallelism: two worker processes split each model and give the same greedy
tokens as one process (and so as HF: ``test_parity.py``); a killed rank ends every
request with an error naming it; shutdown leaves no process behind.

The summation order of a split matmul differs from the whole one, so logits differ in
their last bits: the test is exact equality of tokens, on configs whose greedy paths
have no near-ties (``helpers.tiny_models.make_tiny_model``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from helpers.engine_processes import (
    assert_engine_gone,
    kill_mid_generation,
    live_schedulers,
)
from helpers.parity import GREEDY as HF_LENGTH_GREEDY
from helpers.parity import random_prompts
from helpers.tiny_family import token_ids
from pagedserve.frontend import LLM, SamplingParams
from pagedserve.frontend.engine_client import EngineClient, EngineDeadError

GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


@pytest.fixture
def make_llm():
    """Tensor-parallel LLMs that are shut down when the test ends, whatever happens."""
    made: list[LLM] = []

    def make(model_dir: Path, **kwargs) -> LLM:
        llm = LLM(model_dir, tensor_parallel_size=kwargs.pop("tensor_parallel_size", 2), **kwargs)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.shutdown()


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "llama3_rope", "qwen3", "opt"])
def test_two_ranks_give_the_same_greedy_tokens_as_one(tiny_model_dirs, make_llm, family):
    prompts = random_prompts(seed=5, vocab_size=512)
    expected = token_ids(LLM(tiny_model_dirs[family], num_blocks=128).generate(prompts, GREEDY))
    llm = make_llm(tiny_model_dirs[family], num_blocks=128)
    assert isinstance(llm.engine, EngineClient) and len(llm.engine.worker_pids) == 2
    assert token_ids(llm.generate(prompts, GREEDY)) == expected


def test_preemption_by_swap_and_chunked_prefill_keep_the_tokens(tiny_model_dirs, make_llm):
    # Each rank swaps its own heads' blocks; the scheduler plans one block space for both.
    settings = dict(num_blocks=16, max_num_batched_tokens=64, preemption_mode="swap")
    prompts = random_prompts(seed=4, vocab_size=512)
    expected = token_ids(LLM(tiny_model_dirs["qwen2"], **settings).generate(prompts, GREEDY))
    llm = make_llm(tiny_model_dirs["qwen2"], **settings)
    assert token_ids(llm.generate(prompts, GREEDY)) == expected
    assert llm.stats()["num_swap_preemptions"] > 0


def test_every_rank_samples_the_same_seeded_tokens(tiny_model_dirs, make_llm):
    # Every rank samples from the gathered logits and keeps its own copy of each request's
    # tokens: a rank that drew differently would feed wrong ids to its shard of the next
    # step, and the outputs would part from one process's.
    params = [
        SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=seed, ignore_eos=True)
        for seed in range(8)
    ]
    prompts = random_prompts(seed=6, vocab_size=512)
    expected = token_ids(LLM(tiny_model_dirs["llama"], num_blocks=128).generate(prompts, params))
    llm = make_llm(tiny_model_dirs["llama"], num_blocks=128)
    assert token_ids(llm.generate(prompts, params)) == expected


def test_each_rank_holds_half_the_kv_heads_in_as_many_blocks(tiny_model_dirs, make_llm):
    # qwen2: 2 KV heads, one per rank, so a block costs each rank half of one process's.
    single = LLM(tiny_model_dirs["qwen2"], kv_cache_bytes=1 << 20)
    llm = make_llm(tiny_model_dirs["qwen2"], kv_cache_bytes=1 << 20)
    assert llm.bytes_per_block * 2 == single.bytes_per_block
    assert llm.num_blocks == 2 * single.num_blocks


def test_shutdown_leaves_no_process_socket_or_shared_memory(tiny_model_dirs, make_llm):
    llm = make_llm(tiny_model_dirs["llama"], num_blocks=64)
    engine = llm.engine
    scheduler_pid, worker_pids = engine.scheduler_pid, engine.worker_pids
    ring, ipc_dir = engine._process.ring_name, engine._process.ipc_dir
    assert len(worker_pids) == 2 and os.path.exists(ipc_dir)
    llm.generate([[5, 6, 7], [8] * 20], GREEDY)
    llm.shutdown()
    assert_engine_gone(llm, scheduler_pid, worker_pids, ring)
    assert not os.path.exists(ipc_dir)  # with the ranks' rendezvous file in it
    assert llm.stats()["num_free_blocks"] == 64


def test_rank_1_killed_mid_generation_fails_every_request_naming_it(tiny_model_dirs, make_llm):
    llm = make_llm(tiny_model_dirs["llama"], num_blocks=256)
    engine = llm.engine
    scheduler_pid, worker_pids = engine.scheduler_pid, engine.worker_pids
    ring = engine._process.ring_name
    error = kill_mid_generation(llm, worker_pids[1])
    assert isinstance(error, EngineDeadError), error
    # Rank 0 fails too, in its next collective; the cause named is the rank that died.
    assert (
        f"worker rank 1 (pid {worker_pids[1]}) died with exit code -9 (killed by SIGKILL)"
        in str(error)
    )
    assert_engine_gone(llm, scheduler_pid, worker_pids, ring)
    assert llm.stats()["num_free_blocks"] == 256


def test_in_process_engine_refuses_more_than_one_rank(tiny_model_dirs):
    with pytest.raises(ValueError, match="tensor_parallel_size=2 runs one worker process per"):
        LLM(tiny_model_dirs["llama"], num_blocks=16, multiprocess=False, tensor_parallel_size=2)


def test_a_size_that_does_not_divide_the_heads_fails_before_any_process_starts(
    tiny_model_dirs,
):
    schedulers_before = live_schedulers()
    started_s = time.monotonic()
    with pytest.raises(ValueError, match="does not divide the model's num_attention_heads=4"):
        LLM(tiny_model_dirs["qwen2"], num_blocks=16, tensor_parallel_size=3)
    assert live_schedulers() == schedulers_before
    assert time.monotonic() - started_s < 5


@pytest.mark.slow
def test_embedded_model_split_over_three_ranks_matches_hf(embedded_hf_greedy):
    # SmolLM2-135M has 9 query and 3 KV heads: 3 ranks split it, 2 do not.
    with pytest.raises(ValueError, match="num_attention_heads=9"):
        LLM(tensor_parallel_size=2)
    prompts, expected = embedded_hf_greedy
    llm = LLM(kv_cache_bytes=128 << 20, tensor_parallel_size=3)
    try:
        outputs = llm.generate(prompts, HF_LENGTH_GREEDY)
        assert token_ids(outputs) == expected
        assert outputs[0].outputs[0].text.startswith(" Paris.")
    finally:
        llm.shutdown()


def test_shared_blocks_and_beams_across_two_ranks(tiny_model_dirs, make_llm):
    """Parallel samples, beams and copy-on-write on two ranks: each rank forks and
    copies its own heads' blocks; tokens and scores as on one rank."""
    prompts = random_prompts(seed=7, vocab_size=512)[:3]
    params = [
        SamplingParams(n=3, temperature=0.9, seed=3, max_tokens=12, ignore_eos=True),
        SamplingParams(beam_width=3, n=2, temperature=0.0, max_tokens=10),
        SamplingParams(n=2, best_of=3, temperature=1.0, seed=4, max_tokens=8, ignore_eos=True),
    ]
    single = LLM(tiny_model_dirs["llama"], num_blocks=128).generate(prompts, params)
    split = make_llm(tiny_model_dirs["llama"], num_blocks=128).generate(prompts, params)
    assert [[c.token_ids for c in o.outputs] for o in split] == [
        [c.token_ids for c in o.outputs] for o in single
    ]
