"""Requests a hostile or careless client sends (issue 34's list), against a real server: each
is refused with a 4xx / INVALID_ARGUMENT naming the field, the value and the limit, where
each once killed the engine (an integer past the wire's int64, a beam score overflowing,
NaN and infinities), stalled the event loop (deep JSON) or held memory (Responses
metadata). After each the server serves on and every block is free (the ``server``
fixture checks)."""

from __future__ import annotations

import json
import socket
import time

import grpc
import pytest

from helpers.grpc_calls import both_rpcs, greedy, token_request
from helpers.http_calls import post
from pagedserve.frontend.client import stream_request
from pagedserve.v1 import generation_pb2 as pb

INT64_MAX = (1 << 63) - 1
INT32_MAX = (1 << 31) - 1
CHAT = [{"role": "user", "content": "hi"}]


def completion(**fields) -> dict:
    return {"prompt": "hi", "max_tokens": 2, **fields}


def chat(**fields) -> dict:
    return {"messages": CHAT, "max_tokens": 2, **fields}


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


HTTP_CASES = [
    # (route, body, the error's param, words of its message)
    ("/v1/completions", completion(seed=2**64), "seed", f"seed must be <= {INT64_MAX}"),
    ("/v1/chat/completions", chat(seed=2**64), "seed", f"seed must be <= {INT64_MAX}"),
    ("/v1/responses", {"input": "hi", "seed": 2**64}, "seed", f"seed must be <= {INT64_MAX}"),
    ("/v1/completions", completion(stop_token_ids=[2**64]), "stop_token_ids",
     f"stop_token_ids[] must be <= {INT32_MAX}"),
    ("/v1/chat/completions", chat(stop_token_ids=[2**64]), "stop_token_ids",
     f"stop_token_ids[] must be <= {INT32_MAX}"),
    ("/v1/completions", completion(priority=2**64), "priority", f"priority must be <= {INT32_MAX}"),
    ("/v1/chat/completions", chat(priority=2**64), "priority", f"priority must be <= {INT32_MAX}"),
    ("/v1/completions", completion(temperature=1, top_k=2**63), "top_k",
     f"top_k must be <= {INT32_MAX}"),
    ("/v1/completions", completion(use_beam_search=True, n=2, length_penalty=200),
     "length_penalty", "length_penalty must be >= -10.0 and <= 10.0, got 200.0"),
    ("/v1/completions", completion(use_beam_search=True, n=2, length_penalty=-200),
     "length_penalty", "length_penalty must be >= -10.0 and <= 10.0, got -200.0"),
    ("/v1/completions", completion(temperature=float("inf")), "temperature",
     "temperature must be >= 0.0 and <= 100.0, got inf"),
    ("/v1/chat/completions", chat(repetition_penalty=float("inf")), "repetition_penalty",
     "repetition_penalty must be >= 0.01 and <= 100.0, got inf"),
    ("/v1/completions", completion(logit_bias={"5": float("nan")}), "logit_bias",
     "logit_bias[5] must be a finite number, got nan"),
    # Once an IndexError in the worker: min_tokens masks the stop tokens' logits.
    ("/v1/completions", completion(min_tokens=1, stop_token_ids=[100000]), "stop_token_ids",
     "stop_token_ids: token id 100000 is outside the vocabulary [0, 512)"),
    ("/v1/completions", completion(user="u" * 300), "user",
     "user must have at most 256 characters, got 300"),
    ("/v1/responses", {"input": "hi", "metadata": {"k": "v" * (3 << 20)}}, "metadata",
     "metadata['k'] has 3145728 characters; values have at most 512"),
    ("/v1/responses", {"input": "hi", "metadata": {str(i): "v" for i in range(17)}},
     "metadata", "metadata must have at most 16 pairs, got 17"),
    ("/v1/responses", {"input": "hi", "metadata": {"k" * 65: "v"}}, "metadata",
     "keys have at most 64"),
]  # fmt: skip


