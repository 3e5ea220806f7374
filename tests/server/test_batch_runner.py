"""``pagedserve run-batch`` as an operator runs it: the real command in a child process on
the tiny model (its scheduler and worker processes, files in and out). Each line is
answered as the same body POSTed to ``pagedserve serve`` is; bad lines get an answer
naming the line and what is wrong, in the input's order; a signal stops the batch after
the lines in flight; the command checks the engine's block accounting at the end."""

from __future__ import annotations

import asyncio
import io
import json
import math
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web

from helpers.http_calls import post
from helpers.processes import is_live, live_children, wait_until
from helpers.server_process import SERVED_MODEL_NAME
from pagedserve.frontend.batch_files import TOO_LONG, FileLines, UrlLines
from pagedserve.frontend.batch_runner import InvalidLine, OrderedWriter, parse_line

BATCH_TIMEOUT_S = 180.0
KV_CACHE_FLAGS = ("--kv-cache-bytes", str(4 << 20), "--served-model-name", SERVED_MODEL_NAME)


def request_line(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def run_batch(
    model_dir: Path, workdir: Path, lines: list[str], *flags: str
) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """The command run to its end on ``lines`` (a file); its result and output records."""
    input_path = workdir / "batch.jsonl"
    output_path = workdir / "out.jsonl"
    input_path.write_text("".join(line + "\n" for line in lines))
    result = subprocess.run(
        [
            sys.executable, "-m", "pagedserve.frontend.cli", "run-batch",
            "--model", str(model_dir), "-i", str(input_path), "-o", str(output_path),
            *KV_CACHE_FLAGS, *flags,
        ],
        capture_output=True, text=True, timeout=BATCH_TIMEOUT_S,
    )  # fmt: skip
    records = []
    if output_path.exists():
        records = [json.loads(line) for line in output_path.read_text().splitlines()]
    return result, records


def without_ids(value):
    """An answer without what differs between two runs of the same request (ids and
    times, at any depth: a response's items have their own)."""
    if isinstance(value, dict):
        return {
            key: without_ids(item)
            for key, item in value.items()
            if key not in ("id", "created", "created_at")
        }
    if isinstance(value, list):
        return [without_ids(item) for item in value]
    return value


def assert_close(got, want, path: str = "") -> None:
    """Equal, floats to float32 reduction order (the two engines batch differently)."""
    if isinstance(want, float):
        assert math.isclose(got, want, rel_tol=1e-4, abs_tol=1e-5), (path, got, want)
    elif isinstance(want, dict):
        assert got.keys() == want.keys(), path
        for key in want:
            assert_close(got[key], want[key], f"{path}.{key}")
    elif isinstance(want, list):
        assert len(got) == len(want), path
        for index, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_close(a, b, f"{path}[{index}]")
    else:
        assert got == want, (path, got, want)


# The calls of every route a line may name, each with what exercises its answer's shape.
CALLS = [
    (
        "chat",
        "/v1/chat/completions",
        {
            "model": SERVED_MODEL_NAME,
            "messages": [{"role": "user", "content": "Say hello"}],
            "max_tokens": 8,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 2,
        },
    ),
    (
        "completions",
        "/v1/completions",
        {"prompt": ["The sky", "Once upon"], "max_tokens": 6, "temperature": 0, "echo": True},
    ),
    ("sampled", "/v1/completions", {"prompt": "abc", "max_tokens": 5, "seed": 7, "n": 2}),
    ("embeddings", "/v1/embeddings", {"input": ["hello", "world"]}),
    ("chat-embedding", "/v1/embeddings", {"messages": [{"role": "user", "content": "hi"}]}),
    (
        "response",
        "/v1/responses",
        {
            "input": "Say hello",
            "instructions": "Be brief",
            "max_output_tokens": 6,
            "temperature": 0,
            "store": False,
        },
    ),  # fmt: skip
    ("score", "/v1/score", {"text_1": "hello", "text_2": ["world", "hello"]}),
    ("rerank", "/v1/rerank", {"query": "hello", "documents": ["a", "hello", "b"], "top_n": 2}),
    ("refused", "/v1/completions", {"prompt": "abc", "max_tokens": 1 << 20}),
]


def test_each_line_is_answered_as_the_http_api_answers_its_body(server, server_model_dir, tmp_path):
    result, records = run_batch(
        server_model_dir,
        tmp_path,
        [request_line(custom_id, url, body) for custom_id, url, body in CALLS],
        "--enable-log-requests",
    )
    assert result.returncode == 0, result.stderr
    assert [r["custom_id"] for r in records] == [custom_id for custom_id, _, _ in CALLS]
    for record, (custom_id, url, body) in zip(records, CALLS, strict=True):
        status, want = post(server, url, body)
        response = record["response"]
        assert record["error"] is None
        assert record["id"].startswith("batch_req_") and response["request_id"].startswith("req_")
        assert response["status_code"] == status, (custom_id, response)
        assert_close(without_ids(response["body"]), without_ids(want), custom_id)
    # The answers' ids carry the line's custom_id (the request log's client id too).
    assert records[0]["response"]["body"]["id"] == "chatcmpl-chat"
    assert "(client id 'completions')" in result.stderr
    assert records[-1]["response"]["body"]["error"]["param"] == "max_tokens"
    assert "batch done: 9 lines" in result.stderr
    assert "8 answered 200, 1 answered 400" in result.stderr
    assert "all 256 blocks free, block accounting consistent" in result.stderr, result.stderr


def test_bad_lines_are_answered_in_order_naming_the_line(server_model_dir, tmp_path):
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    lines = [
        request_line("a", "/v1/chat/completions", chat),
        "",  # blank: skipped, but counted in the line numbers
        "{not json",
        "[1, 2]",
        json.dumps({"method": "POST", "url": "/v1/completions", "body": {}}),
        json.dumps({"custom_id": "b", "method": "GET", "url": "/v1/completions", "body": {}}),
        request_line("c", "/v1/audio/speech", {}),
        json.dumps({"custom_id": "d", "method": "POST", "url": "/v1/completions", "body": []}),
        request_line("a", "/v1/completions", {"prompt": "x"}),
        request_line("e", "/v1/chat/completions", {**chat, "stream": True}),
        request_line("f", "/v1/chat/completions", {**chat, "model": "another"}),
        request_line("h", "/v1/responses", {"input": "hi", "background": True}),
        request_line("g", "/v1/completions", {"prompt": "x", "max_tokens": 2}),
    ]
    result, records = run_batch(server_model_dir, tmp_path, lines)
    assert result.returncode == 0, result.stderr
    invalid = [
        (None, "line 3: not valid JSON: Expecting property name enclosed in double quotes "
               "(column 2)"),
        (None, "line 4: must be a JSON object, got an array"),
        (None, "line 5: custom_id must be a non-empty string, got None"),
        ("b", "line 6: method must be 'POST', got 'GET'"),
        ("c", "line 7: url must be one of /v1/chat/completions, /v1/completions, "
              "/v1/embeddings, /v1/responses, /v1/score, /v1/rerank, /v1/classify, /score, "
              "/rerank, /v2/rerank, /classify, got "
              "'/v1/audio/speech'"),
        ("d", "line 8: body must be a JSON object (the request /v1/completions takes), "
              "got an array"),
        ("a", "line 9: custom_id 'a' is line 1's already"),
    ]  # fmt: skip
    assert len(records) == 1 + len(invalid) + 4
    assert records[0]["response"]["status_code"] == 200
    for record, (custom_id, message) in zip(records[1:], invalid, strict=False):
        assert record["custom_id"] == custom_id
        assert record["response"] is None
        assert record["error"]["code"] == "invalid_request_line"
        assert record["error"]["message"].startswith(message), record
    stream, model, background, last = records[-4:]
    assert stream["custom_id"] == "e" and stream["response"]["status_code"] == 400
    assert stream["response"]["body"]["error"]["param"] == "stream"
    assert model["response"]["status_code"] == 404
    assert "another" in model["response"]["body"]["error"]["message"]
    assert background["custom_id"] == "h" and background["response"]["status_code"] == 400
    assert background["response"]["body"]["error"]["param"] == "background"
    assert last["custom_id"] == "g" and last["response"]["status_code"] == 200
    assert "3 answered 200" not in result.stderr  # counted by status:
    assert "2 answered 200, 2 answered 400, 1 answered 404, 7 invalid" in result.stderr


def test_standard_input_to_standard_output(server_model_dir, tmp_path):
    lines = [
        request_line(f"q{i}", "/v1/completions", {"prompt": "ab" * i, "max_tokens": 3})
        for i in range(1, 6)
    ]
    result = subprocess.run(
        [
            sys.executable, "-m", "pagedserve.frontend.cli", "run-batch",
            "--model", str(server_model_dir), "-i", "-", "-o", "-", *KV_CACHE_FLAGS,
            "--max-lines-in-flight", "2",
        ],
        input="".join(line + "\n" for line in lines),
        capture_output=True, text=True, timeout=BATCH_TIMEOUT_S,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]  # nothing else there
    assert [r["custom_id"] for r in records] == [f"q{i}" for i in range(1, 6)]
    assert all(r["response"]["status_code"] == 200 for r in records)
    assert "running standard input" in result.stderr


def test_a_signal_stops_reading_and_the_lines_in_flight_finish(server_model_dir, tmp_path):
    """SIGTERM: no new line starts, those running end normally and are written, the
    output answers a prefix of the input, the engine's processes end, exit 1."""
    input_path = tmp_path / "batch.jsonl"
    output_path = tmp_path / "out.jsonl"
    body = {"prompt": "ab", "max_tokens": 60, "ignore_eos": True}
    input_path.write_text(
        "".join(request_line(f"q{i}", "/v1/completions", body) + "\n" for i in range(200))
    )
    log_path = tmp_path / "batch.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [
                sys.executable, "-m", "pagedserve.frontend.cli", "run-batch",
                "--model", str(server_model_dir), "-i", str(input_path), "-o",
                str(output_path), *KV_CACHE_FLAGS, "--max-lines-in-flight", "3",
            ],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            assert wait_until(
                lambda: output_path.exists() and output_path.read_text().count("\n") >= 2,
                BATCH_TIMEOUT_S,
            ), log_path.read_text()
            engine_pids = live_children(process.pid)
            process.send_signal(signal.SIGTERM)
            assert process.wait(60) == 1, log_path.read_text()
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    records = [json.loads(line) for line in output_path.read_text().splitlines()]
    assert 2 <= len(records) < 200
    assert [r["custom_id"] for r in records] == [f"q{i}" for i in range(len(records))]
    assert all(r["response"]["status_code"] == 200 for r in records)
    assert all(r["response"]["body"]["usage"]["completion_tokens"] == 60 for r in records)
    log = log_path.read_text()
    assert "SIGTERM: reading no more lines" in log
    assert f"stopped after {len(records)} lines of the input" in log
    assert wait_until(lambda: not any(is_live(pid) for pid in engine_pids), 10.0)


