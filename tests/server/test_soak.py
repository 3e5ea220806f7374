"""A bounded soak: 20 s of mixed traffic from 16 client threads against one server, on
127.0.0.1 only, over both APIs. Each call is one of: a stream read to its end, a whole
result, a stream cancelled part-way, a call whose deadline passes, bad input, parallel
samples with a stop string, beam search (gRPC); a streamed or whole completion, a client
that disconnects mid-stream, bad input, a background response polled, cancelled, or streamed,
lost and resumed (HTTP). Every call must end in exactly one final message, or in its
expected error status where it is a cancel, a deadline or bad input, and each kind must
come a few times. Afterwards nothing runs, every block is free, the server counted every
cancel and disconnect as cancelled and only bad input as failed, the accounting holds, its
memory has not grown without bound, and it drains and exits 0."""

from __future__ import annotations

import collections
import http.client
import json
import random
import threading
import time
from pathlib import Path

import grpc
import pytest

from pagedserve.frontend.client import stream_request
from pagedserve.scheduler.fault_injection import ENVIRONMENT_VARIABLE
from pagedserve.v1 import generation_pb2 as pb

SOAK_S = 20.0
NUM_CLIENTS = 16
# What a call can end in; each must come MIN_PER_KIND times, so that a kind of call that
# stopped running fails the soak (one that fails does at once). The clients draw their calls
# from seeded generators: which calls come is fixed, only how many varies. By each client's
# 12th call every outcome has come twice (the rarest: background_cancel and
# background_resume); a client makes over 50 calls in 20 s on a 2-core machine.
OUTCOMES = (
    "stream", "whole", "cancel", "cancel_unread", "deadline", "bad", "samples_stop", "beams",
    "http_stream", "http_whole", "http_disconnect", "http_bad",
    "background_poll", "background_cancel", "background_resume",
)  # fmt: skip
MIN_PER_KIND = 2


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def background_response(port: int, rng: random.Random, max_tokens: int) -> str:
    """A background response (the Responses API): polled to its end, cancelled, or
    streamed, its stream lost after a few events and read again from there to its end."""
    kind = rng.choice(["background_poll", "background_cancel", "background_resume"])
    body = {"input": "soak", "max_output_tokens": max_tokens, "background": True,
            "temperature": 0, "stream": kind == "background_resume"}  # fmt: skip
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)

    def call(method: str, path: str, data: dict | None = None) -> dict:
        connection.request(method, path, None if data is None else json.dumps(data))
        response = connection.getresponse()
        answer = json.loads(response.read())
        assert response.status == 200, answer
        return answer

    try:
        if kind == "background_resume":
            connection.request("POST", "/v1/responses", json.dumps(body))
            response = connection.getresponse()
            assert response.status == 200, response.read()
            assert response.readline() == b"event: response.created\n"
            response_id = json.loads(response.readline().removeprefix(b"data: "))["response"]["id"]
            connection.close()  # lost after the first event: the response runs on
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            connection.request("GET", f"/v1/responses/{response_id}?stream=true&starting_after=0")
            rest = connection.getresponse().read().decode()
            # One end (incomplete when max_output_tokens cut it), and no error event (a stream
            # that fails part-way ends with one).
            ends = rest.count("event: response.completed") + rest.count(
                "event: response.incomplete"
            )
            assert ends == 1, rest[-300:]
            assert "event: error" not in rest, rest[-300:]
            return kind
        response_id = call("POST", "/v1/responses", body)["id"]
        if kind == "background_cancel":
            status = call("POST", f"/v1/responses/{response_id}/cancel")["status"]
            assert status in ("cancelled", "completed", "incomplete"), status
            return kind
        deadline_s = time.monotonic() + 60
        while (status := call("GET", f"/v1/responses/{response_id}")["status"]) in (
            "queued",
            "in_progress",
        ):
            assert time.monotonic() < deadline_s, "a background response is stuck"
            time.sleep(0.02)
        assert status in ("completed", "incomplete"), status
        return kind
    finally:
        connection.close()


