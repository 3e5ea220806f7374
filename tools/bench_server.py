"""What the server's frontends cost: ``pagedserve serve`` under load against the offline API.

Starts a real server (``python -m pagedserve.frontend.cli serve --port 0``, and
``--http-port 0`` when the HTTP API is benchmarked) and sends it a synthetic trace
(tools/traces.py: random prompt token ids, fixed output lengths with EOS ignored, greedy),
all at once or as Poisson arrivals (``--request-rate``), 127.0.0.1 only, over the API that
``--api`` names:

- ``grpc`` (the default): ``GenerateStream`` calls, a grpc.aio client on one channel. Every
  request must end with exactly one message with ``finished`` set, as its last, carrying
  exactly its output length (token ids and usage, finish reason LENGTH).
- ``http``: the OpenAI-compatible API, ``POST /v1/completions`` streamed as server-sent
  events, the same prompts as token ids, with ``stream_options.include_usage``; an aiohttp
  client with a connection per call in flight (HTTP/1.1 carries one call at a time), opened
  before the clock starts. Every request must end with exactly one chunk with a
  ``finish_reason`` ("length"), then a usage chunk with exactly its output length, then
  ``data: [DONE]``. Its chunks carry text, not token ids: the usage chunk counts its tokens,
  and its text is what is compared with the offline run's.
- ``both``: every repeat over each, on the same server, the first of the two alternating
  between repeats so that the machine's drift weighs on both alike.

Per request it measures the time to first token (TTFT; over HTTP, the first chunk of the
choice, which leaves with the first token even when the detokenizer still holds its text
back), the time per output token after the first (TPOT: (latency - TTFT) / (tokens - 1))
and the end-to-end latency (to the last message; over HTTP, ``[DONE]``); over the run,
output tokens/s and requests/s. Anything else than the ending above is counted by kind,
failed calls by status (gRPC's code; over HTTP ``HTTP <status>``, or the exception's name
when the connection failed). After each server run ``GetStats`` (over gRPC, whichever API
carried the calls) must show no integrity error and every KV block free.

The peer, in the same run on the same trace and engine settings (the server's block count
included): ``LLM(model, multiprocess=True).generate`` on the same prompts, the same
scheduler and worker processes with no server and no asyncio. The ratio of output tokens/s,
server over offline, is what the frontend costs: for gRPC protobuf and gRPC's core, for
HTTP JSON, server-sent events and aiohttp; for both the event loop, the engine thread, one
message per request and engine step, and this client, which shares the cores. With
``--api both``, http over grpc compares the two frontends on one server in one run. The
offline peer always gets every request at once, so the ratios over it mean that only with
the default ``--request-rate inf``; at a finite rate the offline figure is the capacity.

Server and offline runs alternate ``--repeats`` times, after a warm-up of each (of each API
benchmarked; oneDNN builds kernels for new shapes in the first steps); medians are reported.
Each run on the server uses a cache namespace of its own, so prefix caching (on unless
``--no-prefix-caching``) never serves a prompt from an earlier run or from the other API.
Each server run and each offline run is cut off at ``--timeout-s``: requests still open are
cancelled and counted. The first run with a problem ends the repeats. Machines are shared
and noisy: read the ratio within one run.

With ``--target-url URL`` it starts nothing and replays the trace over HTTP (``--api http``,
the only API it takes there) against a server already running at URL: pagedserve, or any
OpenAI-compatible server that takes token-id prompts and vLLM's ``ignore_eos`` (vLLM,
SGLang); a load generator for operators, and a way to measure a peer on the same trace.
``--model-name`` is the ``model`` sent (default: the first of the target's
``GET /v1/models``), ``--vocab-size`` the vocabulary the prompts' ids are drawn from
(default: the entry's ``vocab_size``, which pagedserve reports and vLLM and SGLang do not:
give it for those), and the entry's ``max_model_len``, where it has one, bounds
``--max-len``. There is no offline peer and no ``GetStats`` check (the target's engine
is not this tool's to see: the JSON says ``"offline": null`` and has no ratio over it), but
every call is checked as above, which is what makes a peer's figure comparable: exactly one
chunk with a finish reason ("length"), a usage chunk with the trace's output length, then
``[DONE]``. The target outlives this run, so each run's ``cache_salt`` (vLLM's name for the
cache namespace) and request ids start with an id of this invocation of its own: an earlier
invocation's prompts in the target's prefix cache never serve this one's. A target that
ignores ``cache_salt`` serves every repeat after the first from its prefix cache: turn
prefix caching off there, or keep to ``--repeats 1``. ``transformers serve`` takes neither
token ids nor ``ignore_eos``: tools/bench_transformers_serve.py starts it beside pagedserve
and sends both the same text prompts with this client.

Example (from the repository root), on the tests' tiny Llama (no tokenizer needed: prompts
are token ids); about a minute on 2 cores:

    .venv/bin/python -c "import sys; sys.path.insert(0, 'tests'); \\
        from helpers.tiny_models import make_tiny_model; from pathlib import Path; \\
        make_tiny_model('llama', Path('/tmp/tiny-llama'))"
    .venv/bin/python tools/bench_server.py --model /tmp/tiny-llama --num-requests 128 \\
        --length-scale 0.25 --max-len 256

The same over both APIs, gRPC and HTTP figures side by side: add ``--api both``.

Without ``--model``, the embedded SmolLM2-135M-Instruct (slower: use small counts; on a
CPU without native bfloat16 (no AVX512-BF16 or AMX, as on this AMD EPYC), keep float32):

    .venv/bin/python tools/bench_server.py --num-requests 16 --length-scale 0.25 \\
        --max-len 256

Against a server already running (here ``pagedserve serve --http-port 8000``; for vLLM or
SGLang, their port, and ``--vocab-size`` of their model: 49152 for SmolLM2):

    .venv/bin/python tools/bench_server.py --target-url http://127.0.0.1:8000 \\
        --num-requests 16 --length-scale 0.25 --max-len 256

Exit status: 0 when every check held, 1 otherwise (the summary and the JSON say which).
"""

from __future__ import annotations

import abc
import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import random
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import aiohttp
import grpc
import numpy as np
from machine import cpu_model
from traces import TRACE_SHAPES, Request, make_trace, trace_stats

from pagedserve.frontend import LLM, SamplingParams, grpc_enums
from pagedserve.scheduler.child_process import die_with_parent
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc

# Token ids below this are special in the embedded model (unk=0, bos=1, eos=2).
FIRST_ORDINARY_TOKEN_ID = 3
# A fixed cache (the engine's default is a share of the memory free when it starts, which
# the second engine to start would see smaller); the offline peer takes the server's count.
DEFAULT_KV_CACHE_BYTES = 1 << 30
# The server drains on SIGTERM; no call is in flight by then, so this is a bound, not a wait.
SERVER_DRAIN_TIMEOUT_S = 10.0
# After the drain the server stops its engine processes; past this, it is killed.
SERVER_EXIT_MARGIN_S = 30.0
# Cancelled calls end at once; this bounds the wait for their tasks to notice.
CANCEL_GRACE_S = 5.0
UNARY_TIMEOUT_S = 30.0
PORT_FILE_POLL_S = 0.05
STATS_POLL_S = 0.1
SERVER_LOG_TAIL_LINES = 40
# Requests carry prompts of a model's whole context; the server allows this much too.
MAX_MESSAGE_BYTES = 64 << 20
PERCENTILES = (50, 90, 99)
MAX_PROBLEM_EXAMPLES = 8
# What starts each server-sent event of /v1/completions (JSON, or [DONE] at the end).
SSE_DATA = b"data: "
# --api: the APIs each repeat runs over, in the order of the even repeats (odd ones reverse it).
API_CHOICES = {"grpc": ("grpc",), "http": ("http",), "both": ("grpc", "http")}
# The prefix of each API's keys in the record: the gRPC API's keep the names they had before
# the HTTP API was benchmarked ("server_tok_s_median", "server_runs"...).
RECORD_PREFIXES = {"grpc": "server", "http": "http"}
# What configures the server this tool starts: with --target-url, which starts none, these
# would do nothing, so they are refused there unless left at their defaults.
STARTED_SERVER_OPTIONS = (
    "model",
    "dtype",
    "block_size",
    "max_num_seqs",
    "max_model_len",
    "max_num_batched_tokens",
    "kv_cache_bytes",
    "no_prefix_caching",
    "stream_interval",
    "server_log",
    "startup_timeout_s",
)

T = TypeVar("T")


class Terminated(KeyboardInterrupt):
    """SIGTERM, handled as Ctrl-C is: what was measured is reported, the server stopped."""