def test_a_signal_stops_a_batch_waiting_on_a_silent_pipe(server_model_dir, tmp_path):
    """Standard input kept open with nothing more to say: SIGTERM still ends the batch
    (the read does not hold the process), the lines read are answered. Meanwhile the
    batch's metrics (--metrics-port) count its calls, under vLLM's names too."""
    output_path = tmp_path / "out.jsonl"
    log_path = tmp_path / "batch.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [
                sys.executable, "-m", "pagedserve.frontend.cli", "run-batch",
                "--model", str(server_model_dir), "-i", "-", "-o", str(output_path),
                *KV_CACHE_FLAGS, "--metrics-port", "0", "--vllm-metric-names",
            ],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=log,
        )  # fmt: skip
        try:
            for i in range(3):
                line = request_line(f"q{i}", "/v1/completions", {"prompt": "ab", "max_tokens": 2})
                process.stdin.write(line.encode() + b"\n")
            process.stdin.flush()  # and kept open
            assert wait_until(
                lambda: output_path.exists() and output_path.read_text().count("\n") == 3,
                BATCH_TIMEOUT_S,
            )
            port = re.search(r"metrics on http://127.0.0.1:(\d+)/metrics", log_path.read_text())
            assert port is not None, log_path.read_text()
            url = f"http://127.0.0.1:{port.group(1)}/metrics"
            with urllib.request.urlopen(url, timeout=10) as response:
                metrics = response.read().decode()
            assert 'pagedserve_requests_total{api="batch",code="OK"} 3.0' in metrics
            assert (
                f'vllm:generation_tokens_total{{model_name="{SERVED_MODEL_NAME}"}} 6.0' in metrics
            )
            process.send_signal(signal.SIGTERM)
            assert process.wait(30) == 1
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
            process.stdin.close()
    log = log_path.read_text()
    assert "stopped after 3 lines of the input" in log, log
    records = [json.loads(line) for line in output_path.read_text().splitlines()]
    assert [r["response"]["status_code"] for r in records] == [200] * 3


