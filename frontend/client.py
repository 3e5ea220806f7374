"""A Python client of ``pagedserve serve``: the offline API's types over gRPC.

::

    from pagedserve.frontend.client import Client
    from pagedserve.frontend import SamplingParams

    with Client("127.0.0.1:50051") as client:
        output = client.generate("The capital of France is", SamplingParams(max_tokens=12))
        print(output.outputs[0].text)
        for output in client.stream("Once upon a time", SamplingParams(max_tokens=64)):
            print(output.outputs[0].text)  # the text so far

``generate`` returns a ``RequestOutput`` as ``LLM.generate`` does; ``stream`` yields the
same ``RequestOutput`` as it grows (text, token ids and logprobs so far; ``finished`` on the
last). ``chat`` and ``chat_stream`` take a conversation, and tools and a tool choice in
OpenAI's shapes (as ``LLM.chat`` takes tools); their outputs carry the calls the model made
(``CompletionOutput.tool_calls``) and, on a server with a reasoning parser, the thinking
(``reasoning_text``) apart from the answer (``text``). ``AsyncClient`` has the same calls as
coroutines and async iterators, for load tools and asyncio services. Errors are
``grpc.RpcError`` with the server's status (``INVALID_ARGUMENT`` naming the field,
``UNAVAILABLE`` while the server drains, ...).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import grpc

from pagedserve.frontend.grpc_convert import (
    FINISH_REASONS,
    GenerationRequest,
    chat_to_proto,
    queue_time_s,
    sampling_params_to_proto,
)
from pagedserve.frontend.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    ToolCall,
)
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc

PromptType = str | Sequence[int]
# A tool choice in OpenAI's form: "none", "auto", "required", or
# {"type": "function", "function": {"name": ...}}.
ToolChoice = str | dict[str, Any]
_FINISH_NAMES = {code: name for name, code in FINISH_REASONS.items()}


def build_request(
    prompt: PromptType | pb.Chat,
    params: SamplingParams | None,
    request_id: str,
    cache_namespace: str,
    lora_adapter: str = "",
    priority: int = 0,
    message_type: type[GenerationRequest] = pb.GenerateRequest,
) -> GenerationRequest:
    """A ``GenerateRequest``, or GenerateStream's twin of it (``message_type``)."""
    request = message_type(
        request_id=request_id,
        cache_namespace=cache_namespace,
        lora_adapter=lora_adapter,
        priority=priority,
    )
    if isinstance(prompt, pb.Chat):
        request.chat.CopyFrom(prompt)
    elif isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
    if params is not None:
        request.sampling.CopyFrom(sampling_params_to_proto(params))
    return request


def stream_request(request: pb.GenerateRequest) -> pb.GenerateStreamRequest:
    """``request`` as GenerateStream takes it (for callers of the raw stub): the two messages
    have the same fields and numbers, so its bytes read as the other."""
    return pb.GenerateStreamRequest.FromString(request.SerializeToString())


def apply_response(
    output: RequestOutput | None, response: pb.GenerateResponse | pb.GenerateStreamResponse
) -> RequestOutput:
    """Add one response (a whole result, or a stream's message) to ``output``."""
    if output is None:
        output = RequestOutput(response.request_id, None, list(response.prompt_token_ids))
    elif response.prompt_token_ids:
        output.prompt_token_ids = list(response.prompt_token_ids)
    if response.prompt_logprobs:
        if output.prompt_logprobs is None:
            output.prompt_logprobs = [None]
        output.prompt_logprobs.extend(
            dict(zip(e.token_ids, e.logprobs)) for e in response.prompt_logprobs
        )
    for message in response.outputs:
        while len(output.outputs) <= message.index:
            output.outputs.append(CompletionOutput(len(output.outputs), "", [], None))
        completion = output.outputs[message.index]
        completion.text += message.text
        completion.reasoning_text += message.reasoning_text
        for call in message.tool_calls:  # a whole call, or a stream's piece of one
            if call.index < len(completion.tool_calls):
                known = completion.tool_calls[call.index]
                completion.tool_calls[call.index] = ToolCall(
                    known.id, known.name, known.arguments + call.arguments
                )
            else:
                completion.tool_calls.append(ToolCall(call.id, call.name, call.arguments))
        completion.token_ids.extend(message.token_ids)
        if message.logprobs:
            completion.logprobs = completion.logprobs or []
            completion.logprobs.extend(dict(zip(e.token_ids, e.logprobs)) for e in message.logprobs)
        if message.HasField("cumulative_logprob"):
            completion.cumulative_logprob = message.cumulative_logprob
        if message.finish_reason:
            completion.finish_reason = _FINISH_NAMES.get(message.finish_reason)
            which = message.WhichOneof("stop_reason")
            completion.stop_reason = None if which is None else getattr(message, which)
    if response.finished:
        output.finished = True
        output.num_cached_tokens = response.usage.cached_prompt_tokens
        output.queue_time_s = queue_time_s(response.usage)
    return output