def _on_sigterm(signal_number: int, frame: object) -> None:
    # KeyboardInterrupt's kind: an event loop lets it through rather than log it.
    raise Terminated("SIGTERM")


# ---------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class EngineSettings:
    """What both engines get: the server as its command-line flags, the peer as ``LLM``
    arguments, from this one place so they cannot drift apart."""

    model: str | None
    dtype: str
    block_size: int
    max_num_seqs: int
    max_model_len: int | None
    max_num_batched_tokens: int | None
    kv_cache_bytes: int
    enable_prefix_caching: bool

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineSettings:
        """The settings ``add_engine_arguments``' flags gave."""
        return cls(
            model=args.model,
            dtype=args.dtype,
            block_size=args.block_size,
            max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len,
            max_num_batched_tokens=args.max_num_batched_tokens,
            kv_cache_bytes=args.kv_cache_bytes,
            enable_prefix_caching=not args.no_prefix_caching,
        )

    def server_flags(self) -> list[str]:
        flags = [] if self.model is None else ["--model", self.model]
        flags += ["--dtype", self.dtype, "--block-size", str(self.block_size)]
        flags += ["--max-num-seqs", str(self.max_num_seqs)]
        flags += ["--kv-cache-bytes", str(self.kv_cache_bytes)]
        if self.max_model_len is not None:
            flags += ["--max-model-len", str(self.max_model_len)]
        if self.max_num_batched_tokens is not None:
            flags += ["--max-num-batched-tokens", str(self.max_num_batched_tokens)]
        if not self.enable_prefix_caching:
            flags.append("--no-prefix-caching")
        return flags

    def offline_llm(self, num_blocks: int) -> LLM:
        # num_blocks, not kv_cache_bytes: the block count the server got, exactly.
        return LLM(
            self.model,
            dtype=self.dtype,
            block_size=self.block_size,
            num_blocks=num_blocks,
            max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len,
            max_num_batched_tokens=self.max_num_batched_tokens,
            enable_prefix_caching=self.enable_prefix_caching,
            multiprocess=True,
        )


# ---------------------------------------------------------------------------- the server


@dataclass(frozen=True)
class Ports:
    """Where the server listens, as its port file says."""

    grpc: int
    http: int | None  # None: started without --http-port


class ServerProcess:
    """A server in a subprocess, logging to a file: ``start`` runs ``pagedserve serve`` and
    waits for its port file (another server: ``launch``, then wait as it tells); ``stop``
    sends SIGTERM and returns its exit status."""

    def __init__(self, argv: list[str], log_path: Path) -> None:
        self.argv = argv
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None
        self.exit_code: int | None = None
        self.stop_note = ""

    def launch(self) -> subprocess.Popen[bytes]:
        """Start the process, logging to ``log_path``; it is not serving yet."""
        parent_pid = os.getpid()
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                # Its own session: a Ctrl-C at the terminal reaches this process only, which
                # then stops the server in order (SIGTERM). If this process is killed
                # outright, the kernel kills the server too.
                start_new_session=True,
                preexec_fn=lambda: die_with_parent(parent_pid),
            )
        return self.process

    def check_alive(self) -> None:
        """Raise, with the log's tail, when the process has exited during start-up."""
        assert self.process is not None
        if self.process.poll() is not None:
            raise RuntimeError(
                f"the server exited during start-up with exit code "
                f"{self.process.returncode}\n{self.log_tail()}"
            )

    def start(self, port_file: Path, startup_timeout_s: float) -> Ports:
        """Start the server and wait for its port file (its ``--port-file``); its ports."""
        process = self.launch()
        deadline_s = time.monotonic() + startup_timeout_s
        while time.monotonic() < deadline_s:
            self.check_alive()
            with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
                # The server replaces the file whole (write, then rename): never half read.
                written = json.loads(port_file.read_text())
                if written["pid"] != process.pid:
                    raise RuntimeError(
                        f"port file {port_file} names pid {written['pid']}, the server "
                        f"is pid {process.pid}"
                    )
                return Ports(written["port"], written["http_port"])
            time.sleep(PORT_FILE_POLL_S)
        raise RuntimeError(
            f"no port file from the server within --startup-timeout-s={startup_timeout_s:g}"
            f"\n{self.log_tail()}"
        )

    def stop(self) -> int | None:
        """SIGTERM, then wait (bounded; SIGKILL past the bound). Idempotent."""
        process = self.process
        if process is None or self.exit_code is not None:
            return self.exit_code
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            wait_s = SERVER_DRAIN_TIMEOUT_S + SERVER_EXIT_MARGIN_S
            try:
                process.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=UNARY_TIMEOUT_S)
                self.stop_note = f"did not exit within {wait_s:g} s of SIGTERM; killed"
        else:
            self.stop_note = "had exited before it was told to stop"
        self.exit_code = process.returncode
        return self.exit_code

    def log_tail(self) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        tail = "\n".join(lines[-SERVER_LOG_TAIL_LINES:])
        return (
            f"--- last {SERVER_LOG_TAIL_LINES} lines of the server's log ({self.log_path}):\n{tail}"
        )


def serve_argv(
    engine: EngineSettings,
    port_file: Path,
    startup_timeout_s: float,
    num_requests: int,
    stream_interval: int,
    *,
    http: bool,
) -> list[str]:
    """``pagedserve serve`` on free ports (named in ``port_file``), its HTTP API too with
    ``http``, taking ``num_requests`` in flight at least."""
    argv = [
        sys.executable,
        "-m",
        "pagedserve.frontend.cli",
        "serve",
        *engine.server_flags(),
        "--port",
        "0",
        "--port-file",
        str(port_file),
        "--drain-timeout-s",
        str(SERVER_DRAIN_TIMEOUT_S),
        "--startup-timeout-s",
        str(startup_timeout_s),
        # The server refuses calls past this many in flight; none may be refused here.
        "--max-concurrent-requests",
        str(max(1024, num_requests)),
        "--stream-interval",
        str(stream_interval),
    ]
    return argv + ["--http-port", "0"] if http else argv


def run_async(coroutine: Coroutine[Any, Any, T]) -> T:
    """On uvloop, as the server runs: the client shares the cores, so its own cost counts
    against the server's figures and should be the least it can be."""
    try:
        import uvloop
    except ImportError:  # not on this platform
        return asyncio.run(coroutine)
    return uvloop.run(coroutine)


def _channel(port: int) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(
        f"127.0.0.1:{port}",
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ],
    )


async def model_info(port: int) -> pb.GetModelInfoResponse:
    async with _channel(port) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        return await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=UNARY_TIMEOUT_S)


def bearer_headers(api_key: str | None) -> dict[str, str]:
    """The HTTP headers that carry ``api_key`` (the target's --api-key), if any."""
    return {} if api_key is None else {"Authorization": f"Bearer {api_key}"}


async def target_model_card(
    base_url: str, model_name: str | None, api_key: str | None = None
) -> dict[str, Any]:
    """The target's ``GET /v1/models`` entry for ``model_name`` (None: its first)."""
    async with (
        aiohttp.ClientSession(
            base_url=base_url,
            timeout=aiohttp.ClientTimeout(total=UNARY_TIMEOUT_S),
            headers=bearer_headers(api_key),
        ) as session,
        session.get("/v1/models") as response,
    ):
        if response.status != 200:
            raise RuntimeError(
                f"GET {base_url}/v1/models answered HTTP {response.status}: "
                f"{(await response.text())[:200]}"
            )
        cards = (await response.json(content_type=None)).get("data") or []
    if not cards:
        raise RuntimeError(f"GET {base_url}/v1/models lists no model")
    if model_name is None:
        return cards[0]
    for card in cards:
        if card.get("id") == model_name:
            return card
    served = ", ".join(repr(card.get("id")) for card in cards)
    raise RuntimeError(f"--model-name {model_name!r} is not served at {base_url}: {served}")


# ---------------------------------------------------------------------------- requests


@dataclass
class CallResult(abc.ABC):
    """One streamed call as the client saw it, whichever API carried it (perf_counter
    seconds)."""

    expected_tokens: int
    sent_s: float | None = None
    first_token_s: float | None = None
    last_message_s: float | None = None
    num_tokens: int = 0
    num_messages: int = 0
    num_final_messages: int = 0
    message_after_final: bool = False
    usage_tokens: int | None = None
    # Set when --timeout-s passed with the call still open (or not yet sent).
    cut_off: bool = False
    # How the call failed: gRPC's status code's name; over HTTP "HTTP <status>" ("... in
    # the stream" for an error event after a 200), or aiohttp's exception's name when the
    # connection failed. "TIMEOUT" when --timeout-s cut it off, "NOT_SENT" when its arrival
    # lay past it, "CANCELLED_IN_CLIENT" when grpc.aio raised CancelledError in a call this
    # tool did not cancel.
    status: str | None = None

    def problem(self) -> str | None:
        """What is wrong with the call, or None when it is exactly what was asked."""
        if self.status is not None:
            return f"status {self.status}"
        if self.num_final_messages == 0:
            return "no final message"
        if self.num_final_messages > 1:
            return "several final messages"
        if self.message_after_final:
            return "messages after the final one"
        return self.output_problem()

    @abc.abstractmethod
    def output_problem(self) -> str | None:
        """What is wrong with a call that ended as it should, in the API's own terms."""


