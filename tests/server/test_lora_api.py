"""LoRA adapters over the real server (``--lora-modules NAME=PATH``): the HTTP API's
``model`` selects an adapter, whose completions and chat answers (whole and streamed)
equal the offline engine's under the same adapter; ``/v1/models`` lists the base model
and each adapter; an unknown model name is a 404 naming ``model``. gRPC's
``lora_adapter`` selects an adapter the same way.

The adapters are random PEFT LoRA adapters of the tiny Llama (``peft``, both A and B
drawn wide, so that their greedy text differs from the base model's)."""

from __future__ import annotations

import concurrent.futures
import json
import random
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from helpers.http_calls import get, post, sse_events
from helpers.lora_adapters import SERVER_ADAPTERS, make_lora_adapter
from helpers.server_process import SERVED_MODEL_NAME, ServerProcess, serving
from pagedserve.frontend import LLM, SamplingParams
from pagedserve.frontend.client import Client

NUM_TOKENS = 16
PROMPT_IDS = [5, 300, 301, 302, 7, 7]
MESSAGES = [{"role": "user", "content": "Tell me about paged attention."}]
MODELS = [SERVED_MODEL_NAME, *SERVER_ADAPTERS]


@pytest.fixture(scope="module")
def adapter_dirs(server_model_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("server_lora")
    return {
        name: str(make_lora_adapter(server_model_dir, root / name, seed, **config))
        for seed, (name, config) in enumerate(SERVER_ADAPTERS.items(), start=1)
    }


@pytest.fixture(scope="module")
def lora_server(server_model_dir, adapter_dirs, tmp_path_factory) -> Iterator[ServerProcess]:
    modules = [f"{name}={path}" for name, path in adapter_dirs.items()]
    workdir = tmp_path_factory.mktemp("lora_server")
    with serving(server_model_dir, workdir, "--lora-modules", *modules) as server:
        yield server


@pytest.fixture
def server(lora_server) -> Iterator[ServerProcess]:
    yield lora_server
    lora_server.assert_blocks_all_free()


@pytest.fixture(scope="module")
def offline(server_model_dir, adapter_dirs) -> LLM:
    return LLM(server_model_dir, num_blocks=128, lora_modules=adapter_dirs)


def greedy(max_tokens: int = NUM_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def body(model: str, **fields) -> dict:
    return {
        "model": model,
        "max_tokens": NUM_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        **fields,
    }


def offline_texts(offline: LLM, messages=None) -> dict[str, str]:
    """Each model's greedy text offline; they must differ, or the test could not fail."""
    texts = {}
    for model in MODELS:
        adapter = None if model == SERVED_MODEL_NAME else model
        if messages is None:
            output = offline.generate(PROMPT_IDS, greedy(), lora_request=adapter)[0]
        else:
            output = offline.chat(messages, greedy(), lora_request=adapter)[0]
        texts[model] = output.outputs[0].text
    assert len(set(texts.values())) == len(MODELS), texts
    return texts


def test_models_lists_the_base_model_and_each_adapter(server, adapter_dirs):
    status, answer = get(server, "/v1/models")
    assert status == 200, answer
    cards = json.loads(answer)["data"]
    assert [card["id"] for card in cards] == MODELS
    assert cards[0].get("parent") is None
    for card in cards[1:]:
        assert card["parent"] == SERVED_MODEL_NAME, card
        assert Path(card["root"]).resolve() == Path(adapter_dirs[card["id"]]).resolve(), card
        status, answer = get(server, f"/v1/models/{card['id']}")
        assert status == 200 and json.loads(answer) == card


def test_completions_under_each_adapter_equal_offline_whole_and_streamed(server, offline):
    want = offline_texts(offline)
    for model in MODELS:
        status, answer = post(server, "/v1/completions", body(model, prompt=PROMPT_IDS))
        assert status == 200, answer
        assert answer["model"] == model
        assert answer["choices"][0]["text"] == want[model], model

        events = sse_events(server, "/v1/completions", body(model, prompt=PROMPT_IDS, stream=True))
        assert events[-1] == "[DONE]"
        chunks = [event for event in events[:-1] if event["choices"]]
        assert all(chunk["model"] == model for chunk in chunks)
        assert "".join(chunk["choices"][0]["text"] for chunk in chunks) == want[model], model


def test_chat_under_each_adapter_equals_offline_whole_and_streamed(server, offline):
    want = offline_texts(offline, MESSAGES)
    for model in MODELS:
        status, answer = post(server, "/v1/chat/completions", body(model, messages=MESSAGES))
        assert status == 200, answer
        assert answer["model"] == model
        assert answer["choices"][0]["message"]["content"] == want[model], model

        events = sse_events(
            server, "/v1/chat/completions", body(model, messages=MESSAGES, stream=True)
        )
        deltas = [event["choices"][0]["delta"] for event in events[:-1] if event["choices"]]
        assert "".join(delta.get("content") or "" for delta in deltas) == want[model], model


def test_concurrent_requests_under_different_adapters_keep_their_own_text(server, offline):
    want = offline_texts(offline)
    models = MODELS * 3
    random.Random(0).shuffle(models)
    with concurrent.futures.ThreadPoolExecutor(len(models)) as pool:
        answers = list(
            pool.map(
                lambda model: post(server, "/v1/completions", body(model, prompt=PROMPT_IDS)),
                models,
            )
        )
    assert [status for status, _ in answers] == [200] * len(models)
    assert [answer["choices"][0]["text"] for _, answer in answers] == [want[m] for m in models]


def test_cached_prefixes_are_not_shared_between_adapters(server):
    prompt = [random.Random(1).randrange(3, 512) for _ in range(40)]  # 2 full blocks of 16

    def cached_tokens(model: str) -> int:
        status, answer = post(server, "/v1/completions", body(model, prompt=prompt, max_tokens=2))
        assert status == 200, answer
        return answer["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert [cached_tokens(model) for model in MODELS] == [0, 0, 0]
    assert [cached_tokens(model) for model in MODELS] == [32, 32, 32]


def test_unknown_model_is_a_404_naming_model_and_what_is_served(server):
    for path, fields in [
        ("/v1/completions", {"prompt": PROMPT_IDS}),
        ("/v1/chat/completions", {"messages": MESSAGES}),
    ]:
        status, answer = post(server, path, body("tiny-nope", **fields))
        assert status == 404, answer
        error = answer["error"]
        assert error["param"] == "model" and "'tiny-nope'" in error["message"], error
        assert all(repr(model) in error["message"] for model in MODELS), error


def test_grpc_lora_adapter_selects_the_adapter_and_an_unknown_one_is_not_found(server, offline):
    want = offline_texts(offline)
    with Client(f"127.0.0.1:{server.port}") as client:
        for model in MODELS:
            adapter = "" if model == SERVED_MODEL_NAME else model
            whole = client.generate(PROMPT_IDS, greedy(), lora_adapter=adapter)
            assert whole.outputs[0].text == want[model], model
            *_, streamed = client.stream(PROMPT_IDS, greedy(), lora_adapter=adapter)
            assert streamed.outputs[0].text == want[model], model
        with pytest.raises(grpc.RpcError) as error:
            client.generate(PROMPT_IDS, greedy(), lora_adapter="tiny-nope")
    assert error.value.code() == grpc.StatusCode.NOT_FOUND
    assert "lora_adapter" in error.value.details() and "'tiny-nope'" in error.value.details()