def conversation(
    messages: Sequence[dict[str, Any]],
    *,
    add_generation_prompt: bool = False,
    continue_final_message: bool = False,
    chat_template_kwargs: dict[str, Any] | None = None,
    chat_template: str | None = None,
) -> pb.Chat:
    """A conversation to embed or classify (``Client.embed(conversation(...))``,
    ``Client.classify(conversation(...))``; vLLM's chat form of those calls): the server
    renders it with the chat template, ending with its last message unless
    ``add_generation_prompt``."""
    chat = chat_to_proto(
        messages,
        continue_final_message=continue_final_message,
        chat_template_kwargs=chat_template_kwargs,
        chat_template=chat_template,
    )
    chat.add_generation_prompt = add_generation_prompt  # unset would mean false here
    return chat


def build_embed_request(
    prompt: PromptType | pb.Chat,
    dimensions: int | None,
    normalize: bool | None,
    request_id: str,
    cache_namespace: str,
    lora_adapter: str,
    priority: int,
) -> pb.EmbedRequest:
    request = pb.EmbedRequest(
        request_id=request_id,
        cache_namespace=cache_namespace,
        lora_adapter=lora_adapter,
        priority=priority,
    )
    if normalize is not None:  # unset: the model's default
        request.normalize = normalize
    if dimensions is not None:
        request.dimensions = dimensions
    if isinstance(prompt, pb.Chat):
        request.chat.CopyFrom(prompt)
    elif isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
    return request


def build_score_request(
    text_1: str | Sequence[str],
    text_2: str | Sequence[str],
    truncate_prompt_tokens: int | None,
    request_id: str,
    lora_adapter: str,
    priority: int,
) -> pb.ScoreRequest:
    request = pb.ScoreRequest(
        request_id=request_id,
        text_1=[text_1] if isinstance(text_1, str) else list(text_1),
        text_2=[text_2] if isinstance(text_2, str) else list(text_2),
        lora_adapter=lora_adapter,
        priority=priority,
    )
    if truncate_prompt_tokens is not None:
        request.truncate_prompt_tokens = truncate_prompt_tokens
    return request


def build_classify_request(
    texts: str | Sequence[str] | pb.Chat,
    truncate_prompt_tokens: int | None,
    use_activation: bool | None,
    request_id: str,
    lora_adapter: str,
    priority: int,
) -> pb.ClassifyRequest:
    request = pb.ClassifyRequest(
        request_id=request_id, lora_adapter=lora_adapter, priority=priority
    )
    if isinstance(texts, pb.Chat):
        request.chat.CopyFrom(texts)
    else:
        request.input.extend([texts] if isinstance(texts, str) else texts)
    if truncate_prompt_tokens is not None:
        request.truncate_prompt_tokens = truncate_prompt_tokens
    if use_activation is not None:
        request.use_activation = use_activation
    return request


