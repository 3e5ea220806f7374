"""Priority scheduling in the whole engine (``LLM(scheduling_policy="priority")``): requests
run by priority, in one process and across processes; preemptions a priority causes keep
every output equal to HF transformers' greedy tokens (float32); the refusals name the
field."""

from __future__ import annotations

import pytest

from helpers.parity import GREEDY, hf_greedy, random_prompts
from pagedserve.frontend import LLM

PROMPTS = random_prompts(7, 512)
PRIORITIES = [3, 0, 2, 1, 0, 3, 1, 2]


@pytest.fixture(scope="module")
def hf_reference(tiny_model_dirs) -> list[list[int]]:
    """HF's greedy tokens for each of PROMPTS, one prompt at a time (no padding)."""
    return hf_greedy(tiny_model_dirs["llama"], PROMPTS)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_priorities_under_a_tiny_cache_keep_tokens_equal_to_hf(tiny_model_dirs, hf_reference, mode):
    # The longest needs 13 blocks of 16, all eight together 52: with 16, requests queue
    # and running ones are preempted.
    llm = LLM(
        tiny_model_dirs["llama"],
        block_size=16,
        num_blocks=16,
        max_num_batched_tokens=64,
        preemption_mode=mode,
        scheduling_policy="priority",
    )
    outputs = llm.generate(PROMPTS, GREEDY, priority=PRIORITIES)
    assert [o.outputs[0].token_ids for o in outputs] == hf_reference
    assert llm.stats()[f"num_{mode}_preemptions"] > 0


def run_engine(llm: LLM, arrivals: list[tuple[int, str, int, int]]) -> tuple[list[str], dict]:
    """Drive ``llm.engine`` step by step: ``arrivals`` are (step, request id, prompt index,
    priority), each added before that step runs. Returns the ids in the order they
    finished and each request's output tokens."""
    engine = llm.engine
    finished, tokens = [], {}
    step = 0
    pending = sorted(arrivals)
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, request_id, index, priority = pending.pop(0)
            engine.add_request(request_id, PROMPTS[index], GREEDY, frozenset(), priority=priority)
        for delta in engine.step():
            tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
            if delta.finished:
                finished.append(delta.request_id)
        step += 1
    return finished, tokens


@pytest.mark.parametrize("multiprocess", [False, True])
def test_a_late_high_priority_request_takes_a_running_ones_place(
    tiny_model_dirs, hf_reference, multiprocess
):
    """One sequence at a time: two low-priority requests queue, the first runs; a
    high-priority one arriving mid-run preempts it, runs to its end, and the preempted
    request then resumes (recomputed) with the tokens HF gives."""
    llm = LLM(
        tiny_model_dirs["llama"],
        num_blocks=64,
        max_num_seqs=1,
        scheduling_policy="priority",
        multiprocess=multiprocess,
    )
    finished, tokens = run_engine(llm, [(0, "low-a", 0, 5), (0, "low-b", 1, 5), (4, "high", 2, 0)])
    assert finished == ["high", "low-a", "low-b"]
    assert [tokens[r] for r in ["low-a", "low-b", "high"]] == hf_reference[:3]
    stats = llm.stats()
    assert stats["num_recompute_preemptions"] == 1, stats
    llm.shutdown()


def test_equal_priorities_never_preempt_and_keep_arrival_order(tiny_model_dirs):
    """d arrives while a runs alone: it outranks the queued b and c, but a is of its own
    priority and runs on."""
    llm = LLM(tiny_model_dirs["llama"], num_blocks=64, max_num_seqs=1, scheduling_policy="priority")
    finished, _ = run_engine(llm, [(0, "a", 0, 0), (0, "b", 1, 1), (2, "c", 2, 1), (3, "d", 3, 0)])
    assert finished == ["a", "d", "b", "c"]
    assert llm.stats()["num_preemptions"] == 0


def test_priorities_are_refused_where_they_cannot_be_honoured(tiny_model_dirs):
    fcfs = LLM(tiny_model_dirs["llama"], num_blocks=16)
    with pytest.raises(ValueError, match=r"priority=1: this engine schedules first come"):
        fcfs.generate(PROMPTS[:1], GREEDY, priority=1)
    with pytest.raises(ValueError, match=r"priority\[1\]=-2: this engine schedules first come"):
        fcfs.generate(PROMPTS[:2], GREEDY, priority=[0, -2])
    assert len(fcfs.generate(PROMPTS[:2], GREEDY, priority=[0, 0])) == 2
    llm = LLM(tiny_model_dirs["llama"], num_blocks=16, scheduling_policy="priority")
    with pytest.raises(ValueError, match=r"priority has 1 entries for 2 prompts"):
        llm.generate(PROMPTS[:2], GREEDY, priority=[1])
    with pytest.raises(ValueError, match=r"priority\[0\] must be an integer .*got 'high'"):
        llm.generate(PROMPTS[:1], GREEDY, priority=["high"])
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority"):
        LLM(tiny_model_dirs["llama"], num_blocks=16, scheduling_policy="sjf")