@pytest.mark.parametrize(("route", "body", "param", "words"), HTTP_CASES)
def test_http_refuses_naming_the_field_and_limit(server, route, body, param, words):
    status, answer = post(server, route, body)
    assert status == 400, answer
    assert words in answer["error"]["message"], answer
    assert answer["error"]["param"] == param, answer


@pytest.mark.parametrize(
    ("data", "words"),
    [
        (nested(100_000).encode(), "the request body nests more than 64 levels deep (the limit)"),
        (
            json.dumps(
                {
                    "prompt": "hi",
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {"name": "x", "schema": json.loads(nested(100))},
                    },
                }
            ).encode(),
            "response_format nests more than 64 levels deep (the limit)",
        ),
        (b'{"prompt": "hi", "max_tokens": 1e999999}', "max_tokens must be an integer, got inf"),
        # Once a 500: no UTF-8 encoder takes a lone surrogate, which JSON can write.
        (b'{"prompt": "hi", "stop": "\\ud800"}', "stop holds a lone surrogate"),
        (b'{"prompt": "hi", "x": {"\\udfff": 1}}', "x holds a lone surrogate"),
    ],
)
def test_deep_or_odd_json_gets_a_400_not_a_500(server, data, words):
    status, answer = post(server, "/v1/completions", data)
    assert status == 400, answer
    assert words in answer["error"]["message"], answer


GRPC_CASES = [
    (token_request([1], greedy(seed=(1 << 64) - 1)), f"sampling.seed must be <= {INT64_MAX}"),
    (token_request([1], greedy(beam_width=2, length_penalty=2000)),
     "sampling.length_penalty must be >= -10.0 and <= 10.0, got 2000.0"),
    (token_request([1], pb.SamplingParams(max_tokens=(1 << 32) - 1)),
     f"sampling.max_tokens must be <= {INT32_MAX}, got 4294967295"),
    # Past the window, as the HTTP API refuses it (it once ran to the window, minutes).
    (token_request([1, 2], greedy(max_tokens=600)),
     "sampling.max_tokens=600: the model's context window is 512 tokens and token_ids "
     "takes 2, which leaves at most 510"),
    (pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role=99, content="hi")]),
                        sampling=greedy()),
     "chat.messages[0].role is 99, which is no ChatRole value this server knows (it knows "
     "CHAT_ROLE_SYSTEM, CHAT_ROLE_DEVELOPER, CHAT_ROLE_USER, CHAT_ROLE_ASSISTANT, "
     "CHAT_ROLE_TOOL)"),
    (pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(content="hi")]), sampling=greedy()),
     "chat.messages[0].role is CHAT_ROLE_UNSPECIFIED; set one of CHAT_ROLE_SYSTEM, "),
    (token_request([1], pb.SamplingParams(max_tokens=2, temperature=float("inf"))),
     "sampling.temperature must be"),
    (token_request([1], greedy(repetition_penalty=float("inf"))),
     "sampling.repetition_penalty must be"),
    (token_request([1], greedy(logit_bias={5: float("nan")})),
     "sampling.logit_bias[5] must be a finite number, got nan"),
    (token_request([1], greedy(min_tokens=1, stop_token_ids=[100000])),
     "stop_token_ids: token id 100000 is outside the vocabulary"),
    (token_request([1], greedy(structured_outputs=pb.StructuredOutputs(
        json_schema=nested(2000)))), "nests more than 64 levels deep (the limit)"),
    (token_request([1], greedy(structured_outputs=pb.StructuredOutputs(
        json_schema=nested(100)))), "nests more than 64 levels deep (the limit)"),
    (token_request([1], greedy(), request_id="r" * 300),
     "request_id must have at most 256 characters, got 300"),
]  # fmt: skip


@pytest.mark.parametrize(("request_message", "words"), GRPC_CASES)
def test_grpc_refuses_naming_the_field_and_limit(server, request_message, words):
    for call in both_rpcs(server.stub):
        with pytest.raises(grpc.RpcError) as caught:
            call(request_message, timeout=30)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
        assert words in caught.value.details(), caught.value.details()


