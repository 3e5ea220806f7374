"""The gRPC API of ``pagedserve serve`` (grpc.aio on uvloop): ``pagedserve.v1.GenerationService``,
the standard health service and reflection, over the server process's shared admission,
drain and engine (``server.py``).

- **Requests**: ``Generate`` (whole result), ``GenerateStream`` (what is new, as it is
  made), ``Tokenize``, ``GetModelInfo``, ``GetStats``. A chat may give tools and a tool
  choice, and its outputs are read as the HTTP API reads them (``chat_request.py``: tool
  calls, and the thinking on a server with a reasoning parser). Bad input gets
  ``INVALID_ARGUMENT`` naming the field, the value and the limit; more than
  ``max_concurrent_requests`` in flight get ``RESOURCE_EXHAUSTED``; the server's other
  refusals (``CallError``) keep their code.
- **Cancellation**: a call the client cancels, or whose deadline passes, ends its request
  in the engine at once, which frees its KV blocks.
- **Health** (``grpc.health.v1.Health``): ``NOT_SERVING`` while the model loads and while
  draining, ``SERVING`` in between; reflection lists the services.
- **TLS** (``tls_cert_file``, ``tls_key_file``; mutual with ``tls_client_ca_file``).
- **API key** (``api_key``): ``pagedserve.v1.GenerationService`` calls without metadata
  ``authorization: Bearer <key>`` end with ``UNAUTHENTICATED``; health and reflection
  stay open.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pagedserve.frontend import grpc_enums
from pagedserve.frontend.api_key import UNAUTHENTICATED_MESSAGE, bearer_matches
from pagedserve.frontend.async_engine import RequestStream
from pagedserve.frontend.call_errors import CallError
from pagedserve.frontend.chat_request import ChatReading, render_chat_prompt
from pagedserve.frontend.chat_template import (
    SETTING_NAMES,
    ChatTemplateOptions,
    check_template_allowed,
    with_reasoning_effort,
)
from pagedserve.frontend.engine_client import EngineDeadError
from pagedserve.frontend.grpc_convert import (
    GenerationRequest,
    StreamState,
    chat_from_proto,
    chat_reading_from_proto,
    chat_sampling_params,
    sampling_params_from_proto,
    usage,
    whole_response,
)
from pagedserve.frontend.openai_calls import OpenAiCalls
from pagedserve.frontend.reflection_services import add_reflection
from pagedserve.frontend.request_contract import check_id_text, check_output_room, decode_json
from pagedserve.frontend.server import MAX_MESSAGE_BYTES
from pagedserve.frontend.tool_calls import Tool
from pagedserve.scheduler.pooling_params import PoolingParams
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from pagedserve.frontend.llm import LLM
    from pagedserve.frontend.server import Server, ServerConfig

logger = logging.getLogger("pagedserve.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GenerationService"].full_name


def server_credentials(config: ServerConfig) -> grpc.ServerCredentials | None:
    """TLS credentials from the PEM files, or None for plaintext."""
    if config.tls_cert_file is None:
        return None
    client_ca = (
        None if config.tls_client_ca_file is None else Path(config.tls_client_ca_file).read_bytes()
    )
    return grpc.ssl_server_credentials(
        [(Path(config.tls_key_file).read_bytes(), Path(config.tls_cert_file).read_bytes())],
        root_certificates=client_ca,
        require_client_auth=client_ca is not None,
    )


class _ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Ends the GenerationService's calls that do not carry the key (other services:
    health and reflection, pass)."""

    def __init__(self, api_key: str) -> None:
        self._api_key = api_key

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(f"/{SERVICE_NAME}/"):
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        if bearer_matches(metadata.get("authorization"), self._api_key):
            return handler

        async def refuse(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)

        async def refuse_stream(request, context):
            await refuse(request, context)
            yield  # never reached: an async generator, as a streaming handler must be

        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(
                refuse_stream,
                handler.request_deserializer,
                handler.response_serializer,
            )
        return grpc.unary_unary_rpc_method_handler(
            refuse, handler.request_deserializer, handler.response_serializer
        )


