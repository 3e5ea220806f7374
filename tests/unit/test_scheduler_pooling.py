"""Pooling (embedding) requests in the scheduler: prompt only, finished in the step that
computes the last prompt token, with the worker's vector; never sampled."""

from __future__ import annotations

import struct

import pytest

from helpers.scheduling import EOS, make_request, make_scheduler, scheduled
from pagedserve.scheduler.messages import StepPlan, StepResult
from pagedserve.scheduler.pooling_params import (
    PROMPT_ONLY_SAMPLING_PARAMS,
    PoolingParams,
    decode_embedding,
)
from pagedserve.scheduler.request import Request
from pagedserve.scheduler.scheduler import Scheduler

VECTOR = struct.pack("<3f", 0.5, -0.25, 1.0)


def pooling_request(request_id: str, num_prompt_tokens: int, first_token: int = 10) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=list(range(first_token, first_token + num_prompt_tokens)),
        sampling_params=PROMPT_ONLY_SAMPLING_PARAMS,
        eos_token_ids=frozenset({EOS}),
        arrival_time_s=0.0,
        max_model_len=256,
        pooling_params=PoolingParams(),
    )


def run_step(scheduler: Scheduler, token_id: int = 7) -> tuple[StepPlan, list]:
    """Answer a plan as the worker does: a token for each generation request whose known
    tokens are all computed, a vector for each such pooling request."""
    plan = scheduler.schedule()
    sampled, embeddings = [], {}
    for item in (*plan.new_requests, *plan.cached_requests):
        request = scheduler.requests[item.request_id]
        if item.num_computed_tokens + item.num_scheduled_tokens == request.num_tokens:
            if request.pooling_params is not None:
                embeddings[item.request_id] = VECTOR
            else:
                sampled.append(item.request_id)
    result = StepResult(plan.step_id, sampled, [token_id] * len(sampled), embeddings=embeddings)
    return plan, scheduler.update_from_output(plan, result)


def test_pooling_request_finishes_when_its_prompt_is_computed():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(pooling_request("e", 20))
    plan, deltas = run_step(scheduler)
    assert scheduled(plan) == {"e": 8}
    assert plan.new_requests[0].pooling_params == PoolingParams()
    assert deltas == []  # a partial chunk says nothing
    plan, deltas = run_step(scheduler)
    assert scheduled(plan) == {"e": 8}
    plan, deltas = run_step(scheduler)
    assert scheduled(plan) == {"e": 4}
    (delta,) = deltas
    assert (delta.request_id, delta.new_token_ids, delta.finished, delta.finish_reason) == (
        "e",
        [],
        True,
        "stop",
    )
    assert decode_embedding(delta.embedding) == [0.5, -0.25, 1.0]
    assert scheduler.num_sampled_tokens == 0
    assert scheduler.block_manager.num_free_blocks == 16
    assert not scheduler.has_unfinished_requests()
    assert scheduler.schedule().finished_request_ids == ["e"]


def test_pooling_and_generation_requests_share_a_step():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("g", 5, max_tokens=2))
    scheduler.add_request(pooling_request("e", 9))
    plan, deltas = run_step(scheduler)
    assert scheduled(plan) == {"g": 5, "e": 9}
    assert [(d.request_id, d.new_token_ids, d.finished) for d in deltas] == [
        ("g", [7], False),
        ("e", [], True),
    ]
    plan, deltas = run_step(scheduler)
    assert scheduled(plan) == {"g": 1}
    assert deltas[0].finished and deltas[0].finish_reason == "length"
    assert scheduler.block_manager.num_free_blocks == 16


def test_pooling_prompt_may_fill_the_window_but_not_exceed_it():
    scheduler = make_scheduler(max_model_len=16)
    with pytest.raises(ValueError, match="prompt is 17 tokens; max_model_len is 16"):
        scheduler.add_request(pooling_request("long", 17))
    scheduler.add_request(pooling_request("full", 16))
    _, deltas = run_step(scheduler)
    assert deltas[0].finished and deltas[0].embedding == VECTOR


def test_pooling_request_preempted_by_recompute_starts_over_and_finishes():
    # 4 blocks of 8 tokens: the decoding request grows into the block the pooling
    # request's chunked prefill holds, so the newer pooling request is recomputed.
    scheduler = make_scheduler(num_blocks=4, max_num_batched_tokens=8, preemption_mode="recompute")
    scheduler.add_request(make_request("g", 8, max_tokens=20))
    run_step(scheduler)  # g prefilled: 1 block, 1 token out
    scheduler.add_request(pooling_request("e", 24))
    plan, _ = run_step(scheduler)
    assert scheduled(plan) == {"g": 1, "e": 7}
    finished = []
    while scheduler.has_unfinished_requests():
        _, deltas = run_step(scheduler)
        finished += [d for d in deltas if d.finished]
        scheduler.block_manager.check_integrity()
    assert scheduler.num_recompute_preemptions > 0
    embedding = next(d for d in finished if d.request_id == "e")
    assert embedding.embedding == VECTOR and embedding.new_token_ids == []
    assert scheduler.block_manager.num_free_blocks == 4
