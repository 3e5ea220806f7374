"""What the gRPC frontend costs: ``pagedserve serve`` under load against the offline API.

Starts a real server (``python -m pagedserve.frontend.cli serve --port 0``) and sends it a
synthetic trace (tools/traces.py: random prompt token ids, fixed output lengths with EOS
ignored, greedy) over gRPC (``GenerateStream``, a grpc.aio client, 127.0.0.1 only), all at
once or as Poisson arrivals (``--request-rate``). Per request it measures the time to first
token (TTFT), the time per output token after the first (TPOT: (latency - TTFT) / (tokens -
1)) and the end-to-end latency; over the run, output tokens/s and requests/s. Every request
must end with exactly one message with ``finished`` set, as its last, carrying exactly its
output length (token ids and usage, finish reason LENGTH); anything else is counted by kind,
failed calls by status code. After each server run ``GetStats`` must show no integrity error
and every KV block free.

The peer, in the same run on the same trace and engine settings (the server's block count
included): ``LLM(model, multiprocess=True).generate`` on the same prompts, the same
scheduler and worker processes with no gRPC and no asyncio. The ratio of output tokens/s,
server over offline, is what the frontend costs: protobuf, the event loop, the engine
thread, one message per request and engine step, and this client, which shares the cores.
The offline peer always gets every request at once, so the ratio means that only with the
default ``--request-rate inf``; at a finite rate the offline figure is the capacity.

Server and offline runs alternate ``--repeats`` times, after a warm-up of each (oneDNN
builds kernels for new shapes in the first steps); medians are reported. Each repeat uses a
cache namespace of its own, so prefix caching (on unless ``--no-prefix-caching``) never
serves a prompt from an earlier repeat. Each server run and each offline run is cut off at
``--timeout-s``: requests still open are cancelled and counted. The first run with a problem
ends the repeats. Machines are shared and noisy: read the ratio within one run.

Example (from the repository root), on the tests' tiny Llama (no tokenizer needed: prompts
are token ids); about a minute on 2 cores:

    .venv/bin/python -c "import sys; sys.path.insert(0, 'tests'); \\
        from conftest import make_tiny_model; from pathlib import Path; \\
        make_tiny_model('llama', Path('/tmp/tiny-llama'))"
    .venv/bin/python tools/bench_server.py --model /tmp/tiny-llama --num-requests 128 \\
        --length-scale 0.25 --max-len 256

Without ``--model``, the embedded SmolLM2-135M-Instruct (slower: use small counts; on a
CPU without native bfloat16 (no AVX512-BF16 or AMX, as on this AMD EPYC), keep float32):

    .venv/bin/python tools/bench_server.py --num-requests 16 --length-scale 0.25 \\
        --max-len 256

Exit status: 0 when every check held, 1 otherwise (the summary and the JSON say which).
"""

from __future__ import annotations

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
from collections import Counter
from collections.abc import Coroutine, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
import numpy as np
from machine import cpu_model
from traces import TRACE_SHAPES, Request, make_trace, trace_stats

from pagedserve.frontend import LLM, SamplingParams
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


class ServerProcess:
    """``pagedserve serve`` in a subprocess, logging to a file; ``stop`` sends SIGTERM and
    returns its exit status."""

    def __init__(self, argv: list[str], log_path: Path, port_file: Path) -> None:
        self.argv = argv
        self.log_path = log_path
        self.port_file = port_file
        self.process: subprocess.Popen[bytes] | None = None
        self.exit_code: int | None = None
        self.stop_note = ""

    def start(self, startup_timeout_s: float) -> int:
        """Start the server and wait for its port file; the port."""
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
        deadline_s = time.monotonic() + startup_timeout_s
        while time.monotonic() < deadline_s:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"the server exited during start-up with exit code "
                    f"{self.process.returncode}\n{self.log_tail()}"
                )
            with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
                # The server replaces the file whole (write, then rename): never half read.
                written = json.loads(self.port_file.read_text())
                if written["pid"] != self.process.pid:
                    raise RuntimeError(
                        f"port file {self.port_file} names pid {written['pid']}, the server "
                        f"is pid {self.process.pid}"
                    )
                return int(written["port"])
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