def classification_outputs(
    request: pb.ClassifyRequest, response: pb.ClassifyResponse
) -> list[ClassificationRequestOutput]:
    """A ``Classify`` response as the offline ``LLM.classify`` returns it (the prompts'
    token ids are not sent back: empty; a conversation's prompt text is the server's)."""
    texts = [None] if request.HasField("chat") else list(request.input)
    return [
        ClassificationRequestOutput(
            request_id=response.request_id,
            prompt=text,
            prompt_token_ids=[],
            outputs=ClassificationOutput(list(item.probs)),
            label=item.label,
        )
        for text, item in zip(texts, response.classifications, strict=True)
    ]


def embedding_output(
    prompt: PromptType | pb.Chat, response: pb.EmbedResponse
) -> EmbeddingRequestOutput:
    """An ``Embed`` response as the offline ``LLM.embed`` returns it (the prompt's token
    ids are known only for a prompt given as ids)."""
    given_ids = not isinstance(prompt, (str, pb.Chat))
    return EmbeddingRequestOutput(
        request_id=response.request_id,
        prompt=prompt if isinstance(prompt, str) else None,
        prompt_token_ids=list(prompt) if given_ids else [],
        outputs=EmbeddingOutput(list(response.embedding)),
        finished=True,
        finish_reason="stop",
        num_cached_tokens=response.usage.cached_prompt_tokens,
        queue_time_s=queue_time_s(response.usage),
    )


def _channel(channels: Any, target: str, credentials, options: dict[str, Any]):
    """A channel from ``grpc`` or ``grpc.aio`` (``channels``), which make them alike."""
    if credentials is None:
        return channels.insecure_channel(target, list(options.items()))
    return channels.secure_channel(target, credentials, list(options.items()))


def _metadata(api_key: str | None) -> tuple[tuple[str, str], ...] | None:
    """What every call sends to a server started with ``--api-key``."""
    return None if api_key is None else (("authorization", f"Bearer {api_key}"),)


def _chat_request(
    messages: Sequence[dict[str, Any]],
    params: SamplingParams | None,
    tools: Sequence[dict[str, Any]] | None,
    tool_choice: ToolChoice | None,
    parallel_tool_calls: bool | None,
    include_reasoning: bool | None,
    reasoning_effort: str | None,
    add_generation_prompt: bool,
    continue_final_message: bool,
    chat_template_kwargs: dict[str, Any] | None,
    chat_template: str | None,
    documents: Sequence[dict[str, str]] | None,
    request_id: str,
    cache_namespace: str,
    lora_adapter: str,
    priority: int,
    message_type: type[GenerationRequest] = pb.GenerateRequest,
) -> GenerationRequest:
    chat = chat_to_proto(
        messages, tools, tool_choice, parallel_tool_calls, include_reasoning,
        add_generation_prompt, continue_final_message, chat_template_kwargs, chat_template,
        documents, reasoning_effort,
    )  # fmt: skip
    return build_request(
        chat, params, request_id, cache_namespace, lora_adapter, priority, message_type
    )