def one_http_call(
    port: int,
    kind: str,
    rng: random.Random,
    prompt: list[int],
    max_tokens: int,
    seed: int | None = None,
) -> str:
    """One call of the OpenAI-compatible API of ``kind`` (``seed``: its sampling seed, None
    for none); return what happened (checked here)."""
    if kind == "background":
        return background_response(port, rng, max_tokens)
    if kind == "http_disconnect":
        max_tokens = 511 - len(prompt)  # still running when the client goes away
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if seed is not None:
        body["seed"] = seed
    if kind == "http_bad":
        body["top_p"] = 1.5
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        stream = kind in ("http_stream", "http_disconnect")
        connection.request("POST", "/v1/completions", json.dumps({**body, "stream": stream}))
        response = connection.getresponse()
        if kind == "http_bad":
            assert response.status == 400 and b"top_p" in response.read()
            return kind
        assert response.status == 200, response.read()
        if kind == "http_disconnect":
            first = response.readline()
            assert first.startswith(b"data: {"), first  # streaming: the call is under way
            return kind  # the connection closes below, mid-stream
        if kind == "http_whole":
            answer = json.loads(response.read())
            assert answer["usage"]["completion_tokens"] == max_tokens, answer
            return kind
        events = [e for e in response.read().decode().split("\n\n") if e.strip()]
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e[len("data: ") :]) for e in events[:-1]]
        errors = [chunk["error"] for chunk in chunks if "error" in chunk]
        assert not errors, errors  # a stream that failed part-way sends its error last
        finishes = [c["choices"][0]["finish_reason"] for c in chunks]
        assert finishes[-1] == "length" and finishes.count(None) == len(finishes) - 1, chunks[-1]
        return kind
    finally:
        connection.close()


GRPC_KINDS = ["stream", "whole", "cancel", "deadline", "bad", "samples_stop", "beams", "stream"]
HTTP_KINDS = ["http_stream", "http_whole", "http_disconnect", "http_bad", "background"]


def one_call(stub, http_port: int, rng: random.Random) -> str:
    """Make one random call over either API; return what happened (checked here)."""
    prompt = [rng.randrange(3, 512) for _ in range(rng.randrange(1, 120))]
    max_tokens = rng.randrange(1, 60)
    if rng.random() < 0.35:
        return one_http_call(http_port, rng.choice(HTTP_KINDS), rng, prompt, max_tokens)
    return one_grpc_call(stub, rng.choice(GRPC_KINDS), rng, prompt, max_tokens)


def one_grpc_call(
    stub,
    kind: str,
    rng: random.Random,
    prompt: list[int],
    max_tokens: int,
    seed: int | None = None,
) -> str:
    """One gRPC call of ``kind`` (``seed``: the sampling seed of the calls that generate,
    None for none); return what happened (checked here). Only the deadline and bad kinds
    expect an error status; any other is an AssertionError that names it."""
    sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, seed=seed)
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=sampling)
    # 390+ tokens take a third of a second at the least: a deadline passes first, and a
    # cancelled stream is cancelled while it runs. (The prompt and max_tokens fit the
    # 512-token window: past it is refused.)
    long = pb.SamplingParams(max_tokens=511 - len(prompt), temperature=0.0, ignore_eos=True)
    long_request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=long)
    try:
        if kind == "stream":
            messages = list(stub.GenerateStream(stream_request(request), timeout=60))
            assert [m.finished for m in messages].count(True) == 1 and messages[-1].finished
            assert sum(len(c.token_ids) for m in messages for c in m.outputs) == max_tokens
        elif kind == "whole":
            reply = stub.Generate(request, timeout=60)
            assert reply.finished and len(reply.outputs[0].token_ids) == max_tokens
        elif kind == "cancel":
            stream = stub.GenerateStream(stream_request(long_request), timeout=60)
            read = [next(stream) for _ in range(rng.randrange(0, 3))]
            assert not any(m.finished for m in read), read
            stream.cancel()
            assert stream.code() == grpc.StatusCode.CANCELLED, stream.code()
            # Cancelled once a message came, the call had surely reached the server.
            return "cancel" if read else "cancel_unread"
        elif kind == "deadline":
            with pytest.raises(grpc.RpcError) as caught:
                stub.Generate(long_request, timeout=rng.uniform(0.001, 0.05))
            assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, caught.value
        elif kind == "bad":
            bad = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[*prompt, 9999]), sampling=sampling)
            with pytest.raises(grpc.RpcError) as caught:
                stub.Generate(bad, timeout=60)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
        elif kind == "samples_stop":
            sampling = pb.SamplingParams(
                max_tokens=max_tokens, temperature=0.9, seed=rng.randrange(1000), n=3,
                stop=["e", "a"],
            )  # fmt: skip
            text_request = pb.GenerateRequest(text="hello soak", sampling=sampling)
            messages = list(stub.GenerateStream(stream_request(text_request), timeout=60))
            assert [m.finished for m in messages].count(True) == 1 and messages[-1].finished
            finished = [c.index for m in messages for c in m.outputs if c.finish_reason]
            assert sorted(finished) == [0, 1, 2]
        else:
            sampling = pb.SamplingParams(
                max_tokens=min(max_tokens, 12), temperature=0.0, beam_width=3, n=2,
                ignore_eos=True,
            )  # fmt: skip
            reply = stub.Generate(
                pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=sampling),
                timeout=60,
            )
            assert reply.finished and len(reply.outputs) == 2
    except grpc.RpcError as error:
        # Even on a slow machine 60 s is ample: a deadline passing here is a failure too.
        raise AssertionError(f"{kind}: {error.code()}: {error.details()}") from None
    return kind


