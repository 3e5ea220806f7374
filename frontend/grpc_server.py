"""``pagedserve serve``: the gRPC server (grpc.aio on uvloop) in front of the engine.

This process is the frontend: it validates and tokenizes requests, decodes and streams
their outputs, and runs no model (neither weights nor compiled ops load here); the
scheduler and the workers run in processes of their own (``async_engine.py``,
``engine_client.py``).

- **Requests** (``pagedserve.v1.Generation``): ``Generate`` (whole result),
  ``GenerateStream`` (what is new, as it is made), ``Tokenize``, ``GetModelInfo``,
  ``GetStats``. Bad input gets ``INVALID_ARGUMENT`` naming the field, the value and the
  limit; more than ``max_concurrent_requests`` in flight get ``RESOURCE_EXHAUSTED``.
- **Cancellation**: a call the client cancels, or whose deadline passes, ends its request
  in the engine at once, which frees its KV blocks.
- **Health** (``grpc.health.v1.Health``): ``NOT_SERVING`` while the model loads and while
  draining, ``SERVING`` in between; reflection lists the services.
- **Draining** (SIGTERM or SIGINT): health turns ``NOT_SERVING``, new calls get
  ``UNAVAILABLE``, calls in flight run to their end for up to ``drain_timeout_s``, then
  those left end with ``UNAVAILABLE``; the engine stops and the process exits 0. A second
  signal ends the drain at once.
- **Engine death**: every call in flight ends with ``UNAVAILABLE`` naming what died, and
  the process exits 1 (systemd's ``Restart=on-failure`` brings it back).
- **TLS** (``tls_cert_file``, ``tls_key_file``; mutual with ``tls_client_ca_file``).
- **Metrics** (``metrics_port``): Prometheus text at ``/metrics`` (``metrics.py``).
- **systemd**: ``READY=1`` once serving, ``STOPPING=1`` when draining, ``WATCHDOG=1``
  from the event loop when ``WatchdogSec=`` is set (tools/systemd/pagedserve.service).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pagedserve.frontend import systemd_notify
from pagedserve.frontend.async_engine import AsyncEngine, RequestStream
from pagedserve.frontend.engine_client import EngineDeadError
from pagedserve.frontend.grpc_convert import (
    StreamState,
    sampling_params_from_proto,
    whole_response,
)
from pagedserve.frontend.metrics import ServerMetrics
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from pagedserve.frontend.llm import LLM

logger = logging.getLogger("pagedserve.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name
DEFAULT_MAX_CONCURRENT_REQUESTS = 1024
DEFAULT_DRAIN_TIMEOUT_S = 30.0
# Requests carry prompts of up to a model's whole context as text or token ids.
MAX_MESSAGE_BYTES = 64 << 20
# After the drain: how long handlers get to send the statuses of the calls ended last.
_FINAL_GRACE_S = 2.0


class ServerDrainingError(RuntimeError):
    """The server stopped before the request finished."""


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 50051  # 0: any free port (written to port_file)
    max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    # Written once serving: {"port": ..., "pid": ..., "metrics_port": ...}, for callers
    # that asked for port 0.
    port_file: str | None = None
    # Prometheus metrics over HTTP at /metrics on host:metrics_port (0: any free port);
    # None: off.
    metrics_port: int | None = None
    # GenerateStream sends a message once this many new tokens are there (the first token
    # and the end at once): 1 streams every step; more cut the frontend's cost per token.
    stream_interval_tokens: int = 1
    # An INFO line per finished call (ids, token counts, finish reasons, seconds).
    log_requests: bool = True
    # TLS: the server's certificate chain and private key (PEM files); with a client CA
    # file too, clients must present a certificate it signed (mutual TLS). None: plaintext.
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_client_ca_file: str | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        if self.max_concurrent_requests < 1:
            raise ValueError(
                f"max_concurrent_requests must be >= 1, got {self.max_concurrent_requests}"
            )
        if self.stream_interval_tokens < 1:
            raise ValueError(
                f"stream_interval_tokens must be >= 1, got {self.stream_interval_tokens}"
            )
        if not self.drain_timeout_s >= 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together: give both or neither")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError("tls_client_ca_file needs tls_cert_file and tls_key_file")
        for name in ("tls_cert_file", "tls_key_file", "tls_client_ca_file"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{name}: {path!r} is not a readable file")

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """TLS credentials from the PEM files, or None for plaintext."""
        if self.tls_cert_file is None:
            return None
        client_ca = (
            None if self.tls_client_ca_file is None else Path(self.tls_client_ca_file).read_bytes()
        )
        return grpc.ssl_server_credentials(
            [(Path(self.tls_key_file).read_bytes(), Path(self.tls_cert_file).read_bytes())],
            root_certificates=client_ca,
            require_client_auth=client_ca is not None,
        )


class _Counters:
    def __init__(self) -> None:
        self.running = 0
        self.finished = 0
        self.failed = 0
        self.cancelled = 0


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, server: Server) -> None:
        self._server = server
        self._engine = server.engine
        self._ids = itertools.count()

    # ------------------------------------------------------------ RPCs

    async def Generate(self, request: pb.GenerateRequest, context) -> pb.GenerateResponse:
        async with self._server.call(context):
            stream = await self._admit(request, context)
            async with contextlib.aclosing(self._run(stream, request, context)) as outputs:
                async for _output in outputs:
                    pass
            return whole_response(request.request_id, stream.output)

    async def GenerateStream(
        self, request: pb.GenerateRequest, context
    ) -> AsyncIterator[pb.GenerateResponse]:
        async with self._server.call(context):
            stream = await self._admit(request, context)
            state = StreamState(request.request_id)
            # aclosing: a call that ends early (cancelled while sending) aborts the request
            # now, not when the generator is collected.
            async with contextlib.aclosing(self._run(stream, request, context)) as outputs:
                interval_tokens = self._server.config.stream_interval_tokens
                async for output in outputs:
                    if not state.due(output, interval_tokens):
                        continue
                    response = state.next_response(output)
                    if response is not None:
                        yield response

    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        llm = await self._ready_llm(context)
        try:
            kind = request.WhichOneof("input")
            if kind == "chat":
                text = self._render_chat(llm, request.chat, "chat")
                token_ids = llm.tokenizer.encode(text, add_special_tokens=False)
            elif kind == "text":
                token_ids = llm.encode_prompt(request.text, "text")
            else:
                raise ValueError("input: set one of text, chat")
        except (ValueError, TypeError) as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        return pb.TokenizeResponse(token_ids=token_ids)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context) -> pb.ModelInfo:
        llm = await self._ready_llm(context)
        config = llm.scheduler_config
        return pb.ModelInfo(
            model=str(llm.model_path),
            architecture=llm.model_config.architecture,
            dtype=llm.dtype,
            vocab_size=llm.model_config.vocab_size,
            max_model_len=config.max_model_len,
            block_size=llm.block_size,
            num_blocks=llm.num_blocks,
            max_num_seqs=config.max_num_seqs,
            tensor_parallel_size=llm.tensor_parallel_size,
            eos_token_ids=sorted(llm.eos_token_ids),
        )

    async def GetStats(self, request: pb.GetStatsRequest, context) -> pb.Stats:
        await self._ready_llm(context)
        try:
            engine_stats = await self._engine.stats()
        except EngineDeadError as error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"engine died: {error}")
        counters = self._server.counters
        return pb.Stats(
            engine={name: float(value) for name, value in engine_stats.stats.items()},
            requests_running=counters.running,
            requests_finished=counters.finished,
            requests_failed=counters.failed,
            requests_cancelled=counters.cancelled,
            integrity_error=engine_stats.integrity_error or "",
        )

    # ------------------------------------------------------------ internals

    async def _ready_llm(self, context) -> LLM:
        if self._engine.dead_message is not None:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, f"engine died: {self._engine.dead_message}"
            )
        if not self._server.serving:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine is still starting")
        return self._engine.llm

    async def _admit(self, request: pb.GenerateRequest, context) -> RequestStream:
        """Validate, tokenize and queue a request, or end the call with a clear status."""
        if self._server.draining:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, "the server is shutting down; send to another one"
            )
        llm = await self._ready_llm(context)
        limit = self._server.config.max_concurrent_requests
        if self._engine.num_open_requests >= limit:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self._engine.num_open_requests} requests are in flight, the server's "
                f"max_concurrent_requests is {limit}; retry later",
            )
        try:
            prompt, token_ids = self._prompt(llm, request)
            params = sampling_params_from_proto(
                request.sampling if request.HasField("sampling") else None,
                self._server.default_params,
            )
            if params.stop and llm.tokenizer is None:
                raise ValueError(
                    f"sampling.stop={params.stop!r}: stop strings need a tokenizer, and "
                    f"{str(llm.model_path)!r} has none; use sampling.stop_token_ids instead"
                )
            llm.engine.check_request_fits(len(token_ids), params.max_tokens, params.num_sequences)
        except (ValueError, TypeError) as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        engine_id = f"grpc-{next(self._ids)}"
        try:
            return self._engine.submit(
                engine_id, prompt, token_ids, params, request.cache_namespace or None
            )
        except EngineDeadError as error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"engine died: {error}")

    def _prompt(self, llm: LLM, request: pb.GenerateRequest) -> tuple[str | None, list[int]]:
        kind = request.WhichOneof("prompt")
        if kind == "text":
            return request.text, llm.encode_prompt(request.text, "text")
        if kind == "token_ids":
            return None, llm.encode_prompt(list(request.token_ids.ids), "token_ids.ids")
        if kind == "chat":
            text = self._render_chat(llm, request.chat, "chat")
            token_ids = llm.tokenizer.encode(text, add_special_tokens=False)
            return text, llm.encode_prompt(token_ids, "chat")
        raise ValueError("prompt: set one of text, token_ids, chat")

    @staticmethod
    def _render_chat(llm: LLM, chat: pb.Chat, field: str) -> str:
        if not chat.messages:
            raise ValueError(f"{field}.messages is empty; it needs at least one message")
        for position, message in enumerate(chat.messages):
            if not message.role:
                raise ValueError(f"{field}.messages[{position}].role is empty")
        conversation = [{"role": m.role, "content": m.content} for m in chat.messages]
        return llm.render_chat(conversation, f"{field}.messages")

    async def _run(
        self, stream: RequestStream, request: pb.GenerateRequest, context
    ) -> AsyncIterator:
        """The request's outputs as they grow; ends the call with a status on failure,
        and the engine's request whenever the call ends first (cancel, deadline)."""
        request_id = stream.output.request_id
        started_s = time.monotonic()
        first_token_s = None
        try:
            async for output in stream:
                if first_token_s is None and any(c.token_ids for c in output.outputs):
                    first_token_s = time.monotonic() - started_s
                yield output
        except EngineDeadError as error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"engine died: {error}")
        except ServerDrainingError as error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(error))
        except ValueError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        finally:
            self._engine.abort(request_id)  # nothing to do once it finished
        output = stream.output
        duration_s = time.monotonic() - started_s
        self._server.metrics.observe_finished(output, first_token_s, duration_s)
        if not self._server.config.log_requests:
            return
        logger.info(
            "%s (client id %r): %d prompt tokens (%d cached), %d output tokens, %s, %.3f s",
            request_id,
            request.request_id,
            len(output.prompt_token_ids),
            output.num_cached_tokens,
            sum(len(c.token_ids) for c in output.outputs),
            ",".join(str(c.finish_reason) for c in output.outputs),
            duration_s,
        )