@dataclass
class StreamResult(CallResult):
    """One GenerateStream call."""

    finish_reason: int | None = None
    other_output_index: bool = False
    prompt_echo_ok: bool | None = None
    request_id_ok: bool = True
    token_ids: list[int] = field(default_factory=list)

    def output_problem(self) -> str | None:
        if self.num_tokens != self.expected_tokens:
            return "wrong token count"
        if self.usage_tokens != self.expected_tokens:
            return "wrong usage.completion_tokens"
        if self.finish_reason != pb.FINISH_REASON_LENGTH:
            return "finish reason not LENGTH"
        if self.other_output_index:
            return "output index other than 0"
        if not self.prompt_echo_ok:
            return "prompt_token_ids not echoed"
        if not self.request_id_ok:
            return "request_id not echoed"
        return None


@dataclass
class CompletionStreamResult(CallResult):
    """One streamed ``POST /v1/completions``: messages are its JSON chunks; the final one
    is the chunk with a ``finish_reason``, and what comes after it may be the usage chunk
    and ``[DONE]`` only. The chunks carry text, so ``num_tokens`` is the usage chunk's."""

    expected_prompt_tokens: int = 0  # usage.prompt_tokens must say this
    # False for a server whose streams end without [DONE] (transformers serve): the end of
    # the response body ends them.
    require_done: bool = True
    done: bool = False  # data: [DONE] came
    finish_reason: str | None = None
    other_choice_index: bool = False
    prompt_tokens_ok: bool | None = None  # usage.prompt_tokens against the prompt sent
    response_id: str | None = None  # the first chunk's id, which every chunk must carry
    response_id_ok: bool = True
    # Lines that are neither a data: event with a JSON object or [DONE], nor the blank
    # line that ends an event.
    unreadable_lines: int = 0
    text: str = ""

    def output_problem(self) -> str | None:
        if self.require_done and not self.done:
            return "no [DONE]"
        if self.usage_tokens is None:
            return "no usage chunk"
        if self.usage_tokens != self.expected_tokens:
            return "wrong usage.completion_tokens"
        if self.finish_reason != "length":
            return "finish reason not length"
        if self.other_choice_index:
            return "choice index other than 0"
        if not self.prompt_tokens_ok:
            return "usage.prompt_tokens not the prompt's length"
        if not self.response_id_ok:
            return "chunk ids differ"
        if self.unreadable_lines:
            return "unreadable lines"
        return None


def generate_request(
    index: int, request: Request, namespace: str, tag: str
) -> pb.GenerateStreamRequest:
    return pb.GenerateStreamRequest(
        request_id=f"{tag}-{index}",
        token_ids=pb.TokenIds(ids=request.prompt_token_ids),
        sampling=pb.SamplingParams(max_tokens=request.output_len, temperature=0.0, ignore_eos=True),
        cache_namespace=namespace,
    )


async def stream_one(
    stub: pb_grpc.GenerationServiceStub,
    message: pb.GenerateStreamRequest,
    expected_prompt: list[int],
    send_at_s: float,
    result: StreamResult,
) -> None:
    """Send at ``send_at_s`` and record what comes back into ``result`` (kept whole if
    the task is cancelled part way)."""
    await asyncio.sleep(max(0.0, send_at_s - time.perf_counter()))
    result.sent_s = time.perf_counter()
    call = stub.GenerateStream(message)
    try:
        async for response in call:
            now_s = time.perf_counter()
            result.num_messages += 1
            result.last_message_s = now_s
            if result.num_final_messages:
                result.message_after_final = True
            if response.request_id != message.request_id:
                result.request_id_ok = False
            if result.prompt_echo_ok is None:
                # The first message carries the prompt as the model saw it.
                result.prompt_echo_ok = list(response.prompt_token_ids) == expected_prompt
            for output in response.outputs:
                if output.index != 0:
                    result.other_output_index = True
                if output.token_ids and result.first_token_s is None:
                    result.first_token_s = now_s
                result.num_tokens += len(output.token_ids)
                result.token_ids.extend(output.token_ids)
                if output.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                    result.finish_reason = output.finish_reason
            if response.finished:
                result.num_final_messages += 1
                result.usage_tokens = response.usage.completion_tokens
    except grpc.aio.AioRpcError as error:
        result.status = error.code().name
    except asyncio.CancelledError:
        call.cancel()  # ends the request in the engine, which frees its blocks
        if result.cut_off:
            result.status = "TIMEOUT"
            raise
        result.status = "CANCELLED_IN_CLIENT"


def completion_body(request: Request, namespace: str, model: str | None) -> dict[str, Any]:
    """What ``generate_request`` asks over gRPC, as ``POST /v1/completions`` asks it;
    ``model`` None sends none, which a started server (it serves one) takes as its own."""
    body: dict[str, Any] = {
        "prompt": request.prompt_token_ids,
        "max_tokens": request.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        # A last chunk with the usage: the only token count a completion stream carries.
        "stream_options": {"include_usage": True},
        "cache_salt": namespace,  # the server's cache namespace, as vLLM names it
    }
    if model is not None:
        body["model"] = model
    return body


async def complete_one(
    session: aiohttp.ClientSession,
    body: dict[str, Any],
    request_id: str,
    send_at_s: float,
    result: CompletionStreamResult,
) -> None:
    """Send at ``send_at_s`` and record the events that come back into ``result`` (kept
    whole if the task is cancelled part way)."""
    await asyncio.sleep(max(0.0, send_at_s - time.perf_counter()))
    result.sent_s = time.perf_counter()
    try:
        async with session.post(
            "/v1/completions", json=body, headers={"X-Request-Id": request_id}
        ) as response:
            if response.status != 200:
                result.status = f"HTTP {response.status}"
                return
            async for line in response.content:
                now_s = time.perf_counter()
                event = line.strip()
                if not event:
                    continue  # the blank line that ends an event
                result.last_message_s = now_s
                if result.done:
                    result.message_after_final = True
                if not event.startswith(SSE_DATA):
                    result.unreadable_lines += 1
                    continue
                data = event[len(SSE_DATA) :]
                if data == b"[DONE]":
                    result.done = True
                    continue
                try:
                    chunk = json.loads(data)
                except json.JSONDecodeError:
                    chunk = None
                if not isinstance(chunk, dict):
                    result.unreadable_lines += 1
                    continue
                result.num_messages += 1
                failure = chunk.get("error")
                if failure is not None:
                    # A stream that failed once it had begun: the status was 200 by then.
                    # pagedserve's error is an object with a code, transformers serve's text.
                    code = failure.get("code") if isinstance(failure, dict) else "error"
                    result.status = f"HTTP {code} in the stream"
                    continue
                if result.response_id is None:
                    result.response_id = chunk.get("id")
                elif chunk.get("id") != result.response_id:
                    result.response_id_ok = False
                for choice in chunk.get("choices", ()):
                    if result.num_final_messages:
                        result.message_after_final = True
                    if choice.get("index") != 0:
                        result.other_choice_index = True
                    if result.first_token_s is None:
                        # The choice's first chunk leaves with the engine's first token, its
                        # text empty when the detokenizer holds it back (part of a character)
                        # or the model has no tokenizer: gRPC's first token, as near as HTTP
                        # shows it.
                        result.first_token_s = now_s
                    result.text += choice.get("text") or ""
                    if choice.get("finish_reason") is not None:
                        result.num_final_messages += 1
                        result.finish_reason = choice["finish_reason"]
                usage = chunk.get("usage")
                if usage is not None:
                    result.usage_tokens = usage.get("completion_tokens")
                    result.num_tokens = result.usage_tokens or 0
                    prompt_tokens = usage.get("prompt_tokens")
                    result.prompt_tokens_ok = prompt_tokens == result.expected_prompt_tokens
    except aiohttp.ClientError as error:
        result.status = type(error).__name__
    except asyncio.CancelledError:
        # Only --timeout-s cancels a call. Leaving the response unread closes its connection
        # (aiohttp reuses none part way through a body), which ends the request in the
        # engine, as a client that goes away does; that frees its blocks.
        result.status = "TIMEOUT"
        raise