async def model_info(port: int) -> pb.ModelInfo:
    async with _channel(port) as channel:
        stub = pb_grpc.GenerationStub(channel)
        return await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=UNARY_TIMEOUT_S)


# ---------------------------------------------------------------------------- requests


@dataclass
class StreamResult:
    """One GenerateStream call as the client saw it (perf_counter seconds)."""

    expected_tokens: int
    sent_s: float | None = None
    first_token_s: float | None = None
    last_message_s: float | None = None
    num_tokens: int = 0
    num_messages: int = 0
    num_final_messages: int = 0
    message_after_final: bool = False
    usage_tokens: int | None = None
    finish_reason: int | None = None
    other_output_index: bool = False
    prompt_echo_ok: bool | None = None
    request_id_ok: bool = True
    token_ids: list[int] = field(default_factory=list)
    # Set when --timeout-s passed with the call still open (or not yet sent).
    cut_off: bool = False
    # The status code's name when the call failed; "TIMEOUT" when --timeout-s cut it off,
    # "NOT_SENT" when its arrival lay past it, "CANCELLED_IN_CLIENT" when grpc.aio raised
    # CancelledError in a call this tool did not cancel.
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


def generate_request(index: int, request: Request, namespace: str, tag: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=f"{tag}-{index}",
        token_ids=pb.TokenIds(ids=request.prompt_token_ids),
        sampling=pb.SamplingParams(max_tokens=request.output_len, temperature=0.0, ignore_eos=True),
        cache_namespace=namespace,
    )