class Client:
    """A blocking client. ``target`` is ``host:port``; ``credentials`` (from
    ``grpc.ssl_channel_credentials``) for a TLS server; ``api_key`` for a server started
    with ``--api-key``."""

    def __init__(
        self,
        target: str,
        credentials: grpc.ChannelCredentials | None = None,
        *,
        api_key: str | None = None,
        **options: Any,
    ) -> None:
        self._metadata = _metadata(api_key)
        self.channel = _channel(grpc, target, credentials, options)
        self.stub = pb_grpc.GenerationServiceStub(self.channel)

    def generate(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        *,
        request_id: str = "",
        cache_namespace: str = "",
        lora_adapter: str = "",
        priority: int = 0,
        timeout_s: float | None = None,
    ) -> RequestOutput:
        """The whole result; ``params=None`` lets the model's generation config decide."""
        request = build_request(prompt, params, request_id, cache_namespace, lora_adapter, priority)
        return self._whole(request, timeout_s)

    def chat(
        self,
        messages: Sequence[dict[str, Any]],
        params: SamplingParams | None = None,
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        tool_choice: ToolChoice | None = None,
        parallel_tool_calls: bool | None = None,
        include_reasoning: bool | None = None,
        reasoning_effort: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        chat_template: str | None = None,
        documents: Sequence[dict[str, str]] | None = None,
        request_id: str = "",
        cache_namespace: str = "",
        lora_adapter: str = "",
        priority: int = 0,
        timeout_s: float | None = None,
    ) -> RequestOutput:
        """The assistant's turn after ``messages`` (the model's chat template; OpenAI's
        message dicts, an assistant's ``tool_calls`` and a tool's ``tool_call_id``
        included). ``tools`` (OpenAI's function tools) go to the template, and
        ``tool_choice`` (unset: "auto" with tools) says how calls come out: each output's
        ``tool_calls``, its ``text`` the content around them. ``reasoning_effort``
        (OpenAI's "low", "medium" or "high") goes to the template as its variable of the
        name (gpt-oss's reads it; ``chat_template_kwargs`` win). ``continue_final_message``
        (with ``add_generation_prompt=False``) has the model go on with the last message,
        ``chat_template_kwargs`` are more template variables, ``documents`` a RAG
        template's sources, and ``chat_template`` a template of the call's own (a server
        started with ``--trust-request-chat-template``), as ``LLM.chat``."""
        request = _chat_request(
            messages, params, tools, tool_choice, parallel_tool_calls, include_reasoning,
            reasoning_effort, add_generation_prompt, continue_final_message,
            chat_template_kwargs, chat_template, documents, request_id, cache_namespace,
            lora_adapter, priority,
        )  # fmt: skip
        return self._whole(request, timeout_s)

    def stream(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        *,
        request_id: str = "",
        cache_namespace: str = "",
        lora_adapter: str = "",
        priority: int = 0,
        timeout_s: float | None = None,
    ) -> Iterator[RequestOutput]:
        """The result as it grows (one ``RequestOutput``, updated in place). Leaving the
        loop early cancels the call, which frees its blocks in the server."""
        request = build_request(
            prompt, params, request_id, cache_namespace, lora_adapter, priority,
            pb.GenerateStreamRequest,
        )  # fmt: skip
        return self._stream(request, timeout_s)

    def chat_stream(
        self,
        messages: Sequence[dict[str, Any]],
        params: SamplingParams | None = None,
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        tool_choice: ToolChoice | None = None,
        parallel_tool_calls: bool | None = None,
        include_reasoning: bool | None = None,
        reasoning_effort: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        chat_template: str | None = None,
        documents: Sequence[dict[str, str]] | None = None,
        request_id: str = "",
        cache_namespace: str = "",
        lora_adapter: str = "",
        priority: int = 0,
        timeout_s: float | None = None,
    ) -> Iterator[RequestOutput]:
        """``chat`` as it grows, as ``stream`` yields it: text, thinking and calls so far
        (a call's arguments grow until the output ends)."""
        request = _chat_request(
            messages, params, tools, tool_choice, parallel_tool_calls, include_reasoning,
            reasoning_effort, add_generation_prompt, continue_final_message,
            chat_template_kwargs, chat_template, documents, request_id, cache_namespace,
            lora_adapter, priority, pb.GenerateStreamRequest,
        )  # fmt: skip
        return self._stream(request, timeout_s)

    def embed(
        self,
        prompt: PromptType | pb.Chat,
        *,
        dimensions: int | None = None,
        normalize: bool | None = None,
        request_id: str = "",
        cache_namespace: str = "",
        lora_adapter: str = "",
        priority: int = 0,
        timeout_s: float | None = None,
    ) -> EmbeddingRequestOutput:
        """The prompt's embedding (the ``Embed`` RPC): ``outputs.embedding``; a
        ``conversation(messages)`` is rendered with the server's chat template."""
        request = build_embed_request(
            prompt, dimensions, normalize, request_id, cache_namespace, lora_adapter, priority
        )
        response = self.stub.Embed(request, timeout=timeout_s, metadata=self._metadata)
        return embedding_output(prompt, response)

    def score(
        self,
        text_1: str | Sequence[str],
        text_2: str | Sequence[str],
        *,
        truncate_prompt_tokens: int | None = None,
        request_id: str = "",
        lora_adapter: str = "",
        priority: int = 0,
        timeout_s: float | None = None,
    ) -> list[float]:
        """Each pair's score (the ``Score`` RPC, as ``LLM.score``): one ``text_1``
        against every ``text_2``, or pairwise."""
        request = build_score_request(
            text_1, text_2, truncate_prompt_tokens, request_id, lora_adapter, priority
        )
        response = self.stub.Score(request, timeout=timeout_s, metadata=self._metadata)
        return list(response.scores)

    def classify(
        self,
        texts: str | Sequence[str] | pb.Chat,
        *,
        truncate_prompt_tokens: int | None = None,
        use_activation: bool | None = None,
        request_id: str = "",
        lora_adapter: str = "",
        priority: int = 0,
        timeout_s: float | None = None,
    ) -> list[ClassificationRequestOutput]:
        """Each text's classification (the ``Classify`` RPC, as ``LLM.classify``):
        ``.outputs.probs`` over the model's labels and the most probable ``.label``; a
        ``conversation(messages)`` is classified as one prompt."""
        request = build_classify_request(
            texts, truncate_prompt_tokens, use_activation, request_id, lora_adapter, priority
        )
        response = self.stub.Classify(request, timeout=timeout_s, metadata=self._metadata)
        return classification_outputs(request, response)

    def tokenize(self, text: str) -> list[int]:
        return list(
            self.stub.Tokenize(pb.TokenizeRequest(text=text), metadata=self._metadata).token_ids
        )

    def model_info(self) -> pb.GetModelInfoResponse:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=self._metadata)

    def stats(self) -> pb.GetStatsResponse:
        return self.stub.GetStats(pb.GetStatsRequest(), metadata=self._metadata)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _whole(self, request: pb.GenerateRequest, timeout_s: float | None) -> RequestOutput:
        response = self.stub.Generate(request, timeout=timeout_s, metadata=self._metadata)
        return apply_response(None, response)

    def _stream(
        self, request: pb.GenerateStreamRequest, timeout_s: float | None
    ) -> Iterator[RequestOutput]:
        call = self.stub.GenerateStream(request, timeout=timeout_s, metadata=self._metadata)
        output = None
        try:
            for response in call:
                output = apply_response(output, response)
                yield output
        finally:
            call.cancel()  # a no-op once the call has ended