class _Undecodable:
    """A request message that did not parse, kept for the handler to refuse by name."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def _lenient(deserializer):
    def deserialize(data: bytes):
        try:
            return deserializer(data)
        except Exception as error:  # protobuf's DecodeError, or a message nested too deep
            return _Undecodable(error)

    return deserialize


class _UndecodableRequestInterceptor(grpc.aio.ServerInterceptor):
    """A request whose bytes do not parse as the method's message ends with
    ``INVALID_ARGUMENT`` naming the message (grpc's own answer is ``UNKNOWN``, as for a
    server fault). Unary requests only: the streaming-request methods are reflection's."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method

        async def refuse(request: _Undecodable, context) -> None:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{method}: the request does not parse as its message: {request.error}",
            )

        deserialize = _lenient(handler.request_deserializer)
        if handler.unary_unary is not None:
            behaviour = handler.unary_unary

            async def unary(request, context):
                if isinstance(request, _Undecodable):
                    return await refuse(request, context)
                return await behaviour(request, context)

            return grpc.unary_unary_rpc_method_handler(
                unary, deserialize, handler.response_serializer
            )
        streaming = handler.unary_stream
        if not inspect.isasyncgenfunction(streaming):  # one that writes (health's Watch)

            async def writing(request, context):
                if isinstance(request, _Undecodable):
                    return await refuse(request, context)
                return await streaming(request, context)

            return grpc.unary_stream_rpc_method_handler(
                writing, deserialize, handler.response_serializer
            )

        async def stream(request, context):
            if isinstance(request, _Undecodable):
                await refuse(request, context)
                return
            async for response in streaming(request, context):
                yield response

        return grpc.unary_stream_rpc_method_handler(
            stream, deserialize, handler.response_serializer
        )


def _grpc_code(context):
    def code_of(error: BaseException) -> str:
        if isinstance(error, CallError):
            return error.code
        return (context.code() or grpc.StatusCode.UNKNOWN).name  # context.abort set it

    return code_of


