"""``pagedserve serve``: the server process, the engine behind it, and what every API of
it shares.

This process is the frontend: it validates and tokenizes requests, decodes and streams
their outputs, and runs no model (neither weights nor compiled ops load here); the
scheduler and the workers run in processes of their own (``async_engine.py``,
``engine_client.py``). Two APIs share one engine, one admission limit and one drain:

- gRPC, always (``grpc_server.py``: ``pagedserve.v1.GenerationService``, health, reflection);
- HTTP, with ``http_port`` (``http_server.py``: OpenAI-compatible completions and chat
  completions, ``/health``, ``/metrics``).

What this module owns:

- **Admission**: refused while the model loads or the server drains (``UNAVAILABLE``),
  past ``max_concurrent_requests`` in flight (``RESOURCE_EXHAUSTED``), or when the request
  could never run (``INVALID_ARGUMENT``, naming the field, the value and the limit).
- **A call's life**: its outputs as they grow; the engine's request ends whenever the call
  ends first (the client cancelled or went away, a deadline passed), which frees its KV
  blocks; counters, Prometheus metrics (``metrics.py``) and a log line per call.
- **Draining** (SIGTERM or SIGINT): health turns ``NOT_SERVING``, new calls are refused,
  calls in flight run to their end for up to ``drain_timeout_s``, then those left end with
  ``UNAVAILABLE``; the engine stops and the process exits 0. A second signal ends the
  drain at once.
- **Engine death**: every call in flight ends with ``UNAVAILABLE`` naming what died, and
  the process exits 1 (systemd's ``Restart=on-failure`` brings it back).
- **systemd**: ``READY=1`` once serving, ``STOPPING=1`` when draining, ``WATCHDOG=1``
  from the event loop when ``WatchdogSec=`` is set (tools/systemd/pagedserve.service).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import itertools
import json
import logging
import os
import signal
import ssl
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from pagedserve.frontend import systemd_notify
from pagedserve.frontend.async_engine import AsyncEngine, RequestStream
from pagedserve.frontend.call_errors import CallError, ServerDrainingError
from pagedserve.frontend.engine_client import EngineDeadError, RequestFailedError
from pagedserve.frontend.liveness import (
    DEFAULT_STALL_EXIT_TIMEOUT_S,
    DEFAULT_STALL_TIMEOUT_S,
    LivenessMonitor,
)
from pagedserve.frontend.metrics import ServerMetrics
from pagedserve.frontend.outputs import EmbeddingRequestOutput
from pagedserve.frontend.reasoning import REASONING_PARSERS
from pagedserve.frontend.responses_store import (
    DEFAULT_RESPONSES_STORE_BYTES,
    DEFAULT_RESPONSES_STORE_SIZE,
    ResponseStore,
)
from pagedserve.frontend.tool_calls import TOOL_CALL_PARSERS

if TYPE_CHECKING:
    from pagedserve.frontend.llm import LLM
    from pagedserve.frontend.outputs import RequestOutput
    from pagedserve.scheduler.pooling_params import PoolingParams
    from pagedserve.scheduler.sampling_params import SamplingParams

logger = logging.getLogger("pagedserve.server")

T = TypeVar("T")

DEFAULT_MAX_CONCURRENT_REQUESTS = 1024
DEFAULT_DRAIN_TIMEOUT_S = 30.0
DEFAULT_HTTP_READ_TIMEOUT_S = 30.0
# Requests carry prompts of up to a model's whole context as text or token ids.
MAX_MESSAGE_BYTES = 64 << 20
# After the drain: how long handlers get to send the statuses of the calls ended last.
FINAL_GRACE_S = 2.0
# Requests are prepared (bodies decoded, templates rendered, prompts tokenized) on this many
# threads, off the event loop; this many more may wait for one, and past that new calls are
# refused (RESOURCE_EXHAUSTED) rather than queued without end.
PREPARE_THREADS = 2
MAX_WAITING_PREPARATIONS = 256


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 50051  # gRPC; 0: any free port (written to port_file)
    # The OpenAI-compatible HTTP API on host:http_port (0: any free port); None: off.
    http_port: int | None = None
    # The model's name in the HTTP API (``model`` in requests and answers); None: the
    # model as the command line named it.
    served_model_name: str | None = None
    # More names requests may give the base model by (vLLM's further --served-model-name
    # values); answers name it served_model_name.
    served_model_aliases: tuple[str, ...] = ()
    max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    # Written once serving: {"port": ..., "http_port": ..., "pid": ..., "metrics_port": ...},
    # for callers that asked for port 0.
    port_file: str | None = None
    # Prometheus metrics over HTTP at /metrics on host:metrics_port (0: any free port);
    # None: off. (The HTTP API serves /metrics on its own port too.)
    metrics_port: int | None = None
    # Streams send a message once this many new tokens are there (the first token and
    # the end at once): 1 streams every step; more cut the frontend's cost per token.
    stream_interval_tokens: int = 1
    # An INFO line per finished call (ids, token counts, finish reasons, seconds).
    log_requests: bool = True
    # TLS for both APIs: the server's certificate chain and private key (PEM files); with
    # a client CA file too, clients must present a certificate it signed (mutual TLS).
    # None: plaintext.
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_client_ca_file: str | None = None
    # Generation calls of both APIs must send "Authorization: Bearer <api_key>"
    # (``api_key.py``); None: no key asked for.
    api_key: str | None = None
    # The model's tool-call format, read for tool_choice "auto" (``tool_calls.py``);
    # None: only "none", "required" and named functions.
    tool_call_parser: str | None = None
    # Splits a reasoning model's thinking from its chat answers (``reasoning.py``);
    # None: the answer is the whole output.
    reasoning_parser: str | None = None
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's; the engine must
    # serve LoRA adapters). Off by default: a client then names directories the server
    # reads, which only a trusted client may do.
    allow_runtime_lora_updating: bool = False
    # A chat request may bring its own template (vLLM's --trust-request-chat-template).
    # Off by default: a template is code the server runs (sandboxed, but a loop in one can
    # hold the frontend), so only trusted clients should send one.
    trust_request_chat_template: bool = False
    # Origins whose browser pages may call the HTTP API (vLLM's --allowed-origins; "*":
    # any), and whether with credentials (cookies, HTTP auth); () : no cross-origin calls.
    allowed_origins: tuple[str, ...] = ()
    allow_credentials: bool = False
    # The Responses API's stored responses (store=true; previous_response_id, GET): the
    # most recent this many, in memory; 0: none.
    responses_store_size: int = DEFAULT_RESPONSES_STORE_SIZE
    # ... and within this many bytes in all (inputs, outputs, a stream's kept events).
    responses_store_bytes: int = DEFAULT_RESPONSES_STORE_BYTES
    # The metrics vLLM also has, a second time under its names (vllm:...), labelled
    # model_name with the served model's name: vLLM's dashboards read this server.
    vllm_metric_names: bool = False
    # Every streamed completion and chat completion ends with a usage chunk, as if it asked
    # for one (stream_options.include_usage; vLLM's --enable-force-include-usage).
    force_include_usage: bool = False
    # Liveness (liveness.py): work pending and no engine step completed for this long makes
    # the server unhealthy; still so this much later, it ends every call and exits 1.
    stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S
    stall_exit_timeout_s: float = DEFAULT_STALL_EXIT_TIMEOUT_S
    # An HTTP client has this long to send a request's headers (from when it connects, or
    # since its previous call on the connection was answered), and then its body; past
    # it the connection closes (408 for a late body): slow senders cannot hold connections.
    http_read_timeout_s: float = DEFAULT_HTTP_READ_TIMEOUT_S

    def __post_init__(self) -> None:
        for name in ("port", "http_port", "metrics_port"):
            port = getattr(self, name)
            if port is not None and not 0 <= port <= 65535:
                raise ValueError(f"{name} must be in [0, 65535], got {port}")
        if self.tool_call_parser not in (None, *TOOL_CALL_PARSERS):
            raise ValueError(
                f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                f"got {self.tool_call_parser!r}"
            )
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(
                f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, "
                f"got {self.reasoning_parser!r}"
            )
        if self.allowed_origins and self.http_port is None:
            raise ValueError("allowed_origins is for the HTTP API: serve it too (http_port)")
        if self.allow_credentials and not self.allowed_origins:
            raise ValueError("allow_credentials needs allowed_origins (the origins it is for)")
        if self.max_concurrent_requests < 1:
            raise ValueError(
                f"max_concurrent_requests must be >= 1, got {self.max_concurrent_requests}"
            )
        if self.responses_store_size < 0:
            raise ValueError(f"responses_store_size must be >= 0, got {self.responses_store_size}")
        if self.responses_store_bytes < 0:
            raise ValueError(
                f"responses_store_bytes must be >= 0, got {self.responses_store_bytes}"
            )
        if self.stream_interval_tokens < 1:
            raise ValueError(
                f"stream_interval_tokens must be >= 1, got {self.stream_interval_tokens}"
            )
        if not self.drain_timeout_s >= 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        for name in ("stall_timeout_s", "stall_exit_timeout_s", "http_read_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key is empty; leave it unset or give a secret")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError("served_model_name is empty; leave it unset or name the model")
        for alias in self.served_model_aliases:
            if not alias.strip():
                raise ValueError("served_model_aliases: a name is empty")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together: give both or neither")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError("tls_client_ca_file needs tls_cert_file and tls_key_file")
        for name in ("tls_cert_file", "tls_key_file", "tls_client_ca_file"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{name}: {path!r} is not a readable file")

    def ssl_context(self) -> ssl.SSLContext | None:
        """The HTTP API's TLS settings (the same files as gRPC's), or None for plaintext."""
        if self.tls_cert_file is None:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.tls_cert_file, self.tls_key_file)
        if self.tls_client_ca_file is not None:
            context.load_verify_locations(self.tls_client_ca_file)
            context.verify_mode = ssl.CERT_REQUIRED
        return context


class Counters:
    """Generation calls of both APIs: running now, and how those that ended ended."""

    def __init__(self) -> None:
        self.running = 0
        self.finished = 0
        self.failed = 0
        self.cancelled = 0


def _unknown_code(error: BaseException) -> str:
    return error.code if isinstance(error, CallError) else "INTERNAL"


def _num_output_tokens(output: RequestOutput | EmbeddingRequestOutput) -> int:
    if isinstance(output, EmbeddingRequestOutput):
        return 0  # a prompt-only request
    return sum(len(completion.token_ids) for completion in output.outputs)


def _finish_reasons(output: RequestOutput | EmbeddingRequestOutput) -> str:
    if isinstance(output, EmbeddingRequestOutput):
        return str(output.finish_reason)
    return ",".join(str(completion.finish_reason) for completion in output.outputs)


class Server:
    """The engine and the APIs in front of it; ``run()`` serves until told to stop and
    returns the process's exit code."""

    def __init__(self, make_llm: Callable[[], LLM], config: ServerConfig) -> None:
        self.config = config
        self.engine = AsyncEngine(make_llm, on_dead=self._on_engine_dead)
        self.counters = Counters()
        self.metrics = ServerMetrics(
            (config.served_model_name or "") if config.vllm_metric_names else None
        )
        self.responses = ResponseStore(config.responses_store_size, config.responses_store_bytes)
        self.draining = False
        self.serving = False  # the engine is up and the defaults are known
        self.default_params: SamplingParams | None = None
        self.serving_since_s = 0.0  # wall-clock time (seconds since the epoch)
        self._exit_code = 0
        # Set by the first SIGTERM or SIGINT, or when the engine dies: serving ends.
        self.stop_requested = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._signals = 0
        self._forced_stop = asyncio.Event()  # a second signal: end the drain now
        self._ids = itertools.count()
        self._prepare_pool = concurrent.futures.ThreadPoolExecutor(
            PREPARE_THREADS, thread_name_prefix="pagedserve-prepare"
        )
        self._num_preparing = 0
        # Called with True once serving, False when draining (the gRPC health service).
        self._on_serving: list[Callable[[bool], object]] = []
        self.liveness = LivenessMonitor(
            config.stall_timeout_s,
            config.stall_exit_timeout_s,
            on_stalled=lambda why: self._notify_serving(False),
            on_recovered=self._on_recovered,
            on_dead=self.engine.declare_dead,
        )

    # ------------------------------------------------------------ what the APIs call

    def ready_llm(self) -> LLM:
        """The engine's ``LLM`` once serving; ``CallError`` (UNAVAILABLE) before that or
        after the engine died."""
        if self.engine.dead_message is not None:
            raise CallError("UNAVAILABLE", f"engine died: {self.engine.dead_message}")
        if not self.serving:
            raise CallError("UNAVAILABLE", "the engine is still starting")
        if self.liveness.stalled is not None:
            raise CallError("UNAVAILABLE", f"{self.liveness.stalled}; send to another server")
        return self.engine.llm

    def check_admission(self, num_requests: int = 1) -> LLM:
        """Whether ``num_requests`` more may start now: ``CallError`` if draining,
        starting, dead, or past the limit of requests in flight."""
        if self.draining:
            raise CallError("UNAVAILABLE", "the server is shutting down; send to another one")
        llm = self.ready_llm()
        limit = self.config.max_concurrent_requests
        open_requests = self.engine.num_open_requests
        if open_requests + num_requests > limit:
            raise CallError(
                "RESOURCE_EXHAUSTED",
                f"{open_requests} requests are in flight, the server's "
                f"max_concurrent_requests is {limit}; retry later",
            )
        return llm

    async def prepare(self, function: Callable[..., T], *args: object) -> T:
        """``function(*args)`` on one of the threads that prepare requests, so that the
        event loop keeps answering (health checks, other streams) while a large prompt is
        tokenized or a template rendered; ``CallError`` (RESOURCE_EXHAUSTED) when too many
        are waiting already."""
        limit = PREPARE_THREADS + MAX_WAITING_PREPARATIONS
        if self._num_preparing >= limit:
            raise CallError(
                "RESOURCE_EXHAUSTED",
                f"{self._num_preparing} requests are being prepared, the most this server "
                "queues; retry later",
            )
        self._num_preparing += 1
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(
                self._prepare_pool, functools.partial(function, *args)
            )
        finally:
            self._num_preparing -= 1

    @staticmethod
    def check_fits(
        llm: LLM,
        token_ids: list[int],
        params: SamplingParams,
        stop_field: str,
        params_field: str,
    ) -> None:
        """``ValueError`` for a request the engine could never run (it names the limit), or
        whose structured output it cannot give (named under ``params_field``)."""
        llm.check_task(None)
        if params.stop and llm.tokenizer is None:
            raise ValueError(
                f"{stop_field}={params.stop!r}: stop strings need a tokenizer, and "
                f"{str(llm.model_path)!r} has none; use stop token ids instead"
            )
        llm.check_token_ids(params, params_field)
        llm.check_logprobs(params, params_field)
        llm.check_structured_outputs(params, params_field)
        llm.engine.check_request_fits(len(token_ids), params.max_tokens, params.num_sequences)

    def submit(
        self,
        api: str,
        prompt: str | None,
        token_ids: list[int],
        params: SamplingParams | PoolingParams,
        cache_namespace: str | None,
        lora_id: int = 0,
        priority: int = 0,
    ) -> RequestStream:
        """Queue a checked request under a new engine id (``<api>-<n>``); an embedding
        request for ``PoolingParams``."""
        try:
            return self.engine.submit(
                f"{api}-{next(self._ids)}",
                prompt,
                token_ids,
                params,
                cache_namespace,
                lora_id,
                priority,
            )
        except EngineDeadError as error:
            raise CallError("UNAVAILABLE", f"engine died: {error}") from None

    async def outputs(
        self, stream: RequestStream, client_request_id: str
    ) -> AsyncIterator[RequestOutput | EmbeddingRequestOutput]:
        """The request's output as it grows (one object, updated in place); raises
        ``CallError`` if it fails, and ends the engine's request whenever the caller stops
        first (use it under ``contextlib.aclosing``)."""
        request_id = stream.output.request_id
        started_s = time.monotonic()
        first_token_s = None
        ending = "cancelled"  # unless it gets further: the caller stopped reading
        try:
            try:
                async for output in stream:
                    if first_token_s is None and _num_output_tokens(output):
                        first_token_s = time.monotonic() - started_s
                    yield output
            except EngineDeadError as error:
                raise CallError("UNAVAILABLE", f"engine died: {error}") from None
            except ServerDrainingError as error:
                raise CallError("UNAVAILABLE", str(error)) from None
            except ValueError as error:  # the scheduler refused it
                raise CallError("INVALID_ARGUMENT", str(error)) from None
            except RequestFailedError as error:  # the engine failed on it, and runs on
                raise CallError("INTERNAL", f"the request failed: {error.reason}") from None
            ending = "finished"
            self.metrics.observe_finished(
                stream.output, first_token_s, time.monotonic() - started_s
            )
        except CallError as error:
            ending = f"failed ({error.code}: {error.message})"
            raise
        finally:
            self.engine.abort(request_id)  # nothing to do once it finished
            if self.config.log_requests:
                self._log_call(stream, client_request_id, started_s, first_token_s, ending)

    def _log_call(
        self,
        stream: RequestStream,
        client_request_id: str,
        started_s: float,
        first_token_s: float | None,
        ending: str,
    ) -> None:
        """The request log's line for a call's engine request, however it ended
        (``ending``: finished, cancelled, or failed with its code and message)."""
        output = stream.output
        duration_s = time.monotonic() - started_s
        fields = {
            "request_id": output.request_id,
            "client_request_id": client_request_id,
            "ending": ending,
            "prompt_tokens": len(output.prompt_token_ids),
            "cached_tokens": output.num_cached_tokens,
            "output_tokens": _num_output_tokens(output),
            "finish_reasons": _finish_reasons(output),
            "duration_s": round(duration_s, 6),
            "queue_time_s": output.queue_time_s,
            "first_token_s": first_token_s,
        }
        logger.info(
            "%s (client id %r) %s: %d prompt tokens (%d cached), %d output tokens, %s, %.3f s "
            "(%s queued)",
            output.request_id,
            client_request_id,
            ending,
            fields["prompt_tokens"],
            fields["cached_tokens"] or 0,
            fields["output_tokens"],
            fields["finish_reasons"],
            duration_s,
            "-" if output.queue_time_s is None else f"{output.queue_time_s:.3f} s",
            extra={"fields": fields},  # the JSON log format's (--log-format json)
        )

    @contextlib.asynccontextmanager
    async def call(
        self, api: str, code_of: Callable[[BaseException], str] = _unknown_code
    ) -> AsyncIterator[Counters]:
        """Count a generation call while it runs, and how it ended (``code_of`` names
        the status an exception ended it with)."""
        counters = self.counters
        counters.running += 1
        self.metrics.running.inc()
        self._idle.clear()
        code = "OK"
        try:
            yield counters
        except (asyncio.CancelledError, GeneratorExit, ConnectionResetError):
            # The client cancelled, its deadline passed, or it went away mid-stream.
            counters.cancelled += 1
            code = "CANCELLED"
            raise
        except BaseException as error:
            counters.failed += 1  # bad input, overload, death
            code = code_of(error)
            raise
        else:
            counters.finished += 1
        finally:
            counters.running -= 1
            self.metrics.running.dec()
            self.metrics.calls.labels(api=api, code=code).inc()
            if counters.running == 0:
                self._idle.set()

    def served_model_name(self) -> str:
        if self.config.served_model_name is not None:
            return self.config.served_model_name
        return str(self.engine.llm.model_path) if self.engine.llm is not None else ""

    def served_model_names(self) -> tuple[str, ...]:
        """The base model's names in the OpenAI API: the first, which answers carry, then
        the aliases requests may use too."""
        return (self.served_model_name(), *self.config.served_model_aliases)

    def on_serving(self, callback: Callable[[bool], object]) -> None:
        """``callback(True)`` once serving, ``callback(False)`` when draining (awaited
        when it returns an awaitable)."""
        self._on_serving.append(callback)

    # ------------------------------------------------------------ the process's life

    async def run(self) -> int:
        # Imported here: each API module builds on this one.
        from pagedserve.frontend.grpc_server import GrpcApi
        from pagedserve.frontend.http_server import HttpApi

        loop = asyncio.get_running_loop()
        grpc_api = GrpcApi(self)
        http_api = HttpApi(self) if self.config.http_port is not None else None
        try:
            grpc_port = grpc_api.bind()
            http_port = None if http_api is None else await http_api.bind()
        except OSError as error:
            logger.error("cannot listen: %s", error)
            if http_api is not None:
                await http_api.stop()
            await grpc_api.stop(None)
            return 1
        for signal_number in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signal_number, self._on_signal, signal_number)
        self.metrics.attach_engine(self.engine.stats, loop)
        metrics_port = None
        if self.config.metrics_port is not None:
            try:
                metrics_port = self.metrics.serve(self.config.host, self.config.metrics_port)
            except OSError as error:
                logger.error(
                    "cannot serve metrics on %s:%d: %s",
                    self.config.host,
                    self.config.metrics_port,
                    error,
                )
                if http_api is not None:
                    await http_api.stop()
                await grpc_api.stop(None)
                return 1
            logger.info("metrics on http://%s:%d/metrics", self.config.host, metrics_port)
        await grpc_api.start()
        watchdog = asyncio.create_task(self._watchdog())
        liveness = asyncio.create_task(self.liveness.run(self.engine))
        try:
            self.engine.start()
            try:
                llm = await self._wait_ready()
            except Exception as error:  # start-up failed: say what, exit non-zero
                logger.error("engine start-up failed: %s", error)
                self._exit_code = 2 if isinstance(error, (ValueError, TypeError)) else 1
                return self._exit_code
            if llm is None:
                return self._exit_code  # told to stop while the model loaded
            self._begin_serving(llm)
            await self._notify_serving(True)
            logger.info(
                "serving %s on %s:%d (gRPC)%s (pid %d); KV cache %d blocks x %d tokens",
                llm.model_path,
                self.config.host,
                grpc_port,
                "" if http_port is None else f" and {self.config.host}:{http_port} (HTTP)",
                os.getpid(),
                llm.num_blocks,
                llm.block_size,
            )
            self._write_port_file(grpc_port, http_port, metrics_port)
            systemd_notify.notify("READY=1", f"STATUS=serving on {self.config.host}:{grpc_port}")
            await self.stop_requested.wait()
            await self._drain()
        finally:
            watchdog.cancel()
            liveness.cancel()
            self.draining = True
            await grpc_api.stop(FINAL_GRACE_S)
            if http_api is not None:
                await http_api.stop()
            await self.engine.shutdown()
            self._prepare_pool.shutdown(wait=False, cancel_futures=True)
            self.metrics.close()
            for signal_number in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(signal_number)
        logger.info("stopped (exit code %d)", self._exit_code)
        return self._exit_code

    async def start_engine(self) -> LLM:
        """Start the engine and wait until it serves, for a caller without the APIs (the
        batch runner); the engine's start-up error if it fails. ``engine.shutdown()``
        ends it."""
        self.engine.start()
        llm = await self.engine.wait_ready()
        self._begin_serving(llm)
        return llm

    def _begin_serving(self, llm: LLM) -> None:
        self.default_params = llm.default_sampling_params()
        self.serving_since_s = time.time()
        self.serving = True

    async def _notify_serving(self, serving: bool) -> None:
        for callback in self._on_serving:
            result = callback(serving)
            if asyncio.iscoroutine(result):
                await result

    async def _wait_ready(self) -> LLM | None:
        ready = asyncio.ensure_future(self.engine.wait_ready())
        stop = asyncio.ensure_future(self.stop_requested.wait())
        await asyncio.wait((ready, stop), return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if ready.done():
            return ready.result()
        ready.cancel()
        return None

    async def _drain(self) -> None:
        """Refuse new calls, let those in flight end (up to the drain timeout), then end
        the rest."""
        self.draining = True
        systemd_notify.notify("STOPPING=1", "STATUS=draining")
        await self._notify_serving(False)
        timeout_s = self.config.drain_timeout_s
        if self.counters.running and self.engine.dead_message is None and self._signals < 2:
            logger.info(
                "draining: %d calls in flight, waiting up to %.0f s",
                self.counters.running,
                timeout_s,
            )
            idle = asyncio.ensure_future(self._idle.wait())
            forced = asyncio.ensure_future(self._forced_stop.wait())
            await asyncio.wait((idle, forced), timeout=timeout_s, return_when="FIRST_COMPLETED")
            idle.cancel()
            forced.cancel()
        error = ServerDrainingError(
            "the server shut down before the request finished (drain timeout "
            f"{timeout_s:g} s); send it again to another server"
        )
        self.engine.fail_all(error)

    def _on_signal(self, signal_number: int) -> None:
        self._signals += 1
        name = signal.Signals(signal_number).name
        if self._signals == 1:
            logger.info("%s: draining", name)
            self.stop_requested.set()
        else:
            logger.info("%s again: ending the calls in flight now", name)
            self._forced_stop.set()

    def _on_engine_dead(self, message: str) -> None:
        self._exit_code = 1
        self.stop_requested.set()

    async def _watchdog(self) -> None:
        interval_s = systemd_notify.watchdog_interval_s()
        if interval_s is None:
            return
        while True:
            if self.liveness.stalled is None:  # a stalled engine: let systemd see it
                systemd_notify.notify("WATCHDOG=1")
            await asyncio.sleep(interval_s)

    async def _on_recovered(self) -> None:
        if self.serving and not self.draining:
            await self._notify_serving(True)

    def _write_port_file(self, port: int, http_port: int | None, metrics_port: int | None) -> None:
        if self.config.port_file is None:
            return
        path = Path(self.config.port_file)
        temporary = path.with_name(path.name + ".tmp")
        contents = {
            "port": port,
            "http_port": http_port,
            "pid": os.getpid(),
            "metrics_port": metrics_port,
        }
        temporary.write_text(json.dumps(contents))
        temporary.replace(path)  # readers never see half a file


def serve(make_llm: Callable[[], LLM], config: ServerConfig) -> int:
    """Run the server on uvloop (asyncio's own loop where uvloop is missing) until it is
    told to stop; returns the exit code."""
    try:
        import uvloop
    except ImportError:  # not on this platform
        return asyncio.run(Server(make_llm, config).run())
    return uvloop.run(Server(make_llm, config).run())