async def open_connections(session: aiohttp.ClientSession, count: int) -> None:
    """Fill the session's pool with ``count`` connections, by as many concurrent
    ``GET /health``: HTTP/1.1 carries one call at a time on a connection, so a run needs one
    per call in flight; made here, before the clock starts, their set-up counts in no call's
    time (as the gRPC channel's does not). The pool closes those idle for 15 s (aiohttp's
    keep-alive, well before the server's): at a finite rate a call may then open its own."""

    async def health() -> None:
        async with session.get("/health") as response:
            response.raise_for_status()

    await asyncio.wait_for(asyncio.gather(*(health() for _ in range(count))), UNARY_TIMEOUT_S)


@dataclass
class Latencies:
    """Per-request figures of one run, milliseconds, over the requests that completed."""

    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    e2e_ms: dict[str, float]


def _summary(values_ms: list[float]) -> dict[str, float]:
    if not values_ms:
        return {}
    summary = {"mean": float(np.mean(values_ms))}
    summary.update({f"p{p}": float(np.percentile(values_ms, p)) for p in PERCENTILES})
    return summary


def latencies(results: Sequence[CallResult]) -> Latencies:
    ttft_ms, tpot_ms, e2e_ms = [], [], []
    for result in results:
        if result.problem() is not None:
            continue
        assert result.sent_s is not None and result.last_message_s is not None
        assert result.first_token_s is not None
        ttft_s = result.first_token_s - result.sent_s
        e2e_s = result.last_message_s - result.sent_s
        ttft_ms.append(ttft_s * 1e3)
        e2e_ms.append(e2e_s * 1e3)
        if result.num_tokens > 1:
            tpot_ms.append((e2e_s - ttft_s) / (result.num_tokens - 1) * 1e3)
    return Latencies(_summary(ttft_ms), _summary(tpot_ms), _summary(e2e_ms))


# ---------------------------------------------------------------------------- runs


@dataclass
class CpuUse:
    """Cores in use over a run, on average: this process's (the client's, or the offline
    engine's frontend), and the whole machine's (``/proc/stat``: every process, the
    server's and the engine's included; None where there is no such file)."""

    this_process_cores: float
    machine_cores: float | None


class CpuClock:
    """Started at a run's start; ``use()`` at its end."""

    def __init__(self) -> None:
        self._wall_s = time.perf_counter()
        self._process_s = time.process_time()
        self._machine_s = _machine_busy_s()

    def use(self) -> CpuUse:
        wall_s = max(time.perf_counter() - self._wall_s, 1e-9)
        machine_s = _machine_busy_s()
        return CpuUse(
            (time.process_time() - self._process_s) / wall_s,
            None
            if machine_s is None or self._machine_s is None
            else (machine_s - self._machine_s) / wall_s,
        )


def _machine_busy_s() -> float | None:
    """CPU seconds every core has spent busy since boot (not idle, not waiting on I/O)."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    ticks = [int(value) for value in fields]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")


@dataclass
class ServerRun:
    """One run of the trace on a server: one this tool started, or the --target-url's."""

    num_requests: int
    output_tokens: int  # received, over every call
    seconds: float  # first send to last message received
    problems: dict[str, int]  # kind -> requests; empty when all is well
    latencies: Latencies
    # GetStats after the run; None on a --target-url, whose engine this tool cannot see.
    stats: dict[str, Any] | None
    stats_problems: list[str]
    # The first few requests with a problem, as the client saw them (seconds from the start).
    problem_examples: list[dict[str, Any]] = field(default_factory=list)
    # Each request's output: token ids over gRPC, text over HTTP (its chunks carry no ids).
    output_token_ids: list[list[int]] = field(repr=False, default_factory=list)
    output_texts: list[str] = field(repr=False, default_factory=list)
    cpu: CpuUse | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.seconds if self.seconds > 0 else 0.0

    @property
    def ok(self) -> bool:
        return not self.problems and not self.stats_problems


def stats_record(stats: pb.GetStatsResponse) -> dict[str, Any]:
    return {
        "engine": dict(stats.engine),
        "requests_running": stats.requests_running,
        "requests_finished": stats.requests_finished,
        "requests_failed": stats.requests_failed,
        "requests_cancelled": stats.requests_cancelled,
        "integrity_error": stats.integrity_error,
    }


def block_problems(engine: dict[str, float], integrity_error: str) -> list[str]:
    """What the engine's counters say is wrong once no request is open."""
    problems = []
    if integrity_error:
        problems.append(f"integrity error: {integrity_error}")
    free, total = engine.get("num_free_blocks"), engine.get("num_total_blocks")
    if free is None or total is None or free != total:
        problems.append(f"KV blocks not all free: {free} of {total}")
    for name in ("num_running", "num_waiting", "num_swapped"):
        if engine.get(name, 0):
            problems.append(f"{name} = {engine[name]:g} with no request open")
    return problems


async def replay(
    send: Callable[[int, float], Coroutine[Any, Any, None]],
    arrivals_s: list[float],
    results: Sequence[CallResult],
    timeout_s: float,
) -> tuple[float, bool]:
    """Start ``send(index, send_at_s)`` for every request, to send at its arrival (seconds
    from the start), wait at most ``timeout_s`` for all of them and cancel those still open.
    Returns the start (perf_counter seconds) and whether any request was cut off."""
    start_s = time.perf_counter()
    tasks = [
        asyncio.create_task(send(index, start_s + arrival_s))
        for index, arrival_s in enumerate(arrivals_s)
    ]
    _, pending = await asyncio.wait(tasks, timeout=timeout_s)
    for task, result in zip(tasks, results):
        if task in pending:
            result.cut_off = True
            if result.sent_s is None:
                result.status = "NOT_SENT"
            task.cancel()
    if pending:
        await asyncio.wait(pending, timeout=CANCEL_GRACE_S)
    for task in tasks:
        if task.done() and not task.cancelled() and task.exception() is not None:
            raise task.exception()  # a fault of this tool, not the server's
    return start_s, bool(pending)


async def replay_grpc(
    stub: pb_grpc.GenerationServiceStub,
    requests: list[Request],
    arrivals_s: list[float],
    namespace: str,
    tag: str,
    timeout_s: float,
) -> tuple[list[StreamResult], float, bool]:
    """``replay`` as GenerateStream calls on ``stub``'s channel; the results too."""
    results = [StreamResult(request.output_len) for request in requests]

    def send(index: int, send_at_s: float) -> Coroutine[Any, Any, None]:
        request = requests[index]
        message = generate_request(index, request, namespace, tag)
        return stream_one(stub, message, request.prompt_token_ids, send_at_s, results[index])

    start_s, cut_off = await replay(send, arrivals_s, results, timeout_s)
    return results, start_s, cut_off


async def replay_http(
    base_url: str,
    model: str | None,
    requests: list[Request],
    arrivals_s: list[float],
    namespace: str,
    tag: str,
    timeout_s: float,
    api_key: str | None = None,
    make_body: Callable[[int], dict[str, Any]] | None = None,
    require_done: bool = True,
) -> tuple[list[CompletionStreamResult], float, bool]:
    """``replay`` as streamed ``POST /v1/completions`` to the server at ``base_url``, asking
    for ``model`` (None: the one served); the results too. ``make_body(index)`` is each
    request's body (default ``completion_body``: token-id prompts), whose prompt must have
    the token count of ``requests[index]``'s; ``require_done`` False takes a stream that
    ends without ``[DONE]``."""
    results = [
        CompletionStreamResult(
            request.output_len,
            expected_prompt_tokens=len(request.prompt_token_ids),
            require_done=require_done,
        )
        for request in requests
    ]
    async with aiohttp.ClientSession(
        base_url=base_url,
        headers=bearer_headers(api_key),
        # No limit on connections: every call in flight needs one of its own.
        connector=aiohttp.TCPConnector(limit=0),
        # --timeout-s bounds the run; aiohttp's default (5 minutes a call) would end a
        # longer stream as a fault of this tool.
        timeout=aiohttp.ClientTimeout(total=None),
    ) as session:
        await open_connections(session, len(requests))

        def send(index: int, send_at_s: float) -> Coroutine[Any, Any, None]:
            if make_body is None:
                body = completion_body(requests[index], namespace, model)
            else:
                body = make_body(index)
            return complete_one(session, body, f"{tag}-{index}", send_at_s, results[index])

        start_s, cut_off = await replay(send, arrivals_s, results, timeout_s)
    return results, start_s, cut_off