class GenerationServicer(pb_grpc.GenerationServiceServicer):
    def __init__(self, server: Server) -> None:
        self._server = server
        self._engine = server.engine
        self._calls = OpenAiCalls(server, "grpc")

    # ------------------------------------------------------------ RPCs

    async def Generate(self, request: pb.GenerateRequest, context) -> pb.GenerateResponse:
        async with self._counted_call(context):
            stream, reading = await self._admit(request)
            async with self._outputs(stream, request) as outputs:
                async for _output in outputs:
                    pass
            return whole_response(request.request_id, stream.output, reading)

    async def GenerateStream(
        self, request: pb.GenerateStreamRequest, context
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        async with self._counted_call(context):
            stream, reading = await self._admit(request)
            state = StreamState(request.request_id, reading)
            async with self._outputs(stream, request) as outputs:
                interval_tokens = self._server.config.stream_interval_tokens
                async for output in outputs:
                    if not state.due(output, interval_tokens):
                        continue
                    response = state.next_response(output)
                    if response is not None:
                        yield response

    async def Embed(self, request: pb.EmbedRequest, context) -> pb.EmbedResponse:
        async with self._counted_call(context):
            stream, _ = await self._admit(request)
            async with self._outputs(stream, request) as outputs:
                async for _output in outputs:
                    pass
            output = stream.output
            if output.outputs is None:  # ended by the engine without its vector
                raise CallError(
                    "INTERNAL", f"request {output.request_id} ended: {output.finish_reason}"
                )
            return pb.EmbedResponse(
                request_id=request.request_id,
                embedding=output.outputs.embedding,
                usage=usage(
                    len(output.prompt_token_ids),
                    cached_prompt_tokens=output.num_cached_tokens,
                    queue_time_s=output.queue_time_s,
                ),
            )

    async def Score(self, request: pb.ScoreRequest, context) -> pb.ScoreResponse:
        """Run as the HTTP API's ``/score`` (``openai_calls.py``), fields renamed."""
        async with self._counted_call(context):
            body: dict = {
                "text_1": list(request.text_1),
                "text_2": list(request.text_2),
                "priority": request.priority,
            }
            self._pooling_options(request, body)
            answer = await self._calls.score("score", body, request.request_id or None)
            return pb.ScoreResponse(
                request_id=request.request_id,
                scores=[item["score"] for item in answer["data"]],
                usage=pb.Usage(prompt_tokens=answer["usage"]["prompt_tokens"]),
            )

    async def Classify(self, request: pb.ClassifyRequest, context) -> pb.ClassifyResponse:
        """Run as the HTTP API's ``/classify`` (``openai_calls.py``)."""
        async with self._counted_call(context):
            body: dict = {"input": list(request.input), "priority": request.priority}
            if request.HasField("use_activation"):
                body["use_activation"] = request.use_activation
            self._pooling_options(request, body)
            if request.HasField("chat"):
                body["input"] = await self._server.prepare(self._classify_chat_ids, request)
            answer = await self._calls.classification(body, request.request_id or None)
            return pb.ClassifyResponse(
                request_id=request.request_id,
                classifications=[
                    pb.Classification(label=item["label"], probs=item["probs"])
                    for item in answer["data"]
                ],
                usage=pb.Usage(prompt_tokens=answer["usage"]["prompt_tokens"]),
            )

    def _classify_chat_ids(self, request: pb.ClassifyRequest) -> list[int]:
        """A Classify request's conversation as the token ids the HTTP route classifies;
        ``CallError`` naming ``chat`` for its errors (its length among them, unless
        ``truncate_prompt_tokens`` cuts it)."""
        if request.input:
            raise CallError(
                "INVALID_ARGUMENT",
                "chat and input are both set: give the texts as input, or one conversation as chat",
                "chat",
            )
        llm = self._server.check_admission()
        try:
            _, token_ids = self._pooling_chat(llm, request.chat)
        except (ValueError, TypeError) as error:
            raise CallError("INVALID_ARGUMENT", str(error), "chat") from None
        max_model_len = llm.scheduler_config.max_model_len
        if not request.HasField("truncate_prompt_tokens") and len(token_ids) > max_model_len:
            raise CallError(
                "INVALID_ARGUMENT",
                f"chat: {len(token_ids)} prompt tokens exceed the model's context window of "
                f"{max_model_len} tokens (truncate_prompt_tokens can cut them)",
                "chat",
            )
        return token_ids

    def _pooling_options(
        self, request: pb.ScoreRequest | pb.ClassifyRequest, body: dict[str, Any]
    ) -> None:
        """A Score or Classify request's truncation and adapter, as the HTTP body names
        them (the adapter is the body's ``model``)."""
        if request.HasField("truncate_prompt_tokens"):
            body["truncate_prompt_tokens"] = request.truncate_prompt_tokens
        if request.lora_adapter:
            try:  # Generate's check and message for an adapter not served
                self._server.check_admission().lora_id(request.lora_adapter, "lora_adapter")
            except ValueError as error:
                raise CallError("NOT_FOUND", str(error), "lora_adapter") from None
            body["model"] = request.lora_adapter

    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        llm = await self._ready_llm(context)
        try:
            token_ids = await self._server.prepare(self._tokenized, llm, request)
        except (ValueError, TypeError) as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        except CallError as error:
            await context.abort(grpc.StatusCode[error.code], error.message)
        return pb.TokenizeResponse(token_ids=token_ids)

    def _tokenized(self, llm: LLM, request: pb.TokenizeRequest) -> list[int]:
        """``Tokenize``'s token ids (a preparing thread's work)."""
        kind = request.WhichOneof("input")
        if kind == "chat":
            conversation, tools = chat_from_proto(request.chat)
            return self._render_chat(llm, request.chat, conversation, tools)[1]
        if kind == "text":
            llm.check_prompt_size(request.text, "text")  # no text past it could be a prompt
            return llm.encode_prompt(request.text, "text")
        raise ValueError("input: set one of text, chat")

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context
    ) -> pb.GetModelInfoResponse:
        llm = await self._ready_llm(context)
        config = llm.scheduler_config
        return pb.GetModelInfoResponse(
            model=str(llm.model_path),
            architecture=llm.model_config.declared_architecture,
            dtype=grpc_enums.value(pb.Dtype, llm.dtype, "dtype"),
            vocab_size=llm.model_config.vocab_size,
            max_model_len=config.max_model_len,
            block_size=llm.block_size,
            num_blocks=llm.num_blocks,
            max_num_seqs=config.max_num_seqs,
            tensor_parallel_size=llm.tensor_parallel_size,
            eos_token_ids=sorted(llm.eos_token_ids),
            quantization=grpc_enums.quantization_value(llm.quantization),
            kv_cache_dtype=grpc_enums.kv_cache_dtype_value(llm.kv_cache_dtype),
            max_output_tokens=llm.generation_defaults.max_tokens_limit,
            labels=llm.model_config.labels,
        )

    async def GetStats(self, request: pb.GetStatsRequest, context) -> pb.GetStatsResponse:
        await self._ready_llm(context)
        try:
            engine_stats = await self._engine.stats()
        except EngineDeadError as error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"engine died: {error}")
        counters = self._server.counters
        return pb.GetStatsResponse(
            engine={name: float(value) for name, value in engine_stats.stats.items()},
            requests_running=counters.running,
            requests_finished=counters.finished,
            requests_failed=counters.failed,
            requests_cancelled=counters.cancelled,
            integrity_error=engine_stats.integrity_error or "",
        )

    # ------------------------------------------------------------ internals

    @contextlib.asynccontextmanager
    async def _counted_call(self, context) -> AsyncIterator[None]:
        """Count a generation call, then end it with the status a ``CallError`` names.
        The abort comes after the count because grpc's ``abort`` sends the status at
        once: inside the counted scope a client could read its error, scrape the
        metrics and not find its call counted yet."""
        try:
            async with self._server.call("grpc", _grpc_code(context)):
                try:
                    yield
                except (CallError, grpc.aio.AbortError):
                    raise
                except Exception as error:  # a fault of ours: this call ends, INTERNAL
                    logger.exception("a gRPC call failed")
                    raise CallError(
                        "INTERNAL", f"internal server error ({type(error).__name__}: {error})"
                    ) from error
        except CallError as error:
            await context.abort(grpc.StatusCode[error.code], error.message)

    async def _ready_llm(self, context) -> LLM:
        try:
            return self._server.ready_llm()
        except CallError as error:
            await context.abort(grpc.StatusCode[error.code], error.message)

    def _outputs(
        self, stream: RequestStream, request: GenerationRequest | pb.EmbedRequest
    ) -> contextlib.aclosing:
        """The request's outputs as they grow (a failure raises ``CallError``), closed on
        leaving: a call that ends early (cancelled while sending) aborts the engine's
        request then, not when the generator is collected."""
        return contextlib.aclosing(self._server.outputs(stream, request.request_id))

    async def _admit(
        self, request: GenerationRequest | pb.EmbedRequest
    ) -> tuple[RequestStream, ChatReading | None]:
        """Validate, tokenize and queue a generation or embedding request, or raise a
        ``CallError`` whose message names the field. A chat's outputs read as the second value
        says (None: the prompt is no chat, its text is the output's). The request is
        prepared off the event loop (``Server.prepare``)."""
        server = self._server
        llm = server.check_admission()
        prompt, token_ids, params, reading, lora_id = await server.prepare(
            self._prepared, llm, request
        )
        stream = server.submit(
            "grpc",
            prompt,
            token_ids,
            params,
            request.cache_namespace or None,
            lora_id,
            request.priority,
        )
        return stream, reading

    def _prepared(
        self, llm: LLM, request: GenerationRequest | pb.EmbedRequest
    ) -> tuple[str | None, list[int], SamplingParams | PoolingParams, ChatReading | None, int]:
        """A request checked and tokenized (a preparing thread's work): its prompt's text
        and token ids, its parameters, how a chat's outputs read, and its adapter's id."""
        try:
            check_id_text("request_id", request.request_id)
            if isinstance(request, GenerationRequest):
                check_id_text("cache_namespace", request.cache_namespace)
            check_id_text("lora_adapter", request.lora_adapter)
            prompt, token_ids, reading = self._prompt(llm, request)
            params, token_ids = self._checked_params(llm, request, token_ids, reading)
            llm.check_priority(request.priority)
        except (ValueError, TypeError) as error:
            raise CallError("INVALID_ARGUMENT", str(error)) from None
        try:
            lora_id = llm.lora_id(request.lora_adapter or None, "lora_adapter")
        except ValueError as error:
            raise CallError("NOT_FOUND", str(error)) from None
        return prompt, token_ids, params, reading, lora_id

    def _checked_params(
        self,
        llm: LLM,
        request: GenerationRequest | pb.EmbedRequest,
        token_ids: list[int],
        reading: ChatReading | None,
    ) -> tuple[SamplingParams | PoolingParams, list[int]]:
        """A generation request's ``SamplingParams`` (unset fields: the defaults; a chat's
        tool choice may constrain the output) or an embedding request's
        ``PoolingParams``, checked against the model and its window; and the prompt's
        token ids as the request keeps them (``truncate_prompt_tokens``)."""
        if isinstance(request, pb.EmbedRequest):
            params = llm.embedding_params(
                normalize=request.normalize if request.HasField("normalize") else None,
                dimensions=request.dimensions if request.HasField("dimensions") else None,
            )
            llm.check_task(params)
            params.check_dimensions(llm.model_config.embedding_size)
            llm.engine.check_request_fits(len(token_ids), 0)
            return params, token_ids
        sampling = request.sampling if request.HasField("sampling") else None
        params = sampling_params_from_proto(
            sampling, self._server.default_params, llm.generation_defaults.max_tokens_limit
        )
        if reading is not None:
            if not params.detokenize:
                raise ValueError(
                    "sampling.detokenize=false is for token-only calls: a chat's answer "
                    "(its content, thinking and tool calls) is read from its text"
                )
            params = chat_sampling_params(params, sampling, reading, llm)
        params = llm.resolve_bad_words(params, "sampling")
        token_ids = llm.truncate_prompt(token_ids, params, "sampling")
        max_model_len = llm.scheduler_config.max_model_len
        max_tokens_set = sampling is not None and sampling.HasField("max_tokens")
        check_output_room(
            len(token_ids),
            params.max_tokens if max_tokens_set else 1,
            max_model_len,
            request.WhichOneof("prompt"),
            "sampling.max_tokens",
        )
        if not max_tokens_set and len(token_ids) + params.max_tokens > max_model_len:
            # The default (the model's or 16) yields to the window, as the HTTP API's does.
            params = dataclasses.replace(params, max_tokens=max_model_len - len(token_ids))
        self._server.check_fits(llm, token_ids, params, "sampling.stop", "sampling")
        return params, token_ids

    def _prompt(
        self, llm: LLM, request: GenerationRequest | pb.EmbedRequest
    ) -> tuple[str | None, list[int], ChatReading | None]:
        """The prompt's text (None when given as ids), its token ids, and for a chat how
        its outputs read."""
        kind = request.WhichOneof("prompt")
        if kind in ("text", "token_ids") and not _truncates(request):
            # Cheap, before the tokenizer spends seconds on a prompt that cannot fit.
            prompt = request.text if kind == "text" else request.token_ids.ids
            llm.check_prompt_size(prompt, "text" if kind == "text" else "token_ids.ids")
        if kind == "text":
            return request.text, llm.encode_prompt(request.text, "text"), None
        if kind == "token_ids":
            return None, llm.encode_prompt(list(request.token_ids.ids), "token_ids.ids"), None
        if kind == "chat" and isinstance(request, pb.EmbedRequest):
            return (*self._pooling_chat(llm, request.chat), None)
        if kind == "chat":
            conversation, tools = chat_from_proto(request.chat)
            config = self._server.config
            reading = chat_reading_from_proto(
                request.chat, tools, config.tool_call_parser, config.reasoning_parser
            )
            text, token_ids = self._render_chat(
                llm, request.chat, conversation, tools, check_size=not _truncates(request)
            )
            return text, token_ids, reading
        raise ValueError("prompt: set one of text, token_ids, chat")

    def _pooling_chat(self, llm: LLM, chat: pb.Chat) -> tuple[str, list[int]]:
        """A conversation to embed or classify (vLLM's chat form of a pooling request):
        rendered ending with its last message unless ``add_generation_prompt``; what only
        a generation or a RAG template reads is refused by name."""
        for name in ("tool_choice", "parallel_tool_calls", "include_reasoning"):
            if chat.HasField(name):
                raise ValueError(f"chat.{name}: a conversation to embed or classify has no answer")
        for name in ("tools", "documents"):
            if getattr(chat, name):
                raise ValueError(
                    f"chat.{name}: a conversation to embed or classify takes messages and the "
                    "template's settings only"
                )
        conversation, _ = chat_from_proto(chat)
        return self._render_chat(llm, chat, conversation, None, opens_turn_default=False)

    def _render_chat(
        self,
        llm: LLM,
        chat: pb.Chat,
        conversation: list[dict],
        tools: list[Tool] | None,
        opens_turn_default: bool = True,
        check_size: bool = True,
    ) -> tuple[str, list[int]]:
        """A chat's prompt text and token ids; ``check_size``: a text too long for the
        window is refused before it is tokenized (unless the request truncates it)."""
        definitions = None if tools is None else [tool.definition for tool in tools]
        opens_turn = opens_turn_default
        if chat.HasField("add_generation_prompt"):
            opens_turn = chat.add_generation_prompt
        template_kwargs = None
        if chat.chat_template_kwargs:
            template_kwargs = decode_json("chat.chat_template_kwargs", chat.chat_template_kwargs)
        template = chat.chat_template or None
        documents = [dict(document.fields) for document in chat.documents] or None
        try:
            template_kwargs = with_reasoning_effort(
                template_kwargs,
                grpc_enums.word(pb.ReasoningEffort, chat.reasoning_effort, "chat.reasoning_effort"),
                "chat.reasoning_effort",
            )
            check_template_allowed(template, self._server.config.trust_request_chat_template)
            options = ChatTemplateOptions(
                add_generation_prompt=opens_turn,
                continue_final_message=chat.continue_final_message,
                chat_template_kwargs=template_kwargs,
                documents=documents,
                chat_template=template,
            )
            return render_chat_prompt(
                llm, conversation, definitions, "chat.messages", options, check_size
            )
        except ValueError as error:
            if str(error).startswith(SETTING_NAMES):
                raise ValueError(f"chat.{error}") from None
            raise


