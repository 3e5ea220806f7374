"""``pagedserve run-batch``: a file of OpenAI batch requests, run on the engine with no
server in front (vLLM's ``run-batch``; OpenAI's Batch API file format).

The input is JSON Lines, one request per line (blank lines are skipped)::

    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

``url`` is ``/v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``,
``/v1/responses``, ``/v1/score``, ``/v1/rerank`` or ``/v1/classify`` and ``body`` what the
HTTP API takes there
(``openai_calls.py`` answers both, so a line reads exactly as the same body POSTed to
``pagedserve serve``), except ``"stream": true``.
``custom_id`` is the caller's name for the line, unique in the file.

The output has one line per input line, in the input's order (written as soon as every
line before it is done, so a long batch's output grows as it runs)::

    {"id": "batch_req_...", "custom_id": "q1",
     "response": {"status_code": 200, "request_id": "req_...", "body": {...}}, "error": null}

As in OpenAI's batch output, a request the API answers with an error keeps it in
``response`` (the HTTP status, and OpenAI's error body naming the field, the value and
the limit); a line that is no request at all (not JSON, a field missing or of the wrong
type, a ``custom_id`` already used) has ``"response": null`` and ``"error": {"code":
"invalid_request_line", "message": "line N: ..."}``.

Either end may be a local file, ``-`` (standard input or output) or an http(s) URL
(``batch_files.py``: the input streamed from a GET, the output PUT once the batch ends).

Lines run concurrently, up to ``max_lines_in_flight`` at once (default twice the engine's
``max_num_seqs``: enough to keep every batch full, while the file is read as it goes).
SIGTERM or SIGINT stops reading: the lines in flight finish and are written, then the
process exits 1 (the output then answers the input's first lines); a second signal ends
those lines too (each answered 503). The process exits 0 once every line is answered,
whatever their statuses; 1 if the engine failed or died, or the batch was stopped; 2 if
the files cannot be opened.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any

from pagedserve.frontend.batch_files import (
    MAX_LINE_BYTES,
    TOO_LONG,
    BatchFileError,
    FileLines,
    Output,
    UrlLines,
    open_input,
    open_output,
)
from pagedserve.frontend.call_errors import HTTP_STATUS, CallError, ServerDrainingError
from pagedserve.frontend.http_server import error_body
from pagedserve.frontend.openai_calls import OpenAiCalls
from pagedserve.frontend.server import Server, ServerConfig

if TYPE_CHECKING:
    from collections.abc import Callable

    from pagedserve.frontend.llm import LLM

logger = logging.getLogger("pagedserve.batch")

# The routes a line may name -> the kind of call (openai_calls.py).
ROUTES = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completion",
    "/v1/embeddings": "embedding",
    "/v1/responses": "response",
    "/v1/score": "score",
    "/v1/rerank": "rerank",
    "/v1/classify": "classify",
    # vLLM's batch runner takes any URL ending in /score or /rerank; these are the
    # server's other routes to them.
    "/score": "score",
    "/rerank": "rerank",
    "/v2/rerank": "rerank",
    "/classify": "classify",
}
INVALID_LINE_CODE = "invalid_request_line"


@dataclass(frozen=True)
class BatchConfig:
    input_path: str  # "-": standard input; http(s)://: GET (batch_files.py)
    output_path: str  # "-": standard output; http(s)://: PUT once the batch ends
    # Lines running at once, at most; None: twice the engine's max_num_seqs.
    max_lines_in_flight: int | None = None
    show_progress: bool = True  # a tqdm bar on stderr, drawn only on a terminal
    # Where an output URL's answers are written before the upload (None: the system's).
    output_tmp_dir: str | None = None

    def __post_init__(self) -> None:
        if self.max_lines_in_flight is not None and self.max_lines_in_flight < 1:
            raise ValueError(f"max_lines_in_flight must be >= 1, got {self.max_lines_in_flight}")


@dataclass(frozen=True)
class BatchLine:
    """A request line, read and checked: ``kind`` is a value of ``ROUTES``."""

    line_number: int  # 1-based, counting blank lines
    custom_id: str
    kind: str
    body: Any


class InvalidLine(ValueError):
    """A line that is no request; its message names the line and what is wrong."""

    def __init__(self, message: str, custom_id: str | None = None) -> None:
        super().__init__(message)
        self.custom_id = custom_id


def parse_line(line_number: int, raw: bytes, seen: dict[str, int]) -> BatchLine:
    """The request on one input line (``InvalidLine`` if it is none); ``seen`` maps the
    custom ids read so far to their lines, and gains this one's."""
    where = f"line {line_number}"
    try:
        text = raw.decode("utf-8")  # JSON Lines is UTF-8 (json.loads would guess UTF-16 too)
    except UnicodeDecodeError as error:
        raise InvalidLine(f"{where}: not UTF-8: {error}") from None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as error:
        raise InvalidLine(f"{where}: not valid JSON: {error.msg} (column {error.colno})") from None
    if not isinstance(record, dict):
        raise InvalidLine(f"{where}: must be a JSON object, got {_json_type(record)}")
    custom_id = record.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise InvalidLine(f"{where}: custom_id must be a non-empty string, got {custom_id!r:.100}")
    method = record.get("method")
    if method != "POST":
        raise InvalidLine(f"{where}: method must be 'POST', got {method!r:.100}", custom_id)
    url = record.get("url")
    if not isinstance(url, str) or url not in ROUTES:
        raise InvalidLine(
            f"{where}: url must be one of {', '.join(ROUTES)}, got {url!r:.100}", custom_id
        )
    body = record.get("body")
    if not isinstance(body, dict):
        raise InvalidLine(
            f"{where}: body must be a JSON object (the request {url} takes), got "
            f"{_json_type(body)}",
            custom_id,
        )
    if custom_id in seen:
        # The output is matched to the input by custom_id: it must name one line.
        raise InvalidLine(
            f"{where}: custom_id {custom_id!r:.100} is line {seen[custom_id]}'s already",
            custom_id,
        )
    seen[custom_id] = line_number
    return BatchLine(line_number, custom_id, ROUTES[url], body)


