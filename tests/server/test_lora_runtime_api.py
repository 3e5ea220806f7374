"""LoRA adapters loaded and unloaded while the real server runs
(``--allow-runtime-lora-updating``): vLLM's ``POST /v1/load_lora_adapter`` and
``/v1/unload_lora_adapter``; a loaded adapter's completions (HTTP and gRPC) equal the
offline engine's under it, ``/v1/models`` follows the loads, and bad calls are refused
naming the field. A server started without the flag has no such routes."""

from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from helpers.http_calls import get, post
from helpers.lora_adapters import SERVER_ADAPTERS, make_lora_adapter
from helpers.server_process import SERVED_MODEL_NAME, ServerProcess, serving
from pagedserve.frontend import LLM, SamplingParams
from pagedserve.frontend.client import Client

NAME = "tiny-all-r8"
NUM_TOKENS = 12
PROMPT_IDS = [5, 300, 301, 302, 7, 7]


@pytest.fixture(scope="module")
def adapter_path(server_model_dir, tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("runtime_lora")
    return str(make_lora_adapter(server_model_dir, root / NAME, 1, **SERVER_ADAPTERS[NAME]))


@pytest.fixture(scope="module")
def updating_server(server_model_dir, tmp_path_factory) -> Iterator[ServerProcess]:
    workdir = tmp_path_factory.mktemp("lora_runtime_server")
    with serving(server_model_dir, workdir, "--allow-runtime-lora-updating") as server:
        yield server


@pytest.fixture
def server(updating_server) -> Iterator[ServerProcess]:
    yield updating_server
    updating_server.assert_blocks_all_free()


def post_text(server, path: str, body: dict) -> tuple[int, str]:
    """A POST whose success answer is plain text (vLLM's), its error one JSON."""
    request = urllib.request.Request(
        server.http_url + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def completion(server, model: str) -> tuple[int, dict]:
    return post(
        server,
        "/v1/completions",
        {
            "model": model,
            "prompt": PROMPT_IDS,
            "max_tokens": NUM_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
        },
    )


def model_ids(server) -> list[str]:
    status, answer = get(server, "/v1/models")
    assert status == 200, answer
    return [card["id"] for card in json.loads(answer)["data"]]


def test_an_adapter_loaded_at_run_time_serves_like_one_loaded_at_start(
    server, server_model_dir, adapter_path
):
    greedy = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    offline = LLM(server_model_dir, num_blocks=64, lora_modules={NAME: adapter_path})
    want = offline.generate(PROMPT_IDS, greedy, lora_request=NAME)[0].outputs[0].text
    base = offline.generate(PROMPT_IDS, greedy)[0].outputs[0].text
    assert want != base
    assert model_ids(server) == [SERVED_MODEL_NAME]

    status, text = post_text(
        server, "/v1/load_lora_adapter", {"lora_name": NAME, "lora_path": adapter_path}
    )
    assert (status, text) == (200, f"Success: LoRA adapter '{NAME}' added successfully.")
    assert model_ids(server) == [SERVED_MODEL_NAME, NAME]
    status, answer = completion(server, NAME)
    assert status == 200, answer
    assert answer["choices"][0]["text"] == want
    status, answer = completion(server, SERVED_MODEL_NAME)
    assert answer["choices"][0]["text"] == base
    with Client(f"127.0.0.1:{server.port}") as client:
        output = client.generate(PROMPT_IDS, greedy, lora_adapter=NAME, timeout_s=60)
    assert output.outputs[0].text == want

    status, text = post_text(server, "/v1/unload_lora_adapter", {"lora_name": NAME})
    assert (status, text) == (200, f"Success: LoRA adapter '{NAME}' removed successfully.")
    assert model_ids(server) == [SERVED_MODEL_NAME]
    status, answer = completion(server, NAME)
    assert status == 404 and answer["error"]["param"] == "model", answer
    with (
        Client(f"127.0.0.1:{server.port}") as client,
        pytest.raises(grpc.RpcError) as caught,
    ):
        client.generate(PROMPT_IDS, greedy, lora_adapter=NAME, timeout_s=60)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


def test_bad_load_and_unload_calls_name_the_field(server, adapter_path, tmp_path):
    cases = [
        ("/v1/load_lora_adapter", {"lora_path": adapter_path}, 400, "lora_name", "non-empty"),
        ("/v1/load_lora_adapter", {"lora_name": "x"}, 400, "lora_path", "non-empty string"),
        (
            "/v1/load_lora_adapter",
            {"lora_name": "x", "lora_path": str(tmp_path / "absent")},
            400,
            "lora_path",
            "adapter_config.json",
        ),
        ("/v1/unload_lora_adapter", {"lora_name": "never"}, 404, "lora_name", "'never'"),
        ("/v1/unload_lora_adapter", {}, 400, "lora_name", "non-empty string"),
    ]
    for path, body, status, param, message in cases:
        got, text = post_text(server, path, body)
        error = json.loads(text)["error"]
        assert (got, error["param"]) == (status, param), (path, body, error)
        assert message in error["message"], (path, body, error)
    # Loaded once, a second load of the name is refused; the first stays served.
    body = {"lora_name": "twice", "lora_path": adapter_path}
    assert post_text(server, "/v1/load_lora_adapter", body)[0] == 200
    got, text = post_text(server, "/v1/load_lora_adapter", body)
    error = json.loads(text)["error"]
    assert got == 400 and error["param"] == "lora_name" and "already loaded" in error["message"]
    assert completion(server, "twice")[0] == 200
    assert post_text(server, "/v1/unload_lora_adapter", {"lora_name": "twice"})[0] == 200


def test_a_weights_file_linked_outside_the_adapter_is_refused_unread(
    server, adapter_path, tmp_path
):
    secret = "root:TOP-SECRET-PASSWORD:0:0"
    outside = tmp_path / "passwd"
    outside.write_text(secret)
    adapter = Path(shutil.copytree(adapter_path, tmp_path / "adapter"))
    (adapter / "adapter_model.safetensors").unlink()
    (adapter / "adapter_model.safetensors").symlink_to(outside)
    got, text = post_text(
        server, "/v1/load_lora_adapter", {"lora_name": "linked", "lora_path": str(adapter)}
    )
    error = json.loads(text)["error"]
    assert (got, error["param"]) == (400, "lora_path"), error
    assert "is a link to a file outside the adapter directory" in error["message"], error
    assert "TOP-SECRET" not in text
    assert model_ids(server) == [SERVED_MODEL_NAME]
    assert completion(server, SERVED_MODEL_NAME)[0] == 200


def test_without_the_flag_the_routes_are_absent(shared_server, adapter_path):
    got, _ = post_text(
        shared_server, "/v1/load_lora_adapter", {"lora_name": NAME, "lora_path": adapter_path}
    )
    assert got == 404
    assert model_ids(shared_server) == [SERVED_MODEL_NAME]
    assert Path(adapter_path).is_dir()