def test_files_that_cannot_be_opened_exit_2_before_the_engine_starts(server_model_dir, tmp_path):
    started_s = time.monotonic()
    missing = subprocess.run(
        [sys.executable, "-m", "pagedserve.frontend.cli", "run-batch",
         "--model", str(server_model_dir), "-i", str(tmp_path / "nope.jsonl"), "-o", "-"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert missing.returncode == 2
    assert "cannot read the input file" in missing.stderr and "nope.jsonl" in missing.stderr
    (tmp_path / "in.jsonl").write_text("")
    unwritable = subprocess.run(
        [sys.executable, "-m", "pagedserve.frontend.cli", "run-batch",
         "--model", str(server_model_dir), "-i", str(tmp_path / "in.jsonl"),
         "-o", str(tmp_path / "no" / "such" / "dir.jsonl")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert unwritable.returncode == 2
    assert "cannot write the output file" in unwritable.stderr
    bad_limit = subprocess.run(
        [sys.executable, "-m", "pagedserve.frontend.cli", "run-batch",
         "-i", "-", "-o", "-", "--max-lines-in-flight", "0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad_limit.returncode == 2
    assert "max_lines_in_flight must be >= 1, got 0" in bad_limit.stderr
    assert time.monotonic() - started_s < 60  # no model was loaded


def test_an_empty_input_is_an_empty_output(server_model_dir, tmp_path):
    result, records = run_batch(server_model_dir, tmp_path, ["", "  "])
    assert result.returncode == 0, result.stderr
    assert records == []
    assert "batch done: 0 lines" in result.stderr


# ---------------------------------------------------------------- the parts, in process


def test_parse_line_names_what_is_wrong():
    seen: dict[str, int] = {}
    line = parse_line(3, b'{"custom_id": "x", "method": "POST", "url": "/v1/embeddings", '
                         b'"body": {"input": "a"}}\n', seen)  # fmt: skip
    assert (line.line_number, line.custom_id, line.kind, line.body) == (
        3, "x", "embedding", {"input": "a"}
    )  # fmt: skip
    assert seen == {"x": 3}
    with pytest.raises(InvalidLine, match="line 4: not UTF-8") as caught:
        parse_line(4, b'{"custom_id": "\xff"}', seen)
    assert caught.value.custom_id is None
    with pytest.raises(InvalidLine, match="line 5: custom_id must be a non-empty string, got 7"):
        parse_line(5, b'{"custom_id": 7}', seen)
    # UTF-16 (which json.loads would take) is no JSON Lines file's encoding.
    with pytest.raises(InvalidLine, match="line 7: not UTF-8"):
        parse_line(7, '{"custom_id": "y"}'.encode("utf-16"), seen)
    with pytest.raises(InvalidLine, match=r"line 8: url must be one of .*, got \['/v1/score'\]"):
        parse_line(8, b'{"custom_id": "y", "method": "POST", "url": ["/v1/score"]}', seen)
    with pytest.raises(InvalidLine, match="line 9: body must be a JSON object .*, got null"):
        parse_line(9, b'{"custom_id": "y", "method": "POST", "url": "/v1/score"}', seen)
    with pytest.raises(InvalidLine, match="line 6: custom_id 'x' is line 3's already"):
        parse_line(6, b'{"custom_id": "x", "method": "POST", "url": "/v1/embeddings", '
                      b'"body": {}}', seen)  # fmt: skip


async def every_line(lines) -> list:
    """A line source read to its end, then closed."""
    try:
        got = []
        while (line := await lines.next_line()) is not None:
            got.append(line)
        return got
    finally:
        await lines.close()


def test_file_lines_skip_a_line_past_their_limit(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"short\n" + b"x" * 100 + b"\n\nnext\n" + b"y" * 40 + b"\nlast")

    async def read_all() -> list:
        lines = FileLines(path.open("rb"), max_bytes=16)
        lines.READ_BYTES = 7  # lines cut across reads
        return await every_line(lines)

    assert asyncio.run(read_all()) == [b"short\n", TOO_LONG, b"\n", b"next\n", TOO_LONG, b"last"]


def test_ordered_writer_holds_a_line_until_those_before_it_are_written():
    out = io.StringIO()
    writer = OrderedWriter(out)
    writer.add(1, {"n": 1})
    writer.add(2, {"n": 2})
    assert out.getvalue() == "" and writer.written == 0
    writer.add(0, {"n": 0})
    assert [json.loads(line)["n"] for line in out.getvalue().splitlines()] == [0, 1, 2]
    writer.add(3, {"n": "ü"})
    assert out.getvalue().endswith('{"n": "ü"}\n') and writer.written == 4


@pytest.mark.slow
def test_run_batch_on_the_embedded_model(tmp_path):
    """The README's example: the embedded model answers a chat line."""
    line = request_line(
        "capital",
        "/v1/chat/completions",
        {
            "model": "SmolLM2-135M-Instruct",
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 24,
        },
    )
    (tmp_path / "in.jsonl").write_text(line + "\n")
    result = subprocess.run(
        [sys.executable, "-m", "pagedserve.frontend.cli", "run-batch",
         "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl")],
        capture_output=True, text=True, timeout=BATCH_TIMEOUT_S,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    (record,) = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert "Paris" in record["response"]["body"]["choices"][0]["message"]["content"]


# ---------------------------------------------------------------- URLs (an object store)


class ObjectStore:
    """A loopback HTTP server holding objects, as an object store's pre-signed URLs do:
    GET streams one in small chunks (lines cut across them), PUT stores one. The first
    ``put_failures`` PUTs are answered 503."""

    CHUNK_BYTES = 7

    def __init__(self, put_failures: int = 0) -> None:
        self.objects: dict[str, bytes] = {}
        self.put_failures = put_failures
        self.puts = 0
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        assert self._started.wait(10)

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port}/{name}"

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application(client_max_size=1 << 30)
        app.router.add_get("/{name}", self._get)
        app.router.add_put("/{name}", self._put)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.port = self._runner.addresses[0][1]
        self._started.set()
        self._loop.run_forever()

    async def _get(self, request: web.Request) -> web.StreamResponse:
        data = self.objects.get(request.match_info["name"])
        if data is None:
            raise web.HTTPNotFound()
        response = web.StreamResponse()
        await response.prepare(request)
        for start in range(0, len(data), self.CHUNK_BYTES):
            await response.write(data[start : start + self.CHUNK_BYTES])
        await response.write_eof()
        return response

    async def _put(self, request: web.Request) -> web.Response:
        self.puts += 1
        body = await request.read()
        if self.puts <= self.put_failures:
            return web.Response(status=503)
        self.objects[request.match_info["name"]] = body
        return web.Response(status=200)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


@pytest.fixture
def store() -> Iterator[ObjectStore]:
    store = ObjectStore(put_failures=1)
    yield store
    store.close()


def run_batch_command(model_dir: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable, "-m", "pagedserve.frontend.cli", "run-batch",
            "--model", str(model_dir), *KV_CACHE_FLAGS, *flags,
        ],
        capture_output=True, text=True, timeout=BATCH_TIMEOUT_S,
    )  # fmt: skip


def test_the_input_is_read_from_a_url_and_the_answers_put_to_one(store, server_model_dir, tmp_path):
    lines = [
        request_line(f"q{i}", "/v1/completions", {"prompt": "ab" * i, "max_tokens": 3})
        for i in range(1, 8)
    ]
    store.objects["in.jsonl"] = "".join(line + "\n" for line in lines).encode()
    result = run_batch_command(
        server_model_dir, "-i", store.url("in.jsonl"), "-o", store.url("out.jsonl"),
        "--output-tmp-dir", str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in store.objects["out.jsonl"].splitlines()]
    assert [r["custom_id"] for r in records] == [f"q{i}" for i in range(1, 8)]
    assert all(r["response"]["status_code"] == 200 for r in records)
    # The first PUT was refused and tried again; the local copy is gone once uploaded.
    assert store.puts == 2
    assert "PUT answered 503" in result.stderr and "trying again" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_an_input_url_that_cannot_be_read_exits_2(store, server_model_dir):
    result = run_batch_command(server_model_dir, "-i", store.url("missing.jsonl"), "-o", "-")
    assert result.returncode == 2
    assert "cannot read the input" in result.stderr and "GET answered 404" in result.stderr


def test_a_failed_upload_keeps_the_answers_and_says_where(server_model_dir, tmp_path):
    store = ObjectStore(put_failures=1000)
    try:
        store.objects["in.jsonl"] = (request_line("a", "/v1/completions", {"prompt": "x"})).encode()
        result = run_batch_command(
            server_model_dir, "-i", store.url("in.jsonl"), "-o", store.url("out.jsonl"),
            "--output-tmp-dir", str(tmp_path),
        )  # fmt: skip
    finally:
        store.close()
    assert result.returncode == 1
    (kept,) = tmp_path.iterdir()
    assert f"they are kept in {kept}" in result.stderr
    (record,) = [json.loads(line) for line in kept.read_text().splitlines()]
    assert record["custom_id"] == "a" and record["response"]["status_code"] == 200


def test_url_lines_are_split_across_chunks_and_a_long_one_skipped():
    store = ObjectStore()
    store.objects["in"] = b"first\n" + b"x" * 40 + b"\nthird\n\n" + b"y" * 40 + b"\nlast"

    async def read_all() -> list:
        return await every_line(await UrlLines.open(store.url("in"), max_bytes=16))

    try:
        got = asyncio.run(read_all())
    finally:
        store.close()
    assert got == [b"first\n", TOO_LONG, b"third\n", b"\n", TOO_LONG, b"last"]