def _json_type(value: Any) -> str:
    """A decoded JSON value's type, as JSON names it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return f"a number ({value!r:.50})"
    if isinstance(value, str):
        return f"a string ({value!r:.50})"
    return "an array" if isinstance(value, list) else "an object"


def _record(custom_id: str | None, response: dict | None, error: dict | None) -> dict:
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": response,
        "error": error,
    }


def answered(custom_id: str, status_code: int, body: dict) -> dict:
    """The output line of a request the API answered (an error body for status >= 400)."""
    response = {"status_code": status_code, "request_id": f"req_{uuid.uuid4().hex}", "body": body}
    return _record(custom_id, response, None)


def invalid(error: InvalidLine) -> dict:
    """The output line of a line that is no request."""
    return _record(error.custom_id, None, {"code": INVALID_LINE_CODE, "message": str(error)})


class OrderedWriter:
    """Output lines in the input's order: each is held until those before it are written,
    so what is on disk is always the answers to a prefix of the input."""

    def __init__(self, file: IO[str]) -> None:
        self._file = file
        self._next = 0
        self._held: dict[int, dict] = {}
        self.written = 0

    def add(self, index: int, record: dict) -> None:
        self._held[index] = record
        lines = []
        while self._next in self._held:
            lines.append(json.dumps(self._held.pop(self._next), ensure_ascii=False) + "\n")
            self._next += 1
        if lines:
            self._file.write("".join(lines))
            self._file.flush()  # readers (tail -f, a pipe) see each answer once it is there
            self.written += len(lines)


@dataclass
class BatchSummary:
    lines: int = 0
    statuses: Counter | None = None  # status code -> lines; 0 for invalid lines
    prompt_tokens: int = 0
    output_tokens: int = 0
    stopped_early: bool = False

    def __post_init__(self) -> None:
        if self.statuses is None:
            self.statuses = Counter()

    def count(self, record: dict) -> None:
        self.lines += 1
        response = record["response"]
        if response is None:
            self.statuses[0] += 1
            return
        self.statuses[response["status_code"]] += 1
        usage = response["body"].get("usage") or {}
        self.prompt_tokens += usage.get("prompt_tokens", 0)
        self.output_tokens += usage.get("completion_tokens", 0)


class BatchRunner:
    """Runs one batch on a serving ``Server`` (its engine started)."""

    def __init__(self, server: Server, config: BatchConfig) -> None:
        self._server = server
        self._config = config
        self._calls = OpenAiCalls(server, "batch")

    async def run(self, lines: FileLines | UrlLines, output_file: IO[str]) -> BatchSummary:
        server = self._server
        llm = server.engine.llm
        limit = self._config.max_lines_in_flight or 2 * llm.scheduler_config.max_num_seqs
        slots = asyncio.Semaphore(limit)
        writer = OrderedWriter(output_file)
        summary = BatchSummary()
        progress = _Progress(self._config.show_progress)
        seen: dict[str, int] = {}
        tasks: set[asyncio.Task] = set()

        def finish(index: int, record: dict) -> None:
            writer.add(index, record)
            summary.count(record)
            progress.update()

        async def run_line(index: int, line: BatchLine) -> None:
            try:
                finish(index, await self._answer(line))
            finally:
                slots.release()

        index = 0
        line_number = 0
        try:
            while True:
                await slots.acquire()  # room for one more line in flight
                started = False
                try:
                    raw = await self._next_line(lines)
                    if raw is None:
                        break
                    line_number += 1
                    if raw is not TOO_LONG and not raw.strip():
                        continue
                    try:
                        if raw is TOO_LONG:
                            raise InvalidLine(
                                f"line {line_number}: longer than {MAX_LINE_BYTES} bytes"
                            )
                        line = parse_line(line_number, raw, seen)
                    except InvalidLine as error:
                        finish(index, invalid(error))
                        index += 1
                        continue
                    task = asyncio.ensure_future(run_line(index, line))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                    started = True
                    index += 1
                finally:
                    if not started:  # a running line frees its slot when it ends
                        slots.release()
            if tasks:
                await asyncio.gather(*tasks)
        finally:
            progress.close()
        summary.stopped_early = server.stop_requested.is_set()
        if summary.stopped_early:
            logger.warning(
                "stopped after %d lines of the input: the rest were not run", line_number
            )
        return summary

    async def _next_line(self, lines: FileLines | UrlLines) -> bytes | object | None:
        """The input's next line; None at its end, once the batch is told to stop (a
        signal, the engine died: also while a pipe says nothing for long), or when the
        input cannot be read (the batch then stops, the lines in flight finish)."""
        stop_requested = self._server.stop_requested
        if stop_requested.is_set():
            return None
        read = asyncio.ensure_future(lines.next_line())
        stop = asyncio.ensure_future(stop_requested.wait())
        try:
            await asyncio.wait((read, stop), return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if not read.done() or stop_requested.is_set():
            read.cancel()
            return None
        try:
            return read.result()
        except (BatchFileError, OSError) as error:
            logger.error("reading the input failed: %s", error)
            stop_requested.set()
            return None

    async def _answer(self, line: BatchLine) -> dict:
        """The output line of a request line: the API's answer or its error."""
        calls = self._calls
        try:
            async with self._server.call("batch"):
                if line.kind == "embedding":
                    body = await calls.embedding(line.body, line.custom_id)
                elif line.kind == "response":
                    body = await calls.response(line.body, line.custom_id)
                elif line.kind in ("score", "rerank"):
                    body = await calls.score(line.kind, line.body, line.custom_id)
                elif line.kind == "classify":
                    body = await calls.classification(line.body, line.custom_id)
                else:
                    body = await calls.generation(line.kind, line.body, line.custom_id)
        except CallError as error:
            return answered(line.custom_id, HTTP_STATUS[error.code], error_body(error))
        except Exception as error:  # a fault of ours: this line fails, the batch goes on
            logger.exception("line %d (custom_id %r) failed", line.line_number, line.custom_id)
            failure = CallError(
                "INTERNAL", f"internal server error ({type(error).__name__}: {error})"
            )
            return answered(line.custom_id, 500, error_body(failure))
        return answered(line.custom_id, 200, body)