async def stream_one(
    stub: pb_grpc.GenerationStub,
    message: pb.GenerateRequest,
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


def latencies(results: list[StreamResult]) -> Latencies:
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
class ServerRun:
    num_requests: int
    output_tokens: int  # received, over every call
    seconds: float  # first send to last message received
    problems: dict[str, int]  # kind -> requests; empty when all is well
    latencies: Latencies
    stats: dict[str, Any]  # GetStats after the run
    stats_problems: list[str]
    # The first few requests with a problem, as the client saw them (seconds from the start).
    problem_examples: list[dict[str, Any]] = field(default_factory=list)
    output_token_ids: list[list[int]] = field(repr=False, default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.seconds if self.seconds > 0 else 0.0

    @property
    def ok(self) -> bool:
        return not self.problems and not self.stats_problems


def stats_record(stats: pb.Stats) -> dict[str, Any]:
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


async def run_server(
    port: int,
    requests: list[Request],
    arrivals_s: list[float],
    namespace: str,
    tag: str,
    timeout_s: float,
) -> ServerRun:
    """Send ``requests`` at ``arrivals_s`` (seconds from the start), wait at most
    ``timeout_s`` for all of them, then check the server's stats."""
    async with _channel(port) as channel:
        stub = pb_grpc.GenerationStub(channel)
        # One connection, made before the clock starts: its set-up is not a request's.
        await asyncio.wait_for(channel.channel_ready(), UNARY_TIMEOUT_S)
        results = [StreamResult(request.output_len) for request in requests]
        start_s = time.perf_counter()
        tasks = [
            asyncio.create_task(
                stream_one(
                    stub,
                    generate_request(index, request, namespace, tag),
                    request.prompt_token_ids,
                    start_s + arrival_s,
                    result,
                )
            )
            for index, (request, arrival_s, result) in enumerate(zip(requests, arrivals_s, results))
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
        ends_s = [r.last_message_s for r in results if r.last_message_s is not None]
        seconds = (max(ends_s) if ends_s else time.perf_counter()) - start_s
        stats = await stub.GetStats(pb.GetStatsRequest(), timeout=UNARY_TIMEOUT_S)
        # A cancelled call's abort reaches the engine a moment after the cancel; with none
        # cancelled, the first answer must already show every block free.
        deadline_s = time.monotonic() + CANCEL_GRACE_S
        while (
            pending
            and (stats.requests_running or block_problems(dict(stats.engine), ""))
            and time.monotonic() < deadline_s
        ):
            await asyncio.sleep(STATS_POLL_S)
            stats = await stub.GetStats(pb.GetStatsRequest(), timeout=UNARY_TIMEOUT_S)
    problems = Counter(p for p in (r.problem() for r in results) if p is not None)
    stats_problems = block_problems(dict(stats.engine), stats.integrity_error)
    if stats.requests_running:
        stats_problems.append(f"requests_running = {stats.requests_running} after the run")
    return ServerRun(
        num_requests=len(requests),
        output_tokens=sum(r.num_tokens for r in results),
        seconds=seconds,
        problems=dict(problems),
        latencies=latencies(results),
        stats=stats_record(stats),
        stats_problems=stats_problems,
        problem_examples=[
            _example(index, result, start_s)
            for index, result in enumerate(results)
            if result.problem() is not None
        ][:MAX_PROBLEM_EXAMPLES],
        output_token_ids=[result.token_ids for result in results],
    )


def _example(index: int, result: StreamResult, start_s: float) -> dict[str, Any]:
    example: dict[str, Any] = {"index": index, "problem": result.problem()}
    for name, value in vars(result).items():
        if name == "token_ids":
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
        outputs = llm.generate(prompts, params, cache_namespace=namespace)
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
        # Other processes on the cores slow both sides; a 1-minute load above cpu_count
        # means the figures are low, the ratio less so.
        "load_average_1m": os.getloadavg()[0],
    }


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _median_of(runs: list[ServerRun], figure: str, statistic: str) -> float | None:
    values = [getattr(run.latencies, figure).get(statistic) for run in runs]
    return _median([v for v in values if v is not None])


def make_record(
    args: argparse.Namespace,
    engine: EngineSettings,
    server_argv: list[str],
    info: pb.ModelInfo | None,
    requests: list[Request],
    warmup: dict[str, Any],
    server_runs: list[ServerRun],
    offline_runs: list[OfflineRun],
    server: ServerProcess,
    load_before: float,
    error: str | None,
) -> dict[str, Any]:
    server_tok_s = _median([run.tokens_per_s for run in server_runs])
    offline_tok_s = _median([run.tokens_per_s for run in offline_runs])
    # The last repeat that ran on both sides. Batches differ between the two (arrival order,
    # timing) and floating-point sums with them, so a greedy output may part ways at a near
    # tie: a sanity figure, not a check.
    matching = None
    if offline_runs:
        server_ids = server_runs[len(offline_runs) - 1].output_token_ids
        offline_ids = offline_runs[-1].output_token_ids
        matching = [sum(s == o for s, o in zip(server_ids, offline_ids)), len(offline_ids)]
    failures = []
    if error is not None:
        failures.append(error)
    for label, runs in (("server", server_runs), ("offline", offline_runs)):
        for index, run in enumerate(runs):
            failures += [f"{label} run {index}: {kind} x{n}" for kind, n in run.problems.items()]
            failures += [f"{label} run {index}: {problem}" for problem in run.stats_problems]
    failures += warmup.get("problems", [])
    if server.exit_code != 0:
        failures.append(f"server exit code {server.exit_code} {server.stop_note}".rstrip())
    elif server.stop_note:
        failures.append(f"server {server.stop_note}")
    return {
        "command": shlex.join(sys.orig_argv),
        # str: a Path, and an infinite rate (JSON has no infinity).
        "settings": {
            k: str(v) if isinstance(v, Path) or v == math.inf else v for k, v in vars(args).items()
        },
        "engine": asdict(engine),
        "server_argv": server_argv,
        "model_info": None
        if info is None
        else {
            "model": info.model,
            "architecture": info.architecture,
            "dtype": info.dtype,
            "vocab_size": info.vocab_size,
            "max_model_len": info.max_model_len,
            "block_size": info.block_size,
            "num_blocks": info.num_blocks,
            "max_num_seqs": info.max_num_seqs,
        },
        "trace_stats": asdict(trace_stats(requests)) if requests else None,
        "server_tok_s_median": server_tok_s,
        "offline_tok_s_median": offline_tok_s,
        "server_over_offline": server_tok_s / offline_tok_s
        if server_tok_s and offline_tok_s
        else None,
        "server_req_s_median": _median([run.requests_per_s for run in server_runs]),
        "offline_req_s_median": _median([run.requests_per_s for run in offline_runs]),
        # Medians over the runs of each run's statistic.
        "server_latency_ms": {
            figure: {
                statistic: _median_of(server_runs, figure, statistic)
                for statistic in ("mean", *(f"p{p}" for p in PERCENTILES))
            }
            for figure in ("ttft_ms", "tpot_ms", "e2e_ms")
        },
        "server_runs": [
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
            }
            for run in server_runs
        ],
        "offline_runs": [
            {
                "tok_s": run.tokens_per_s,
                "req_s": run.requests_per_s,
                "seconds": run.seconds,
                "output_tokens": run.output_tokens,
                "problems": run.problems,
                "stats_problems": run.stats_problems,
            }
            for run in offline_runs
        ],
        "outputs_equal_offline": matching,
        "warmup": warmup,
        "server_exit_code": server.exit_code,
        "server_stop_note": server.stop_note,
        "failures": failures,
        "ok": not failures,
        "machine": {**machine_info(), "load_average_1m_before": load_before},
    }


def format_summary(record: dict[str, Any]) -> str:
    settings, stats = record["settings"], record["trace_stats"]
    lines = []
    if stats is not None:
        lines.append(
            f"{stats['num_requests']} requests ({settings['trace']} x{settings['length_scale']:g}: "
            f"mean {stats['mean_input_len']:.0f} in / {stats['mean_output_len']:.0f} out), "
            f"rate {settings['request_rate']} req/s, "
            f"{len(record['server_runs'])} server and {len(record['offline_runs'])} offline runs"
        )

    def figures(key: str) -> str:
        return ", ".join(f"{run[key]:.1f}" for run in record[f"{side}_runs"])

    lines.append(f"  {'':10}{'tok/s':>10}{'req/s':>10}   runs (tok/s)")
    for side in ("server", "offline"):
        tok_s, req_s = record[f"{side}_tok_s_median"], record[f"{side}_req_s_median"]
        if tok_s is not None:
            lines.append(f"  {side:10}{tok_s:10.1f}{req_s:10.2f}   {figures('tok_s')}")
    if record["server_over_offline"] is not None:
        lines.append(f"  server / offline: {record['server_over_offline']:.3f}")
    latency = record["server_latency_ms"]
    for figure, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("e2e_ms", "latency")):
        values = latency[figure]
        if values["p50"] is not None:
            lines.append(
                f"  server {label:8} median {values['p50']:8.1f} ms, p90 {values['p90']:8.1f}, "
                f"p99 {values['p99']:8.1f} (medians over runs)"
            )
    if record["outputs_equal_offline"] is not None:
        equal, total = record["outputs_equal_offline"]
        lines.append(f"  outputs equal to the offline run's: {equal} of {total}")
    last = record["server_runs"][-1]["stats"]["engine"] if record["server_runs"] else None
    if last is not None:
        lines.append(
            f"  GetStats after the last run: {last.get('num_free_blocks', 0):.0f} of "
            f"{last.get('num_total_blocks', 0):.0f} KV blocks free"
        )
    lines.append(
        f"  server exit code {record['server_exit_code']} {record['server_stop_note']}".rstrip()
    )
    if record["failures"]:
        lines.append("FAILED:")
        lines += [f"  {failure}" for failure in record["failures"]]
        for index, run in enumerate(record["server_runs"]):
            for example in run["problem_examples"][:3]:
                lines.append(f"  server run {index}, request {example}")
    else:
        lines.append("every request complete and exact, every block free: ok")
    machine = record["machine"]
    lines.append(
        f"{machine['cpu_model']}, {machine['cpu_count']} CPUs, 1-minute load "
        f"{machine['load_average_1m_before']:.1f} before, {machine['load_average_1m']:.1f} after"
    )
    return "\n".join(lines)


