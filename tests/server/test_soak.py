"""A bounded soak: 40 s of mixed traffic from 16 client threads against one server, on
127.0.0.1 only, over both APIs. Each call is one of: a stream read to its end, a whole
result, a stream cancelled part-way, a call whose deadline passes, bad input, parallel
samples with a stop string, beam search (gRPC); a streamed or whole completion, a client
that disconnects mid-stream, bad input, a background response polled, cancelled, or streamed,
lost and resumed (HTTP). Every call must end in exactly one final
message or one expected error status; afterwards nothing runs, every block is free, the
accounting holds, the server's memory has not grown without bound, and it drains and
exits 0."""

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

from pagedserve.v1 import generation_pb2 as pb

SOAK_S = 40.0
NUM_CLIENTS = 16


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
            assert "event: response.completed" in rest, rest[-300:]
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


def one_http_call(port: int, rng: random.Random, prompt: list[int], max_tokens: int) -> str:
    """One random call of the OpenAI-compatible API; return what happened (checked here)."""
    kind = rng.choice(["http_stream", "http_whole", "http_disconnect", "http_bad", "background"])
    if kind == "background":
        return background_response(port, rng, max_tokens)
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
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
            response.readline()
            return kind  # the connection closes below, mid-stream
        if kind == "http_whole":
            answer = json.loads(response.read())
            assert answer["usage"]["completion_tokens"] == max_tokens
            return kind
        events = [e for e in response.read().decode().split("\n\n") if e.strip()]
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e[len("data: ") :]) for e in events[:-1]]
        finishes = [c["choices"][0]["finish_reason"] for c in chunks]
        assert finishes.count("length") == 1 and finishes[-1] == "length", chunks[-1]
        return kind
    finally:
        connection.close()


def one_call(stub, http_port: int, rng: random.Random) -> str:
    """Make one random call over either API; return what happened (checked here)."""
    prompt = [rng.randrange(3, 512) for _ in range(rng.randrange(1, 120))]
    max_tokens = rng.randrange(1, 60)
    sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=sampling)
    if rng.random() < 0.35:
        return one_http_call(http_port, rng, prompt, max_tokens)
    kind = rng.choice(
        ["stream", "whole", "cancel", "deadline", "bad", "samples_stop", "beams", "stream"]
    )
    try:
        if kind == "stream":
            messages = list(stub.GenerateStream(request, timeout=60))
            assert [m.finished for m in messages].count(True) == 1 and messages[-1].finished
            assert sum(len(c.token_ids) for m in messages for c in m.outputs) == max_tokens
        elif kind == "whole":
            reply = stub.Generate(request, timeout=60)
            assert reply.finished and len(reply.outputs[0].token_ids) == max_tokens
        elif kind == "cancel":
            stream = stub.GenerateStream(request, timeout=60)
            for _ in range(rng.randrange(0, 3)):
                if next(stream, None) is None:
                    break
            stream.cancel()
        elif kind == "deadline":
            # 390+ tokens take a third of a second at the least; the deadline passes first.
            # (The prompt and max_tokens fit the 512-token window: past it is refused.)
            long = pb.SamplingParams(max_tokens=511 - len(prompt), temperature=0.0, ignore_eos=True)
            long_request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=long)
            with pytest.raises(grpc.RpcError) as caught:
                stub.Generate(long_request, timeout=rng.uniform(0.001, 0.05))
            assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        elif kind == "bad":
            bad = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[*prompt, 9999]), sampling=sampling)
            with pytest.raises(grpc.RpcError) as caught:
                stub.Generate(bad, timeout=60)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        elif kind == "samples_stop":
            sampling = pb.SamplingParams(
                max_tokens=max_tokens, temperature=0.9, seed=rng.randrange(1000), n=3,
                stop=["e", "a"],
            )  # fmt: skip
            text_request = pb.GenerateRequest(text="hello soak", sampling=sampling)
            messages = list(stub.GenerateStream(text_request, timeout=60))
            assert [m.finished for m in messages].count(True) == 1
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
        # A deadline may pass on any call when the machine is slow; nothing else may fail.
        assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED, (kind, error)
        return f"{kind}:deadline"
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
    assert outcomes["http_stream"] and outcomes["http_disconnect"], outcomes
    assert outcomes["background_poll"] and outcomes["background_resume"], outcomes
    server.assert_blocks_all_free()
    stats = server.stats()
    assert stats.engine["num_preemptions"] > 0, ("the cache was meant to run short", outcomes)
    # The frontend keeps no per-request state past a call: its memory settles.
    assert rss_bytes(server.pid) - rss_start < 64 << 20
    assert server.terminate() == 0
