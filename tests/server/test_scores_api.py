"""vLLM's ``/score`` and ``/rerank`` over the real server on an embedding model: the cosine
similarity of the texts' embeddings, as the offline ``LLM.score`` gives it; rerank sorted
best first and cut to ``top_n``; ``/invocations`` takes both shapes; bad bodies are a 400
naming the field. The gRPC ``Score`` RPC gives the same scores."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from helpers.http_calls import post
from helpers.server_process import SERVED_MODEL_NAME, ServerProcess, serving
from pagedserve.frontend import LLM
from pagedserve.frontend.client import Client
from pagedserve.v1 import generation_pb2 as pb

QUERY = "The capital of France is"
DOCUMENTS = ["Paris", "a small cat", "The capital of France is", "Berlin is in Germany"]


@pytest.fixture(scope="module")
def scores_server(server_model_dir, tmp_path_factory) -> Iterator[ServerProcess]:
    with serving(server_model_dir, tmp_path_factory.mktemp("scores_server")) as server:
        yield server


@pytest.fixture
def server(scores_server) -> Iterator[ServerProcess]:
    yield scores_server
    scores_server.assert_blocks_all_free()


@pytest.fixture(scope="module")
def offline(server_model_dir) -> LLM:
    return LLM(server_model_dir, num_blocks=128)


def tokens(offline: LLM, text: str) -> int:
    return len(offline.tokenizer.encode(text))


@pytest.mark.parametrize("path", ["/v1/score", "/score"])
def test_score_one_against_many_and_pairwise_as_offline(server, offline, path):
    status, answer = post(server, path, {"model": SERVED_MODEL_NAME, "text_1": QUERY,
                                         "text_2": DOCUMENTS})  # fmt: skip
    assert status == 200, answer
    want = offline.score(QUERY, DOCUMENTS, use_tqdm=False)
    assert answer["object"] == "list" and answer["model"] == SERVED_MODEL_NAME
    assert answer["id"].startswith("score-")
    assert [d["index"] for d in answer["data"]] == [0, 1, 2, 3]
    assert all(d["object"] == "score" for d in answer["data"])
    assert [d["score"] for d in answer["data"]] == pytest.approx(
        [o.outputs.score for o in want], abs=1e-5
    )
    assert answer["data"][2]["score"] == pytest.approx(1.0)  # the query itself
    prompt_tokens = sum(tokens(offline, QUERY) + tokens(offline, d) for d in DOCUMENTS)
    assert answer["usage"] == {
        "prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens, "completion_tokens": 0
    }  # fmt: skip
    status, pairwise = post(server, path, {"text_1": DOCUMENTS[:2], "text_2": DOCUMENTS[2:]})
    assert status == 200, pairwise
    want = offline.score(DOCUMENTS[:2], DOCUMENTS[2:], use_tqdm=False)
    assert [d["score"] for d in pairwise["data"]] == pytest.approx(
        [o.outputs.score for o in want], abs=1e-5
    )


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank", "/v2/rerank"])
def test_rerank_sorts_best_first_and_keeps_top_n(server, offline, path):
    scores = [o.outputs.score for o in offline.score(QUERY, DOCUMENTS, use_tqdm=False)]
    order = sorted(range(len(DOCUMENTS)), key=lambda i: scores[i], reverse=True)
    status, answer = post(server, path, {"query": QUERY, "documents": DOCUMENTS, "top_n": 2})
    assert status == 200, answer
    assert answer["id"].startswith("rerank-") and answer["model"] == SERVED_MODEL_NAME
    assert [r["index"] for r in answer["results"]] == order[:2]
    assert order[0] == 2  # the document equal to the query
    for result in answer["results"]:
        assert result["document"] == {"text": DOCUMENTS[result["index"]]}
        assert result["relevance_score"] == pytest.approx(scores[result["index"]], abs=1e-5)
    total = sum(tokens(offline, QUERY) + tokens(offline, d) for d in DOCUMENTS)
    assert answer["usage"] == {"total_tokens": total}
    status, everything = post(server, path, {"query": QUERY, "documents": DOCUMENTS})
    assert status == 200
    assert [r["index"] for r in everything["results"]] == order


def test_invocations_take_score_and_rerank_bodies(server):
    status, score = post(server, "/invocations", {"text_1": QUERY, "text_2": DOCUMENTS[:1]})
    assert status == 200 and score["data"][0]["object"] == "score"
    status, rerank = post(server, "/invocations", {"query": QUERY, "documents": DOCUMENTS})
    assert status == 200 and len(rerank["results"]) == len(DOCUMENTS)


@pytest.mark.parametrize(
    ("path", "body", "param", "message"),
    [
        ("/v1/score", {"text_2": "a"}, "text_1", "text_1 is required: a string or a non-empty"),
        ("/v1/score", {"text_1": "a", "text_2": []}, "text_2", "text_2 must be a string or a "
         "non-empty list of strings, got []"),
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_2",
         "text_1 has 2 texts and text_2 3: give one text_1"),
        ("/v1/score", {"text_1": "a", "text_2": [1, 2]}, "text_2", "text_2 must be a string"),
        ("/v1/score", {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 0},
         "truncate_prompt_tokens", "truncate_prompt_tokens must be -1 or in [1, "),
        ("/v1/score", {"text_1": "", "text_2": "b"}, "text_1", "text_1: prompt is empty"),
        ("/v1/score", {"text_1": "a", "text_2": "b", "model": "other"}, "model",
         "model 'other' is not served here"),
        ("/v1/rerank", {"documents": ["a"]}, "query", "query must be a string, got None"),
        ("/v1/rerank", {"query": "a", "documents": "b"}, "documents",
         "documents must be a non-empty list of strings, got 'b'"),
        ("/v1/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n",
         "top_n must be >= 0, got -1"),
        ("/v1/rerank", {"query": "a", "documents": ["b"], "priority": 3}, "priority",
         "priority"),
        ("/v1/rerank", ["a"], "", "the request body must be a JSON object, got list"),
    ],
)  # fmt: skip
def test_bad_bodies_are_refused_naming_the_field(server, path, body, param, message):
    status, answer = post(server, path, body)
    assert status == (404 if param == "model" else 400), answer
    assert answer["error"]["param"] == param
    assert message in answer["error"]["message"], answer


def test_grpc_score_answers_as_the_http_route(server, offline):
    """The Score RPC (and the Python client's ``score``): the same scores, the errors
    named by the proto's fields."""
    want = [o.outputs.score for o in offline.score(QUERY, DOCUMENTS, use_tqdm=False)]
    with Client(f"127.0.0.1:{server.port}") as client:
        assert client.score(QUERY, DOCUMENTS) == pytest.approx(want, abs=1e-5)
        pairwise = client.score(DOCUMENTS[:2], DOCUMENTS[2:], request_id="pairs")
        assert len(pairwise) == 2
    response = server.stub.Score(
        pb.ScoreRequest(request_id="r1", text_1=[QUERY], text_2=DOCUMENTS[:1]), timeout=30
    )
    assert response.request_id == "r1" and len(response.scores) == 1
    assert response.usage.prompt_tokens == tokens(offline, QUERY) + tokens(offline, DOCUMENTS[0])
    for request, code, message in [
        (pb.ScoreRequest(text_2=["a"]), grpc.StatusCode.INVALID_ARGUMENT,
         "text_1 must be a string or a non-empty list of strings, got []"),
        (pb.ScoreRequest(text_1=["a", "b"], text_2=["a", "b", "c"]),
         grpc.StatusCode.INVALID_ARGUMENT, "text_1 has 2 texts and text_2 3"),
        (pb.ScoreRequest(text_1=["a"], text_2=["b"], truncate_prompt_tokens=0),
         grpc.StatusCode.INVALID_ARGUMENT, "truncate_prompt_tokens must be -1 or in [1, "),
        (pb.ScoreRequest(text_1=["a"], text_2=["b"], lora_adapter="none"),
         grpc.StatusCode.NOT_FOUND, "lora_adapter"),
    ]:  # fmt: skip
        with pytest.raises(grpc.RpcError) as caught:
            server.stub.Score(request, timeout=30)
        assert caught.value.code() == code
        assert message in caught.value.details(), caught.value.details()


def test_a_causal_lm_refuses_classification(server):
    """/classify needs a sequence classification model: a 400 naming ``model`` (the gRPC
    Classify RPC: INVALID_ARGUMENT), nothing queued."""
    status, answer = post(server, "/v1/classify", {"input": "a"})
    assert status == 400, answer
    assert answer["error"]["param"] == "model"
    assert "LlamaForCausalLM: this model is a causal LM" in answer["error"]["message"]
    with pytest.raises(grpc.RpcError) as caught:
        server.stub.Classify(pb.ClassifyRequest(input=["a"]), timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "no classifier head" in caught.value.details()