# ---------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default=None, help="local HF directory or .gguf (default: the embedded model)"
    )
    parser.add_argument("--trace", default="sharegpt", choices=sorted(TRACE_SHAPES))
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument(
        "--length-scale",
        type=float,
        default=0.25,
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
    parser.add_argument("--repeats", type=int, default=3, help="server and offline runs each")
    parser.add_argument(
        "--warmup-requests", type=int, default=8, help="first requests of the trace, untimed"
    )
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
        help="how long the server may take to load the model and write its port file",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--block-size", type=int, default=16, choices=[8, 16, 32])
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--kv-cache-bytes", type=int, default=DEFAULT_KV_CACHE_BYTES)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="the server's --stream-interval: tokens per streamed message (1: every step)",
    )
    parser.add_argument("--server-log", type=Path, default=None, help="keep the server's log here")
    parser.add_argument("--json", type=Path, default=None, help="write every figure here")
    args = parser.parse_args(argv)
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
    engine = EngineSettings(
        model=args.model,
        dtype=args.dtype,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_bytes=args.kv_cache_bytes,
        enable_prefix_caching=not args.no_prefix_caching,
    )
    info: pb.ModelInfo | None = None
    requests: list[Request] = []
    warmup: dict[str, Any] = {}
    server_runs: list[ServerRun] = []
    offline_runs: list[OfflineRun] = []
    error: str | None = None
    llm: LLM | None = None
    with tempfile.TemporaryDirectory(prefix="bench-server-") as directory:
        port_file = Path(directory) / "port.json"
        server_argv = [
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
            str(args.startup_timeout_s),
            # The server refuses calls past this many in flight; none may be refused here.
            "--max-concurrent-requests",
            str(max(1024, args.num_requests)),
            "--stream-interval",
            str(args.stream_interval),
        ]
        server = ServerProcess(
            server_argv, args.server_log or Path(directory) / "server.log", port_file
        )
        try:
            _log(f"starting the server: {shlex.join(server_argv)}")
            port = server.start(args.startup_timeout_s)
            info = run_async(model_info(port))
            _log(
                f"serving {info.model} on port {port}: {info.num_blocks} blocks x "
                f"{info.block_size} tokens, max_model_len {info.max_model_len}"
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
                run = run_async(
                    run_server(port, warm, [0.0] * len(warm), "warmup", "warmup", args.timeout_s)
                )
                offline = run_offline(llm, warm, "warmup", args.timeout_s)
                problems = [f"server warm-up: {kind} x{n}" for kind, n in run.problems.items()]
                problems += [f"server warm-up: {p}" for p in run.stats_problems]
                problems += [
                    f"offline warm-up: {kind} x{n}" for kind, n in offline.problems.items()
                ]
                problems += [f"offline warm-up: {p}" for p in offline.stats_problems]
                warmup = {"requests": len(warm), "problems": problems}
                if problems:
                    raise RuntimeError("the warm-up failed: " + "; ".join(problems))
            for repeat in range(args.repeats):
                namespace = f"repeat-{repeat}"
                run = run_async(
                    run_server(port, requests, arrivals_s, namespace, namespace, args.timeout_s)
                )
                server_runs.append(run)
                _log(
                    f"server run {repeat}: {run.tokens_per_s:.1f} tok/s, {run.seconds:.2f} s"
                    + ("" if run.ok else f"; problems {run.problems} {run.stats_problems}")
                )
                if not run.ok:
                    break
                offline = run_offline(llm, requests, namespace, args.timeout_s)
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
    record = make_record(
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
    print(format_summary(record))
    if args.json is not None:
        args.json.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0 if record["ok"] else 1


def _log(message: str) -> None:
    print(f"bench_server: {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
