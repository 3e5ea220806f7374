"""Between the gRPC API's messages (protos/pagedserve/v1/generation.proto) and the
engine's: sampling settings and chats (messages, tools, tool choice) in, outputs out
(whole, or what is new since the last streamed message). A chat is checked and read by
the functions the HTTP API uses (``tool_calls.py``, ``chat_request.py``); their errors
name OpenAI's fields, renamed here to the proto's (``chat.tools[0].name``)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedserve.frontend import grpc_enums
from pagedserve.frontend.chat_request import (
    ChatAnswer,
    ChatAnswerStream,
    ChatReading,
    tool_constraint,
)
from pagedserve.frontend.chat_template import message_reasoning
from pagedserve.frontend.generation_config import DEFAULT_FIELDS, limit_max_tokens
from pagedserve.frontend.outputs import CompletionOutput, RequestOutput
from pagedserve.frontend.reasoning import ReasoningParser
from pagedserve.frontend.request_contract import check_chat_role, clamped_logit_bias, decode_json
from pagedserve.frontend.tool_calls import (
    Tool,
    ToolCallError,
    ToolCalling,
    chat_message_tool_fields,
    parse_tools,
)
from pagedserve.scheduler.sampling_params import SamplingParams, StructuredOutputsParams
from pagedserve.scheduler.structured_output import grammar_text
from pagedserve.v1 import generation_pb2 as pb

if TYPE_CHECKING:
    from pagedserve.frontend.llm import LLM

# Proto3 `optional` fields copied as they are when set (unset: SamplingParams' default).
_OPTIONAL_FIELDS = (
    "max_tokens",
    "min_tokens",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "logprobs",
    "prompt_logprobs",
    "n",
    "best_of",
    "beam_width",
    "length_penalty",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "truncate_prompt_tokens",
    "detokenize",
)

# StructuredOutputs' constraint (the proto's oneof) -> StructuredOutputsParams' field.
_STRUCTURED_KINDS = {
    "json_schema": "json",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "json_object": "json_object",
}

# Generate's request or GenerateStream's twin of it (the same fields and numbers).
GenerationRequest = pb.GenerateRequest | pb.GenerateStreamRequest

FINISH_REASONS = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
    "tool_calls": pb.FINISH_REASON_TOOL_CALLS,
}


def sampling_params_from_proto(
    message: pb.SamplingParams | None,
    default: SamplingParams,
    max_tokens_limit: int | None = None,
) -> SamplingParams:
    """The request's ``SamplingParams``. ``default`` is the model's (its generation config,
    ``generation_config.py``): all of it when the request sets none, its temperature, top_k,
    top_p, min_p, repetition_penalty and max_tokens where the request leaves them unset.
    ``max_tokens_limit`` (the config's max_new_tokens) cuts a larger max_tokens. Raises
    ``ValueError`` naming ``sampling.<field>``, the value and the limit."""
    if message is None:
        return default
    kwargs: dict[str, Any] = {
        name: getattr(message, name) for name in _OPTIONAL_FIELDS if message.HasField(name)
    }
    if kwargs.get("beam_width", 1) > 1:
        kwargs.setdefault("temperature", 0.0)  # beam search is greedy, whatever the model's
    for name in (*DEFAULT_FIELDS, "max_tokens"):  # unset: the model's generation config decides
        kwargs.setdefault(name, getattr(default, name))
    try:
        kwargs["max_tokens"] = limit_max_tokens(
            kwargs["max_tokens"], kwargs.get("min_tokens", 0), max_tokens_limit
        )
    except ValueError as error:
        raise ValueError(f"sampling.{error}") from None
    # A number this server does not know is refused by name.
    grpc_enums.word(pb.EarlyStopping, message.early_stopping, "sampling.early_stopping")
    kwargs.update(
        ignore_eos=message.ignore_eos,
        stop_token_ids=list(message.stop_token_ids),
        stop=list(message.stop) or None,
        include_stop_str_in_output=message.include_stop_str_in_output,
        early_stopping=grpc_enums.EARLY_STOPPING_FROM_PROTO[message.early_stopping],
    )
    if message.HasField("structured_outputs"):
        kwargs["structured_outputs"] = _structured_outputs_from_proto(message.structured_outputs)
    if message.logit_bias:
        kwargs["logit_bias"] = clamped_logit_bias("sampling.logit_bias", dict(message.logit_bias))
    if message.allowed_token_ids:
        kwargs["allowed_token_ids"] = list(message.allowed_token_ids)
    if message.bad_words:
        kwargs["bad_words"] = list(message.bad_words)
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as error:
        raise ValueError(f"sampling.{error}") from None


def _structured_outputs_from_proto(message: pb.StructuredOutputs) -> StructuredOutputsParams:
    """The constraint, compiled here so that an error names the proto's field
    (``sampling.structured_outputs.json_schema``, not the engine's ``json``)."""
    kind = message.WhichOneof("constraint")
    if kind is None:
        raise ValueError(
            "sampling.structured_outputs is set but names no constraint; set one of "
            + ", ".join(_STRUCTURED_KINDS)
        )
    if kind == "json_object" and not message.json_object:
        raise ValueError(
            "sampling.structured_outputs.json_object must be true (any JSON object); leave "
            "structured_outputs unset for unconstrained output"
        )
    engine_kind = _STRUCTURED_KINDS[kind]
    value = getattr(message, kind)
    if kind == "choice":
        value = list(value.choices)
    try:
        params = StructuredOutputsParams(
            **{engine_kind: value}, disable_any_whitespace=message.disable_any_whitespace
        )
        grammar_text(params)
    except (ValueError, TypeError) as error:
        text = str(error)
        prefix = f"structured_outputs.{engine_kind}"
        raise ValueError(f"sampling.structured_outputs.{kind}{text.removeprefix(prefix)}") from None
    return params


def _structured_outputs_to_proto(params: StructuredOutputsParams) -> pb.StructuredOutputs:
    message = pb.StructuredOutputs(disable_any_whitespace=params.disable_any_whitespace)
    kind = params.kind
    if kind == "choice":
        message.choice.choices.extend(params.choice)
    elif kind == "json":
        message.json_schema = params.json  # JSON text once constructed
    else:
        setattr(message, kind, getattr(params, kind))
    return message


def sampling_params_to_proto(params: SamplingParams) -> pb.SamplingParams:
    """The request's settings as the server reads them: every field set explicitly, so
    the server applies exactly ``params`` (the client's side of the conversion above)."""
    message = pb.SamplingParams(
        temperature=params.temperature,
        ignore_eos=params.ignore_eos,
        stop_token_ids=params.stop_token_ids,
        stop=params.stop or [],
        include_stop_str_in_output=params.include_stop_str_in_output,
        early_stopping=grpc_enums.EARLY_STOPPING_TO_PROTO[params.early_stopping],
    )
    for name in _OPTIONAL_FIELDS:
        value = getattr(params, name)
        if value is not None:
            setattr(message, name, value)
    if params.structured_outputs is not None:
        message.structured_outputs.CopyFrom(_structured_outputs_to_proto(params.structured_outputs))
    if params.logit_bias:
        message.logit_bias.update(params.logit_bias)
    if params.allowed_token_ids:
        message.allowed_token_ids.extend(params.allowed_token_ids)
    if params.bad_words_token_ids is not None and not params.bad_words:
        raise ValueError(
            "bad_words_token_ids: the server tokenizes bad_words itself; set bad_words instead"
        )
    message.bad_words.extend(params.bad_words or ())
    return message


# ---------------------------------------------------------------- chats


def _renamed(error: ToolCallError, field: str) -> ValueError:
    """``error`` under the proto's names: OpenAI's ``tools[0].function.name`` is
    ``chat.tools[0].name``, ``tool_choice.function.name`` is
    ``chat.tool_choice.function_name`` (``field``: the Chat's own name)."""
    name = error.field.replace(".function.", ".")
    if name == "tool_choice.name":
        name = "tool_choice.function_name"
    if not name.startswith(f"{field}."):
        name = f"{field}.{name}"
    message = str(error)
    if message.startswith(error.field):
        message = name + message[len(error.field) :]
    return ValueError(message)


def _message_as_openai(message: pb.ChatMessage, role: str) -> dict[str, Any]:
    """A chat message in OpenAI's shape, which ``chat_message_tool_fields`` reads."""
    shaped: dict[str, Any] = {"role": role, "content": message.content}
    if message.tool_calls:
        shaped["tool_calls"] = [
            {
                **({"id": call.id} if call.id else {}),
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
            for call in message.tool_calls
        ]
    if role == "tool":
        shaped["tool_call_id"] = message.tool_call_id
    if message.name:
        shaped["name"] = message.name
    return shaped


def _tools_from_proto(tools: Sequence[pb.Tool], field: str) -> list[Tool] | None:
    """The chat's tools, checked as the HTTP API checks them; None when it gives none."""
    if not tools:
        return None
    functions = []
    for position, tool in enumerate(tools):
        function: dict[str, Any] = {"name": tool.name}
        if tool.description:
            function["description"] = tool.description
        if tool.parameters:
            function["parameters"] = decode_json(
                f"{field}.tools[{position}].parameters", tool.parameters
            )
        functions.append({"type": "function", "function": function})
    try:
        return parse_tools(functions)
    except ToolCallError as error:
        raise _renamed(error, field) from None


def chat_from_proto(
    chat: pb.Chat, field: str = "chat"
) -> tuple[list[dict[str, Any]], list[Tool] | None]:
    """The conversation as the chat template gets it (role, content, and an assistant's
    calls or a tool message's call id) and the chat's tools; ``ValueError`` naming
    ``<field>.<proto field>``, the value and the limit."""
    if not chat.messages:
        raise ValueError(f"{field}.messages is empty; it needs at least one message")
    conversation = []
    for position, message in enumerate(chat.messages):
        name = f"{field}.messages[{position}]"
        role_field = f"{name}.role"
        role = check_chat_role(
            grpc_enums.required_word(pb.ChatRole, message.role, role_field), role_field
        )
        entry: dict[str, Any] = {"role": role, "content": message.content}
        try:
            entry.update(chat_message_tool_fields(_message_as_openai(message, role), name))
        except ToolCallError as error:
            raise _renamed(error, field) from None
        entry.update(
            message_reasoning(role, message.reasoning_content or None, f"{name}.reasoning_content")
        )
        conversation.append(entry)
    return conversation, _tools_from_proto(chat.tools, field)


def _tool_choice(chat: pb.Chat, field: str) -> str | dict[str, Any] | None:
    """The tool choice in OpenAI's form (a mode, or the named function); None: unset."""
    if not chat.HasField("tool_choice"):
        return None
    kind = chat.tool_choice.WhichOneof("choice")
    if kind is None:
        raise ValueError(
            f"{field}.tool_choice is set but holds neither mode nor function_name; set one, "
            "or leave tool_choice unset"
        )
    if kind == "function_name":
        return {"type": "function", "function": {"name": chat.tool_choice.function_name}}
    # ToolCalling, the HTTP API's reader, checks the mode (chat_reading_from_proto).
    return grpc_enums.required_word(
        pb.ToolChoiceMode, chat.tool_choice.mode, f"{field}.tool_choice.mode"
    )


def chat_reading_from_proto(
    chat: pb.Chat,
    tools: list[Tool] | None,
    tool_call_parser: str | None,
    reasoning_parser: str | None,
    field: str = "chat",
) -> ChatReading:
    """How the chat's outputs read: its tool calling (``tools`` from ``chat_from_proto``;
    ``tool_call_parser``, the server's, for "auto") and the server's ``reasoning_parser``;
    ``ValueError`` naming the field as ``chat_from_proto`` does."""
    tool_choice = _tool_choice(chat, field)
    calling = None
    if tools is None:
        if tool_choice not in (None, "none"):
            raise ValueError(
                f"{field}.tool_choice needs {field}.tools to choose from; the chat gives none"
            )
    else:
        parallel = chat.parallel_tool_calls if chat.HasField("parallel_tool_calls") else True
        try:
            calling = ToolCalling(tools, tool_choice, parallel, tool_call_parser)
        except ToolCallError as error:
            raise _renamed(error, field) from None
        if calling.mode == "none":
            calling = None
    return ChatReading(
        calling,
        ReasoningParser(reasoning_parser) if reasoning_parser else None,
        chat.include_reasoning if chat.HasField("include_reasoning") else True,
    )


def chat_sampling_params(
    params: SamplingParams,
    message: pb.SamplingParams | None,
    reading: ChatReading,
    llm: LLM,
    field: str = "chat",
) -> SamplingParams:
    """``params`` with what the chat's reading needs: a required or named tool choice's
    constraint (refused beside ``sampling.structured_outputs``), and special tokens kept
    in the text where the readers' markers are special (unless ``message`` sets
    ``skip_special_tokens``)."""
    calling = reading.tool_calling
    if calling is not None:
        try:
            constraint = tool_constraint(calling, llm)
        except ToolCallError as error:
            raise _renamed(error, field) from None
        if constraint is not None:
            choice = "required" if calling.mode == "required" else "a named function"
            if params.structured_outputs is not None:
                raise ValueError(
                    f"{field}.tool_choice ({choice}) constrains the output to the calls, and "
                    "sampling.structured_outputs sets another constraint; give one"
                )
            try:
                params = dataclasses.replace(params, structured_outputs=constraint)
            except (ValueError, TypeError) as error:  # e.g. beside beam search
                raise ValueError(
                    f"{field}.tool_choice ({choice}) constrains the output to the calls: {error}"
                ) from None
    skip_set = message is not None and message.HasField("skip_special_tokens")
    if not skip_set and reading.keeps_special_tokens(llm):
        params = dataclasses.replace(params, skip_special_tokens=False)
    return params


def chat_to_proto(
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None = None,
    tool_choice: str | dict[str, Any] | None = None,
    parallel_tool_calls: bool | None = None,
    include_reasoning: bool | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: dict[str, Any] | None = None,
    chat_template: str | None = None,
    documents: Sequence[dict[str, str]] | None = None,
    reasoning_effort: str | None = None,
) -> pb.Chat:
    """A ``Chat`` from OpenAI's shapes (the client's side of ``chat_from_proto``):
    messages as dicts (``tool_calls`` with arguments as JSON text or an object,
    ``tool_call_id``), tools as ``{"type": "function", "function": {"name",
    "description", "parameters"}}`` (the offline ``LLM.chat``'s), ``tool_choice`` a mode
    or ``{"type": "function", "function": {"name": ...}}``, ``chat_template_kwargs``
    sent as JSON text; an assistant message's ``reasoning_content`` (or ``reasoning``) sent
    back. The server checks the rest."""
    chat = pb.Chat(continue_final_message=continue_final_message)
    if reasoning_effort is not None:
        chat.reasoning_effort = grpc_enums.value(
            pb.ReasoningEffort, reasoning_effort, "reasoning_effort"
        )
    if not add_generation_prompt:
        chat.add_generation_prompt = False
    if chat_template_kwargs is not None:
        chat.chat_template_kwargs = json.dumps(chat_template_kwargs, ensure_ascii=False)
    if chat_template is not None:
        chat.chat_template = chat_template
    for document in documents or []:
        chat.documents.add(fields=document)
    for position, message in enumerate(messages):
        entry = chat.messages.add(
            role=grpc_enums.value(pb.ChatRole, message["role"], f"messages[{position}].role"),
            content=message.get("content") or "",
            tool_call_id=message.get("tool_call_id") or "",
            name=message.get("name") or "",
            reasoning_content=message.get("reasoning_content") or message.get("reasoning") or "",
        )
        for call in message.get("tool_calls") or []:
            function = call["function"]
            arguments = function.get("arguments", "")
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments, ensure_ascii=False)
            entry.tool_calls.add(
                id=call.get("id") or "", name=function["name"], arguments=arguments
            )
    for position, tool in enumerate(tools or []):
        if tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise ValueError(
                f"tools[{position}] must be {{'type': 'function', 'function': {{...}}}}, got "
                f"{tool!r:.200}"
            )
        function = tool["function"]
        parameters = function.get("parameters")
        chat.tools.add(
            name=function.get("name", ""),
            description=function.get("description") or "",
            parameters="" if parameters is None else json.dumps(parameters, ensure_ascii=False),
        )
    if isinstance(tool_choice, dict):
        chat.tool_choice.function_name = tool_choice["function"]["name"]
    elif tool_choice is not None:
        chat.tool_choice.mode = grpc_enums.value(pb.ToolChoiceMode, tool_choice, "tool_choice")
    if parallel_tool_calls is not None:
        chat.parallel_tool_calls = parallel_tool_calls
    if include_reasoning is not None:
        chat.include_reasoning = include_reasoning
    return chat


def _set_answer(message: pb.Completion, answer: ChatAnswer) -> None:
    message.text = answer.content
    message.reasoning_text = answer.reasoning
    message.tool_calls.extend(
        pb.ToolCall(id=call.id, name=call.name, arguments=call.arguments, index=index)
        for index, call in enumerate(answer.tool_calls)
    )
    message.finish_reason = FINISH_REASONS.get(answer.finish_reason)


# ---------------------------------------------------------------- responses


def _token_logprobs(entry: dict[int, float]) -> pb.TokenLogprobs:
    return pb.TokenLogprobs(token_ids=list(entry), logprobs=list(entry.values()))


def _set_stop_reason(message: pb.Completion, completion: CompletionOutput) -> None:
    if isinstance(completion.stop_reason, str):
        message.stop_string = completion.stop_reason
    elif completion.stop_reason is not None:
        message.stop_token_id = completion.stop_reason


def usage(
    prompt_tokens: int,
    completion_tokens: int = 0,
    cached_prompt_tokens: int = 0,
    queue_time_s: float | None = None,
) -> pb.Usage:
    """A ``Usage``; ``queue_time`` set when the engine measured it."""
    message = pb.Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        cached_prompt_tokens=cached_prompt_tokens,
    )
    if queue_time_s is not None:
        message.queue_time.FromNanoseconds(round(queue_time_s * 1e9))
    return message


def queue_time_s(message: pb.Usage) -> float | None:
    """``Usage.queue_time`` in seconds (the client's side of ``usage``); None when unset."""
    return message.queue_time.ToNanoseconds() / 1e9 if message.HasField("queue_time") else None


def _usage(output: RequestOutput) -> pb.Usage:
    return usage(
        len(output.prompt_token_ids),
        sum(len(c.token_ids) for c in output.outputs),
        output.num_cached_tokens,
        output.queue_time_s,
    )


def whole_response(
    client_request_id: str, output: RequestOutput, reading: ChatReading | None = None
) -> pb.GenerateResponse:
    """``Generate``'s answer: every output in full; a chat's read by ``reading`` (its
    text then the answer only, beside its thinking and calls)."""
    response = pb.GenerateResponse(
        request_id=client_request_id,
        prompt_token_ids=output.prompt_token_ids,
        finished=output.finished,
        usage=_usage(output),
    )
    if output.prompt_logprobs is not None:
        response.prompt_logprobs.extend(
            _token_logprobs(entry) for entry in output.prompt_logprobs if entry is not None
        )
    for completion in output.outputs:
        message = response.outputs.add(
            index=completion.index,
            text=completion.text,
            token_ids=completion.token_ids,
            finish_reason=FINISH_REASONS.get(completion.finish_reason),
        )
        if reading is not None:
            _set_answer(message, reading.whole(completion.text, completion.finish_reason))
        if completion.logprobs is not None:
            message.logprobs.extend(_token_logprobs(entry) for entry in completion.logprobs)
        if completion.cumulative_logprob is not None:
            message.cumulative_logprob = completion.cumulative_logprob
        _set_stop_reason(message, completion)
    return response


@dataclass
class _Sent:
    """How much of one output a stream has sent."""

    text_chars: int = 0
    tokens: int = 0
    logprobs: int = 0
    finished: bool = False
    chat: ChatAnswerStream | None = None  # a chat's reader: what it has settled


@dataclass
class StreamState:
    """What ``GenerateStream`` has sent of a request, so each message carries only what
    is new. The text only grows: the detokenizer holds back what a stop string may cut.
    A chat's outputs are read by ``reading`` (the text the answer, beside the thinking
    and the calls as their readers settle them)."""

    client_request_id: str
    reading: ChatReading | None = None
    outputs: dict[int, _Sent] = field(default_factory=dict)
    prompt_sent: bool = False
    prompt_logprobs_sent: int = 0

    def due(self, output: RequestOutput, interval_tokens: int) -> bool:
        """Whether to send now: the first message (time to first token), at least
        ``interval_tokens`` new tokens over the outputs, or an output or the request
        ended. Fewer, larger messages cost the frontend less per token."""
        if output.finished or not self.prompt_sent or interval_tokens <= 1:
            return True
        new_tokens = 0
        for completion in output.outputs:
            sent = self.outputs.get(completion.index)
            sent_tokens = 0 if sent is None else sent.tokens
            if completion.finish_reason is not None and (sent is None or not sent.finished):
                return True
            new_tokens += len(completion.token_ids) - sent_tokens
        return new_tokens >= interval_tokens

    def next_response(self, output: RequestOutput) -> pb.GenerateStreamResponse | None:
        """The message for what changed since the last one; None when nothing did."""
        response = pb.GenerateStreamResponse(request_id=self.client_request_id)
        changed = False
        if not self.prompt_sent:
            response.prompt_token_ids.extend(output.prompt_token_ids)
            self.prompt_sent = changed = True
        if output.prompt_logprobs is not None:
            new = [e for e in output.prompt_logprobs[1:][self.prompt_logprobs_sent :]]
            if new:
                response.prompt_logprobs.extend(_token_logprobs(entry) for entry in new)
                self.prompt_logprobs_sent += len(new)
                changed = True
        for completion in output.outputs:
            sent = self.outputs.get(completion.index)
            if sent is None:
                chat = None if self.reading is None else self.reading.stream()
                sent = self.outputs[completion.index] = _Sent(chat=chat)
            new_tokens = completion.token_ids[sent.tokens :]
            new_logprobs = (
                [] if completion.logprobs is None else completion.logprobs[sent.logprobs :]
            )
            finish_reason = completion.finish_reason
            newly_finished = finish_reason is not None and not sent.finished
            new_reasoning, new_calls = "", []
            if sent.chat is None:
                new_text = completion.text[sent.text_chars :]
            else:
                read = sent.chat.feed(completion.text, finish_reason is not None)
                new_text, new_reasoning, new_calls = read.content, read.reasoning, read.tool_calls
                finish_reason = sent.chat.finish_reason(finish_reason)
            news = new_text or new_reasoning or new_calls or new_tokens or new_logprobs
            if not (news or newly_finished):
                continue
            message = response.outputs.add(
                index=completion.index,
                text=new_text,
                token_ids=new_tokens,
                reasoning_text=new_reasoning,
            )
            message.tool_calls.extend(
                pb.ToolCall(
                    id=call.id or "",
                    name=call.name or "",
                    arguments=call.arguments,
                    index=call.index,
                )
                for call in new_calls
            )
            message.logprobs.extend(_token_logprobs(entry) for entry in new_logprobs)
            if newly_finished:
                message.finish_reason = FINISH_REASONS.get(finish_reason)
                _set_stop_reason(message, completion)
                if completion.cumulative_logprob is not None:
                    message.cumulative_logprob = completion.cumulative_logprob
                sent.finished = True
            sent.text_chars = len(completion.text)
            sent.tokens = len(completion.token_ids)
            sent.logprobs += len(new_logprobs)
            changed = True
        if output.finished:
            response.finished = True
            response.usage.CopyFrom(_usage(output))
            changed = True
        return response if changed else None
