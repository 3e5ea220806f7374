"""A request's failure is the request's, the event loop stays free, a stalled engine is
noticed (DESIGN.md's invariants), each against a real server:

- faults forced in each stage of the pipeline (``PAGEDSERVE_FAULT_INJECTION``) end only the
  request they hit, while others stream the tokens they stream without it;
- a 60 MiB prompt, and a long one tokenized whole (it truncates), leave ``/health`` and an
  unrelated stream answering within a second;
- a stopped worker turns the server unhealthy, a continued one healthy again, and one
  stopped for good ends every call with UNAVAILABLE naming it and the server with exit 1.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from helpers.grpc_calls import greedy, token_request
from helpers.http_calls import post
from helpers.processes import is_live, wait_until
from pagedserve.frontend.client import stream_request
from pagedserve.scheduler.fault_injection import ENVIRONMENT_VARIABLE, STAGES

PROMPTS = [[5, 300, 301, 302], [400, 7, 7, 401, 402], [9, 10, 11]]
# The seed each stage's fault is injected for.
FAULT_SEEDS = {stage: 9000 + index for index, stage in enumerate(STAGES)}


def tokens_of(stream) -> list[int]:
    return [
        token for response in stream for output in response.outputs for token in output.token_ids
    ]


def test_a_fault_in_each_stage_ends_only_its_request(start_server):
    faults = ",".join(f"{stage}:{seed}" for stage, seed in FAULT_SEEDS.items())
    server = start_server(env={ENVIRONMENT_VARIABLE: faults})
    stub = server.stub
    expected = [
        tokens_of(stub.GenerateStream(stream_request(token_request(p, greedy(40)))))
        for p in PROMPTS
    ]

    results: dict[str, object] = {}

    def stream(index: int) -> None:
        results[f"stream-{index}"] = tokens_of(
            stub.GenerateStream(
                stream_request(token_request(PROMPTS[index], greedy(40))), timeout=60
            )
        )

    def faulty(stage: str) -> None:
        request = token_request([7, 8, 9], greedy(20, seed=FAULT_SEEDS[stage]))
        try:
            stub.Generate(request, timeout=60)
            results[stage] = "accepted"
        except grpc.RpcError as error:
            results[stage] = (error.code(), error.details())

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(PROMPTS))]
    threads += [threading.Thread(target=faulty, args=(stage,)) for stage in STAGES]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    for stage in STAGES:
        code, details = results[stage]
        assert code == grpc.StatusCode.INTERNAL, (stage, results[stage])
        assert f"fault injected at {stage}" in details, (stage, details)
    for index, tokens in enumerate(expected):
        assert results[f"stream-{index}"] == tokens, index
    # The engine runs on: the same requests, the same tokens, every block free.
    assert (
        tokens_of(stub.GenerateStream(stream_request(token_request(PROMPTS[0], greedy(40)))))
        == expected[0]
    )
    server.assert_blocks_all_free()
    assert server.terminate() == 0


def _health_latency_s(server) -> float:
    started_s = time.monotonic()
    with urllib.request.urlopen(server.http_url + "/health", timeout=10) as response:
        assert response.status == 200
    return time.monotonic() - started_s


def _watch_while(server, busy: threading.Event) -> tuple[float, float, int]:
    """While ``busy`` is set: unrelated streams back to back (the longest wait for a next
    token) and /health every 50 ms (the slowest answer); and how many tokens came."""
    worst_gap_s = worst_health_s = 0.0
    num_tokens = 0

    def streams() -> None:
        nonlocal worst_gap_s, num_tokens
        while busy.is_set():
            last_s = time.monotonic()
            for response in server.stub.GenerateStream(
                stream_request(token_request([5, 6], greedy(400)))
            ):
                now_s = time.monotonic()
                worst_gap_s = max(worst_gap_s, now_s - last_s)
                last_s = now_s
                num_tokens += sum(len(output.token_ids) for output in response.outputs)
                if not busy.is_set():
                    break

    streamer = threading.Thread(target=streams)
    streamer.start()
    while busy.is_set():
        worst_health_s = max(worst_health_s, _health_latency_s(server))
        time.sleep(0.05)
    streamer.join(60)
    return worst_gap_s, worst_health_s, num_tokens


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        # Refused before it is tokenized: no tokenizer's tokens are that long.
        ({"prompt": "hello world " * ((60 << 20) // 12), "max_tokens": 2}, 400, "cannot fit"),
        # Tokenized whole (it truncates), on a preparing thread.
        ({"prompt": "hello world " * ((3 << 20) // 12), "max_tokens": 2,
          "truncate_prompt_tokens": 8}, 200, None),
    ],
)  # fmt: skip
def test_a_huge_prompt_leaves_health_and_other_streams_answering(server, body, status, words):
    busy = threading.Event()
    busy.set()
    answer: dict = {}

    def call() -> None:
        try:
            answer["status"], answer["body"] = post(server, "/v1/completions", body, 120)
        finally:
            time.sleep(0.5)  # a last look once it is answered
            busy.clear()

    caller = threading.Thread(target=call)
    caller.start()
    worst_gap_s, worst_health_s, num_tokens = _watch_while(server, busy)
    caller.join(120)
    assert answer["status"] == status, answer
    if words is not None:
        assert words in answer["body"]["error"]["message"], answer
    assert num_tokens > 0
    assert worst_gap_s < 1.0 and worst_health_s < 1.0, (worst_gap_s, worst_health_s)


def _health(server) -> tuple[int, int]:
    """The HTTP /health status and gRPC health's status."""
    try:
        with urllib.request.urlopen(server.http_url + "/health", timeout=5) as response:
            http_status = response.status
    except urllib.error.HTTPError as error:
        http_status = error.code
    check = health_pb2_grpc.HealthStub(server.channel).Check(
        health_pb2.HealthCheckRequest(service=""), timeout=5
    )
    return http_status, check.status