@pytest.mark.slow
def test_soak_mixed_traffic_leaves_nothing_behind(start_server):
    server = start_server(
        "--kv-cache-bytes", str(1 << 20), "--max-num-seqs", "32", "--http-port", "0"
    )  # fmt: skip
    stub = server.stub
    server.stub.Generate(
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]), sampling=pb.SamplingParams())
    )
    rss_start = rss_bytes(server.pid)
    outcomes: collections.Counter = collections.Counter()
    failures: list[BaseException] = []
    lock = threading.Lock()
    deadline_s = time.monotonic() + SOAK_S

    def client(seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < deadline_s and not failures:
            try:
                outcome = one_call(stub, server.http_port, rng)
            except BaseException as error:  # reported below, with the others stopped
                with lock:
                    failures.append(error)
                return
            with lock:
                outcomes[outcome] += 1

    threads = [threading.Thread(target=client, args=(seed,)) for seed in range(NUM_CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(SOAK_S + 120)
    assert not any(thread.is_alive() for thread in threads), "a client is stuck"
    assert not failures, failures[0]
    assert sum(outcomes.values()) > 100, outcomes
    scarce = {kind: outcomes[kind] for kind in OUTCOMES if outcomes[kind] < MIN_PER_KIND}
    assert not scarce, (scarce, outcomes)
    server.assert_blocks_all_free()
    stats = server.stats()
    # The server ended each cancelled stream and each disconnected client part-way (not at
    # their last token, which would count them as finished); deadlines may count here too.
    assert stats.requests_cancelled >= outcomes["cancel"] + outcomes["http_disconnect"], (
        stats.requests_cancelled,
        outcomes,
    )
    # Only bad input failed: a call that failed part-way, streamed or not, counts here.
    assert stats.requests_failed == outcomes["bad"] + outcomes["http_bad"], (
        stats.requests_failed,
        outcomes,
    )
    assert stats.engine["num_preemptions"] > 0, ("the cache was meant to run short", outcomes)
    # The frontend keeps no per-request state past a call: its memory settles.
    assert rss_bytes(server.pid) - rss_start < 64 << 20
    assert server.terminate() == 0


# A sampling seed whose requests fail as their output is turned into text.
FAULT_SEED = 4242


def test_the_soak_s_checks_fail_a_call_that_fails_part_way(start_server):
    """What makes the soak able to fail: its checker raises on a call whose output fails
    (forced by PAGEDSERVE_FAULT_INJECTION), streamed or whole, over either API, and
    passes the same call without the seed that fails."""
    fault = {ENVIRONMENT_VARIABLE: f"output_processing:{FAULT_SEED}"}
    server = start_server("--http-port", "0", env=fault)
    rng = random.Random(0)
    prompt = [5, 6, 7]
    for kind in ("stream", "whole"):
        with pytest.raises(AssertionError, match="fault injected at output_processing"):
            one_grpc_call(server.stub, kind, rng, prompt, 20, seed=FAULT_SEED)
        assert one_grpc_call(server.stub, kind, rng, prompt, 20) == kind
    for kind in ("http_stream", "http_whole"):
        with pytest.raises(AssertionError, match="fault injected at output_processing"):
            one_http_call(server.http_port, kind, rng, prompt, 20, seed=FAULT_SEED)
        assert one_http_call(server.http_port, kind, rng, prompt, 20) == kind
    server.assert_blocks_all_free()
    assert server.stats().requests_failed == 4