def test_undecodable_protobuf_is_invalid_argument(server):
    raw = server.channel.unary_unary(
        "/pagedserve.v1.GenerationService/Generate",
        request_serializer=lambda data: data,
        response_deserializer=lambda data: data,
    )
    raw_stream = server.channel.unary_stream(
        "/pagedserve.v1.GenerationService/GenerateStream",
        request_serializer=lambda data: data,
        response_deserializer=lambda data: data,
    )
    for call in (raw, lambda data, **kw: list(raw_stream(data, **kw))):
        with pytest.raises(grpc.RpcError) as caught:
            call(b"\xff\xff\xff\xff", timeout=10)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
        assert "does not parse" in caught.value.details()
    assert server.stub.Generate(token_request([1, 2], greedy(3))).finished


def test_a_cancelled_call_leaves_a_request_log_line(server):
    request = token_request([5, 6, 7], greedy(400), request_id="cancelled-call")
    responses = server.stub.GenerateStream(stream_request(request))
    next(responses)  # it runs
    responses.cancel()

    def logged() -> bool:
        return any(
            "'cancelled-call'" in line and " cancelled: " in line
            for line in server.log().splitlines()
        )

    deadline_s = time.monotonic() + 10
    while not logged():
        assert time.monotonic() < deadline_s, server.log()[-3000:]
        time.sleep(0.05)


def test_slow_headers_and_a_slow_body_are_cut(start_server):
    server = start_server("--http-port", "0", "--http-read-timeout-s", "1")
    dribbling = socket.create_connection(("127.0.0.1", server.http_port))
    dribbling.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # no end of headers
    silent = socket.create_connection(("127.0.0.1", server.http_port))
    started_s = time.monotonic()
    for connection in (dribbling, silent):
        connection.settimeout(10)
        assert connection.recv(1024) == b""  # closed by the server
    assert time.monotonic() - started_s < 5
    late_body = socket.create_connection(("127.0.0.1", server.http_port))
    late_body.settimeout(10)
    late_body.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100\r\n\r\n{"
    )
    answer = late_body.recv(4096)
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert b"did not arrive within 1 s" in answer
    for connection in (dribbling, silent, late_body):
        connection.close()
    status, answer = post(server, "/v1/completions", {"prompt": [1, 2], "max_tokens": 2})
    assert status == 200, answer
    server.assert_blocks_all_free()


def test_a_huge_tokenize_is_refused_at_once(server):
    """A 63 MiB Tokenize once held the event loop for 91 s: no text that long could be a
    prompt of this model, so it is refused before the tokenizer sees it."""
    text = "hello world " * ((63 << 20) // 12)
    started_s = time.monotonic()
    with pytest.raises(grpc.RpcError) as caught:
        server.stub.Tokenize(pb.TokenizeRequest(text=text), timeout=60)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
    assert "cannot fit the model's context window of 512 tokens" in caught.value.details()
    status, answer = post(server, "/tokenize", {"prompt": text})
    assert status == 400 and "cannot fit" in answer["error"]["message"], answer
    assert time.monotonic() - started_s < 10


def test_a_request_template_that_loops_is_cut_at_its_budget(start_server):
    server = start_server("--http-port", "0", "--trust-request-chat-template")
    loop = "{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}x"
    started_s = time.monotonic()
    status, answer = post(server, "/v1/chat/completions", chat(chat_template=loop))
    assert status == 400, answer
    assert "rendering took longer than 1 s" in answer["error"]["message"], answer
    assert time.monotonic() - started_s < 10
    with pytest.raises(grpc.RpcError) as caught:
        server.stub.Generate(
            pb.GenerateRequest(
                chat=pb.Chat(messages=[pb.ChatMessage(role=pb.CHAT_ROLE_USER, content="hi")],
                             chat_template=loop),
                sampling=greedy(2),
            ),
            timeout=30,
        )  # fmt: skip
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
    assert "rendering took longer than 1 s" in caught.value.details()
    # The model's own template still serves.
    status, answer = post(server, "/v1/chat/completions", chat())
    assert status == 200, answer
    server.assert_blocks_all_free()
