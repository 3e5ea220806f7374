"""Sequence classification models over the real server: vLLM's ``/classify`` (and
``/invocations``, the gRPC ``Classify`` RPC, run-batch lines) answers as the offline
``LLM.classify``, a conversation (``messages``) as the chat template renders it; a
cross-encoder's ``/score`` and ``/rerank`` answer as ``LLM.score``;
a classification model refuses generation and embeddings, and a causal LM refuses
classification, each with a 400 naming ``model``."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import grpc
import pytest

from helpers.http_calls import post
from helpers.pooling_models import LABELS, make_cross_encoder, make_text_classifier
from helpers.server_process import CHAT_TEMPLATE, SERVED_MODEL_NAME, ServerProcess, serving
from pagedserve.frontend import LLM, PoolingParams
from pagedserve.frontend.chat_template import ChatTemplateOptions
from pagedserve.frontend.client import Client, conversation
from pagedserve.v1 import generation_pb2 as pb

TEXTS = ["PagedAttention keeps the KV cache in blocks", "a small cat", "x"]
QUERY = "what is paged attention?"
DOCUMENTS = ["blocks of keys and values", "a recipe for bread", "paged attention pages"]


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory):
    path = make_text_classifier(tmp_path_factory.mktemp("text_classifier"))
    config_path = path / "tokenizer_config.json"  # a chat template, for messages
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def cross_encoder_dir(tmp_path_factory):
    return make_cross_encoder(tmp_path_factory.mktemp("cross_encoder"))


@pytest.fixture(scope="module")
def classifier_server(classifier_dir, tmp_path_factory) -> Iterator[ServerProcess]:
    with serving(classifier_dir, tmp_path_factory.mktemp("classifier_server")) as server:
        yield server


@pytest.fixture
def server(classifier_server) -> Iterator[ServerProcess]:
    yield classifier_server
    classifier_server.assert_blocks_all_free()


@pytest.fixture(scope="module")
def offline(classifier_dir) -> LLM:
    return LLM(classifier_dir, num_blocks=64)


def probs(outputs) -> list[list[float]]:
    return [output.outputs.probs for output in outputs]


@pytest.mark.parametrize("path", ["/v1/classify", "/classify"])
def test_classify_answers_as_offline(server, offline, path):
    status, answer = post(server, path, {"model": SERVED_MODEL_NAME, "input": TEXTS})
    assert status == 200, answer
    want = offline.classify(TEXTS, use_tqdm=False)
    assert answer["object"] == "list" and answer["model"] == SERVED_MODEL_NAME
    assert answer["id"].startswith("classify-")
    assert [d["index"] for d in answer["data"]] == [0, 1, 2]
    for item, output in zip(answer["data"], want):
        assert item["probs"] == pytest.approx(output.outputs.probs, abs=1e-6)
        assert item["label"] == output.label and item["label"] in LABELS.values()
        assert item["num_classes"] == 3 and sum(item["probs"]) == pytest.approx(1.0)
    prompt_tokens = sum(len(output.prompt_token_ids) for output in want)
    assert answer["usage"] == {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
    }


def test_classify_takes_ids_raw_logits_and_invocations(server, offline):
    token_ids = offline.tokenizer.encode(TEXTS[0])
    raw = offline.classify(
        [token_ids], PoolingParams(task="classify", use_activation=False), use_tqdm=False
    )
    for name in ("use_activation", "activation"):
        status, answer = post(server, "/v1/classify", {"input": token_ids, name: False})
        assert status == 200, answer
        assert answer["data"][0]["probs"] == pytest.approx(raw[0].outputs.probs, abs=1e-5)
    status, answer = post(
        server, "/invocations", {"input": TEXTS[1], "request_id": "mine", "priority": 0}
    )
    assert status == 200, answer
    assert answer["id"] == "classify-mine"
    assert answer["data"][0]["probs"] == pytest.approx(
        offline.classify(TEXTS[1], use_tqdm=False)[0].outputs.probs, abs=1e-6
    )


def test_pooling_answers_with_the_classifications(server, offline):
    """vLLM's ``/pooling`` on a classifier: each input's probabilities (or with
    ``use_activation`` false its raw logits, a reward model's scores) as ``/classify``
    gives them; an embedding field or task is refused by name."""
    status, answer = post(server, "/pooling", {"input": TEXTS, "model": SERVED_MODEL_NAME})
    assert status == 200, answer
    assert answer["id"].startswith("pool-")
    want = offline.classify(TEXTS, use_tqdm=False)
    for index, (item, output) in enumerate(zip(answer["data"], want, strict=True)):
        assert item["index"] == index and item["object"] == "pooling"
        assert item["data"] == pytest.approx(output.outputs.probs, abs=1e-6)
    raw = offline.classify(
        TEXTS[:1], PoolingParams(task="classify", use_activation=False), use_tqdm=False
    )
    status, answer = post(
        server, "/pooling", {"input": TEXTS[0], "task": "classify", "use_activation": False}
    )
    assert status == 200, answer
    assert answer["data"][0]["data"] == pytest.approx(raw[0].outputs.probs, abs=1e-5)
    # vLLM's per-token task: the head's probabilities at every prompt token.
    rows = offline.encode(TEXTS[:1], pooling_task="token_classify", use_tqdm=False)
    status, answer = post(server, "/pooling", {"input": TEXTS[0], "task": "token_classify"})
    assert status == 200, answer
    got = answer["data"][0]["data"]
    assert len(got) == len(rows[0].prompt_token_ids) == len(rows[0].outputs.data)
    for row, want_row in zip(got, rows[0].outputs.data):
        assert row == pytest.approx(want_row, abs=1e-6)
    assert got[-1] == pytest.approx(want[0].outputs.probs, abs=1e-5)
    for body, param in [
        ({"input": "a", "normalize": True}, "normalize"),
        ({"input": "a", "task": "embed"}, "task"),
        ({"input": "a", "task": "token_embed"}, "task"),
    ]:
        status, answer = post(server, "/pooling", body)
        assert status == 400 and answer["error"]["param"] == param, answer


def test_classify_takes_a_conversation_as_messages(server, offline):
    """vLLM's chat form: one conversation rendered with the chat template (ending with its
    last message unless add_generation_prompt), classified as its token ids are."""
    conversation = [{"role": "user", "content": TEXTS[0]}]
    for fields in ({}, {"add_generation_prompt": True, "use_activation": False}):
        options = ChatTemplateOptions(add_generation_prompt=bool(fields))
        text = offline.render_chat(conversation, options=options)
        token_ids = offline.tokenizer.encode(text, add_special_tokens=False)
        params = PoolingParams(task="classify", use_activation=not fields)
        want = offline.classify([token_ids], params, use_tqdm=False)[0]
        status, answer = post(server, "/v1/classify", {"messages": conversation, **fields})
        assert status == 200, answer
        (item,) = answer["data"]
        assert item["probs"] == pytest.approx(want.outputs.probs, abs=1e-5)
        assert item["label"] == want.label
        assert answer["usage"]["prompt_tokens"] == len(token_ids)


@pytest.mark.parametrize(
    ("path", "body", "param", "message"),
    [
        ("/v1/classify", {}, "input", "input is required"),
        ("/v1/classify", {"input": []}, "input", "input"),
        ("/v1/classify", {"input": "a", "truncate_prompt_tokens": 0},
         "truncate_prompt_tokens", "truncate_prompt_tokens must be -1 or in [1, "),
        ("/v1/classify", {"input": "a", "use_activation": "no"}, "use_activation",
         "use_activation must be a boolean, got 'no'"),
        ("/v1/classify", {"input": "a", "use_activation": True, "activation": False},
         "activation", "use_activation=True and activation=False disagree"),
        ("/v1/classify", {"input": "a", "priority": 2}, "priority", "priority"),
        ("/v1/classify", {"input": [600]}, "input", "600"),
        ("/v1/classify", ["a"], "", "the request body must be a JSON object, got list"),
        ("/v1/classify", {"input": "a", "messages": [{"role": "user", "content": "b"}]},
         "messages", "messages and input are both set"),
        ("/v1/classify", {"input": "a", "continue_final_message": True},
         "continue_final_message", "a chat setting: it needs messages"),
        ("/v1/classify", {"messages": [{"role": "user", "content": "b"}],
                          "add_generation_prompt": True, "continue_final_message": True},
         "continue_final_message", "cannot both be true"),
        # A classifier serves nothing else, and scores only with one label.
        ("/v1/completions", {"prompt": "a", "max_tokens": 2}, "model",
         "LlamaForSequenceClassification: this model is a sequence classification model"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]}, "model",
         "not the generate task"),
        ("/v1/embeddings", {"input": "a"}, "model", "not the embed task"),
        ("/v1/responses", {"input": "a"}, "model", "not the generate task"),
        ("/v1/score", {"text_1": "a", "text_2": "b"}, "model",
         "this classification model has 3 labels (negative, neutral, positive)"),
        ("/v1/rerank", {"query": "a", "documents": ["b"]}, "model", "3 labels"),
    ],
)  # fmt: skip
def test_bad_bodies_and_other_tasks_are_refused_naming_the_field(
    server, path, body, param, message
):
    status, answer = post(server, path, body)
    assert status == 400, answer
    assert answer["error"]["param"] == param, answer
    assert message in answer["error"]["message"], answer


def test_grpc_classify_answers_as_the_http_route(server, offline):
    want = offline.classify(TEXTS, use_tqdm=False)
    with Client(f"127.0.0.1:{server.port}") as client:
        outputs = client.classify(TEXTS, request_id="c1")
        assert [o.label for o in outputs] == [o.label for o in want]
        for output, expected in zip(outputs, want):
            assert output.outputs.probs == pytest.approx(expected.outputs.probs, abs=1e-6)
            assert output.prompt == TEXTS[want.index(expected)]
        raw = client.classify(TEXTS[0], use_activation=False)[0].outputs.probs
        assert sum(raw) != pytest.approx(1.0)
    info = server.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    assert info.architecture == "LlamaForSequenceClassification"
    assert list(info.labels) == list(LABELS.values())
    response = server.stub.Classify(pb.ClassifyRequest(request_id="r", input=TEXTS), timeout=30)
    assert response.request_id == "r"
    assert response.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in want)
    # A conversation, as /v1/classify's messages.
    messages = [{"role": "user", "content": TEXTS[0]}]
    text = offline.render_chat(messages, options=ChatTemplateOptions(add_generation_prompt=False))
    token_ids = offline.tokenizer.encode(text, add_special_tokens=False)
    want = offline.classify([token_ids], use_tqdm=False)[0]
    with Client(f"127.0.0.1:{server.port}") as client:
        (output,) = client.classify(conversation(messages))
        assert output.outputs.probs == pytest.approx(want.outputs.probs, abs=1e-5)
        assert output.label == want.label and output.prompt is None
        (cut,) = client.classify(conversation(messages), truncate_prompt_tokens=4)
        (tail,) = offline.classify([token_ids[-4:]], use_tqdm=False)
        assert cut.outputs.probs == pytest.approx(tail.outputs.probs, abs=1e-5)
    chat = conversation(messages)
    long_chat = conversation([{"role": "user", "content": "x " * 600}])
    for request, code, message in [
        (pb.ClassifyRequest(input=["a"], chat=chat), grpc.StatusCode.INVALID_ARGUMENT,
         "chat and input are both set"),
        (pb.ClassifyRequest(chat=long_chat), grpc.StatusCode.INVALID_ARGUMENT,
         "prompt tokens exceed the model's context window of 512"),
        (pb.ClassifyRequest(chat=pb.Chat(messages=[pb.ChatMessage(content="a")])),
         grpc.StatusCode.INVALID_ARGUMENT,
         "chat.messages[0].role is CHAT_ROLE_UNSPECIFIED; set one of CHAT_ROLE_SYSTEM, "),
        (pb.ClassifyRequest(), grpc.StatusCode.INVALID_ARGUMENT, "input"),
        (pb.ClassifyRequest(input=["a"], truncate_prompt_tokens=0),
         grpc.StatusCode.INVALID_ARGUMENT, "truncate_prompt_tokens must be -1 or in [1, "),
        (pb.ClassifyRequest(input=["a"], lora_adapter="none"), grpc.StatusCode.NOT_FOUND,
         "lora_adapter"),
    ]:  # fmt: skip
        with pytest.raises(grpc.RpcError) as caught:
            server.stub.Classify(request, timeout=30)
        assert caught.value.code() == code
        assert message in caught.value.details(), caught.value.details()
    generate = pb.GenerateRequest(text="a", sampling=pb.SamplingParams(max_tokens=2))
    with pytest.raises(grpc.RpcError) as caught:
        server.stub.Generate(generate, timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not the generate task" in caught.value.details()


def test_run_batch_classifies_lines(classifier_dir, offline, tmp_path):
    lines = [
        {"custom_id": "c", "method": "POST", "url": "/v1/classify", "body": {"input": TEXTS}},
        {"custom_id": "g", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "a", "max_tokens": 2}},
    ]  # fmt: skip
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = subprocess.run(
        [sys.executable, "-m", "pagedserve.frontend.cli", "run-batch", "--model",
         str(classifier_dir), "--kv-cache-bytes", str(4 << 20), "-i", str(source), "-o", "-"],
        capture_output=True, timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    classified, generated = [json.loads(line) for line in result.stdout.splitlines()]
    assert classified["response"]["status_code"] == 200
    data = classified["response"]["body"]["data"]
    want = offline.classify(TEXTS, use_tqdm=False)
    for item, expected in zip(data, probs(want), strict=True):
        assert item["probs"] == pytest.approx(expected, abs=1e-6)
    assert generated["response"]["status_code"] == 400
    assert generated["response"]["body"]["error"]["param"] == "model"


def test_cross_encoder_scores_and_reranks_as_offline(cross_encoder_dir, tmp_path):
    offline = LLM(cross_encoder_dir, num_blocks=64)
    want = [o.outputs.score for o in offline.score(QUERY, DOCUMENTS, use_tqdm=False)]
    pair_tokens = [len(o.prompt_token_ids) for o in offline.score(QUERY, DOCUMENTS)]
    with serving(cross_encoder_dir, tmp_path) as server:
        status, answer = post(server, "/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS})
        assert status == 200, answer
        assert [d["score"] for d in answer["data"]] == pytest.approx(want, abs=1e-6)
        assert answer["usage"]["prompt_tokens"] == sum(pair_tokens)
        status, answer = post(
            server, "/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": 2}
        )
        assert status == 200, answer
        order = sorted(range(len(DOCUMENTS)), key=want.__getitem__, reverse=True)
        assert [r["index"] for r in answer["results"]] == order[:2]
        assert answer["results"][0]["relevance_score"] == pytest.approx(want[order[0]])
        assert answer["usage"] == {"total_tokens": sum(pair_tokens)}
        status, answer = post(
            server,
            "/v1/score",
            {"text_1": QUERY, "text_2": DOCUMENTS, "truncate_prompt_tokens": 8},
        )
        assert status == 200 and answer["usage"]["prompt_tokens"] == 8 * len(DOCUMENTS)
        with Client(f"127.0.0.1:{server.port}") as client:
            assert client.score(QUERY, DOCUMENTS) == pytest.approx(want, abs=1e-6)
        # One label: it classifies too (the sigmoid of its logit).
        status, answer = post(server, "/v1/classify", {"input": "a"})
        assert status == 200 and answer["data"][0]["num_classes"] == 1
        server.assert_blocks_all_free()