async def run_server(
    api: str,
    ports: Ports,
    requests: list[Request],
    arrivals_s: list[float],
    namespace: str,
    tag: str,
    timeout_s: float,
    make_body: Callable[[int], dict[str, Any]] | None = None,
) -> ServerRun:
    """Send ``requests`` over ``api`` at ``arrivals_s`` (seconds from the start), wait at
    most ``timeout_s`` for all of them, then check the server's stats (over gRPC, which
    serves them whichever API carried the calls). ``make_body``: as ``replay_http``'s."""
    async with _channel(ports.grpc) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        # One connection, made before the clock starts: its set-up is not a request's.
        await asyncio.wait_for(channel.channel_ready(), UNARY_TIMEOUT_S)
        results: Sequence[CallResult]
        clock = CpuClock()
        if api == "grpc":
            grpc_results, start_s, cut_off = await replay_grpc(
                stub, requests, arrivals_s, namespace, tag, timeout_s
            )
            results = grpc_results
            output_token_ids = [result.token_ids for result in grpc_results]
            output_texts = []
        else:
            assert ports.http is not None
            http_results, start_s, cut_off = await replay_http(
                f"http://127.0.0.1:{ports.http}",
                None,
                requests,
                arrivals_s,
                namespace,
                tag,
                timeout_s,
                make_body=make_body,
            )
            results = http_results
            output_token_ids = []
            output_texts = [result.text for result in http_results]
        cpu = clock.use()
        seconds = _run_seconds(results, start_s)
        stats = await stub.GetStats(pb.GetStatsRequest(), timeout=UNARY_TIMEOUT_S)
        # A cancelled call's abort reaches the engine a moment after the cancel; with none
        # cancelled, the first answer must already show every block free.
        deadline_s = time.monotonic() + CANCEL_GRACE_S
        while (
            cut_off
            and (stats.requests_running or block_problems(dict(stats.engine), ""))
            and time.monotonic() < deadline_s
        ):
            await asyncio.sleep(STATS_POLL_S)
            stats = await stub.GetStats(pb.GetStatsRequest(), timeout=UNARY_TIMEOUT_S)
    stats_problems = block_problems(dict(stats.engine), stats.integrity_error)
    if stats.requests_running:
        stats_problems.append(f"requests_running = {stats.requests_running} after the run")
    run = _server_run(
        results,
        start_s,
        seconds,
        stats_record(stats),
        stats_problems,
        output_token_ids,
        output_texts,
    )
    run.cpu = cpu
    return run


async def run_target(
    base_url: str,
    model: str,
    requests: list[Request],
    arrivals_s: list[float],
    namespace: str,
    tag: str,
    timeout_s: float,
    api_key: str | None = None,
    make_body: Callable[[int], dict[str, Any]] | None = None,
    require_done: bool = True,
) -> ServerRun:
    """``run_server`` over HTTP on a server this tool did not start: the same calls, checked
    alike, but no stats after them (nothing says what the target's engine holds).
    ``make_body`` and ``require_done``: as ``replay_http``'s."""
    results, start_s, _ = await replay_http(
        base_url,
        model,
        requests,
        arrivals_s,
        namespace,
        tag,
        timeout_s,
        api_key,
        make_body=make_body,
        require_done=require_done,
    )
    texts = [result.text for result in results]
    return _server_run(results, start_s, _run_seconds(results, start_s), None, [], [], texts)


def _run_seconds(results: Sequence[CallResult], start_s: float) -> float:
    """From ``start_s`` to the last message of any call (to now when none came)."""
    ends_s = [r.last_message_s for r in results if r.last_message_s is not None]
    return (max(ends_s) if ends_s else time.perf_counter()) - start_s


def _server_run(
    results: Sequence[CallResult],
    start_s: float,
    seconds: float,
    stats: dict[str, Any] | None,
    stats_problems: list[str],
    output_token_ids: list[list[int]],
    output_texts: list[str],
) -> ServerRun:
    problems = Counter(p for p in (r.problem() for r in results) if p is not None)
    return ServerRun(
        num_requests=len(results),
        output_tokens=sum(r.num_tokens for r in results),
        seconds=seconds,
        problems=dict(problems),
        latencies=latencies(results),
        stats=stats,
        stats_problems=stats_problems,
        problem_examples=[
            _example(index, result, start_s)
            for index, result in enumerate(results)
            if result.problem() is not None
        ][:MAX_PROBLEM_EXAMPLES],
        output_token_ids=output_token_ids,
        output_texts=output_texts,
    )


def _example(index: int, result: CallResult, start_s: float) -> dict[str, Any]:
    example: dict[str, Any] = {"index": index, "problem": result.problem()}
    for name, value in vars(result).items():
        if name in ("token_ids", "text"):
            continue
        if name.endswith("_s") and value is not None:
            value = value - start_s
        example[name] = value
    return example


@dataclass
class OfflineRun:
    num_requests: int
    output_tokens: int
    seconds: float
    problems: dict[str, int]
    stats_problems: list[str]
    output_token_ids: list[list[int]] = field(repr=False, default_factory=list)
    # Empty when the model has no tokenizer: then no output has text to compare.
    output_texts: list[str] = field(repr=False, default_factory=list)
    cpu: CpuUse | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.seconds

    @property
    def ok(self) -> bool:
        return not self.problems and not self.stats_problems


@contextlib.contextmanager
def time_limit(seconds: float, what: str) -> Iterator[None]:
    """Raise ``TimeoutError`` in this (the main) thread after ``seconds``: ``generate``
    blocks, and its own ``finally`` then aborts what it had queued."""

    def on_alarm(signal_number: int, frame: object) -> None:
        raise TimeoutError(f"{what} ran past --timeout-s={seconds:g}")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_offline(llm: LLM, requests: list[Request], namespace: str, timeout_s: float) -> OfflineRun:
    prompts = [request.prompt_token_ids for request in requests]
    params = [
        SamplingParams(max_tokens=request.output_len, ignore_eos=True, temperature=0.0)
        for request in requests
    ]
    with time_limit(timeout_s, "the offline run"):
        started_s = time.perf_counter()
        clock = CpuClock()
        outputs = llm.generate(prompts, params, cache_namespace=namespace)
        cpu = clock.use()
        seconds = time.perf_counter() - started_s
    problems: Counter[str] = Counter()
    for request, output in zip(requests, outputs):
        if len(output.outputs[0].token_ids) != request.output_len:
            problems["wrong token count"] += 1
        elif output.outputs[0].finish_reason != "length":
            problems["finish reason not length"] += 1
    stats = llm.stats()
    integrity_error = ""
    try:
        llm.check_integrity()
    except AssertionError as error:
        integrity_error = str(error) or "check_integrity failed"
    return OfflineRun(
        num_requests=len(requests),
        output_tokens=sum(len(output.outputs[0].token_ids) for output in outputs),
        seconds=seconds,
        problems=dict(problems),
        stats_problems=block_problems({k: float(v) for k, v in stats.items()}, integrity_error),
        output_token_ids=[list(output.outputs[0].token_ids) for output in outputs],
        output_texts=[] if llm.tokenizer is None else [o.outputs[0].text for o in outputs],
        cpu=cpu,
    )


def poisson_arrivals_s(count: int, rate_per_s: float, seed: int) -> list[float]:
    """Arrival times from the start, seconds: all 0 at an infinite rate."""
    if math.isinf(rate_per_s):
        return [0.0] * count
    rng = random.Random(seed)
    arrivals_s = []
    clock_s = 0.0
    for _ in range(count):
        clock_s += rng.expovariate(rate_per_s)
        arrivals_s.append(clock_s)
    return arrivals_s


# ---------------------------------------------------------------------------- report


def machine_info() -> dict[str, Any]:
    return {
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "python_version": platform.python_version(),
        "grpc_version": grpc.__version__,
        "aiohttp_version": aiohttp.__version__,
        # Other processes on the cores slow both sides; a 1-minute load above cpu_count
        # means the figures are low, the ratio less so.
        "load_average_1m": os.getloadavg()[0],
    }


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _median_of(runs: list[ServerRun], figure: str, statistic: str) -> float | None:
    values = [getattr(run.latencies, figure).get(statistic) for run in runs]
    return _median([v for v in values if v is not None])


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator and denominator else None


def _equal_outputs(server_outputs: list[Any], offline_outputs: list[Any]) -> list[int]:
    """[how many equal the offline run's, how many there are]."""
    return [sum(s == o for s, o in zip(server_outputs, offline_outputs)), len(offline_outputs)]


