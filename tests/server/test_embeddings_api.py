"""``POST /v1/embeddings`` over the real server: OpenAI's client and raw bodies get the
offline ``LLM.embed`` vectors, as floats and as base64; batches keep their order; a
conversation (``messages``) is embedded as the chat template renders it; bad
fields are a 400 naming the field; calls count in /metrics. gRPC's ``Embed`` gives the same
vectors. (``--api-key`` on this route:
test_http_api.py's API key test.)"""

from __future__ import annotations

import base64
import json
import re
import struct
import urllib.error
import urllib.request
from collections.abc import Iterator

import grpc
import openai
import pytest

from helpers.http_calls import get
from helpers.openai_shapes import assert_openai_shape
from helpers.server_process import SERVED_MODEL_NAME, ServerProcess, serving
from pagedserve.frontend import LLM, PoolingParams
from pagedserve.frontend.chat_template import ChatTemplateOptions
from pagedserve.frontend.client import Client, conversation
from pagedserve.v1 import generation_pb2 as pb

TEXTS = ["The capital of France is", "a", "PagedAttention " * 20]
TOKEN_IDS = [[5, 300, 301, 302], [7] * 40]


@pytest.fixture(scope="module")
def embedding_server(server_model_dir, tmp_path_factory) -> Iterator[ServerProcess]:
    workdir = tmp_path_factory.mktemp("embedding_server")
    with serving(server_model_dir, workdir) as server:
        yield server


@pytest.fixture
def server(embedding_server) -> Iterator[ServerProcess]:
    yield embedding_server
    embedding_server.assert_blocks_all_free()


@pytest.fixture(scope="module")
def offline(server_model_dir) -> LLM:
    return LLM(server_model_dir, num_blocks=128)


