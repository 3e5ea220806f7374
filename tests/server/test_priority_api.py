"""Priority scheduling over the real server (``--scheduling-policy priority``): HTTP's and
gRPC's ``priority`` reach the scheduler, a late high-priority request preempts a running
low-priority one and ends first, and both outputs equal the offline engine's; a bad
priority is a 400 / INVALID_ARGUMENT naming the field, and a first-come-first-served
server refuses any priority but 0 the same way."""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from helpers.http_calls import post
from helpers.server_process import SERVED_MODEL_NAME, ServerProcess, serving
from pagedserve.frontend import LLM, SamplingParams
from pagedserve.frontend.client import Client

PROMPT_IDS = [5, 300, 301, 302, 7, 7]
OTHER_PROMPT_IDS = [9, 40, 41, 42, 43]
LONG_TOKENS = 500  # still streaming when the short request comes: over 0.4 s
SHORT_TOKENS = 8


@pytest.fixture(scope="module")
def priority_server(server_model_dir, tmp_path_factory) -> Iterator[ServerProcess]:
    # One sequence at a time: a request of a better priority can only run by preempting.
    workdir = tmp_path_factory.mktemp("priority_server")
    flags = ("--max-num-seqs", "1", "--scheduling-policy", "priority")
    with serving(server_model_dir, workdir, *flags) as server:
        yield server


@pytest.fixture
def server(priority_server) -> Iterator[ServerProcess]:
    yield priority_server
    priority_server.assert_blocks_all_free()


@pytest.fixture(scope="module")
def offline(server_model_dir) -> LLM:
    return LLM(server_model_dir, num_blocks=128)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def body(prompt: list[int], max_tokens: int, **fields) -> dict:
    return {
        "model": SERVED_MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        **fields,
    }


def test_priority_over_http_and_grpc_equals_offline(server, offline):
    want = offline.generate(PROMPT_IDS, greedy(SHORT_TOKENS))[0].outputs[0].text
    for priority in [-5, 0, 7]:
        status, answer = post(
            server, "/v1/completions", body(PROMPT_IDS, SHORT_TOKENS, priority=priority)
        )
        assert status == 200, answer
        assert answer["choices"][0]["text"] == want
    with Client(f"127.0.0.1:{server.port}") as client:
        output = client.generate(PROMPT_IDS, greedy(SHORT_TOKENS), priority=3, timeout_s=60)
    assert output.outputs[0].text == want


def test_a_late_high_priority_request_preempts_and_ends_first(server, offline):
    want_long = offline.generate(PROMPT_IDS, greedy(LONG_TOKENS))[0].outputs[0].text
    want_short = offline.generate(OTHER_PROMPT_IDS, greedy(SHORT_TOKENS))[0].outputs[0].text
    preemptions_before = server.stats().engine["num_recompute_preemptions"]
    first_chunk = threading.Event()
    long_result: dict = {}

    def stream_long() -> None:
        connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=120)
        try:
            connection.request(
                "POST",
                "/v1/completions",
                json.dumps(body(PROMPT_IDS, LONG_TOKENS, priority=10, stream=True)),
                headers={"Content-Type": "application/json"},
            )
            response = connection.getresponse()
            long_result["status"] = response.status
            text = []
            for line in response:
                line = line.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[len(b"data: ") :])
                if event["choices"]:
                    text.append(event["choices"][0]["text"])
                    first_chunk.set()
            long_result["text"] = "".join(text)
            long_result["ended_s"] = time.monotonic()
        finally:
            first_chunk.set()
            connection.close()

    thread = threading.Thread(target=stream_long)
    thread.start()
    try:
        assert first_chunk.wait(60)
        status, answer = post(server, "/v1/completions", body(OTHER_PROMPT_IDS, SHORT_TOKENS))
        short_ended_s = time.monotonic()
    finally:
        thread.join(120)
    assert status == 200, answer
    assert answer["choices"][0]["text"] == want_short
    assert long_result["status"] == 200
    # The long request was preempted for the short one (priority 0 < 10) and resumed by
    # recomputing its tokens: its text is what it would have been.
    assert long_result["text"] == want_long
    assert short_ended_s < long_result["ended_s"]
    assert server.stats().engine["num_recompute_preemptions"] == preemptions_before + 1


@pytest.mark.parametrize("value", ["high", 1.5, True, [1]])
def test_a_priority_that_is_not_an_integer_is_a_400(server, value):
    status, answer = post(server, "/v1/completions", body(PROMPT_IDS, 2, priority=value))
    assert status == 400, answer
    error = answer["error"]
    assert error["param"] == "priority", error
    assert f"priority must be an integer, got {value!r}" in error["message"], error


def test_a_first_come_first_served_server_refuses_a_priority(shared_server):
    message = "priority=2: this engine schedules first come, first served"
    for path, fields in [
        ("/v1/completions", {"prompt": PROMPT_IDS}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ]:
        request = {"model": SERVED_MODEL_NAME, "max_tokens": 2, "priority": 2, **fields}
        status, answer = post(shared_server, path, request)
        assert status == 400, answer
        assert answer["error"]["param"] == "priority", answer
        assert message in answer["error"]["message"], answer
        assert "--scheduling-policy priority" in answer["error"]["message"], answer
        request["priority"] = 0
        status, answer = post(shared_server, path, request)
        assert status == 200, answer
    with (
        Client(f"127.0.0.1:{shared_server.port}") as client,
        pytest.raises(grpc.RpcError) as caught,
    ):
        client.generate(PROMPT_IDS, greedy(2), priority=2, timeout_s=60)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in caught.value.details()
    shared_server.assert_blocks_all_free()