SERVING = (200, health_pb2.HealthCheckResponse.SERVING)
NOT_SERVING = (503, health_pb2.HealthCheckResponse.NOT_SERVING)


def test_a_stopped_worker_makes_the_server_unhealthy_then_ends_it(start_server):
    server = start_server(
        "--http-port", "0", "--stall-timeout-s", "2", "--stall-exit-timeout-s", "4"
    )  # fmt: skip
    (worker,) = server.worker_pids()
    engine_pids = server.engine_pids()
    # Long enough to be mid-stream at each stop (two stall timeouts of 2 s).
    request = token_request([5, 6], greedy(250))
    expected = tokens_of(server.stub.GenerateStream(stream_request(request)))

    # Stopped, then continued before the exit timeout: unhealthy, then serving again, and
    # the stream it held ends as it would have.
    stream = server.stub.GenerateStream(stream_request(request), timeout=60)
    first = next(stream)
    os.kill(worker, signal.SIGSTOP)
    try:
        stopped_s = time.monotonic()
        assert wait_until(lambda: _health(server) == NOT_SERVING, 6), _health(server)
        assert time.monotonic() - stopped_s >= 1.5  # not before the stall timeout
        status, refused = post(server, "/v1/completions", {"prompt": [1], "max_tokens": 2})
        assert status == 503 and "worker rank 0" in refused["error"]["message"], refused
    finally:
        os.kill(worker, signal.SIGCONT)
    assert wait_until(lambda: _health(server) == SERVING, 5), _health(server)
    assert tokens_of([first]) + tokens_of(stream) == expected
    server.assert_blocks_all_free()

    # Stopped for good: every call ends UNAVAILABLE naming the worker, the server exits 1.
    stream = server.stub.GenerateStream(stream_request(request), timeout=60)
    next(stream)
    os.kill(worker, signal.SIGSTOP)
    with pytest.raises(grpc.RpcError) as caught:
        tokens_of(stream)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, caught.value
    assert f"worker rank 0 (pid {worker}) makes no progress" in caught.value.details()
    assert server.process.wait(30) == 1
    assert wait_until(lambda: not any(is_live(pid) for pid in engine_pids), 10), [
        pid for pid in engine_pids if is_live(pid)
    ]