def post(server: ServerProcess, body: dict) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    request = urllib.request.Request(
        server.http_url + "/v1/embeddings", data=json.dumps(body).encode(), headers=headers
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def close(actual: list[float], expected: list[float]) -> bool:
    return len(actual) == len(expected) and all(
        abs(a - e) <= 1e-5 for a, e in zip(actual, expected)
    )


def test_openai_client_gets_the_offline_embeddings(server, offline):
    want = [o.outputs.embedding for o in offline.embed(TEXTS)]
    with openai.OpenAI(
        base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0, timeout=60
    ) as client:
        # Unless told a format, the client asks for base64 and decodes it itself.
        for fields in ({}, {"encoding_format": "float"}):
            answer = client.embeddings.create(model=SERVED_MODEL_NAME, input=TEXTS, **fields)
            assert [item.index for item in answer.data] == [0, 1, 2]
            for item, expected in zip(answer.data, want):
                assert close(item.embedding, expected)
        prompt_tokens = sum(len(o.prompt_token_ids) for o in offline.embed(TEXTS))
        assert answer.usage.prompt_tokens == answer.usage.total_tokens == prompt_tokens
        assert answer.model == SERVED_MODEL_NAME
        one = client.embeddings.create(model=SERVED_MODEL_NAME, input=TEXTS[0], dimensions=16)
        cut = offline.embed(TEXTS[0], PoolingParams(dimensions=16))[0].outputs.embedding
        assert close(one.data[0].embedding, cut)


def test_raw_bodies_token_ids_base64_and_vllm_fields(server, offline):
    want = [o.outputs.embedding for o in offline.embed(TOKEN_IDS)]
    status, answer = post(server, {"input": TOKEN_IDS, "encoding_format": "base64"})
    assert status == 200, answer
    assert answer["object"] == "list" and answer["usage"]["prompt_tokens"] == 44
    for item, expected in zip(answer["data"], want):
        assert item["object"] == "embedding"
        packed = base64.b64decode(item["embedding"])
        assert list(struct.unpack(f"<{len(packed) // 4}f", packed)) == pytest.approx(
            expected, abs=1e-5
        )
    status, answer = post(server, {"input": TOKEN_IDS[0], "normalize": False})
    raw = offline.embed(TOKEN_IDS[0], PoolingParams(normalize=False))[0].outputs.embedding
    assert status == 200 and close(answer["data"][0]["embedding"], raw)
    assert_openai_shape("embeddings", answer)  # exactly the openai SDK's type, strictly
    # vLLM's truncate_prompt_tokens keeps a prompt's last tokens.
    status, answer = post(server, {"input": TOKEN_IDS[1] + [9, 9], "truncate_prompt_tokens": 3})
    tail = offline.embed([[7, 9, 9]])[0].outputs.embedding
    assert status == 200 and close(answer["data"][0]["embedding"], tail)
    assert answer["usage"]["prompt_tokens"] == 3


def test_pooling_answers_with_the_embeddings(server, offline):
    """vLLM's ``/pooling`` on an embedding model: each input's embedding (as
    ``/v1/embeddings`` gives it, its fields too) as a ``pooling`` object; a field or task of
    classification is refused by name."""
    from helpers.http_calls import post as post_to

    want = [o.outputs.embedding for o in offline.embed(TOKEN_IDS)]
    status, answer = post_to(server, "/pooling", {"input": TOKEN_IDS, "task": "embed"})
    assert status == 200, answer
    assert answer["id"].startswith("pool-") and answer["object"] == "list"
    assert answer["model"] == SERVED_MODEL_NAME
    assert [item["object"] for item in answer["data"]] == ["pooling", "pooling"]
    assert [item["index"] for item in answer["data"]] == [0, 1]
    assert all(close(item["data"], w) for item, w in zip(answer["data"], want, strict=True))
    assert answer["usage"]["prompt_tokens"] == answer["usage"]["total_tokens"] == 44
    status, answer = post_to(
        server,
        "/pooling",
        {"input": TOKEN_IDS[0], "encoding_format": "base64", "normalize": False, "dimensions": 8},
    )
    assert status == 200, answer
    raw = offline.embed(TOKEN_IDS[0], PoolingParams(normalize=False, dimensions=8))
    packed = base64.b64decode(answer["data"][0]["data"])
    assert close(list(struct.unpack(f"<{len(packed) // 4}f", packed)), raw[0].outputs.embedding)
    # vLLM's per-token task: a row per prompt token (base64: the rows one after another).
    rows = [o.outputs.data for o in offline.encode(TOKEN_IDS, pooling_task="token_embed")]
    status, answer = post_to(server, "/pooling", {"input": TOKEN_IDS, "task": "token_embed"})
    assert status == 200, answer
    for item, want_rows, ids in zip(answer["data"], rows, TOKEN_IDS, strict=True):
        assert len(item["data"]) == len(want_rows) == len(ids)
        assert all(close(row, want_row) for row, want_row in zip(item["data"], want_rows))
    body = {"input": TOKEN_IDS[0], "task": "token_embed", "encoding_format": "base64"}
    status, answer = post_to(server, "/pooling", body)
    packed = base64.b64decode(answer["data"][0]["data"])
    flat = [value for row in rows[0] for value in row]
    assert status == 200 and close(list(struct.unpack(f"<{len(packed) // 4}f", packed)), flat)
    for body, param, message in [
        ({"input": "a", "task": "classify"}, "task", "pools for 'embed' and 'token_embed' only"),
        ({"input": "a", "task": "token_classify"}, "task", "'token_embed' only"),
        ({"input": "a", "task": "reward"}, "task", "task must be one of embed, classify"),
        ({"input": "a", "use_activation": False}, "use_activation", "a setting of task"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format", "'float' or 'base64'"),
        ({"input": "a", "dimensions": 0}, "dimensions", "dimensions"),
    ]:
        status, answer = post_to(server, "/pooling", body)
        assert status == 400 and answer["error"]["param"] == param, answer
        assert message in answer["error"]["message"], answer


CONVERSATION = [
    {"role": "system", "content": "Embed the user's question."},
    {"role": "user", "content": "Where is the Eiffel tower?"},
]


def test_messages_are_embedded_as_the_chat_template_renders_them(server, offline):
    """vLLM's chat form: one conversation through the chat template, ending with its last
    message unless add_generation_prompt asks for the assistant's turn."""
    for opens_turn in (False, True):
        options = ChatTemplateOptions(add_generation_prompt=opens_turn)
        text = offline.render_chat(CONVERSATION, options=options)
        token_ids = offline.tokenizer.encode(text, add_special_tokens=False)
        want = offline.embed([token_ids])[0].outputs.embedding
        body = {"messages": CONVERSATION}
        if opens_turn:
            body["add_generation_prompt"] = True
        status, answer = post(server, body)
        assert status == 200, answer
        assert [item["index"] for item in answer["data"]] == [0]
        assert close(answer["data"][0]["embedding"], want)
        assert answer["usage"]["prompt_tokens"] == len(token_ids)
    assert text.endswith("<|im_start|>assistant\n")  # the last one opened the turn
    # The template's variables, and truncate_prompt_tokens cuts the rendered prompt.
    status, answer = post(
        server,
        {
            "messages": CONVERSATION,
            "chat_template_kwargs": {"enable_thinking": False},
            "add_generation_prompt": True,
            "truncate_prompt_tokens": 5,
            "dimensions": 8,
        },
    )
    options = ChatTemplateOptions(chat_template_kwargs={"enable_thinking": False})
    text = offline.render_chat(CONVERSATION, options=options)
    tail = offline.tokenizer.encode(text, add_special_tokens=False)[-5:]
    want = offline.embed([tail], PoolingParams(dimensions=8))[0].outputs.embedding
    assert status == 200 and close(answer["data"][0]["embedding"], want), answer
    assert answer["usage"]["prompt_tokens"] == 5


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"input": []}, "input", "input must be a string, a list of strings"),
        ({"input": ""}, "input", "input: prompt is empty"),
        ({}, "input", "input is required"),
        ({"input": ["ok", [1, 99999]]}, "input[1]", r"token id 99999 is outside the vocabulary"),
        (
            {"input": [5] * 513},
            "input",
            "513 prompt tokens exceed the model's context window of 512",
        ),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format", "'float' or 'base64'"),
        ({"input": "a", "dimensions": 0}, "dimensions", r"dimensions must be in \[1, 128\], got 0"),
        ({"input": "a", "dimensions": 129}, "dimensions", r"in \[1, 128\], got 129"),
        ({"input": "a", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", r"-1 or in \[1"),
        ({"input": "a", "normalize": "yes"}, "normalize", "normalize must be a boolean"),
        # The chat form.
        ({"input": "a", "messages": CONVERSATION}, "messages", "messages and input are both"),
        ({"messages": []}, "messages", "messages must be a non-empty list"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "one of"),
        (
            {"input": "a", "add_generation_prompt": True},
            "add_generation_prompt",
            "add_generation_prompt is a chat setting: it needs messages",
        ),
        (
            {"messages": CONVERSATION, "chat_template": "{{ messages }}"},
            "chat_template",
            "does not render a request's own template",
        ),
        (
            {"messages": CONVERSATION, "chat_template_kwargs": {"messages": 1}},
            "chat_template_kwargs",
            "set by the rendering itself",
        ),
        (
            {"messages": [{"role": "user", "content": "x " * 600}]},
            "messages",
            "prompt tokens exceed the model's context window of 512",
        ),
    ],
)
def test_bad_fields_are_refused_by_name(server, body, param, message):
    status, answer = post(server, {"model": SERVED_MODEL_NAME, **body})
    assert status == 400, answer
    error = answer["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert re.search(message, error["message"]), error


def ok_http_calls(server: ServerProcess) -> float:
    status, metrics = get(server, "/metrics")
    assert status == 200
    name = 'pagedserve_requests_total{api="http",code="OK"} '
    line = next((line for line in metrics.decode().splitlines() if line.startswith(name)), None)
    return 0.0 if line is None else float(line[len(name) :])


def test_other_model_is_404_and_metrics_count_the_calls(server):
    status, answer = post(server, {"model": "other", "input": "a"})
    assert status == 404 and answer["error"]["param"] == "model"
    before = ok_http_calls(server)
    assert post(server, {"input": ["a", "b"]})[0] == 200
    assert ok_http_calls(server) == before + 1


def test_grpc_embed_equals_the_offline_vectors(server, offline):
    """gRPC's Embed: text and token ids, dimensions and normalize, usage; bad fields are
    INVALID_ARGUMENT naming the field."""
    with Client(f"127.0.0.1:{server.port}") as client:
        for prompt in [TEXTS[0], TOKEN_IDS[1]]:
            want = offline.embed(prompt)[0]
            got = client.embed(prompt, request_id="e-1", timeout_s=60)
            assert got.request_id == "e-1"
            assert close(got.outputs.embedding, want.outputs.embedding)
        raw = offline.embed(TEXTS[2], PoolingParams(normalize=False, dimensions=8))[0]
        client.embed(TEXTS[2], timeout_s=60)
        got = client.embed(TEXTS[2], dimensions=8, normalize=False, timeout_s=60)
        assert close(got.outputs.embedding, raw.outputs.embedding)
        assert got.num_cached_tokens > 0  # the same text was embedded just before
        response = client.stub.Embed(pb.EmbedRequest(token_ids=pb.TokenIds(ids=TOKEN_IDS[0])))
        assert response.usage.prompt_tokens == len(TOKEN_IDS[0])
        # A conversation, as /v1/embeddings' messages.
        for opens_turn in (False, True):
            options = ChatTemplateOptions(add_generation_prompt=opens_turn)
            text = offline.render_chat(CONVERSATION, options=options)
            token_ids = offline.tokenizer.encode(text, add_special_tokens=False)
            want = offline.embed([token_ids])[0].outputs.embedding
            chat = conversation(CONVERSATION, add_generation_prompt=opens_turn)
            got = client.embed(chat, timeout_s=60)
            assert close(got.outputs.embedding, want) and got.prompt is None
        chat = conversation(CONVERSATION)
        for request, message in [
            (pb.EmbedRequest(), "prompt: set one of text, token_ids, chat"),
            (pb.EmbedRequest(chat=pb.Chat()), "chat.messages is empty"),
            (
                pb.EmbedRequest(chat=pb.Chat(messages=chat.messages, tools=[pb.Tool(name="f")])),
                "chat.tools: a conversation to embed or classify takes messages",
            ),
            (
                pb.EmbedRequest(chat=pb.Chat(messages=chat.messages, include_reasoning=False)),
                "chat.include_reasoning: a conversation to embed or classify has no answer",
            ),
            (
                pb.EmbedRequest(chat=pb.Chat(messages=chat.messages, chat_template="{{ 1 }}")),
                "chat.chat_template: this server does not render",
            ),
            (pb.EmbedRequest(text="x", dimensions=100000), "dimensions=100000 exceeds"),
            (pb.EmbedRequest(text="x", dimensions=0), "dimensions must be an integer >= 1"),
            (pb.EmbedRequest(token_ids=pb.TokenIds(ids=[5] * 5000)), "max_model_len"),
            (pb.EmbedRequest(text="x", priority=3), "priority=3"),
        ]:
            with pytest.raises(grpc.RpcError) as caught:
                client.stub.Embed(request, timeout=60)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, request
            assert message in caught.value.details(), caught.value.details()


def test_pooler_config_reaches_both_apis(server_model_dir, tmp_path):
    """``--pooler-config``: mean pooling, unnormalized by default, on /v1/embeddings,
    /v1/score and gRPC's Embed, as the offline engine with the same pooler_config."""
    pooler = {"pooling_type": "MEAN", "normalize": False}
    offline = LLM(server_model_dir, num_blocks=128, pooler_config=pooler)
    want = [o.outputs.embedding for o in offline.embed(TEXTS)]
    with serving(server_model_dir, tmp_path, "--pooler-config", json.dumps(pooler)) as server:
        status, answer = post(server, {"input": TEXTS})
        assert status == 200, answer
        for item, vector in zip(answer["data"], want):
            assert close(item["embedding"], vector)
        status, answer = post(server, {"input": TEXTS[0], "normalize": True})
        norm = sum(value * value for value in answer["data"][0]["embedding"]) ** 0.5
        assert status == 200 and abs(norm - 1.0) < 1e-5
        with Client(f"127.0.0.1:{server.port}") as client:
            assert close(client.embed(TEXTS[2]).outputs.embedding, want[2])
        request = urllib.request.Request(
            server.http_url + "/v1/score",
            data=json.dumps({"text_1": TEXTS[0], "text_2": TEXTS[1:]}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            scores = [item["score"] for item in json.loads(response.read())["data"]]
        expected = [o.outputs.score for o in offline.score(TEXTS[0], TEXTS[1:])]
        assert scores == pytest.approx(expected, abs=1e-5)
        server.assert_blocks_all_free()