class AsyncClient:
    """The same calls for asyncio (``grpc.aio``); create it inside the running loop."""

    def __init__(
        self,
        target: str,
        credentials: grpc.ChannelCredentials | None = None,
        *,
        api_key: str | None = None,
        **options: Any,
    ) -> None:
        self._metadata = _metadata(api_key)
        self.channel = _channel(grpc.aio, target, credentials, options)
        self.stub = pb_grpc.GenerationServiceStub(self.channel)

    async def generate(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        *,
        request_id: str = "",
        cache_namespace: str = "",
        lora_adapter: str = "",
        priority: int = 0,
        timeout_s: float | None = None,
    ) -> RequestOutput:
        request = build_request(prompt, params, request_id, cache_namespace, lora_adapter, priority)
        return await self._whole(request, timeout_s)

    async def chat(
        self,
        messages: Sequence[dict[str, Any]],
        params: SamplingParams | None = None,
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        tool_choice: ToolChoice | None = None,
        parallel_tool_calls: bool | None = None,
        include_reasoning: bool | None = None,
        reasoning_effort: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        chat_template: str | None = None,
        documents: Sequence[dict[str, str]] | None = None,
        request_id: str = "",
        cache_namespace: str = "",
        lora_adapter: str = "",
        priority: int = 0,
        timeout_s: float | None = None,
    ) -> RequestOutput:
        request = _chat_request(
            messages, params, tools, tool_choice, parallel_tool_calls, include_reasoning,
            reasoning_effort, add_generation_prompt, continue_final_message,
            chat_template_kwargs, chat_template, documents, request_id, cache_namespace,
            lora_adapter, priority,
        )  # fmt: skip
        return await self._whole(request, timeout_s)

    def stream(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        *,
        request_id: str = "",
        cache_namespace: str = "",
        lora_adapter: str = "",
        priority: int = 0,
        timeout_s: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        request = build_request(
            prompt, params, request_id, cache_namespace, lora_adapter, priority,
            pb.GenerateStreamRequest,
        )  # fmt: skip
        return self._stream(request, timeout_s)

    def chat_stream(
        self,
        messages: Sequence[dict[str, Any]],
        params: SamplingParams | None = None,
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        tool_choice: ToolChoice | None = None,
        parallel_tool_calls: bool | None = None,
        include_reasoning: bool | None = None,
        reasoning_effort: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        chat_template: str | None = None,
        documents: Sequence[dict[str, str]] | None = None,
        request_id: str = "",
        cache_namespace: str = "",
        lora_adapter: str = "",
        priority: int = 0,
        timeout_s: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        request = _chat_request(
            messages, params, tools, tool_choice, parallel_tool_calls, include_reasoning,
            reasoning_effort, add_generation_prompt, continue_final_message,
            chat_template_kwargs, chat_template, documents, request_id, cache_namespace,
            lora_adapter, priority, pb.GenerateStreamRequest,
        )  # fmt: skip
        return self._stream(request, timeout_s)

    async def embed(
        self,
        prompt: PromptType | pb.Chat,
        *,
        dimensions: int | None = None,
        normalize: bool | None = None,
        request_id: str = "",
        cache_namespace: str = "",
        lora_adapter: str = "",
        priority: int = 0,
        timeout_s: float | None = None,
    ) -> EmbeddingRequestOutput:
        request = build_embed_request(
            prompt, dimensions, normalize, request_id, cache_namespace, lora_adapter, priority
        )
        response = await self.stub.Embed(request, timeout=timeout_s, metadata=self._metadata)
        return embedding_output(prompt, response)

    async def score(
        self,
        text_1: str | Sequence[str],
        text_2: str | Sequence[str],
        *,
        truncate_prompt_tokens: int | None = None,
        request_id: str = "",
        lora_adapter: str = "",
        priority: int = 0,
        timeout_s: float | None = None,
    ) -> list[float]:
        request = build_score_request(
            text_1, text_2, truncate_prompt_tokens, request_id, lora_adapter, priority
        )
        response = await self.stub.Score(request, timeout=timeout_s, metadata=self._metadata)
        return list(response.scores)

    async def classify(
        self,
        texts: str | Sequence[str] | pb.Chat,
        *,
        truncate_prompt_tokens: int | None = None,
        use_activation: bool | None = None,
        request_id: str = "",
        lora_adapter: str = "",
        priority: int = 0,
        timeout_s: float | None = None,
    ) -> list[ClassificationRequestOutput]:
        request = build_classify_request(
            texts, truncate_prompt_tokens, use_activation, request_id, lora_adapter, priority
        )
        response = await self.stub.Classify(request, timeout=timeout_s, metadata=self._metadata)
        return classification_outputs(request, response)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def _whole(self, request: pb.GenerateRequest, timeout_s: float | None) -> RequestOutput:
        response = await self.stub.Generate(request, timeout=timeout_s, metadata=self._metadata)
        return apply_response(None, response)

    async def _stream(
        self, request: pb.GenerateStreamRequest, timeout_s: float | None
    ) -> AsyncIterator[RequestOutput]:
        call = self.stub.GenerateStream(request, timeout=timeout_s, metadata=self._metadata)
        output = None
        try:
            async for response in call:
                output = apply_response(output, response)
                yield output
        finally:
            call.cancel()
