"""Async scheduling (scheduler/schedule_ahead.py) gives the tokens of the synchronous
engine, greedy and seeded, through preemption, chunked prefill, prefix hits, stops that
waste a step, aborts while a step is in flight, and the features that turn it off (beams,
n > 1, speculation); in process and with worker processes. Each scenario also shows that
plans were made ahead, so a path that never overlaps cannot pass; where every request
samples plainly, also that the worker queued steps behind the one in flight, their
decodes' input tokens taken from its device tensor (``StepResult.launched_ahead``)."""

from __future__ import annotations

import pytest

from pagedserve.frontend import LLM, SamplingParams
from pagedserve.scheduler.engine_core import EngineCore

VOCAB = 512


def _prompts(num: int, length: int, shared: int = 0) -> list[list[int]]:
    """``num`` prompts of ``length`` tokens; the first ``shared`` tokens common to all."""
    common = [(7 * i) % (VOCAB - 3) + 3 for i in range(shared)]
    return [
        common + [(31 * r + 17 * i) % (VOCAB - 3) + 3 for i in range(length - shared)]
        for r in range(num)
    ]


def _tokens(model, prompts, params, **options) -> tuple[list[list[list[int]]], dict]:
    llm = LLM(model, **options)
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.stats()
    finally:
        llm.shutdown()
    return [[list(c.token_ids) for c in output.outputs] for output in outputs], stats


def _same_with_and_without(model, prompts, params, **options) -> dict:
    expected, _ = _tokens(model, prompts, params, async_scheduling=False, **options)
    got, stats = _tokens(model, prompts, params, async_scheduling=True, **options)
    assert got == expected
    return stats


# Seeded draws with stop tokens: requests end at different steps, mostly on a token the
# scheduler could not foresee, so the step planned ahead of that token is wasted.
STOPS = [11, 12, 13, 14, 15, 16, 17, 18]


def _seeded(max_tokens: int, seed: int = 0, presence_penalty: float = 0.5) -> list[SamplingParams]:
    return [
        SamplingParams(
            temperature=1.0,
            top_p=0.9,
            seed=seed + i,
            max_tokens=max_tokens + i % 5,
            stop_token_ids=STOPS,
            presence_penalty=presence_penalty,
        )
        for i in range(12)
    ]


SCENARIOS = {
    # Varied lengths; prompts sharing three blocks (prefix hits after the first).
    "greedy_prefix_hits": (
        _prompts(12, 40, shared=24),
        [SamplingParams(temperature=0.0, max_tokens=20 + 3 * i) for i in range(12)],
        {"block_size": 8},
    ),
    "seeded_stops": (_prompts(12, 9), _seeded(40), {}),
    # No penalty: the worker launches each decode step behind the one in flight.
    "seeded_plain_stops": (_prompts(12, 9), _seeded(40, presence_penalty=0.0), {}),
    # 12 long prompts in 32-token steps, then too few blocks for every sequence to grow.
    "chunked_prefill_and_preemption": (
        _prompts(12, 50),
        _seeded(60, seed=100),
        {"block_size": 8, "num_blocks": 96, "max_num_batched_tokens": 32},
    ),
}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_tokens_match_the_synchronous_engine(tiny_model_dirs, scenario):
    prompts, params, options = SCENARIOS[scenario]
    stats = _same_with_and_without(tiny_model_dirs["llama"], prompts, params, **options)
    assert stats["num_steps_scheduled_ahead"] > 10, stats
    plain = scenario in ("greedy_prefix_hits", "seeded_plain_stops")
    assert (stats["num_steps_launched_ahead"] > 10) == plain, stats
    if scenario == "chunked_prefill_and_preemption":
        assert stats["num_preemptions"] > 0, stats


def test_beams_samples_and_speculation_run_without_overlap_and_match(tiny_model_dirs):
    model = tiny_model_dirs["llama"]
    prompts = _prompts(4, 12)
    beams = SamplingParams(beam_width=3, n=2, temperature=0.0, max_tokens=12)
    stats = _same_with_and_without(model, prompts, beams)
    assert stats["num_steps_scheduled_ahead"] == 0, stats
    samples = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12)
    stats = _same_with_and_without(model, prompts, samples)
    assert stats["num_steps_scheduled_ahead"] == 0, stats
    repeating = [[5, 6, 7, 8] * 6 for _ in range(4)]
    stats = _same_with_and_without(
        model,
        repeating,
        SamplingParams(temperature=0.0, max_tokens=16),
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
    )
    assert stats["num_steps_scheduled_ahead"] == 0, stats


def test_an_abort_while_a_step_is_in_flight_ends_that_request_only(tiny_model_dirs):
    """Requests aborted between steps, with the next plan already at the worker: the
    others' tokens are the synchronous engine's, and every block comes back."""
    model = tiny_model_dirs["llama"]
    prompts = _prompts(6, 9)
    params = SamplingParams(temperature=0.0, max_tokens=30)

    def run(async_scheduling: bool) -> dict[str, list[int]]:
        llm = LLM(model, async_scheduling=async_scheduling)
        try:
            engine: EngineCore = llm.engine
            for index, prompt in enumerate(prompts):
                engine.add_request(f"r{index}", prompt, params, frozenset())
            tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
            steps = 0
            while engine.has_unfinished_requests():
                for delta in engine.step():
                    tokens[delta.request_id].extend(delta.new_token_ids)
                steps += 1
                if steps == 5:
                    engine.abort_request("r1")
                if steps == 9:
                    engine.abort_request("r4")
            if async_scheduling:
                assert engine.stats()["num_steps_scheduled_ahead"] > 10
        finally:
            llm.shutdown()
        return tokens

    expected, got = run(False), run(True)
    for request_id in ("r0", "r2", "r3", "r5"):
        assert got[request_id] == expected[request_id]
        assert len(got[request_id]) == 30
    # An aborted request's tokens stop where the abort found it, in both engines.
    assert got["r1"] == expected["r1"][: len(got["r1"])]
    assert got["r4"] == expected["r4"][: len(got["r4"])]


def test_worker_processes_give_the_same_tokens(tiny_model_dirs):
    params = _seeded(30, seed=7, presence_penalty=0.0)
    stats = _same_with_and_without(
        tiny_model_dirs["llama"], _prompts(12, 9), params, multiprocess=True
    )
    assert stats["num_steps_scheduled_ahead"] > 10, stats
    assert stats["num_steps_launched_ahead"] > 10, stats
