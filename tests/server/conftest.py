"""Fixtures of the server tests: the tiny model they serve, and the real server
(``helpers.server_process``) shared by a module's tests or started by a test of its own.
After each test the shared server's block accounting must hold (GetStats)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from helpers.server_process import CHAT_TEMPLATE, SERVED_MODEL_NAME, ServerProcess
from helpers.tiny_tokenizers import BYTE_LEVEL_SPECIALS, byte_level_tokenizer, save_for_transformers


@pytest.fixture(scope="session")
def server_model_dir(tiny_model_dirs, tmp_path_factory) -> Path:
    """The tiny random Llama with a byte-level tokenizer (its greedy output decodes to
    text) and a chat template."""
    path = tmp_path_factory.mktemp("tiny_llama_server")
    shutil.copytree(tiny_model_dirs["llama"], path, dirs_exist_ok=True)
    save_for_transformers(byte_level_tokenizer([], vocab_size=512), path, BYTE_LEVEL_SPECIALS)
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config))
    return path


# ---------------------------------------------------------------- the server


@pytest.fixture
def start_server(server_model_dir, tmp_path) -> Iterator[Callable[..., ServerProcess]]:
    """A server of a test's own (fault tests): ``start_server(*flags, env=...)``."""
    servers: list[ServerProcess] = []

    def start(*flags: str, env: dict[str, str] | None = None, wait: bool = True) -> ServerProcess:
        workdir = tmp_path / f"server{len(servers)}"
        workdir.mkdir()
        server = ServerProcess(server_model_dir, workdir, *flags, env=env)
        servers.append(server)
        return server.wait_serving() if wait else server

    yield start
    for server in servers:
        server.close()


@pytest.fixture(scope="module")
def shared_server(server_model_dir, tmp_path_factory) -> Iterator[ServerProcess]:
    """One server for a module's tests, both APIs; stopped by SIGTERM at the end, which
    must drain cleanly (exit 0)."""
    server = ServerProcess(
        server_model_dir,
        tmp_path_factory.mktemp("server"),
        "--kv-cache-bytes",
        str(4 << 20),
        "--max-concurrent-requests",
        "64",
        "--metrics-port",
        "0",
        "--http-port",
        "0",
        "--served-model-name",
        SERVED_MODEL_NAME,
    ).wait_serving()
    yield server
    try:
        assert server.terminate() == 0, server.log()
    finally:
        server.close()


@pytest.fixture
def server(shared_server) -> Iterator[ServerProcess]:
    """The module's server, checked after the test: nothing left running, every block free,
    the accounting consistent."""
    yield shared_server
    shared_server.assert_blocks_all_free()