class _Progress:
    """Lines answered, and their rate, on stderr when it is a terminal (the total is not
    known while the input is read as it goes)."""

    def __init__(self, enabled: bool) -> None:
        self._bar = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(desc="Running batch", unit="req", dynamic_ncols=True, disable=None)

    def update(self) -> None:
        if self._bar is not None:
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


async def _run(
    make_llm: Callable[[], LLM], server_config: ServerConfig, config: BatchConfig
) -> int:
    # Both ends are opened before the model loads: a wrong path fails at once.
    try:
        lines = await open_input(config.input_path)
    except BatchFileError as error:
        logger.error("%s", error)
        return 2
    try:
        try:
            output = open_output(config.output_path, config.output_tmp_dir)
        except BatchFileError as error:
            logger.error("%s", error)
            return 2
        code, ran = await _run_on_engine(make_llm, server_config, config, lines, output)
    finally:
        await lines.close()
    if not ran:  # the engine never started: there is nothing to deliver
        output.discard()
        return code
    try:
        await output.finish()
    except BatchFileError as error:
        logger.error("%s", error)
        return 1
    return code


async def _run_on_engine(
    make_llm, server_config, config, lines: FileLines | UrlLines, output: Output
) -> tuple[int, bool]:
    """The exit code, and whether the batch ran (the engine started)."""
    server = Server(make_llm, server_config)
    runner = BatchRunner(server, config)
    loop = asyncio.get_running_loop()
    signals = 0

    def on_signal(signal_number: int) -> None:
        nonlocal signals
        signals += 1
        name = signal.Signals(signal_number).name
        server.stop_requested.set()
        if signals == 1:
            logger.info("%s: reading no more lines; the lines in flight finish", name)
        else:
            logger.info("%s again: ending the lines in flight now", name)
            server.engine.fail_all(ServerDrainingError(f"the batch was stopped ({name})"))

    for signal_number in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signal_number, on_signal, signal_number)
    try:
        started_s = time.monotonic()
        try:
            llm = await server.start_engine()
        except Exception as error:
            logger.error("engine start-up failed: %s", error)
            return (2 if isinstance(error, (ValueError, TypeError)) else 1), False
        logger.info(
            "engine ready in %.1f s (%s); running %s",
            time.monotonic() - started_s,
            llm.model_path,
            "standard input" if config.input_path == "-" else config.input_path,
        )
        if server_config.metrics_port is not None:
            server.metrics.attach_engine(server.engine.stats, loop)
            port = server.metrics.serve(server_config.host, server_config.metrics_port)
            logger.info("metrics on http://%s:%d/metrics", server_config.host, port)
        started_s = time.monotonic()
        summary = await runner.run(lines, output.file)
        _log_summary(summary, time.monotonic() - started_s)
        if server.engine.dead_message is not None:
            logger.error("the engine died: %s", server.engine.dead_message)
            return 1, True
        if not summary.stopped_early and not await _blocks_all_free(server):
            return 1, True
        return (1 if summary.stopped_early else 0), True
    finally:
        for signal_number in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signal_number)
        await server.engine.shutdown()
        server.metrics.close()