def _api_figures(
    prefix: str, runs: list[ServerRun], offline_tok_s: float | None, *, over_offline: bool = True
) -> dict[str, Any]:
    """One API's figures, as the record keys them; ``over_offline`` False leaves out the
    ratio over the offline peer (a --target-url run has none)."""
    tok_s = _median([run.tokens_per_s for run in runs])
    figures: dict[str, Any] = {f"{prefix}_tok_s_median": tok_s}
    if over_offline:
        figures[f"{prefix}_over_offline"] = _ratio(tok_s, offline_tok_s)
    return figures | {
        f"{prefix}_req_s_median": _median([run.requests_per_s for run in runs]),
        # Medians over the runs of each run's statistic.
        f"{prefix}_latency_ms": {
            figure: {
                statistic: _median_of(runs, figure, statistic)
                for statistic in ("mean", *(f"p{p}" for p in PERCENTILES))
            }
            for figure in ("ttft_ms", "tpot_ms", "e2e_ms")
        },
        f"{prefix}_runs": [
            {
                "tok_s": run.tokens_per_s,
                "req_s": run.requests_per_s,
                "seconds": run.seconds,
                "output_tokens": run.output_tokens,
                "problems": run.problems,
                "latencies": asdict(run.latencies),
                "stats": run.stats,
                "stats_problems": run.stats_problems,
                "problem_examples": run.problem_examples,
                "cpu": None if run.cpu is None else asdict(run.cpu),
            }
            for run in runs
        ],
    }


def make_record(
    args: argparse.Namespace,
    engine: EngineSettings,
    server_argv: list[str],
    info: pb.GetModelInfoResponse | None,
    requests: list[Request],
    warmup: dict[str, Any],
    server_runs: dict[str, list[ServerRun]],
    offline_runs: list[OfflineRun],
    server: ServerProcess,
    load_before: float,
    error: str | None,
) -> dict[str, Any]:
    """``server_runs``: each API's runs, by API (those of --api)."""
    offline_tok_s = _median([run.tokens_per_s for run in offline_runs])
    # The last repeat that ran on every side (an offline run follows the repeat's server
    # runs only once they all went well). Batches differ between the sides (arrival order,
    # timing) and floating-point sums with them, so a greedy output may part ways at a near
    # tie: a sanity figure, not a check.
    last_repeat = len(offline_runs) - 1
    matching = None
    if offline_runs and "grpc" in server_runs:
        matching = _equal_outputs(
            server_runs["grpc"][last_repeat].output_token_ids, offline_runs[-1].output_token_ids
        )
    failures = []
    if error is not None:
        failures.append(error)
    for label, runs in [*server_runs.items(), ("offline", offline_runs)]:
        failures += _run_failures(label, runs)
    failures += warmup.get("problems", [])
    if server.exit_code != 0:
        failures.append(f"server exit code {server.exit_code} {server.stop_note}".rstrip())
    elif server.stop_note:
        failures.append(f"server {server.stop_note}")
    record = {
        "command": shlex.join(sys.orig_argv),
        "settings": _settings_record(args),
        "engine": asdict(engine),
        "server_argv": server_argv,
        "model_info": None
        if info is None
        else {
            "model": info.model,
            "architecture": info.architecture,
            "dtype": grpc_enums.word(pb.Dtype, info.dtype, "dtype"),
            "vocab_size": info.vocab_size,
            "max_model_len": info.max_model_len,
            "block_size": info.block_size,
            "num_blocks": info.num_blocks,
            "max_num_seqs": info.max_num_seqs,
        },
        "trace_stats": asdict(trace_stats(requests)) if requests else None,
        # The gRPC API's (empty with --api http).
        **_api_figures(RECORD_PREFIXES["grpc"], server_runs.get("grpc", []), offline_tok_s),
        "offline_tok_s_median": offline_tok_s,
        "offline_req_s_median": _median([run.requests_per_s for run in offline_runs]),
        "offline_runs": [
            {
                "tok_s": run.tokens_per_s,
                "req_s": run.requests_per_s,
                "seconds": run.seconds,
                "output_tokens": run.output_tokens,
                "problems": run.problems,
                "stats_problems": run.stats_problems,
                "cpu": None if run.cpu is None else asdict(run.cpu),
            }
            for run in offline_runs
        ],
        "outputs_equal_offline": matching,  # the gRPC API's, token ids
    }
    if "http" in server_runs:
        prefix = RECORD_PREFIXES["http"]
        record.update(_api_figures(prefix, server_runs["http"], offline_tok_s))
        grpc_tok_s = record[f"{RECORD_PREFIXES['grpc']}_tok_s_median"]
        record[f"{prefix}_over_grpc"] = _ratio(record[f"{prefix}_tok_s_median"], grpc_tok_s)
        # Texts: the chunks carry no token ids. None without a tokenizer (no text).
        record[f"{prefix}_outputs_equal_offline"] = (
            _equal_outputs(
                server_runs["http"][last_repeat].output_texts, offline_runs[-1].output_texts
            )
            if offline_runs and offline_runs[-1].output_texts
            else None
        )
    record.update(
        {
            "warmup": warmup,
            "server_exit_code": server.exit_code,
            "server_stop_note": server.stop_note,
            "failures": failures,
            "ok": not failures,
            "machine": {**machine_info(), "load_average_1m_before": load_before},
        }
    )
    return record


def make_target_record(
    args: argparse.Namespace,
    card: dict[str, Any] | None,
    invocation_id: str,
    requests: list[Request],
    warmup: dict[str, Any],
    runs: list[ServerRun],
    load_before: float,
    error: str | None,
) -> dict[str, Any]:
    """The record of a --target-url run: the HTTP API's figures under ``make_record``'s
    keys; what a target cannot give (the offline peer, GetStats) is there as null, not
    left out."""
    failures = [] if error is None else [error]
    failures += _run_failures("http", runs)
    failures += warmup.get("problems", [])
    return {
        "command": shlex.join(sys.orig_argv),
        "settings": _settings_record(args),
        "target_url": args.target_url,
        # Its GET /v1/models entry, as it gave it (None when that failed).
        "target_model": card,
        # What starts this invocation's cache_salt values and request ids on the target.
        "invocation_id": invocation_id,
        "trace_stats": asdict(trace_stats(requests)) if requests else None,
        **_api_figures(RECORD_PREFIXES["http"], runs, None, over_offline=False),
        # Neither an offline peer nor GetStats (each run's "stats" is null): nothing here
        # can start the target's engine with its settings or see its KV blocks.
        "offline": None,
        "server_stats_checked": False,
        "warmup": warmup,
        "failures": failures,
        "ok": not failures,
        "machine": {**machine_info(), "load_average_1m_before": load_before},
    }


def _settings_record(args: argparse.Namespace) -> dict[str, Any]:
    # str: a Path, and an infinite rate (JSON has no infinity).
    return {k: str(v) if isinstance(v, Path) or v == math.inf else v for k, v in vars(args).items()}


def _run_failures(label: str, runs: Sequence[ServerRun | OfflineRun]) -> list[str]:
    failures = []
    for index, run in enumerate(runs):
        failures += [f"{label} run {index}: {kind} x{n}" for kind, n in run.problems.items()]
        failures += [f"{label} run {index}: {problem}" for problem in run.stats_problems]
    return failures


