"""The HTTP API of ``pagedserve serve --http-port N``: OpenAI-compatible, on aiohttp, in
the same process and event loop as the gRPC API, sharing its engine, admission limit,
drain and metrics (``server.py``).

Routes:

- ``POST /v1/completions``, ``POST /v1/chat/completions``: OpenAI's requests and answers
  (``openai_protocol.py``, ``openai_answers.py``, ``openai_streams.py``); ``"stream":
  true`` answers with server-sent events, one ``data: {chunk}`` per step (or per
  ``--stream-interval`` tokens), then
  ``data: [DONE]``. A client that disconnects ends its requests in the engine at once.
- ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``, ``GET
  /v1/responses/{id}/input_items``, ``POST /v1/responses/{id}/cancel``: OpenAI's Responses
  API (``openai_responses.py``), run as a chat completion (or in the background); a
  stream's events are typed (``event: <type>``) and end without ``[DONE]``, as OpenAI's do.
- ``POST /v1/embeddings``: OpenAI's embeddings (``input`` as text, token ids or a batch
  of either; ``encoding_format`` float or base64; ``dimensions``), vLLM's
  ``truncate_prompt_tokens`` and ``normalize``: one prompt-only engine request per input.
- ``POST /score`` (``/v1/score``) and ``POST /rerank`` (``/v1/rerank``, ``/v2/rerank``):
  vLLM's scores: of an embedding model, the cosine similarity of two texts' embeddings;
  of a cross-encoder, each pair classified (``openai_scores.py``).
- ``POST /classify`` (``/v1/classify``): vLLM's classifications by a sequence
  classification model, probabilities over its labels (``openai_classify.py``).
- ``POST /pooling``: vLLM's pooler output of either task in one shape, an embedding or a
  classification's probabilities per input (``openai_pooling.py``).
- ``GET /v1/models`` (and ``/v1/models/{name}``): the one model served.
- ``POST /tokenize``, ``POST /detokenize``: as vLLM's.
- ``GET /health``: 200 while serving, 503 while the model loads, when draining, or once
  the engine died. ``GET /metrics``: Prometheus text. ``GET /version``.

Errors are OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: 400 for
bad input (the message names the field, the value and the limit), 404 for another model
or route, 429 past ``--max-concurrent-requests``, 503 while starting or draining or once
the engine died, 500 for a fault of the server's own. A stream that fails after it began
sends the error as its last event before ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import re
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from aiohttp import web, web_protocol, web_server

from pagedserve.frontend import openai_answers as answers
from pagedserve.frontend import responses_store
from pagedserve.frontend.api_key import UNAUTHENTICATED_MESSAGE, bearer_matches
from pagedserve.frontend.call_errors import HTTP_STATUS, CallError
from pagedserve.frontend.cors import CorsPolicy
from pagedserve.frontend.openai_calls import OpenAiCalls
from pagedserve.frontend.openai_prompts import chat_prompt
from pagedserve.frontend.openai_streams import StreamWriter
from pagedserve.frontend.request_contract import decode_json
from pagedserve.frontend.responses_output import ResponseStream
from pagedserve.frontend.server import MAX_MESSAGE_BYTES

if TYPE_CHECKING:
    from pagedserve.frontend.server import Server

logger = logging.getLogger("pagedserve.server")

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}
# When a refused client may try again (429, 503), in seconds.
_RETRY_AFTER_S = 1
# Bodies up to this size are decoded on the event loop (a thread would cost more).
_DECODE_ON_LOOP_BYTES = 1 << 20


def error_body(error: CallError) -> dict:
    status = HTTP_STATUS[error.code]
    return {
        "error": {
            "message": error.message,
            "type": _ERROR_TYPES[status],
            "param": error.param,
            "code": status,
        }
    }


def error_response(error: CallError) -> web.Response:
    status = HTTP_STATUS[error.code]
    headers = {"Retry-After": str(_RETRY_AFTER_S)} if status in (429, 503) else None
    return web.json_response(error_body(error), status=status, headers=headers)


def _sse(data: Any) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


def _typed_sse(event: dict) -> bytes:
    """A Responses API event: its type named on the ``event:`` line too."""
    return f"event: {event['type']}\n".encode() + _sse(event)


@web.middleware
async def _errors(request: web.Request, handler) -> web.StreamResponse:
    """Every error in OpenAI's shape, aiohttp's own (404, 405, 413) included."""
    try:
        return await handler(request)
    except CallError as error:
        return error_response(error)
    except web.HTTPException as error:
        if error.status < 400:
            raise
        code = {404: "NOT_FOUND", 503: "UNAVAILABLE"}.get(error.status, "INVALID_ARGUMENT")
        body = error_body(CallError(code, f"{request.method} {request.path}: {error.reason}"))
        body["error"]["code"] = error.status
        return web.json_response(body, status=error.status)
    except Exception as error:  # a fault of ours: still an answer in OpenAI's shape
        logger.exception("%s %s failed", request.method, request.path)
        return error_response(_internal_error(error))


def _internal_error(error: Exception) -> CallError:
    return CallError("INTERNAL", f"internal server error ({type(error).__name__}: {error})")


# Open without the API key: probes, scrapers and version checks hold none.
_OPEN_PATHS = frozenset({"/health", "/ping", "/metrics", "/version", "/load"})


def _api_key_check(api_key: str):
    @web.middleware
    async def check(request: web.Request, handler) -> web.StreamResponse:
        if request.path not in _OPEN_PATHS and not bearer_matches(
            request.headers.get("Authorization"), api_key
        ):
            response = error_response(CallError("UNAUTHENTICATED", UNAUTHENTICATED_MESSAGE))
            response.headers["WWW-Authenticate"] = "Bearer"
            return response
        return await handler(request)

    return check


class _HeaderTimedHandler(web_protocol.RequestHandler):
    """aiohttp's connection protocol, which waits for a request's headers without end once
    one byte has come: here a connection closes when they are not all in within
    ``header_timeout_s`` (``await_headers`` starts the clock again once a call on it has
    been answered)."""

    header_timeout_s = 30.0  # set per server (``ServerConfig.http_read_timeout_s``)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._header_tail = b""
        self.await_headers()

    def await_headers(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._header_tail = b""
        self._header_timer = self._loop.call_later(self.header_timeout_s, self._too_slow)

    def data_received(self, data: bytes) -> None:
        if self._header_timer is not None:
            seen = self._header_tail + data
            if b"\r\n\r\n" in seen:  # the headers' end
                self._header_timer.cancel()
                self._header_timer = None
            else:
                self._header_tail = seen[-3:]
        super().data_received(data)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        super().connection_lost(exc)

    def _too_slow(self) -> None:
        self._header_timer = None
        if self.transport is not None:
            self.transport.close()


class _HeaderTimedServer(web_server.Server):
    header_timeout_s = 30.0

    def __call__(self) -> web_protocol.RequestHandler:
        handler = _HeaderTimedHandler(self, loop=self._loop, **self._kwargs)
        handler.header_timeout_s = self.header_timeout_s
        return handler


class _AppRunner(web.AppRunner):
    """aiohttp's runner, its connections ``_HeaderTimedHandler``s."""

    def __init__(self, app: web.Application, header_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._header_timeout_s = header_timeout_s

    async def _make_server(self) -> web_server.Server:
        server = await super()._make_server()
        # NOTE: aiohttp builds its server with arguments of its own; the subclass only
        # changes which protocol each connection gets.
        server.__class__ = _HeaderTimedServer
        server.header_timeout_s = self._header_timeout_s
        return server


@web.middleware
async def _next_headers_timed(request: web.Request, handler) -> web.StreamResponse:
    """Once a call is answered, its connection's next headers are timed afresh."""
    try:
        return await handler(request)
    finally:
        if isinstance(request.protocol, _HeaderTimedHandler):
            request.protocol.await_headers()


class HttpApi:
    """The aiohttp application of a ``Server``: bound before the model loads (``/health``
    answers 503 meanwhile), stopped after the drain."""

    def __init__(self, server: Server) -> None:
        self._server = server
        self._calls = OpenAiCalls(server, "http")
        middlewares = [_errors, _next_headers_timed]
        if server.config.api_key is not None:
            middlewares.append(_api_key_check(server.config.api_key))
        app = web.Application(client_max_size=MAX_MESSAGE_BYTES, middlewares=middlewares)
        if server.config.allowed_origins:
            CorsPolicy(server.config.allowed_origins, server.config.allow_credentials).install(app)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat_completions)
        app.router.add_post("/v1/responses", self._responses)
        app.router.add_get("/v1/responses/{response_id}", self._get_response)
        app.router.add_get("/v1/responses/{response_id}/input_items", self._input_items)
        app.router.add_delete("/v1/responses/{response_id}", self._delete_response)
        app.router.add_post("/v1/responses/{response_id}/cancel", self._cancel_response)
        app.router.add_post("/v1/embeddings", self._embeddings)
        # vLLM's scores of an embedding model (and the rerank route's versions it serves).
        for path in ("/score", "/v1/score"):
            app.router.add_post(path, self._score)
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            app.router.add_post(path, self._rerank)
        for path in ("/classify", "/v1/classify"):
            app.router.add_post(path, self._classify)
        app.router.add_post("/pooling", self._pooling)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/v1/models/{name:.+}", self._model)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/detokenize", self._detokenize)
        app.router.add_get("/health", self._health)
        # SageMaker's routes (vLLM serves them too): a probe, and one route for all calls.
        app.router.add_get("/ping", self._health)
        app.router.add_post("/ping", self._health)
        app.router.add_post("/invocations", self._invocations)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/version", self._version)
        # vLLM's: the requests in flight (a load balancer's signal), and a reset of the prefix
        # cache (benchmarks measure cold prompts with it).
        app.router.add_get("/load", self._load)
        app.router.add_post("/reset_prefix_cache", self._reset_prefix_cache)
        if server.config.allow_runtime_lora_updating:
            app.router.add_post("/v1/load_lora_adapter", self._load_lora_adapter)
            app.router.add_post("/v1/unload_lora_adapter", self._unload_lora_adapter)
        # handler_cancellation: a client that goes away cancels its handler, which ends
        # its requests in the engine (the default lets them run to the end unread).
        self._runner = _AppRunner(
            app,
            server.config.http_read_timeout_s,
            handler_cancellation=True,
            access_log=None,
        )
        self._set_up = False

    async def _json_body(self, request: web.Request) -> Any:
        """The body as JSON, whatever its content type says (as curl -d sends it), no
        deeper than the request contract's ``MAX_JSON_DEPTH``. A client that takes longer
        than ``http_read_timeout_s`` to send it is answered 408; a large body is decoded off
        the event loop."""
        timeout_s = self._server.config.http_read_timeout_s
        try:
            data = await asyncio.wait_for(request.read(), timeout_s)
        except asyncio.TimeoutError:
            raise CallError(
                "DEADLINE_EXCEEDED", f"the request body did not arrive within {timeout_s:g} s", ""
            ) from None
        try:
            if len(data) <= _DECODE_ON_LOOP_BYTES:
                return decode_json("the request body", data, "")
            return await self._server.prepare(decode_json, "the request body", data, "")
        except ValueError as error:
            message = str(error)
            # The field at fault leads its message ("stop holds ..."), or the body does.
            field = (
                "" if message.startswith("the request body") else re.split(r"[ .\[]", message)[0]
            )
            raise CallError("INVALID_ARGUMENT", message, field) from None

    async def bind(self) -> int:
        """Listen on the configured address; returns the port. ``OSError`` if it cannot."""
        config = self._server.config
        await self._runner.setup()
        self._set_up = True
        site = web.TCPSite(
            self._runner,
            config.host,
            config.http_port,
            ssl_context=config.ssl_context(),
            shutdown_timeout=1.0,  # after the drain, nothing should be left to wait for
            reuse_port=False,
        )
        try:
            await site.start()
        except OSError as error:
            raise OSError(
                f"cannot listen on {config.host}:{config.http_port} (HTTP): {error.strerror}"
            ) from None
        return self._runner.addresses[-1][1]

    async def stop(self) -> None:
        if self._set_up:
            await self._runner.cleanup()
            self._set_up = False

    # ------------------------------------------------------------ generation

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate("completion", request)

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate("chat", request)

    async def _generate(self, kind: str, http_request: web.Request) -> web.StreamResponse:
        try:
            response = await self._generate_counted(kind, http_request)
        except _StreamFailed as failure:
            response = failure.response
        if response.prepared:
            # An event stream: its end goes out once the call is counted, so a client that
            # has read [DONE] finds its call in /metrics and the stats.
            with contextlib.suppress(ConnectionResetError):  # gone after its last event
                await response.write(b"data: [DONE]\n\n")
                await response.write_eof()
        return response

    async def _generate_counted(self, kind: str, http_request: web.Request):
        server = self._server
        async with server.call("http"):
            server.check_admission()  # before the body is read: refused while starting
            api_request, streams, llm = await self._calls.start_generation(
                kind, await self._json_body(http_request), http_request.headers.get("X-Request-Id")
            )
            if api_request.stream:
                return await self._stream(api_request, streams, http_request)
            outputs = await self._calls.whole(api_request.client_request_id, streams)
            return web.json_response(
                answers.whole_response(api_request, outputs, llm),
                headers=_request_id_header(http_request),
            )

    async def _embeddings(self, http_request: web.Request) -> web.Response:
        return await self._answered(http_request, self._calls.embedding)

    async def _classify(self, http_request: web.Request) -> web.Response:
        return await self._answered(http_request, self._calls.classification)

    async def _pooling(self, http_request: web.Request) -> web.Response:
        return await self._answered(http_request, self._calls.pooling)

    async def _answered(self, http_request: web.Request, call) -> web.Response:
        """A body answered whole by ``call`` (one of ``OpenAiCalls``'), as JSON."""
        server = self._server
        async with server.call("http"):
            server.check_admission()
            body = await call(
                await self._json_body(http_request), http_request.headers.get("X-Request-Id")
            )
            return web.json_response(body, headers=_request_id_header(http_request))

    async def _responses(self, http_request: web.Request) -> web.StreamResponse:
        try:
            response = await self._responses_counted(http_request)
        except _StreamFailed as failure:
            response = failure.response
        if response.prepared:
            with contextlib.suppress(ConnectionResetError):
                await response.write_eof()  # a Responses stream ends without [DONE]
        return response

    async def _responses_counted(self, http_request: web.Request) -> web.StreamResponse:
        server = self._server
        async with server.call("http"):
            server.check_admission()
            call, api_request, streams, llm = await self._calls.start_response(
                await self._json_body(http_request), http_request.headers.get("X-Request-Id")
            )
            if call.background:
                queued = await self._calls.start_background(call, api_request, streams, llm)
                if not call.stream:
                    return web.json_response(queued, headers=_request_id_header(http_request))
                # The stream follows the kept events: a client gone leaves the response
                # running, and GET ...?stream=true reads it again.
                log = server.responses.event_logs[call.response_id]
                return await self._follow(http_request, log, -1)
            if not call.stream:
                answer = await self._calls.whole_response(call, api_request, streams, llm)
                return web.json_response(answer, headers=_request_id_header(http_request))
            writer = ResponseStream(call, api_request, llm)
            stream = await self._event_stream(http_request)
            for event in writer.start():
                await stream.write(_typed_sse(event))
            failure = None
            chunks = self._chunks(api_request, streams, [writer])
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    if isinstance(chunk, CallError):
                        failure = chunk
                        chunk = writer.failed(chunk, HTTP_STATUS[chunk.code])
                    await stream.write(_typed_sse(chunk))
            if failure is not None:
                raise _StreamFailed(failure, stream)
            if call.store and writer.response is not None:
                server.responses.put(responses_store.stored(call, writer.response))
            return stream

    async def _get_response(self, http_request: web.Request) -> web.StreamResponse:
        response_id = http_request.match_info["response_id"]
        store = self._server.responses
        stream = http_request.query.get("stream", "false")
        if stream not in ("true", "false"):
            raise CallError(
                "INVALID_ARGUMENT", f"stream must be true or false, got {stream!r:.50}", "stream"
            )
        if stream == "false":
            return web.json_response(store.get(response_id).response)
        log = store.event_log(response_id)
        return await self._follow(
            http_request, log, responses_store.starting_after(dict(http_request.query), log)
        )

    async def _follow(
        self, http_request: web.Request, log: responses_store.EventLog, starting_after: int
    ) -> web.StreamResponse:
        """A streamed background response's events after ``starting_after``, as they come,
        until it ends (or the client goes)."""
        stream = await self._event_stream(http_request)
        events = log.follow(starting_after)
        async with contextlib.aclosing(events):
            async for event in events:
                await stream.write(_typed_sse(event))
        return stream

    async def _input_items(self, http_request: web.Request) -> web.Response:
        stored = self._server.responses.get(http_request.match_info["response_id"])
        page = responses_store.input_items_page(stored, dict(http_request.query))
        return web.json_response(page)

    async def _cancel_response(self, http_request: web.Request) -> web.Response:
        response = await self._server.responses.cancel(http_request.match_info["response_id"])
        return web.json_response(response)

    async def _delete_response(self, http_request: web.Request) -> web.Response:
        response_id = http_request.match_info["response_id"]
        store = self._server.responses
        if response_id in store.running:  # a background response still running ends first
            await store.cancel(response_id)
        store.delete(response_id)
        return web.json_response({"id": response_id, "object": "response", "deleted": True})

    async def _score(self, http_request: web.Request) -> web.Response:
        return await self._scores("score", http_request)

    async def _rerank(self, http_request: web.Request) -> web.Response:
        return await self._scores("rerank", http_request)

    async def _scores(self, kind: str, http_request: web.Request) -> web.Response:
        return await self._answered(http_request, functools.partial(self._calls.score, kind))

    async def _stream(self, api_request, streams, http_request: web.Request):
        """The chunks as server-sent events; ``_generate`` sends [DONE] after the count."""
        server = self._server
        llm = server.engine.llm
        response_id = answers.response_id(api_request)
        texts = answers.TokenTexts(llm, api_request.tokens_as_ids)
        interval_tokens = server.config.stream_interval_tokens
        writers = [
            StreamWriter(api_request, response_id, i, llm, texts, interval_tokens)
            for i in range(len(streams))
        ]
        response = await self._event_stream(http_request)
        failure = None
        # aclosing: a client gone while a chunk is written ends the requests now, not when
        # the generator is collected.
        chunks = self._chunks(api_request, streams, writers)
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                if isinstance(chunk, CallError):
                    failure = chunk
                    chunk = error_body(chunk)
                await response.write(_sse(chunk))
        if failure is not None:
            raise _StreamFailed(failure, response)
        return response

    @staticmethod
    async def _event_stream(http_request: web.Request) -> web.StreamResponse:
        """A server-sent-event answer, its headers sent."""
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",  # proxies: pass events on as they come
                **_request_id_header(http_request),
            }
        )
        await response.prepare(http_request)
        return response

    async def _chunks(self, api_request, streams, writers) -> AsyncIterator[dict | CallError]:
        """Every prompt's chunks as they come (one task per prompt feeds a queue), then
        the usage chunk; or, at the first failure, the error (and nothing after it)."""
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def feed(stream, writer) -> None:
            try:
                outputs = self._server.outputs(stream, api_request.client_request_id)
                async with contextlib.aclosing(outputs):
                    async for output in outputs:
                        for chunk in writer.chunks(output):
                            queue.put_nowait(chunk)
                queue.put_nowait(done)
            except CallError as error:
                queue.put_nowait(error)
            except Exception as error:  # a fault of ours: the stream must still end
                logger.exception("stream of %s failed", stream.output.request_id)
                queue.put_nowait(_internal_error(error))

        tasks = [
            asyncio.ensure_future(feed(stream, writer))
            for stream, writer in zip(streams, writers, strict=True)
        ]
        failure: CallError | None = None
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, CallError):
                    failure = item
                    break
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if failure is not None:
            yield failure
            return
        if api_request.include_usage:
            chunk = writers[0].chunk([])
            chunk["usage"] = answers.usage([s.output for s in streams])
            yield chunk

    # ------------------------------------------------------------ the rest

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": self._model_cards()})

    async def _model(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        for card in self._model_cards():
            if card["id"] == name:
                return web.json_response(card)
        raise CallError("NOT_FOUND", f"model {name!r} is not served here", "model")

    def _model_cards(self) -> list[dict]:
        """The base model's card (one per name it is served by, as vLLM lists them), then
        one per LoRA adapter (``parent``: the base model,
        ``root``: the adapter's directory, as vLLM lists them). OpenAI's fields, and the
        limits a request must fit (``max_model_len``, as vLLM reports it; ``vocab_size``,
        which token-id prompts must stay below)."""
        llm = self._server.ready_llm()
        base = {
            "id": self._server.served_model_name(),
            "object": "model",
            "created": int(self._server.serving_since_s),
            "owned_by": "pagedserve",
            "root": str(llm.model_path),
            "parent": None,
            "max_model_len": llm.scheduler_config.max_model_len,
            "vocab_size": llm.model_config.vocab_size,
        }
        aliases = [{**base, "id": name} for name in self._server.config.served_model_aliases]
        adapters = [
            {**base, "id": name, "root": path, "parent": base["id"]}
            for name, path in llm.lora_paths.items()
        ]
        return [base, *aliases, *adapters]

    async def _load_lora_adapter(self, request: web.Request) -> web.Response:
        """vLLM's ``{"lora_name", "lora_path"}``: serve a PEFT LoRA adapter from now on;
        its files are checked against the model before the engine hears of it."""
        llm = self._server.ready_llm()
        name, path = _lora_fields(await self._json_body(request), "lora_name", "lora_path")
        try:
            lora_id = llm.register_lora(name, path)
        except ValueError as error:
            message = str(error)
            field = "lora_name" if message.startswith("lora_name") else "lora_path"
            raise CallError("INVALID_ARGUMENT", message, field) from None
        self._server.engine.load_lora(lora_id, name, llm.lora_paths[name])
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def _unload_lora_adapter(self, request: web.Request) -> web.Response:
        """vLLM's ``{"lora_name"}``: requests may no longer name the adapter (those in
        flight finish under it)."""
        llm = self._server.ready_llm()
        (name,) = _lora_fields(await self._json_body(request), "lora_name")
        try:
            lora_id = llm.deregister_lora(name)
        except ValueError as error:
            raise CallError("NOT_FOUND", str(error), "lora_name") from None
        self._server.engine.unload_lora(lora_id)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    async def _tokenize(self, request: web.Request) -> web.Response:
        llm = self._server.ready_llm()
        body = await self._json_body(request)
        token_ids = await self._server.prepare(self._tokenized, body, llm)
        return web.json_response(
            {
                "tokens": token_ids,
                "count": len(token_ids),
                "max_model_len": llm.scheduler_config.max_model_len,
            }
        )

    def _tokenized(self, body: Any, llm) -> list[int]:
        """``/tokenize``'s token ids (a preparing thread's work)."""
        if not isinstance(body, dict):
            raise CallError("INVALID_ARGUMENT", "the request body must be a JSON object", "")
        try:
            if "messages" in body:
                prompt = chat_prompt(body, llm, self._server.config.trust_request_chat_template)
                return prompt.token_ids
            text = body.get("prompt")
            if not isinstance(text, str):
                raise CallError(
                    "INVALID_ARGUMENT",
                    f"prompt must be a string (or send messages), got {text!r:.100}",
                    "prompt",
                )
            add_special_tokens = body.get("add_special_tokens", True)
            if not isinstance(add_special_tokens, bool):
                raise CallError(
                    "INVALID_ARGUMENT",
                    f"add_special_tokens must be a boolean, got {add_special_tokens!r}",
                    "add_special_tokens",
                )
            if llm.tokenizer is None:
                raise ValueError("prompt: text needs a tokenizer, and this model has none")
            llm.check_prompt_size(text, "prompt")  # no text past it could be a prompt
            return llm.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        except ValueError as error:
            raise CallError("INVALID_ARGUMENT", str(error), "prompt") from None

    async def _detokenize(self, request: web.Request) -> web.Response:
        llm = self._server.ready_llm()
        body = await self._json_body(request)
        return web.json_response({"prompt": await self._server.prepare(_detokenized, body, llm)})

    async def _invocations(self, request: web.Request) -> web.StreamResponse:
        """The body's shape picks the API, as vLLM's ``/invocations`` does: ``messages`` a
        chat completion, ``prompt`` a completion, ``input`` an embedding (a classification
        on a classification model), ``text_1`` a score, ``query`` a rerank."""
        body = await self._json_body(request)  # aiohttp keeps it for the handler's own read
        if isinstance(body, dict):
            if "messages" in body:
                return await self._generate("chat", request)
            if "prompt" in body:
                return await self._generate("completion", request)
            if "input" in body:
                llm = self._server.check_admission()
                if llm.model_config.task == "classify":
                    return await self._classify(request)
                return await self._embeddings(request)
            if "text_1" in body:
                return await self._scores("score", request)
            if "query" in body:
                return await self._scores("rerank", request)
        raise CallError(
            "INVALID_ARGUMENT",
            "/invocations: the body must be a chat completion (messages), a completion "
            "(prompt), an embedding (input), a score (text_1) or a rerank (query) request",
            "",
        )

    async def _health(self, request: web.Request) -> web.Response:
        server = self._server
        if server.draining:
            raise CallError("UNAVAILABLE", "the server is shutting down")
        server.ready_llm()
        return web.Response(status=200)

    async def _metrics(self, request: web.Request) -> web.Response:
        # It asks the engine over this very loop: render it on another thread.
        loop = asyncio.get_running_loop()
        accept = request.headers.get("Accept")
        text, content_type = await loop.run_in_executor(None, self._server.metrics.render, accept)
        response = web.Response(body=text)
        response.headers["Content-Type"] = content_type
        return response

    async def _load(self, request: web.Request) -> web.Response:
        """vLLM's ``{"server_load": N}``: the engine requests in flight."""
        return web.json_response({"server_load": self._server.engine.num_open_requests})

    async def _reset_prefix_cache(self, request: web.Request) -> web.Response:
        """vLLM's ``POST /reset_prefix_cache``: cached prefixes are forgotten (the requests
        in flight keep their blocks); 200 with an empty body."""
        self._server.ready_llm()
        self._server.engine.reset_prefix_cache()
        return web.Response()

    async def _version(self, request: web.Request) -> web.Response:
        from importlib.metadata import version

        return web.json_response({"version": version("pagedserve")})


class _StreamFailed(CallError):
    """A stream that ended with an error event: the call counts as failed with the
    error's code, and the response already sent stands."""

    def __init__(self, error: CallError, response: web.StreamResponse) -> None:
        super().__init__(error.code, error.message, error.param)
        self.response = response


def _request_id_header(request: web.Request) -> dict[str, str]:
    """The client's ``X-Request-Id``, echoed (tracing across proxies)."""
    request_id = request.headers.get("X-Request-Id")
    return {} if request_id is None else {"X-Request-Id": request_id}


def _detokenized(body: Any, llm) -> str:
    """``/detokenize``'s text (a preparing thread's work)."""
    tokens = body.get("tokens") if isinstance(body, dict) else None
    if not isinstance(tokens, list):
        raise CallError(
            "INVALID_ARGUMENT", f"tokens must be a list of token ids, got {tokens!r:.100}", "tokens"
        )
    try:
        token_ids = llm.encode_prompt(tokens, "tokens") if tokens else []
    except (ValueError, TypeError) as error:
        raise CallError("INVALID_ARGUMENT", str(error), "tokens") from None
    if llm.tokenizer is None:
        raise CallError("INVALID_ARGUMENT", "this model has no tokenizer to decode with", "")
    return llm.tokenizer.decode(token_ids)


def _lora_fields(body: object, *names: str) -> list[str]:
    """The named string fields of a LoRA-adapter call's body, or a 400 naming the first
    one missing or not a non-empty string."""
    if not isinstance(body, dict):
        raise CallError("INVALID_ARGUMENT", "the request body must be a JSON object", "")
    values = []
    for name in names:
        value = body.get(name)
        if not isinstance(value, str) or not value:
            raise CallError(
                "INVALID_ARGUMENT", f"{name} must be a non-empty string, got {value!r:.100}", name
            )
        values.append(value)
    return values