async def _blocks_all_free(server: Server, timeout_s: float = 5.0) -> bool:
    """Whether, with every line answered, the engine holds no request and every KV block
    is free, its block accounting consistent (logged either way: a batch job's own check
    of the engine, as the tests check it after each test)."""
    deadline_s = time.monotonic() + timeout_s
    while True:
        stats = await server.engine.stats()
        counts = stats.stats
        settled = (
            counts["num_running"] == counts["num_waiting"] == counts["num_swapped"] == 0
            and counts["num_free_blocks"] == counts["num_total_blocks"]
            and counts["num_free_host_blocks"] == counts["num_total_host_blocks"]
        )
        if stats.integrity_error is not None:
            logger.error("the engine's block accounting is broken: %s", stats.integrity_error)
            return False
        if settled:
            logger.info(
                "KV cache: all %d blocks free, block accounting consistent",
                counts["num_total_blocks"],
            )
            return True
        if time.monotonic() > deadline_s:
            logger.error("with every line answered, the engine still holds blocks: %s", counts)
            return False
        await asyncio.sleep(0.05)


def _log_summary(summary: BatchSummary, elapsed_s: float) -> None:
    by_status = ", ".join(
        f"{count} invalid" if status == 0 else f"{count} answered {status}"
        for status, count in sorted(summary.statuses.items(), key=lambda item: item[0] or 1000)
    )
    logger.info(
        "batch done: %d lines in %.1f s (%s); %d prompt tokens, %d output tokens (%.1f output "
        "tokens/s)",
        summary.lines,
        elapsed_s,
        by_status or "none",
        summary.prompt_tokens,
        summary.output_tokens,
        summary.output_tokens / max(elapsed_s, 1e-9),
    )


def run_batch(make_llm: Callable[[], LLM], server_config: ServerConfig, config: BatchConfig) -> int:
    """Run the batch (on uvloop where it is installed); returns the exit code."""
    try:
        import uvloop
    except ImportError:  # not on this platform
        return asyncio.run(_run(make_llm, server_config, config))
    return uvloop.run(_run(make_llm, server_config, config))