def format_summary(record: dict[str, Any]) -> str:
    settings, stats = record["settings"], record["trace_stats"]
    apis = API_CHOICES[settings["api"]]
    target_url = record.get("target_url")  # None: on a server this tool started
    lines = []
    if stats is not None:
        counts = ", ".join(f"{len(record[f'{RECORD_PREFIXES[api]}_runs'])} {api}" for api in apis)
        peer = (
            f"and {len(record['offline_runs'])} offline runs"
            if target_url is None
            else f"runs on {target_url} (model {record['target_model']['id']})"
        )
        lines.append(
            f"{stats['num_requests']} requests ({settings['trace']} x{settings['length_scale']:g}: "
            f"mean {stats['mean_input_len']:.0f} in / {stats['mean_output_len']:.0f} out), "
            f"rate {settings['request_rate']} req/s, {counts} {peer}"
        )
    # Each side's figures, by its name in the summary.
    prefixes = {api: RECORD_PREFIXES[api] for api in apis}
    if target_url is None:
        prefixes["offline"] = "offline"

    def figures(prefix: str, key: str) -> str:
        return ", ".join(f"{run[key]:.1f}" for run in record[f"{prefix}_runs"])

    lines.append(f"  {'':10}{'tok/s':>10}{'req/s':>10}   runs (tok/s)")
    for side, prefix in prefixes.items():
        tok_s, req_s = record[f"{prefix}_tok_s_median"], record[f"{prefix}_req_s_median"]
        if tok_s is not None:
            lines.append(f"  {side:10}{tok_s:10.1f}{req_s:10.2f}   {figures(prefix, 'tok_s')}")
    for api in apis:
        ratio = record.get(f"{RECORD_PREFIXES[api]}_over_offline")
        if ratio is not None:
            lines.append(f"  {api} / offline: {ratio:.3f}")
    http_over_grpc = record.get(f"{RECORD_PREFIXES['http']}_over_grpc")
    if http_over_grpc is not None:
        lines.append(f"  http / grpc: {http_over_grpc:.3f}")
    for side, prefix in prefixes.items():
        uses = [run["cpu"] for run in record.get(f"{prefix}_runs", []) if run.get("cpu")]
        if uses:
            this = statistics.median(use["this_process_cores"] for use in uses)
            machine = [use["machine_cores"] for use in uses if use["machine_cores"] is not None]
            who = "the client" if side != "offline" else "the offline frontend"
            lines.append(
                f"  {side} cores busy (medians): {who} {this:.2f}"
                + (f", the machine {statistics.median(machine):.2f}" if machine else "")
                + f" of {os.cpu_count()}"
            )
    for api in apis:
        latency = record[f"{RECORD_PREFIXES[api]}_latency_ms"]
        for figure, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("e2e_ms", "latency")):
            values = latency[figure]
            if values["p50"] is not None:
                lines.append(
                    f"  {api} {label:8} median {values['p50']:8.1f} ms, p90 "
                    f"{values['p90']:8.1f}, p99 {values['p99']:8.1f} (medians over runs)"
                )
    for key, what in (
        ("outputs_equal_offline", "grpc outputs (token ids)"),
        (f"{RECORD_PREFIXES['http']}_outputs_equal_offline", "http outputs (text)"),
    ):
        if record.get(key) is not None:
            equal, total = record[key]
            lines.append(f"  {what} equal to the offline run's: {equal} of {total}")
    if target_url is not None:
        lines.append(
            "  no offline peer and no GetStats check: the target's engine is not this tool's "
            "to start or see"
        )
    else:
        for api in apis:
            runs = record[f"{RECORD_PREFIXES[api]}_runs"]
            if runs:
                last = runs[-1]["stats"]["engine"]
                lines.append(
                    f"  GetStats after the last {api} run: {last.get('num_free_blocks', 0):.0f} "
                    f"of {last.get('num_total_blocks', 0):.0f} KV blocks free"
                )
        lines.append(
            f"  server exit code {record['server_exit_code']} {record['server_stop_note']}".rstrip()
        )
    if record["failures"]:
        lines.append("FAILED:")
        lines += [f"  {failure}" for failure in record["failures"]]
        for api in apis:
            for index, run in enumerate(record[f"{RECORD_PREFIXES[api]}_runs"]):
                for example in run["problem_examples"][:3]:
                    lines.append(f"  {api} run {index}, request {example}")
    elif target_url is not None:
        lines.append("every request complete and exact: ok")
    else:
        lines.append("every request complete and exact, every block free: ok")
    machine = record["machine"]
    lines.append(
        f"{machine['cpu_model']}, {machine['cpu_count']} CPUs, 1-minute load "
        f"{machine['load_average_1m_before']:.1f} before, {machine['load_average_1m']:.1f} after"
    )
    return "\n".join(lines)


# ---------------------------------------------------------------------------- main


def target_url(text: str) -> str:
    """--target-url: the server's root, as scheme://host:port (the paths are this tool's)."""
    url = urlsplit(text)
    if url.scheme not in ("http", "https") or not url.netloc:
        raise argparse.ArgumentTypeError(f"an http:// or https:// URL with a host, got {text!r}")
    if url.path not in ("", "/") or url.query or url.fragment:
        raise argparse.ArgumentTypeError(
            f"the server's root, without the path of its API (this tool sends to "
            f"/v1/completions), got {text!r}"
        )
    return f"{url.scheme}://{url.netloc}"