def _truncates(request: GenerationRequest | pb.EmbedRequest) -> bool:
    """Whether the request keeps only its prompt's end (``truncate_prompt_tokens``; an
    embedding request has none)."""
    return (
        isinstance(request, GenerationRequest)
        and request.HasField("sampling")
        and request.sampling.HasField("truncate_prompt_tokens")
    )


class GrpcApi:
    """The gRPC server of a ``Server``: bound before the model loads (health checks are
    answered meanwhile), stopped after the drain."""

    def __init__(self, server: Server) -> None:
        self._server = server
        api_key = server.config.api_key
        self._grpc = grpc.aio.server(
            interceptors=[
                _UndecodableRequestInterceptor(),
                *([] if api_key is None else [_ApiKeyInterceptor(api_key)]),
            ],
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.so_reuseport", 0),  # a port in use is an error, not a shared port
            ],
        )
        self._health = health.aio.HealthServicer()
        pb_grpc.add_GenerationServiceServicer_to_server(GenerationServicer(server), self._grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._grpc)
        add_reflection(self._grpc, (SERVICE_NAME, health.SERVICE_NAME))
        server.on_serving(self._set_serving)

    def bind(self) -> int:
        """Listen on the configured address; returns the port. ``OSError`` if it cannot."""
        config = self._server.config
        address = f"{config.host}:{config.port}"
        try:
            credentials = server_credentials(config)
            if credentials is None:
                return self._grpc.add_insecure_port(address)
            return self._grpc.add_secure_port(address, credentials)
        except RuntimeError as error:
            raise OSError(f"cannot listen on {address}: {error}") from None

    async def start(self) -> None:
        await self._set_serving(False)
        await self._grpc.start()

    async def stop(self, grace_s: float | None) -> None:
        await self._health.enter_graceful_shutdown()
        await self._grpc.stop(grace_s)

    async def _set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for service in ("", SERVICE_NAME):
            await self._health.set(service, status)
