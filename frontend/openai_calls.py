"""The OpenAI API's calls on a ``Server``, apart from how they arrive: the HTTP API
(``http_server.py``) and the batch runner (``batch_runner.py``) share them, so a line of a
batch file is answered exactly as the same body POSTed to ``pagedserve serve``.

A call here is checked (admission, the body, whether it fits the engine), submitted as
one engine request per prompt, and its outputs gathered; a ``CallError`` says why one
did not run. Streaming stays with the HTTP API: only it has a client to stream to.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from typing import TYPE_CHECKING, Any

from pagedserve.frontend import openai_answers as answers
from pagedserve.frontend import openai_classify as classify
from pagedserve.frontend import openai_embeddings as embeddings
from pagedserve.frontend import openai_pooling as pooling
from pagedserve.frontend import openai_protocol as protocol
from pagedserve.frontend import openai_responses as responses
from pagedserve.frontend import openai_scores as scores
from pagedserve.frontend import responses_output, responses_store
from pagedserve.frontend.call_errors import HTTP_STATUS, CallError

if TYPE_CHECKING:
    from pagedserve.frontend.async_engine import RequestStream
    from pagedserve.frontend.llm import LLM
    from pagedserve.frontend.outputs import EmbeddingRequestOutput, RequestOutput
    from pagedserve.frontend.server import Server


logger = logging.getLogger(__name__)


class OpenAiCalls:
    """``api`` names the calls' engine requests (``<api>-<n>``) and their metrics."""

    def __init__(self, server: Server, api: str) -> None:
        self._server = server
        self.api = api

    async def start_generation(
        self, kind: str, body: Any, client_request_id: str | None, streaming_allowed: bool = True
    ) -> tuple[protocol.ApiRequest, list[RequestStream], LLM]:
        """Check and submit a ``/v1/completions`` (``kind="completion"``) or
        ``/v1/chat/completions`` (``"chat"``) body: its parsed request, one stream per
        prompt, and the engine's ``LLM``. Without ``streaming_allowed``, ``"stream": true``
        is refused (a batch has no one to stream to). The body is checked, rendered and
        tokenized off the event loop (``Server.prepare``)."""
        server = self._server
        llm = server.check_admission()
        api_request = await server.prepare(
            self._prepare_generation, kind, body, llm, client_request_id
        )
        if api_request.stream and server.config.force_include_usage:
            api_request.include_usage = True  # the operator's choice (billing by stream)
        if api_request.stream and not streaming_allowed:
            raise CallError(
                "INVALID_ARGUMENT",
                "stream=true: a batch's answers are written whole; leave stream unset",
                "stream",
            )
        llm = server.check_admission(len(api_request.prompts))
        streams = self._submit(
            [
                (prompt, params)
                for prompt, params in zip(api_request.prompts, api_request.params, strict=True)
            ],
            api_request.cache_namespace,
            api_request.lora_id,
            api_request.priority,
        )
        return api_request, streams, llm

    def _prepare_generation(
        self, kind: str, body: Any, llm: LLM, client_request_id: str | None
    ) -> protocol.ApiRequest:
        """A generation body parsed and checked against the engine (a preparing thread's
        work: it touches no state of the event loop's)."""
        server = self._server
        try:
            llm.check_task(None)
        except ValueError as error:
            raise CallError("INVALID_ARGUMENT", str(error), "model") from None
        api_request = protocol.parse_request(
            kind,
            body,
            llm,
            server.default_params,
            server.served_model_names(),
            client_request_id,
            server.config.max_concurrent_requests,
            server.config.tool_call_parser,
            server.config.reasoning_parser,
            server.config.trust_request_chat_template,
        )
        for prompt, params in zip(api_request.prompts, api_request.params, strict=True):
            try:
                server.check_fits(llm, prompt.token_ids, params, "stop", "")
            except (ValueError, TypeError) as error:
                param = protocol.field_named(error)
                raise CallError("INVALID_ARGUMENT", str(error), param) from None
        return api_request

    async def generation(self, kind: str, body: Any, client_request_id: str | None) -> dict:
        """A completion or chat completion answered whole (OpenAI's response body)."""
        api_request, streams, llm = await self.start_generation(
            kind, body, client_request_id, streaming_allowed=False
        )
        outputs = await self.whole(api_request.client_request_id, streams)
        return answers.whole_response(api_request, outputs, llm)

    async def start_response(
        self, body: Any, client_request_id: str | None, streaming_allowed: bool = True
    ) -> tuple[responses.ResponsesCall, protocol.ApiRequest, list[RequestStream], LLM]:
        """Check and submit a ``/v1/responses`` body (it runs as a chat completion):
        the call, its chat request, its one stream and the engine's ``LLM``."""
        # On the loop: it reads the response store; the chat it becomes is prepared off it.
        call = responses.prepare(body, self._server.responses)
        if call.background and not streaming_allowed:
            raise CallError(
                "INVALID_ARGUMENT",
                "background=true: a batch's answers are written whole; leave background unset",
                "background",
            )
        try:
            api_request, streams, llm = await self.start_generation(
                "chat", call.chat_body, client_request_id, streaming_allowed
            )
        except CallError as error:
            raise responses.renamed(error) from None
        return call, api_request, streams, llm

    async def response(self, body: Any, client_request_id: str | None) -> dict:
        """A Responses API body answered whole (and stored when it asks to be)."""
        started = await self.start_response(body, client_request_id, streaming_allowed=False)
        return await self.whole_response(*started)

    async def whole_response(
        self,
        call: responses.ResponsesCall,
        api_request: protocol.ApiRequest,
        streams: list[RequestStream],
        llm: LLM,
    ) -> dict:
        """A started Responses call's answer, once its output is whole (stored when the
        request asks to be)."""
        (output,) = await self.whole(api_request.client_request_id, streams)
        response = responses_output.whole_response(call, api_request, output, llm)
        if call.store:
            self._server.responses.put(responses_store.stored(call, response))
        return response

    async def start_background(
        self,
        call: responses.ResponsesCall,
        api_request: protocol.ApiRequest,
        streams: list[RequestStream],
        llm: LLM,
    ) -> dict:
        """Run a started ``background`` Responses call on its own and return it ``queued``
        (stored, as each later status is, for ``GET``); a streamed one's events go to its
        ``EventLog`` in the store as they come."""
        store = self._server.responses
        queued = responses_output.unfinished_response(call, api_request, "queued")
        store.put(responses_store.stored(call, queued))
        log = None
        if call.stream:
            log = store.event_logs[call.response_id] = responses_store.EventLog(
                functools.partial(store.count_events, call.response_id)
            )
        task = asyncio.create_task(self._background(call, api_request, streams, llm, log))
        store.running[call.response_id] = task
        # One turn of the loop: the task enters its call count (server.call) before the
        # caller's ends, so a drain starting now still waits for it.
        await asyncio.sleep(0)
        return queued

    async def _background(
        self,
        call: responses.ResponsesCall,
        api_request: protocol.ApiRequest,
        streams: list[RequestStream],
        llm: LLM,
        log: responses_store.EventLog | None,
    ) -> None:
        """A background response's run: it ends stored as completed (or incomplete),
        failed with its error, or cancelled; a streamed one's ``log`` then ends too."""
        server = self._server
        store = server.responses

        def ended(error: CallError | None) -> None:  # None: cancelled
            store.put(
                responses_store.stored(
                    call, responses_output.ended_response(call, api_request, error)
                )
            )

        try:
            async with server.call("http"):
                store.put(
                    responses_store.stored(
                        call, responses_output.unfinished_response(call, api_request, "in_progress")
                    )
                )
                try:
                    if log is None:
                        await self.whole_response(call, api_request, streams, llm)
                    else:
                        await self._streamed_response(call, api_request, streams, llm, log)
                except asyncio.CancelledError:
                    ended(None)
                    raise
                except CallError as error:
                    ended(error)
                    raise
                except Exception as error:  # a bug: the response still ends, failed
                    ended(CallError("INTERNAL", f"internal error: {error}"))
                    raise
        except (asyncio.CancelledError, CallError):
            pass  # stored above; counted by server.call
        except Exception:
            logger.exception("background response %s failed", call.response_id)
        finally:
            store.running.pop(call.response_id, None)
            if log is not None:
                log.end()

    async def _streamed_response(
        self,
        call: responses.ResponsesCall,
        api_request: protocol.ApiRequest,
        streams: list[RequestStream],
        llm: LLM,
        log: responses_store.EventLog,
    ) -> None:
        """A streamed background response's events into ``log`` as its output grows (the
        error event last if it fails), the whole response stored at the end."""
        writer = responses_output.ResponseStream(call, api_request, llm)
        log.add(writer.start())
        (stream,) = streams
        outputs = self._server.outputs(stream, api_request.client_request_id)
        try:
            async with contextlib.aclosing(outputs):
                async for output in outputs:
                    log.add(writer.chunks(output))
        except CallError as error:
            log.add([writer.failed(error, HTTP_STATUS[error.code])])
            raise
        if writer.response is not None:
            self._server.responses.put(responses_store.stored(call, writer.response))

    async def embedding(self, body: Any, client_request_id: str | None) -> dict:
        """A ``/v1/embeddings`` body answered (OpenAI's response body)."""
        api_request = await self._parse_pooling(
            embeddings.parse_embedding_request, body, client_request_id, **self._chat_options()
        )
        outputs = await self._pooled(api_request)
        return embeddings.embedding_response(api_request, outputs)

    async def classification(self, body: Any, client_request_id: str | None) -> dict:
        """A ``/classify`` body answered (vLLM's response body)."""
        api_request = await self._parse_pooling(
            classify.parse_classify_request, body, client_request_id, **self._chat_options()
        )
        outputs = await self._pooled(api_request)
        return classify.classify_response(api_request, outputs)

    async def pooling(self, body: Any, client_request_id: str | None) -> dict:
        """A ``/pooling`` body answered (vLLM's response body): the embeddings or the
        classifications, by the model's task, in one shape."""
        call = await self._parse_pooling(
            pooling.parse_pooling_request, body, client_request_id, **self._chat_options()
        )
        outputs = await self._pooled(call.request)
        return pooling.pooling_response(call, outputs)

    async def score(self, kind: str, body: Any, client_request_id: str | None) -> dict:
        """A ``/score`` (``kind="score"``) or ``/rerank`` (``"rerank"``) body answered
        (vLLM's response body): the texts embedded, each pair's cosine similarity; on a
        cross-encoder, each pair classified."""
        parse = scores.parse_score_request if kind == "score" else scores.parse_rerank_request
        api_request = await self._parse_pooling(parse, body, client_request_id)
        outputs = await self._pooled(api_request)
        if kind == "score":
            return scores.score_response(api_request, outputs)
        return scores.rerank_response(api_request, outputs)

    async def _parse_pooling(self, parse, body: Any, client_request_id: str | None, **options):
        """A pooling request's body checked by ``parse`` (once the server admits calls),
        off the event loop; ``options``: ``parse``'s own keywords."""
        server = self._server
        return await server.prepare(
            functools.partial(parse, **options),
            body,
            server.check_admission(),
            server.served_model_names(),
            client_request_id,
            server.config.max_concurrent_requests,
        )

    def _chat_options(self) -> dict[str, Any]:
        """How a pooling request's ``messages`` may be rendered (the server's trust)."""
        return {"trust_request_chat_template": self._server.config.trust_request_chat_template}

    async def _pooled(self, api_request) -> list[EmbeddingRequestOutput]:
        """The embedding of each of a checked pooling request's prompts, in order."""
        server = self._server
        llm = server.check_admission(len(api_request.prompts))
        try:
            llm.check_task(api_request.params)
        except ValueError as error:
            raise CallError("INVALID_ARGUMENT", str(error), "model") from None
        for name, prompt in zip(api_request.prompt_names, api_request.prompts, strict=True):
            try:
                llm.engine.check_request_fits(len(prompt.token_ids), 0)
            except ValueError as error:
                raise CallError("INVALID_ARGUMENT", f"{name}: {error}", name) from None
        streams = self._submit(
            [(prompt, api_request.params) for prompt in api_request.prompts],
            None,
            api_request.lora_id,
            api_request.priority,
        )
        outputs = await self.whole(api_request.client_request_id, streams)
        for output in outputs:
            if output.outputs is None:  # ended by the engine without its vector
                raise CallError(
                    "INTERNAL", f"request {output.request_id} ended: {output.finish_reason}"
                )
        return outputs

    async def whole(
        self, client_request_id: str, streams: list[RequestStream]
    ) -> list[RequestOutput | EmbeddingRequestOutput]:
        """Every stream's final output, in order; at the first failure (or when the call is
        cancelled) the others end too."""

        async def run(stream):
            outputs = self._server.outputs(stream, client_request_id)
            async with contextlib.aclosing(outputs):
                async for _output in outputs:
                    pass
            return stream.output

        tasks = [asyncio.ensure_future(run(stream)) for stream in streams]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:  # one failed or the call was cancelled: end the others
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _submit(self, requests, cache_namespace, lora_id, priority) -> list[RequestStream]:
        """One engine request per (prompt, params); if one cannot be queued, those already
        queued end."""
        server = self._server
        streams = []
        try:
            for prompt, params in requests:
                streams.append(
                    server.submit(
                        self.api,
                        prompt.text,
                        prompt.token_ids,
                        params,
                        cache_namespace,
                        lora_id,
                        priority,
                    )
                )
        except CallError:
            for stream in streams:
                server.engine.abort(stream.output.request_id)
            raise
        return streams