def add_run_arguments(
    parser: argparse.ArgumentParser,
    *,
    trace: str,
    length_scale: float,
    repeats: int,
    repeats_help: str,
    warmup_help: str,
) -> None:
    """The trace's and the runs' flags, with this tool's defaults where they differ."""
    parser.add_argument("--trace", default=trace, choices=sorted(TRACE_SHAPES))
    parser.add_argument("--num-requests", type=int, default=64, help="per repeat")
    parser.add_argument(
        "--length-scale",
        type=float,
        default=length_scale,
        help="multiplies the trace's mean prompt and output lengths",
    )
    parser.add_argument(
        "--max-len", type=int, default=512, help="prompt + output of a request, at most"
    )
    parser.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="Poisson arrivals per second (inf: every request at once)",
    )
    parser.add_argument("--repeats", type=int, default=repeats, help=repeats_help)
    parser.add_argument("--warmup-requests", type=int, default=8, help=warmup_help)
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=300.0,
        help="wall-clock limit of each run; what is still open then is cancelled",
    )
    parser.add_argument(
        "--startup-timeout-s",
        type=float,
        default=180.0,
        help="how long a server may take to load the model and listen",
    )
    parser.add_argument("--seed", type=int, default=0)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine's flags (``EngineSettings.from_args``), besides ``--model``."""
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--block-size", type=int, default=16, choices=[8, 16, 32])
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--kv-cache-bytes", type=int, default=DEFAULT_KV_CACHE_BYTES)
    parser.add_argument("--no-prefix-caching", action="store_true")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default=None, help="local HF directory or .gguf (default: the embedded model)"
    )
    parser.add_argument(
        "--api",
        default=None,
        choices=sorted(API_CHOICES),
        help="what carries the calls: gRPC GenerateStream, the OpenAI-compatible HTTP API's "
        "streamed /v1/completions, or both in every repeat (their order alternating); "
        "default grpc, and http with --target-url, the only one it takes",
    )
    parser.add_argument(
        "--target-url",
        type=target_url,
        default=None,
        help="start no server: replay the trace over HTTP on the OpenAI-compatible server "
        "already running here (pagedserve, vLLM, SGLang...), e.g. http://127.0.0.1:8000; "
        "no offline peer, no GetStats",
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help="with --target-url: the target's API key, sent as 'Authorization: Bearer KEY' "
        "(default: $PAGEDSERVE_API_KEY, which keeps it out of ps)",
    )
    parser.add_argument(
        "--model-name",
        default=None,
        help="with --target-url: the model to ask for (default: the first of its /v1/models)",
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="with --target-url: the model's vocabulary size, which the prompts' token ids "
        "stay below (default: the vocab_size of its /v1/models entry, which pagedserve "
        "reports; vLLM and SGLang need it given)",
    )
    add_run_arguments(
        parser,
        trace="sharegpt",
        length_scale=0.25,
        repeats=3,
        repeats_help="server (of each API) and offline runs each",
        warmup_help="first requests of the trace, untimed",
    )
    add_engine_arguments(parser)
    parser.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="the server's --stream-interval: tokens per streamed message (1: every step)",
    )
    parser.add_argument("--server-log", type=Path, default=None, help="keep the server's log here")
    parser.add_argument("--json", type=Path, default=None, help="write every figure here")
    args = parser.parse_args(argv)
    if args.target_url is None:
        given = [
            name
            for name in ("model_name", "vocab_size", "api_key")
            if getattr(args, name) is not None
        ]
        if given:
            parser.error(
                f"--{given[0].replace('_', '-')} is for --target-url only: a server this tool "
                "starts asks for no key, names its model and reports its vocabulary"
            )
        args.api = args.api or "grpc"
    else:
        if args.api not in (None, "http"):
            parser.error(
                f"--target-url takes --api http only (its calls go over HTTP), got --api {args.api}"
            )
        args.api = "http"
        args.api_key = args.api_key or os.environ.get("PAGEDSERVE_API_KEY")
        if args.vocab_size is not None and args.vocab_size <= FIRST_ORDINARY_TOKEN_ID:
            parser.error(
                f"--vocab-size must be > {FIRST_ORDINARY_TOKEN_ID}: the prompts' token ids are "
                f"drawn from [{FIRST_ORDINARY_TOKEN_ID}, vocab-size), got {args.vocab_size}"
            )
        given = [
            f"--{name.replace('_', '-')}"
            for name in STARTED_SERVER_OPTIONS
            if getattr(args, name) != parser.get_default(name)
        ]
        if given:
            parser.error(
                f"--target-url starts no server, so {', '.join(given)} would do nothing: "
                "set the target's engine where it runs"
            )
    for name in ("num_requests", "repeats", "max_len", "max_num_seqs", "kv_cache_bytes"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup_requests < 0:
        parser.error(f"--warmup-requests must be >= 0, got {args.warmup_requests}")
    for name in ("request_rate", "length_scale", "timeout_s", "startup_timeout_s"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _on_sigterm)
    load_before = os.getloadavg()[0]
    if args.target_url is None:
        record = bench_started_server(args, load_before)
    else:
        record = bench_target(args, load_before)
    print(format_summary(record))
    if args.json is not None:
        args.json.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0 if record["ok"] else 1


def bench_started_server(args: argparse.Namespace, load_before: float) -> dict[str, Any]:
    """Start the server, then the warm-up and the repeats on it and offline; the record."""
    engine = EngineSettings.from_args(args)
    apis = API_CHOICES[args.api]
    info: pb.GetModelInfoResponse | None = None
    requests: list[Request] = []
    warmup: dict[str, Any] = {}
    server_runs: dict[str, list[ServerRun]] = {api: [] for api in apis}
    offline_runs: list[OfflineRun] = []
    error: str | None = None
    llm: LLM | None = None
    with tempfile.TemporaryDirectory(prefix="bench-server-") as directory:
        port_file = Path(directory) / "port.json"
        server_argv = serve_argv(
            engine,
            port_file,
            args.startup_timeout_s,
            args.num_requests,
            args.stream_interval,
            http="http" in apis,
        )
        server = ServerProcess(server_argv, args.server_log or Path(directory) / "server.log")
        try:
            _log(f"starting the server: {shlex.join(server_argv)}")
            ports = server.start(port_file, args.startup_timeout_s)
            if "http" in apis and ports.http is None:
                raise RuntimeError(f"the server's port file {port_file} names no http_port")
            info = run_async(model_info(ports.grpc))
            http_note = "" if ports.http is None else f" and HTTP port {ports.http}"
            _log(
                f"serving {info.model} on gRPC port {ports.grpc}{http_note}: {info.num_blocks} "
                f"blocks x {info.block_size} tokens, max_model_len {info.max_model_len}"
            )
            max_len = min(args.max_len, info.max_model_len)
            requests = make_trace(
                args.trace,
                args.num_requests,
                args.seed,
                max_len,
                info.vocab_size,
                FIRST_ORDINARY_TOKEN_ID,
                length_scale=args.length_scale,
            )
            arrivals_s = poisson_arrivals_s(len(requests), args.request_rate, args.seed)
            llm = engine.offline_llm(info.num_blocks)
            if llm.num_blocks != info.num_blocks:
                raise RuntimeError(
                    f"the offline engine got {llm.num_blocks} blocks, the server {info.num_blocks}"
                )
            warm = requests[: args.warmup_requests]
            if warm:
                _log(f"warm-up: {len(warm)} requests on each")
                problems = []
                for api in apis:
                    namespace = f"warmup-{api}"
                    run = run_async(
                        run_server(
                            api,
                            ports,
                            warm,
                            [0.0] * len(warm),
                            namespace,
                            namespace,
                            args.timeout_s,
                        )
                    )
                    problems += [f"{api} warm-up: {kind} x{n}" for kind, n in run.problems.items()]
                    problems += [f"{api} warm-up: {p}" for p in run.stats_problems]
                offline = run_offline(llm, warm, "warmup", args.timeout_s)
                problems += [
                    f"offline warm-up: {kind} x{n}" for kind, n in offline.problems.items()
                ]
                problems += [f"offline warm-up: {p}" for p in offline.stats_problems]
                warmup = {"requests": len(warm), "problems": problems}
                if problems:
                    raise RuntimeError("the warm-up failed: " + "; ".join(problems))
            for repeat in range(args.repeats):
                # Each API first in every other repeat: the machine's drift weighs on both.
                for api in apis if repeat % 2 == 0 else apis[::-1]:
                    namespace = f"repeat-{repeat}-{api}"
                    run = run_async(
                        run_server(
                            api, ports, requests, arrivals_s, namespace, namespace, args.timeout_s
                        )
                    )
                    server_runs[api].append(run)
                    _log(
                        f"{api} run {repeat}: {run.tokens_per_s:.1f} tok/s, {run.seconds:.2f} s"
                        + ("" if run.ok else f"; problems {run.problems} {run.stats_problems}")
                    )
                    if not run.ok:
                        break
                if not run.ok:
                    break
                offline = run_offline(llm, requests, f"repeat-{repeat}", args.timeout_s)
                offline_runs.append(offline)
                _log(
                    f"offline run {repeat}: {offline.tokens_per_s:.1f} tok/s, "
                    f"{offline.seconds:.2f} s"
                )
                if not offline.ok:
                    break
        except (Exception, KeyboardInterrupt) as caught:
            # Reported with whatever was measured before it; the server is stopped below.
            error = f"{type(caught).__name__}: {caught}"
            _log(f"stopped early: {error}")
        finally:
            if llm is not None:
                llm.shutdown()
            _log("stopping the server (SIGTERM)")
            server.stop()
            if server.exit_code != 0 or server.stop_note or error is not None:
                print(server.log_tail(), file=sys.stderr)
    return make_record(
        args,
        engine,
        server_argv,
        info,
        requests,
        warmup,
        server_runs,
        offline_runs,
        server,
        load_before,
        error,
    )


def bench_target(args: argparse.Namespace, load_before: float) -> dict[str, Any]:
    """--target-url: the warm-up and the repeats over HTTP on a server already running,
    nothing else; the record."""
    # The target outlives this invocation, and an earlier one of the same trace (the same
    # seed: the same prompts) left them in its prefix cache: each run's cache_salt starts
    # with this invocation's own id, and its request ids with it, which keeps them apart
    # from those of another invocation running on the target at the same time.
    invocation_id = uuid.uuid4().hex[:12]
    card: dict[str, Any] | None = None
    requests: list[Request] = []
    warmup: dict[str, Any] = {}
    runs: list[ServerRun] = []
    error: str | None = None
    try:
        card = run_async(target_model_card(args.target_url, args.model_name, args.api_key))
        model = card["id"]
        max_len = args.max_len
        # vLLM's and SGLang's entries have it too; a prompt + output past it is refused.
        if isinstance(card.get("max_model_len"), int):
            max_len = min(max_len, card["max_model_len"])
        # pagedserve's entry reports its vocabulary; vLLM's and SGLang's do not.
        vocab_size = args.vocab_size or card.get("vocab_size")
        if not isinstance(vocab_size, int) or vocab_size <= FIRST_ORDINARY_TOKEN_ID:
            raise RuntimeError(
                f"--target-url needs --vocab-size here: the prompts' token ids must lie in "
                f"the target's vocabulary, and its GET /v1/models entry for {model!r} does "
                f"not report one (vocab_size: {card.get('vocab_size')!r})"
            )
        _log(
            f"target {args.target_url}, model {model!r} (owned by {card.get('owned_by')}, "
            f"max_model_len {card.get('max_model_len')}); invocation {invocation_id}"
        )
        requests = make_trace(
            args.trace,
            args.num_requests,
            args.seed,
            max_len,
            vocab_size,
            FIRST_ORDINARY_TOKEN_ID,
            length_scale=args.length_scale,
        )
        arrivals_s = poisson_arrivals_s(len(requests), args.request_rate, args.seed)
        warm = requests[: args.warmup_requests]
        if warm:
            _log(f"warm-up: {len(warm)} requests")
            namespace = f"{invocation_id}-warmup-http"
            run = run_async(
                run_target(
                    args.target_url,
                    model,
                    warm,
                    [0.0] * len(warm),
                    namespace,
                    namespace,
                    args.timeout_s,
                    args.api_key,
                )
            )
            problems = [f"http warm-up: {kind} x{n}" for kind, n in run.problems.items()]
            warmup = {"requests": len(warm), "problems": problems}
            if problems:
                raise RuntimeError("the warm-up failed: " + "; ".join(problems))
        for repeat in range(args.repeats):
            namespace = f"{invocation_id}-repeat-{repeat}-http"
            run = run_async(
                run_target(
                    args.target_url,
                    model,
                    requests,
                    arrivals_s,
                    namespace,
                    namespace,
                    args.timeout_s,
                    args.api_key,
                )
            )
            runs.append(run)
            _log(
                f"http run {repeat}: {run.tokens_per_s:.1f} tok/s, {run.seconds:.2f} s"
                + ("" if run.ok else f"; problems {run.problems}")
            )
            if not run.ok:
                break
    except (Exception, KeyboardInterrupt) as caught:
        # Reported with whatever was measured before it.
        error = f"{type(caught).__name__}: {caught}"
        _log(f"stopped early: {error}")
    return make_target_record(args, card, invocation_id, requests, warmup, runs, load_before, error)


def _log(message: str) -> None:
    print(f"bench_server: {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