class Server:
    """The gRPC server and the engine behind it; ``run()`` serves until told to stop
    and returns the process's exit code."""

    def __init__(self, make_llm: Callable[[], LLM], config: ServerConfig) -> None:
        self.config = config
        self.engine = AsyncEngine(make_llm, on_dead=self._on_engine_dead)
        self.counters = _Counters()
        self.metrics = ServerMetrics()
        self.draining = False
        self.serving = False  # the engine is up and the defaults are known
        self.default_params = None
        self._exit_code = 0
        self._stop = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._health = health.aio.HealthServicer()
        self._signals = 0
        self._forced_stop = asyncio.Event()  # a second signal: end the drain now

    @contextlib.asynccontextmanager
    async def call(self, context) -> AsyncIterator[_Counters]:
        """Count a generation call while it runs, and how it ended."""
        counters = self.counters
        counters.running += 1
        self.metrics.running.inc()
        self._idle.clear()
        code = grpc.StatusCode.OK
        try:
            yield counters
        except (asyncio.CancelledError, GeneratorExit):
            # The client cancelled, its deadline passed, or it went away mid-stream.
            counters.cancelled += 1
            code = grpc.StatusCode.CANCELLED
            raise
        except BaseException:
            counters.failed += 1  # context.abort raises: bad input, overload, death
            code = context.code() or grpc.StatusCode.UNKNOWN
            raise
        else:
            counters.finished += 1
        finally:
            counters.running -= 1
            self.metrics.running.dec()
            self.metrics.calls.labels(code=code.name).inc()
            if counters.running == 0:
                self._idle.set()

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.so_reuseport", 0),  # a port in use is an error, not a shared port
            ]
        )
        pb_grpc.add_GenerationServicer_to_server(GenerationServicer(self), server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        address = f"{self.config.host}:{self.config.port}"
        try:
            credentials = self.config.server_credentials()
            if credentials is None:
                port = server.add_insecure_port(address)
            else:
                port = server.add_secure_port(address, credentials)
        except RuntimeError as error:
            logger.error("cannot listen on %s: %s", address, error)
            return 1
        for signal_number in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signal_number, self._on_signal, signal_number)
        metrics_port = None
        if self.config.metrics_port is not None:
            try:
                metrics_port = self.metrics.serve(
                    self.config.host, self.config.metrics_port, self.engine.stats, loop
                )
            except OSError as error:
                logger.error(
                    "cannot serve metrics on %s:%d: %s",
                    self.config.host,
                    self.config.metrics_port,
                    error,
                )
                await server.stop(None)
                return 1
            logger.info("metrics on http://%s:%d/metrics", self.config.host, metrics_port)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await server.start()
        watchdog = asyncio.create_task(self._watchdog())
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
            self.default_params = llm.default_sampling_params()
            self.serving = True
            await self._set_health(health_pb2.HealthCheckResponse.SERVING)
            logger.info(
                "serving %s on %s:%d (pid %d); KV cache %d blocks x %d tokens",
                llm.model_path,
                self.config.host,
                port,
                os.getpid(),
                llm.num_blocks,
                llm.block_size,
            )
            self._write_port_file(port, metrics_port)
            systemd_notify.notify("READY=1", f"STATUS=serving on {self.config.host}:{port}")
            await self._stop.wait()
            await self._drain()
        finally:
            watchdog.cancel()
            self.draining = True
            await self._health.enter_graceful_shutdown()
            await server.stop(_FINAL_GRACE_S)
            await self.engine.shutdown()
            self.metrics.close()
            for signal_number in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(signal_number)
        logger.info("stopped (exit code %d)", self._exit_code)
        return self._exit_code

    async def _wait_ready(self) -> LLM | None:
        ready = asyncio.ensure_future(self.engine.wait_ready())
        stop = asyncio.ensure_future(self._stop.wait())
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
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
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
            self._stop.set()
        else:
            logger.info("%s again: ending the calls in flight now", name)
            self._forced_stop.set()

    def _on_engine_dead(self, message: str) -> None:
        self._exit_code = 1
        self._stop.set()

    async def _set_health(self, status: int) -> None:
        for service in ("", SERVICE_NAME):
            await self._health.set(service, status)

    async def _watchdog(self) -> None:
        interval_s = systemd_notify.watchdog_interval_s()
        if interval_s is None:
            return
        while True:
            systemd_notify.notify("WATCHDOG=1")
            await asyncio.sleep(interval_s)

    def _write_port_file(self, port: int, metrics_port: int | None) -> None:
        if self.config.port_file is None:
            return
        path = Path(self.config.port_file)
        temporary = path.with_name(path.name + ".tmp")
        contents = {"port": port, "pid": os.getpid(), "metrics_port": metrics_port}
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
