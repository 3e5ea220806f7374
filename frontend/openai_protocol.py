"""The OpenAI-compatible HTTP API's messages: JSON bodies in, the engine's requests out;
the engine's outputs in, OpenAI's JSON out (whole answers and stream chunks).

Requests are read as OpenAI's ``/v1/completions`` and ``/v1/chat/completions`` define
them, plus the sampling fields vLLM adds (``top_k``, ``min_p``, ``repetition_penalty``,
``min_tokens``, ``stop_token_ids``, ``ignore_eos``, ``best_of``, ``use_beam_search``,
``prompt_logprobs``, ``allowed_token_ids``, ``cache_salt``...), so clients and load-testing
tools written for either work unchanged. Structured output comes as OpenAI's
``response_format`` (JSON object or schema), vLLM's ``structured_outputs`` object, or
vLLM's older ``guided_json``, ``guided_regex``, ``guided_choice`` and ``guided_grammar``;
one constraint per request. ``logit_bias`` values are clamped to [-100, 100], as vLLM
does. Chat requests may give ``tools`` and ``tool_choice`` (``tool_calls.py``). Bad input
raises ``CallError`` (``INVALID_ARGUMENT``) naming the field, the value and the limit;
fields OpenAI defines that this engine cannot honour (suffix, the deprecated functions) are
refused by name rather than ignored; fields nobody defines are ignored and listed in the
server's log, as vLLM does.
"""

from __future__ import annotations

import base64
import dataclasses
import logging
import re
import struct
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedserve.frontend import tool_calls
from pagedserve.frontend.call_errors import CallError
from pagedserve.frontend.chat_request import (
    ChatAnswer,
    ChatAnswerStream,
    ChatReading,
    render_chat_prompt,
    tool_constraint,
)
from pagedserve.frontend.chat_template import (
    SETTING_NAMES,
    ChatTemplateOptions,
    check_template_allowed,
    message_reasoning,
    with_reasoning_effort,
)
from pagedserve.frontend.generation_config import DEFAULT_FIELDS, limit_max_tokens
from pagedserve.frontend.reasoning import ReasoningParser
from pagedserve.frontend.request_contract import (
    check_chat_role,
    check_id_text,
    check_output_room,
    clamped_logit_bias,
)
from pagedserve.frontend.tool_calls import ToolCallDelta, ToolCallError, ToolCalling
from pagedserve.scheduler.pooling_params import PoolingParams
from pagedserve.scheduler.sampling_params import (
    STRUCTURED_OUTPUT_KINDS,
    SamplingParams,
    StructuredOutputsParams,
)
from pagedserve.scheduler.scheduler import max_sequence_tokens
from pagedserve.scheduler.structured_output import grammar_text

if TYPE_CHECKING:
    from pagedserve.frontend.llm import LLM
    from pagedserve.frontend.outputs import (
        CompletionOutput,
        EmbeddingRequestOutput,
        RequestOutput,
        ToolCall,
    )

logger = logging.getLogger("pagedserve.server")

# OpenAI's default for /v1/completions; chat completions default to the rest of the
# model's context window, as vLLM does.
DEFAULT_COMPLETION_MAX_TOKENS = 16

# Body field -> SamplingParams field, copied when present and not null.
_SAMPLING_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
    "seed": "seed",
    "min_tokens": "min_tokens",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "n": "n",
    "best_of": "best_of",
    "length_penalty": "length_penalty",
    "early_stopping": "early_stopping",
    "include_stop_str_in_output": "include_stop_str_in_output",
    "skip_special_tokens": "skip_special_tokens",
    "spaces_between_special_tokens": "spaces_between_special_tokens",
    "prompt_logprobs": "prompt_logprobs",
    "allowed_token_ids": "allowed_token_ids",
    "bad_words": "bad_words",
    "truncate_prompt_tokens": "truncate_prompt_tokens",
}
# Fields read elsewhere in this module, or accepted and without effect here.
_COMMON_FIELDS = {
    "model",
    "stream",
    "stream_options",
    "stop",
    "max_tokens",
    "use_beam_search",
    "cache_salt",
    "priority",
    "request_id",
    "return_tokens_as_token_ids",
    "return_token_ids",
    "user",
    "logprobs",
    "logit_bias",
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
}
_COMPLETION_FIELDS = {"prompt", "echo", "suffix"}
_CHAT_FIELDS = {
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "parallel_tool_calls",
    "include_reasoning",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template_kwargs",
    "chat_template",
    "documents",
    "echo",
    "reasoning_effort",
}
# vLLM's older structured-output fields -> StructuredOutputsParams' field.
_GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def invalid_field(message: str, param: str) -> CallError:
    return CallError("INVALID_ARGUMENT", message, param)


def _sampling_error(error: Exception, names: dict[str, str]) -> CallError:
    """SamplingParams' message with its field named as the request names it."""
    message = str(error)
    name = re.match(r"[a-z_]+", message)
    param = names.get(name.group(0), name.group(0)) if name else None
    if param is not None and name is not None and param != name.group(0):
        message = param + message[len(name.group(0)) :]
    return CallError("INVALID_ARGUMENT", message, param)


def field_named(error: Exception) -> str | None:
    """The request field an engine check's message starts with (``stop_token_ids: token
    id ...``), when it names one."""
    name = re.match(r"[a-z_]+", str(error))
    known = _COMMON_FIELDS | set(_SAMPLING_FIELDS) | _COMPLETION_FIELDS | _CHAT_FIELDS
    return name.group(0) if name and name.group(0) in known else None


def checked_body(body: Any, known: set[str] | frozenset[str], api: str) -> dict:
    """A request body that is a JSON object; the fields ``api`` does not know are ignored,
    and named in the log (vLLM's behaviour: a client's extra fields do not fail it)."""
    if not isinstance(body, dict):
        raise invalid_field(
            f"the request body must be a JSON object, got {type(body).__name__}", ""
        )
    ignored = sorted(set(body) - known)
    if ignored:
        logger.warning("fields ignored (not part of the %s API): %s", api, ", ".join(ignored))
    return body


def typed_field(body: dict, name: str, kinds: tuple[type, ...], what: str, default: Any = None):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds:
        raise invalid_field(f"{name} must be {what}, got {value!r}", name)
    if not isinstance(value, kinds):
        raise invalid_field(f"{name} must be {what}, got {value!r}", name)
    return value


def id_field(body: dict, name: str) -> str | None:
    """A client's id or label (a string of at most ``MAX_ID_CHARS`` characters), or None."""
    value = typed_field(body, name, (str,), "a string")
    if value is not None:
        try:
            check_id_text(name, value)
        except ValueError as error:
            raise invalid_field(str(error), name) from None
    return value


def int_field(body: dict, name: str, minimum: int, maximum: int | None = None) -> int | None:
    value = typed_field(body, name, (int,), "an integer")
    if value is None:
        return None
    if value < minimum or (maximum is not None and value > maximum):
        limit = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise invalid_field(f"{name} must be {limit}, got {value}", name)
    return value


@dataclass
class Prompt:
    """One prompt of a request: its text (None when given as ids) and token ids."""

    text: str | None
    token_ids: list[int]


@dataclass
class ApiRequest:
    """A checked request: its prompts (several for a batched ``/v1/completions``), one
    ``SamplingParams`` per prompt, and how to answer."""

    kind: str  # "completion" or "chat"
    model: str
    prompts: list[Prompt]
    params: list[SamplingParams]
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    continuous_usage: bool  # stream_options.continuous_usage_stats: usage on every chunk
    logprobs: int | None  # how many top alternatives to report per token; None: no logprobs
    echo: bool  # completions: the prompt before the output (text, and logprobs)
    # vLLM's prompt_logprobs: each choice reports the prompt's logprobs (its first chunk,
    # when streamed).
    prompt_logprobs: bool
    cache_namespace: str | None
    client_request_id: str
    # The LoRA adapter the request's ``model`` names (0: the base model).
    lora_id: int = 0
    # vLLM's ``priority``: lower runs first (a server started with --scheduling-policy
    # priority; otherwise only 0 is accepted).
    priority: int = 0
    # Chat requests: how their outputs read (tool calls with tools and a tool_choice other
    # than "none"; the thinking on a server with --reasoning-parser, reported unless
    # include_reasoning is false); None for completions, whose text is raw.
    chat_reading: ChatReading | None = None
    # vLLM's return_tokens_as_token_ids: logprobs name each token "token_id:<id>" (a token
    # that is part of a character has no text of its own to name it by).
    tokens_as_ids: bool = False
    # vLLM's chat ``echo``: the text each choice's content starts with (the last message's,
    # when it is the role that answers: the assistant's unless add_generation_prompt is
    # false); "" for completions (their echo is ``echo``).
    chat_echo: str = ""
    # vLLM's return_token_ids: each choice's token ids beside its text, and the prompt's
    # (the response's for chat, each choice's for completions; a stream sends them once,
    # first).
    return_token_ids: bool = False
    created_s: int = field(default_factory=lambda: int(time.time()))


def parse_request(
    kind: str,
    body: Any,
    llm: LLM,
    default_params: SamplingParams,
    served_model_name: str | tuple[str, ...],
    client_request_id: str | None,
    max_prompts: int = 1024,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    trust_request_chat_template: bool = False,
) -> ApiRequest:
    """The request ``body`` (decoded JSON) of ``/v1/completions`` (``kind="completion"``)
    or ``/v1/chat/completions`` (``"chat"``), checked and tokenized. A batch of more than
    ``max_prompts`` prompts (the server's limit of requests in flight) is refused before
    anything is tokenized: it could never be admitted. ``tool_call_parser``: the server's
    reader of calls in the model's own format, for ``tool_choice="auto"``; None: off.
    ``reasoning_parser``: the server's splitter of a reasoning model's thinking from its
    answer (chat only); None: off. ``trust_request_chat_template``: a chat request may
    bring its own template (``--trust-request-chat-template``)."""
    known = _COMMON_FIELDS | set(_SAMPLING_FIELDS)
    known |= _COMPLETION_FIELDS if kind == "completion" else _CHAT_FIELDS
    checked_body(body, known, kind)
    model, lora_id = served_model(body, llm, served_model_name)
    _refuse_unsupported(kind, body)
    tool_calling = _tool_calling(body, tool_call_parser) if kind == "chat" else None
    chat_reading = None
    if kind == "chat":
        chat_reading = ChatReading(
            tool_calling,
            ReasoningParser(reasoning_parser) if reasoning_parser else None,
            typed_field(body, "include_reasoning", (bool,), "a boolean", True),
        )
    chat_echo = ""
    if kind == "completion":
        prompts = _completion_prompts(body, llm, max_prompts)
        logprobs = int_field(body, "logprobs", 0)  # at most max_logprobs: check_fits
        echo = typed_field(body, "echo", (bool,), "a boolean", False)
        max_tokens_names = ("max_tokens",)
    else:
        prompts = [chat_prompt(body, llm, trust_request_chat_template)]
        logprobs = None
        if typed_field(body, "logprobs", (bool,), "a boolean", False):
            logprobs = int_field(body, "top_logprobs", 0, llm.max_logprobs) or 0
        elif body.get("top_logprobs") is not None:
            raise invalid_field(
                f"top_logprobs={body['top_logprobs']!r} needs logprobs: true", "top_logprobs"
            )
        echo = False
        max_tokens_names = ("max_completion_tokens", "max_tokens")
        chat_echo = _chat_echo(body)
    stream = typed_field(body, "stream", (bool,), "a boolean", False)
    options = typed_field(body, "stream_options", (dict,), "an object", {})
    if options and not stream:
        raise invalid_field("stream_options is set but stream is not true", "stream_options")
    include_usage = typed_field(options, "include_usage", (bool,), "a boolean", False)
    continuous_usage = typed_field(options, "continuous_usage_stats", (bool,), "a boolean", False)
    cache_salt = id_field(body, "cache_salt")
    request_id = id_field(body, "request_id") or client_request_id or ""
    id_field(body, "user")
    priority = checked_priority(body, llm)
    structured = _structured_outputs(body, llm)
    if tool_calling is not None and tool_calling.constraint() is not None:
        structured = _tool_constraint(tool_calling, structured, llm)
    base = _base_params(body, default_params, logprobs, echo, max_tokens_names, structured)
    try:
        base = llm.resolve_bad_words(base, "")
    except ValueError as error:
        raise invalid_field(str(error), "bad_words") from None
    if (
        body.get("skip_special_tokens") is None
        and chat_reading is not None
        and chat_reading.keeps_special_tokens(llm)
    ):
        base = dataclasses.replace(base, skip_special_tokens=False)
    max_tokens_name = next((n for n in max_tokens_names if body.get(n) is not None), None)
    max_model_len = llm.scheduler_config.max_model_len
    # The most tokens a sequence of this request can hold: the context window, or less
    # when the whole KV cache is smaller (every sequence may need blocks of its own).
    max_total_tokens = max_sequence_tokens(
        llm.scheduler_config, llm.block_size, llm.num_blocks, base.num_sequences
    )
    params: list[SamplingParams] = []
    for position, prompt in enumerate(prompts):
        field_name = "prompt" if len(prompts) == 1 else f"prompt[{position}]"
        if kind == "chat":
            field_name = "messages"
        try:
            kept = llm.truncate_prompt(prompt.token_ids, base, "")
        except ValueError as error:
            raise invalid_field(str(error), "truncate_prompt_tokens") from None
        if len(kept) < len(prompt.token_ids):  # its text is no longer the prompt's
            prompt = prompts[position] = Prompt(None, kept)
        num_prompt_tokens = len(prompt.token_ids)
        try:
            check_output_room(
                num_prompt_tokens,
                1 if max_tokens_name is None else base.max_tokens,
                max_model_len,
                field_name,
                max_tokens_name or "max_tokens",
            )
        except ValueError as error:
            param = field_name if str(error).startswith(field_name) else max_tokens_name
            raise invalid_field(str(error), param) from None
        if max_tokens_name is None:
            default = DEFAULT_COMPLETION_MAX_TOKENS if kind == "completion" else max_model_len
            room = max(1, max_total_tokens - num_prompt_tokens)
            if base.min_tokens > room:
                raise invalid_field(
                    f"min_tokens={base.min_tokens}: {field_name} takes {num_prompt_tokens} "
                    f"of the {max_total_tokens} tokens a sequence can hold here, which "
                    f"leaves at most {room}",
                    "min_tokens",
                )
            # An unset max_tokens never undercuts min_tokens.
            max_tokens = min(max(default, base.min_tokens), room)
            prompt_params = dataclasses.replace(base, max_tokens=_limited(max_tokens, base, llm))
        else:
            max_tokens = _limited(base.max_tokens, base, llm)
            prompt_params = base
            if max_tokens != base.max_tokens:
                prompt_params = dataclasses.replace(base, max_tokens=max_tokens)
        params.append(prompt_params)
    return ApiRequest(
        kind=kind,
        model=model,
        lora_id=lora_id,
        priority=priority,
        prompts=prompts,
        params=params,
        stream=stream,
        include_usage=include_usage or continuous_usage,
        continuous_usage=continuous_usage,
        logprobs=logprobs,
        echo=echo,
        prompt_logprobs=body.get("prompt_logprobs") is not None,
        cache_namespace=cache_salt,
        client_request_id=request_id,
        chat_reading=chat_reading,
        tokens_as_ids=typed_field(body, "return_tokens_as_token_ids", (bool,), "a boolean", False),
        return_token_ids=typed_field(body, "return_token_ids", (bool,), "a boolean", False),
        chat_echo=chat_echo,
    )


def served_model(body: dict, llm: LLM, served_model_name: str | tuple[str, ...]) -> tuple[str, int]:
    """The ``model`` a request names and its LoRA adapter id (0: the base model).
    ``served_model_name``: the base model's name, or its names (vLLM's several
    ``--served-model-name``s: a request may give any, the answer names the first)."""
    names = (served_model_name,) if isinstance(served_model_name, str) else served_model_name
    model = typed_field(body, "model", (str,), "a string", names[0])
    if model in names:
        return names[0], 0
    lora_id = llm.lora_ids.get(model)
    if lora_id is None:
        served = ", ".join([*map(repr, names), *map(repr, llm.lora_ids)])
        raise CallError(
            "NOT_FOUND",
            f"model {model!r} is not served here; this server serves {served}",
            "model",
        )
    return model, lora_id


def _refuse_unsupported(kind: str, body: dict) -> None:
    if kind == "completion":
        if body.get("suffix"):
            raise invalid_field("suffix (insertion) is not supported by this server", "suffix")
        return
    # OpenAI's deprecated forms of tools and tool_choice.
    for name in ("functions", "function_call"):
        if body.get(name) not in (None, "none"):
            raise invalid_field(
                f"{name} is deprecated by OpenAI and not supported here: give the functions as "
                "tools (type 'function') and choose with tool_choice",
                name,
            )


def _tool_calling(body: dict, tool_call_parser: str | None) -> ToolCalling | None:
    """The request's tool calling; None without tools or with tool_choice "none"."""
    tools = body.get("tools")
    tool_choice = body.get("tool_choice")
    parallel = typed_field(body, "parallel_tool_calls", (bool,), "a boolean", True)
    if tools is None:
        if tool_choice not in (None, "none"):
            raise invalid_field(
                f"tool_choice={tool_choice!r:.200} needs tools to choose from", "tool_choice"
            )
        return None
    try:
        calling = ToolCalling(
            tool_calls.parse_tools(tools), tool_choice, parallel, tool_call_parser
        )
    except ToolCallError as error:
        raise invalid_field(str(error), error.field) from None
    return None if calling.mode == "none" else calling


def _tool_constraint(
    calling: ToolCalling,
    structured: tuple[str, StructuredOutputsParams] | None,
    llm: LLM,
) -> tuple[str, StructuredOutputsParams]:
    """The structured output that makes a required or named tool choice's calls: the
    output is constrained to the calls' JSON."""
    if structured is not None:
        raise invalid_field(
            f"tool_choice={'required' if calling.mode == 'required' else 'a named function'} "
            f"constrains the output to the calls, and {structured[0]} sets another constraint; "
            "give one",
            structured[0],
        )
    try:
        params = tool_constraint(calling, llm)
    except ToolCallError as error:
        raise invalid_field(str(error), error.field) from None
    assert params is not None
    return "tool_choice", params


# A constraint as the request gave it: the field to name in errors, StructuredOutputsParams'
# field, and its value.
_Constraint = tuple[str, str, Any]


def _structured_outputs(body: dict, llm: LLM) -> tuple[str, StructuredOutputsParams] | None:
    """The request's structured output and the field it came in, or None (no constraint).
    The constraint is compiled here, so an error names the field the client used
    (``guided_regex does not compile: ...``)."""
    constraints = _response_format_constraints(body) + _structured_outputs_constraints(body)
    constraints += [
        (name, kind, body[name])
        for name, kind in _GUIDED_FIELDS.items()
        if body.get(name) is not None
    ]
    if not constraints:
        return None
    if len(constraints) > 1:
        names = " and ".join(name for name, _, _ in constraints)
        raise invalid_field(
            f"one structured output constraint per request, got {names}", constraints[1][0]
        )
    ((name, kind, value),) = constraints
    if llm.grammar_vocabulary is None:
        raise invalid_field(
            f"{name}: structured output is matched over the model's tokenizer, and "
            f"{str(llm.model_path)!r} has none (or only a slow one)",
            name,
        )
    try:
        params = StructuredOutputsParams(
            **{kind: value}, disable_any_whitespace=_disable_any_whitespace(body)
        )
        grammar_text(params)
    except (ValueError, TypeError) as error:
        message = str(error)
        prefix = f"structured_outputs.{kind}"
        if message.startswith(prefix):
            message = name + message[len(prefix) :]
        raise invalid_field(message, name) from None
    return name, params


def _response_format_constraints(body: dict) -> list[_Constraint]:
    """OpenAI's ``response_format``: text (no constraint), any JSON object, or a JSON
    schema (``json_schema.name`` required, as OpenAI and vLLM require it; ``strict`` and
    ``description`` change nothing here: the schema is always enforced)."""
    response_format = typed_field(body, "response_format", (dict,), "an object")
    if response_format is None:
        return []
    kind = response_format.get("type")
    if kind == "text":
        return []
    if kind == "json_object":
        return [("response_format", "json_object", True)]
    if kind != "json_schema":
        raise invalid_field(
            f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
            "response_format.type",
        )
    json_schema = response_format.get("json_schema")
    if not isinstance(json_schema, dict):
        raise invalid_field(
            "response_format.json_schema must be an object with name and schema, got "
            f"{json_schema!r:.200}",
            "response_format.json_schema",
        )
    name = json_schema.get("name")
    if not isinstance(name, str) or not name:
        raise invalid_field(
            f"response_format.json_schema.name must be a non-empty string, got {name!r:.100}",
            "response_format.json_schema.name",
        )
    schema = json_schema.get("schema")
    if not isinstance(schema, dict):
        # vLLM runs such a request unconstrained; refused here, as an ignored schema would
        # be (use type json_object for any JSON object).
        raise invalid_field(
            "response_format.json_schema.schema must be a JSON schema (an object), got "
            f"{schema!r:.200}; for any JSON object use response_format type 'json_object'",
            "response_format.json_schema.schema",
        )
    return [("response_format.json_schema.schema", "json", schema)]


def _structured_outputs_constraints(body: dict) -> list[_Constraint]:
    """vLLM's ``structured_outputs`` object: exactly one of its constraint fields, and
    ``disable_any_whitespace`` (``_disable_any_whitespace``). Its other fields (backend
    options, structural tags) are refused by name unless unset (null or false, which
    clients that send every field do)."""
    structured = typed_field(body, "structured_outputs", (dict,), "an object")
    if structured is None:
        return []
    constraints = []
    for key, value in structured.items():
        if value is None or value is False:
            continue
        name = f"structured_outputs.{key}"
        if key == "disable_any_whitespace":
            if value is not True:
                raise invalid_field(f"{name} must be a boolean, got {value!r:.100}", name)
            continue
        if key not in STRUCTURED_OUTPUT_KINDS:
            raise invalid_field(
                f"{name} is not supported by this server; set one of "
                f"{', '.join(STRUCTURED_OUTPUT_KINDS)}",
                name,
            )
        constraints.append((name, key, value))
    if not constraints:
        raise invalid_field(
            f"structured_outputs must set one of {', '.join(STRUCTURED_OUTPUT_KINDS)}; got none",
            "structured_outputs",
        )
    return constraints


def _disable_any_whitespace(body: dict) -> bool:
    """``structured_outputs.disable_any_whitespace``, already checked by
    ``_structured_outputs_constraints``. One constraint per request, so when it is true
    the constraint is the one in ``structured_outputs``."""
    structured = body.get("structured_outputs")
    return isinstance(structured, dict) and structured.get("disable_any_whitespace") is True


def _logit_bias(body: dict) -> dict[int, float] | None:
    """OpenAI's ``logit_bias``: token ids (as JSON object keys, so strings) -> bias,
    each clamped to [-100, 100] as vLLM does (``clamped_logit_bias``)."""
    bias = typed_field(body, "logit_bias", (dict,), "an object of token id -> bias")
    if bias is None:
        return None
    by_token_id = {}
    for key, value in bias.items():
        token_id = int(key) if key.strip().isdigit() and key.isascii() else -1
        if token_id < 0 or str(token_id) != key.strip():
            raise invalid_field(
                f"logit_bias: key {key!r:.100} is not a token id (a non-negative integer)",
                "logit_bias",
            )
        by_token_id[token_id] = value
    try:
        return clamped_logit_bias("logit_bias", by_token_id)
    except (ValueError, TypeError) as error:
        raise invalid_field(str(error), "logit_bias") from None


def _limited(max_tokens: int, params: SamplingParams, llm: LLM) -> int:
    """``max_tokens`` cut to the generation config's max_new_tokens, as vLLM's server cuts it
    (a request's min_tokens above it is refused by name)."""
    try:
        return limit_max_tokens(
            max_tokens, params.min_tokens, llm.generation_defaults.max_tokens_limit
        )
    except ValueError as error:
        raise invalid_field(str(error), "min_tokens") from None


def _base_params(
    body: dict,
    default_params: SamplingParams,
    logprobs: int | None,
    echo: bool,
    max_tokens_names: tuple[str, ...],
    structured: tuple[str, StructuredOutputsParams] | None,
) -> SamplingParams:
    kwargs: dict[str, Any] = {
        target: body[name]
        for name, target in _SAMPLING_FIELDS.items()
        if body.get(name) is not None
    }
    logit_bias = _logit_bias(body)
    if logit_bias:
        kwargs["logit_bias"] = logit_bias
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise invalid_field(f"stop must be a string or a list of strings, got {stop!r}", "stop")
        kwargs["stop"] = stop or None
    use_beam_search = typed_field(body, "use_beam_search", (bool,), "a boolean", False)
    if use_beam_search:
        # vLLM's convention: best_of (else n) beams, n of them returned.
        kwargs["beam_width"] = kwargs.pop("best_of", None) or kwargs.get("n", 1)
        kwargs.setdefault("temperature", 0.0)
        if kwargs["temperature"] != 0:  # checked as SamplingParams would, named here
            raise invalid_field(
                f"temperature={kwargs['temperature']!r}: beam search is greedy; set it to 0",
                "temperature",
            )
    elif "length_penalty" in kwargs or "early_stopping" in kwargs:
        name = "length_penalty" if "length_penalty" in kwargs else "early_stopping"
        raise invalid_field(f"{name} applies to beam search only: set use_beam_search", name)
    # Unset: the model's generation config decides (as in the gRPC API).
    for name in DEFAULT_FIELDS:
        kwargs.setdefault(name, getattr(default_params, name))
    if logprobs is not None:
        kwargs["logprobs"] = logprobs
        if echo:
            kwargs.setdefault("prompt_logprobs", logprobs)
    names = {"logprobs": "logprobs", "beam_width": "best_of"}
    if structured is not None:
        names["structured_outputs"], kwargs["structured_outputs"] = structured
    for name in max_tokens_names:
        if body.get(name) is not None:
            kwargs["max_tokens"] = body[name]
            names["max_tokens"] = name
            break
    else:
        # Replaced per prompt; as large as min_tokens meanwhile, which it must not undercut.
        min_tokens = kwargs.get("min_tokens")
        kwargs["max_tokens"] = min_tokens if isinstance(min_tokens, int) and min_tokens > 1 else 1
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as error:
        raise _sampling_error(error, names) from None


def _completion_prompts(
    body: dict, llm: LLM, max_prompts: int, field: str = "prompt"
) -> list[Prompt]:
    """The prompts of a completions ``prompt`` (or an embeddings ``input``: ``field``):
    a string, token ids, or a batch of either."""
    prompt = body.get(field)
    if prompt is None:
        raise invalid_field(
            f"{field} is required: a string, a list of strings, or token ids", field
        )
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
        items = [prompt]
    elif isinstance(prompt, list) and prompt:
        items = prompt
    else:
        raise invalid_field(
            f"{field} must be a string, a list of strings, a list of token ids or a list of "
            f"lists of token ids, and not empty; got {prompt!r:.200}",
            field,
        )
    if len(items) > max_prompts:
        raise invalid_field(
            f"{field}: a batch of {len(items)} prompts; this server takes at most "
            f"{max_prompts} (its max_concurrent_requests)",
            field,
        )
    prompts = []
    truncating = body.get("truncate_prompt_tokens") is not None
    for position, item in enumerate(items):
        name = field if len(items) == 1 else f"{field}[{position}]"
        if not isinstance(item, (str, list)) or isinstance(item, bool):
            raise invalid_field(
                f"{name} must be a string or a list of token ids, got {item!r:.200}", name
            )
        try:
            if not truncating:  # cheap, before the tokenizer spends seconds on it
                llm.check_prompt_size(item, name)
            token_ids = llm.encode_prompt(item, name)
        except (ValueError, TypeError) as error:
            raise invalid_field(str(error), name) from None
        prompts.append(Prompt(item if isinstance(item, str) else None, token_ids))
    return prompts


def chat_prompt(
    body: dict,
    llm: LLM,
    trust_request_chat_template: bool = False,
    opens_turn_default: bool = True,
) -> Prompt:
    """The prompt of a chat request: its messages (and tools, when it gives them) through
    the model's chat template (or the request's own, when the server trusts its clients
    with one). ``opens_turn_default``: ``add_generation_prompt`` when the body leaves it
    unset (a pooling request's conversation ends with its last message, as vLLM's)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid_field(
            f"messages must be a non-empty list of {{role, content}} objects, got "
            f"{messages!r:.200}",
            "messages",
        )
    conversation = []
    for position, message in enumerate(messages):
        name = f"messages[{position}]"
        if not isinstance(message, dict):
            raise invalid_field(f"{name} must be an object, got {message!r:.200}", name)
        try:
            role = check_chat_role(message.get("role"), f"{name}.role")
        except ValueError as error:
            raise invalid_field(str(error), f"{name}.role") from None
        entry = {"role": role, "content": _message_text(message, name)}
        try:
            entry.update(tool_calls.chat_message_tool_fields(message, name))
        except ToolCallError as error:
            raise invalid_field(str(error), error.field) from None
        entry.update(_message_reasoning(message, name))
        conversation.append(entry)
    tools = None
    if body.get("tools") is not None:
        try:
            tools = [tool.definition for tool in tool_calls.parse_tools(body["tools"])]
        except ToolCallError as error:
            raise invalid_field(str(error), error.field) from None
    # vLLM's: a new assistant turn (the default), or the last message left open to go on.
    opens_turn = typed_field(
        body, "add_generation_prompt", (bool,), "a boolean", opens_turn_default
    )
    continues = typed_field(body, "continue_final_message", (bool,), "a boolean", False)
    # vLLM's: more variables for the template (a Qwen3-style {"enable_thinking": false}),
    # a RAG template's documents, and a template of the request's own (a server that
    # trusts its clients with one: a template is code the server runs).
    template = body.get("chat_template")
    try:
        template_kwargs = with_reasoning_effort(
            body.get("chat_template_kwargs"), body.get("reasoning_effort")
        )
    except ValueError as error:
        raise invalid_field(str(error), "reasoning_effort") from None
    try:
        check_template_allowed(template, trust_request_chat_template)
        options = ChatTemplateOptions(
            add_generation_prompt=opens_turn,
            continue_final_message=continues,
            chat_template_kwargs=template_kwargs,
            documents=body.get("documents"),
            chat_template=template,
        )
        text, token_ids = render_chat_prompt(
            llm,
            conversation,
            tools,
            "messages",
            options,
            check_size=body.get("truncate_prompt_tokens") is None,
        )
    except (ValueError, TypeError) as error:
        message = str(error)
        name = next((name for name in SETTING_NAMES if message.startswith(name)), "messages")
        raise invalid_field(message, name) from None
    return Prompt(text, token_ids)


def _message_reasoning(message: dict, name: str) -> dict[str, str]:
    """An assistant message's reported thinking (``reasoning_content``, or ``reasoning``) for
    the template (``chat_template.message_reasoning``)."""
    for field_name in ("reasoning_content", "reasoning"):
        if message.get(field_name) is not None:
            field = f"{name}.{field_name}"
            try:
                return message_reasoning(message.get("role"), message[field_name], field)
            except ValueError as error:
                raise invalid_field(str(error), field) from None
    return {}


def _chat_echo(body: dict) -> str:
    """vLLM's chat ``echo`` of a checked chat body: the last message's text when it is of
    the role that answers (the assistant's, or the last message's own with
    add_generation_prompt false: the continued message then reads whole)."""
    if not typed_field(body, "echo", (bool,), "a boolean", False):
        return ""
    last = body["messages"][-1]
    opens_turn = typed_field(body, "add_generation_prompt", (bool,), "a boolean", True)
    if opens_turn and last.get("role") != "assistant":
        return ""
    return _message_text(last, f"messages[{len(body['messages']) - 1}]")


def _message_text(message: dict, name: str) -> str:
    content = message.get("content")
    return "" if content is None else content_text(content, f"{name}.content")


def content_text(content: Any, name: str, part_types: tuple[str, ...] = ("text",)) -> str:
    """A message's content (field ``name``) as one text: a string, or a list of text
    parts of ``part_types``."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid_field(
            f"{name} must be a string or a list of text parts, got {content!r:.200}", name
        )
    texts = []
    for position, part in enumerate(content):
        part_name = f"{name}[{position}]"
        if not isinstance(part, dict) or part.get("type") not in part_types:
            kind = part.get("type") if isinstance(part, dict) else part
            types = ", ".join(map(repr, part_types))
            raise invalid_field(
                f"{part_name}: only text parts are supported (type {types}), got {kind!r:.100}",
                part_name,
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise invalid_field(f"{part_name}.text must be a string, got {text!r:.100}", part_name)
        texts.append(text)
    return "".join(texts)


# ---------------------------------------------------------------- answers


def response_id(request: ApiRequest) -> str:
    """The answer's id: the client's request id (``X-Request-Id`` or ``request_id``) after
    OpenAI's prefix, as vLLM names it, so a client can match answers to requests; a
    random one when the client named none."""
    prefix = "cmpl-" if request.kind == "completion" else "chatcmpl-"
    return prefix + (request.client_request_id or uuid.uuid4().hex)


def finish_reason(completion: CompletionOutput) -> str | None:
    """OpenAI's: "stop" (EOS, a stop token or string) or "length"; an output the
    engine aborted has none (its call ended with an error instead)."""
    return completion.finish_reason if completion.finish_reason in ("stop", "length") else None


def usage(outputs: list[RequestOutput]) -> dict:
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    completion_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in outputs)},
    }


class TokenTexts:
    """Each token as logprobs name it (``__call__``: its own text, ``tokenizer.decode([id])``,
    or ``"token_id:<id>"`` when asked or without a tokenizer) and its text (``text``: what it
    adds to the output, for offsets); cached."""

    def __init__(self, llm: LLM, as_token_ids: bool = False) -> None:
        self._tokenizer = llm.tokenizer
        self._as_token_ids = as_token_ids
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        if self._as_token_ids:
            return f"token_id:{token_id}"
        return self.text(token_id)

    def text(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            if self._tokenizer is None:
                text = f"token_id:{token_id}"
            else:
                text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text


def _top(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda item: -item[1])[:k]


def completion_logprobs(
    token_ids: list[int],
    entries: list[dict[int, float] | None],
    k: int,
    text_offset_start: int,
    texts: TokenTexts,
) -> dict:
    """The legacy completions format: tokens, their logprobs, the top ``k`` per token,
    and each token's character offset."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    offset = text_offset_start
    for token_id, entry in zip(token_ids, entries, strict=True):
        tokens.append(texts(token_id))
        offsets.append(offset)
        offset += len(texts.text(token_id))
        if entry is None:  # the prompt's first token: nothing predicts it
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(entry.get(token_id))
        top_logprobs.append({texts(t): lp for t, lp in _top(entry, k)})
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def chat_logprobs(
    token_ids: list[int], entries: list[dict[int, float]], k: int, texts: TokenTexts
) -> dict:
    """The chat format: per token its text, logprob, UTF-8 bytes and the top ``k``."""

    def item(token_id: int, logprob: float) -> dict:
        return {
            "token": texts(token_id),
            "logprob": logprob,
            "bytes": list(texts.text(token_id).encode()),
        }

    content = []
    for token_id, entry in zip(token_ids, entries, strict=True):
        chosen = item(token_id, entry[token_id])
        chosen["top_logprobs"] = [item(t, lp) for t, lp in _top(entry, k)]
        content.append(chosen)
    return {"content": content}


def prompt_logprobs(output: RequestOutput, texts: TokenTexts) -> list[dict | None]:
    """vLLM's format: per prompt token (None for the first, which nothing predicts), each
    token id's logprob and text."""
    return [
        None
        if entry is None
        else {
            str(token_id): {"logprob": logprob, "decoded_token": texts(token_id)}
            for token_id, logprob in entry.items()
        }
        for entry in output.prompt_logprobs or []
    ]


def whole_response(request: ApiRequest, outputs: list[RequestOutput], llm: LLM) -> dict:
    """The answer of a call that did not stream: every choice in full."""
    texts = TokenTexts(llm, request.tokens_as_ids)
    choices = []
    for prompt_index, (prompt, output) in enumerate(zip(request.prompts, outputs, strict=True)):
        num_outputs = len(output.outputs)
        for completion in output.outputs:
            index = prompt_index * num_outputs + completion.index
            if request.chat_reading is not None:
                answer = request.chat_reading.whole(completion.text, finish_reason(completion))
                message = _chat_message(request.chat_reading, answer)
                if request.chat_echo:
                    message["content"] = request.chat_echo + (message["content"] or "")
                choice = {
                    "index": index,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": answer.finish_reason,
                    "stop_reason": completion.stop_reason,
                }
                if request.logprobs is not None and completion.logprobs is not None:
                    choice["logprobs"] = chat_logprobs(
                        completion.token_ids, completion.logprobs, request.logprobs, texts
                    )
            else:
                prefix = _echo_text(request, prompt, output, llm)
                choice = {
                    "index": index,
                    "text": prefix + completion.text,
                    "logprobs": None,
                    "finish_reason": finish_reason(completion),
                    "stop_reason": completion.stop_reason,
                }
                if request.logprobs is not None and completion.logprobs is not None:
                    token_ids, entries = list(completion.token_ids), list(completion.logprobs)
                    if request.echo:
                        token_ids = list(output.prompt_token_ids) + token_ids
                        entries = list(output.prompt_logprobs or []) + entries
                    choice["logprobs"] = completion_logprobs(
                        token_ids, entries, request.logprobs, 0, texts
                    )
            if request.prompt_logprobs:
                choice["prompt_logprobs"] = prompt_logprobs(output, texts)
            if request.return_token_ids:
                if request.kind == "completion":
                    choice["prompt_token_ids"] = list(output.prompt_token_ids)
                choice["token_ids"] = list(completion.token_ids)
            choices.append(choice)
    response = {
        "id": response_id(request),
        "object": "chat.completion" if request.kind == "chat" else "text_completion",
        "created": request.created_s,
        "model": request.model,
        "choices": choices,
        "usage": usage(outputs),
    }
    if request.return_token_ids and request.kind == "chat":
        response["prompt_token_ids"] = list(outputs[0].prompt_token_ids)
    return response


def _chat_message(reading: ChatReading, answer: ChatAnswer) -> dict[str, Any]:
    """A whole answer's assistant message: content (null beside calls or thinking when
    empty, as vLLM writes it), the calls, the thinking."""
    message: dict[str, Any] = {"role": "assistant", "content": answer.content}
    if answer.tool_calls:
        message["content"] = answer.content or None
        message["tool_calls"] = [_openai_call(call) for call in answer.tool_calls]
    if reading.reasoning is not None:
        message["content"] = message["content"] or None
        if reading.include_reasoning:
            message["reasoning_content"] = answer.reasoning or None
    return message


def _openai_call(call: ToolCall) -> dict[str, Any]:
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def _openai_call_delta(delta: ToolCallDelta) -> dict[str, Any]:
    """OpenAI's ``tool_calls`` delta: the first of a call names it and carries its id."""
    if delta.id is None:
        return {"index": delta.index, "function": {"arguments": delta.arguments}}
    return {
        "index": delta.index,
        "id": delta.id,
        "type": "function",
        "function": {"name": delta.name, "arguments": delta.arguments},
    }


def _echo_text(request: ApiRequest, prompt: Prompt, output: RequestOutput, llm: LLM) -> str:
    if not request.echo:
        return ""
    if prompt.text is not None:
        return prompt.text
    if llm.tokenizer is None:
        return ""
    return llm.tokenizer.decode(list(output.prompt_token_ids), skip_special_tokens=False)


@dataclass
class _ChoiceCursor:
    """How much of one choice a stream has sent."""

    text_chars: int = 0
    tokens: int = 0
    logprobs: int = 0
    started: bool = False
    finished: bool = False
    chat: ChatAnswerStream | None = None  # a chat request: its reader


class StreamWriter:
    """The chunks of a streamed answer for one prompt of a request: each carries only
    what is new since the last, and the first of a chat choice names the role."""

    def __init__(
        self,
        request: ApiRequest,
        response_id: str,
        prompt_index: int,
        llm: LLM,
        texts: TokenTexts,
        interval_tokens: int,
    ) -> None:
        self._request = request
        self._id = response_id
        self._prompt_index = prompt_index
        self._llm = llm
        self._texts = texts
        self._interval_tokens = interval_tokens
        self._cursors: dict[int, _ChoiceCursor] = {}

    def chunks(self, output: RequestOutput) -> list[dict]:
        """The chunks for what changed (none when too little did for the interval)."""
        if not self._due(output):
            return []
        request = self._request
        chunks = []
        num_outputs = len(output.outputs)
        for completion in output.outputs:
            cursor = self._cursors.get(completion.index)
            if cursor is None:
                cursor = self._cursors[completion.index] = _ChoiceCursor()
                if request.chat_reading is not None:
                    cursor.chat = request.chat_reading.stream()
            new_text = completion.text[cursor.text_chars :]
            new_tokens = completion.token_ids[cursor.tokens :]
            new_entries = (
                [] if completion.logprobs is None else completion.logprobs[cursor.logprobs :]
            )
            reason = finish_reason(completion)
            newly_finished = reason is not None and not cursor.finished
            new_logprobs = request.logprobs is not None and bool(new_entries)
            call_deltas: list[dict] = []
            new_reasoning = ""
            if cursor.chat is not None:
                read = cursor.chat.feed(completion.text, reason is not None)
                new_text, new_reasoning = read.content, read.reasoning
                call_deltas = [_openai_call_delta(delta) for delta in read.tool_calls]
                reason = cursor.chat.finish_reason(reason)
            if not cursor.started and not (new_tokens or newly_finished):
                # The prompt still being prefilled (a chunked prefill reports its prompt
                # logprobs piece by piece): a choice starts with its first token, when the
                # prompt's are all there.
                continue
            news = new_text or new_reasoning or call_deltas or new_logprobs or newly_finished
            if cursor.started and not news:
                continue  # tokens whose text the detokenizer (or a parser) holds back
            index = self._prompt_index * num_outputs + completion.index
            choice: dict[str, Any] = {"index": index}
            if request.kind == "chat":
                delta: dict[str, Any] = {}
                if not cursor.started:
                    delta["role"] = "assistant"
                    new_text = request.chat_echo + new_text
                if new_reasoning:
                    delta["reasoning_content"] = new_reasoning
                if new_text or not (call_deltas or new_reasoning):
                    delta["content"] = new_text
                if call_deltas:
                    delta["tool_calls"] = call_deltas
                choice["delta"] = delta
                choice["logprobs"] = None
                if request.logprobs is not None and new_entries:
                    choice["logprobs"] = chat_logprobs(
                        new_tokens[: len(new_entries)], new_entries, request.logprobs, self._texts
                    )
            else:
                prefix = ""
                token_ids, entries = new_tokens[: len(new_entries)], list(new_entries)
                offset = cursor.text_chars
                if not cursor.started and request.echo:
                    prompt = request.prompts[self._prompt_index]
                    prefix = _echo_text(request, prompt, output, self._llm)
                    if request.logprobs is not None:
                        token_ids = list(output.prompt_token_ids) + token_ids
                        entries = list(output.prompt_logprobs or []) + entries
                choice["text"] = prefix + new_text
                choice["logprobs"] = None
                if request.logprobs is not None and (entries or not cursor.started):
                    choice["logprobs"] = completion_logprobs(
                        token_ids, entries, request.logprobs, offset, self._texts
                    )
            choice["finish_reason"] = reason if newly_finished else None
            choice["stop_reason"] = completion.stop_reason if newly_finished else None
            if request.prompt_logprobs and not cursor.started:
                choice["prompt_logprobs"] = prompt_logprobs(output, self._texts)
            first_of_stream = not any(c.started for c in self._cursors.values())
            if request.return_token_ids:
                if request.kind == "completion" and not cursor.started:
                    choice["prompt_token_ids"] = list(output.prompt_token_ids)
                # Every token since the last chunk, those whose text is held back included.
                choice["token_ids"] = list(new_tokens)
            cursor.started = True
            cursor.finished = cursor.finished or newly_finished
            cursor.text_chars = len(completion.text)
            cursor.tokens = len(completion.token_ids)
            cursor.logprobs += len(new_entries)
            chunk = self.chunk([choice])
            if request.return_token_ids and request.kind == "chat" and first_of_stream:
                chunk["prompt_token_ids"] = list(output.prompt_token_ids)
            if request.continuous_usage:
                chunk["usage"] = usage([output])
            chunks.append(chunk)
        return chunks

    def chunk(self, choices: list[dict]) -> dict:
        request = self._request
        message = {
            "id": self._id,
            "object": "chat.completion.chunk" if request.kind == "chat" else "text_completion",
            "created": request.created_s,
            "model": request.model,
            "choices": choices,
        }
        if request.include_usage:
            message["usage"] = None
        return message

    def _due(self, output: RequestOutput) -> bool:
        """As ``--stream-interval`` says: the first chunk at once, then once enough new
        tokens are there, and whenever a choice ends."""
        if output.finished or self._interval_tokens <= 1 or not self._cursors:
            return True
        new_tokens = 0
        for completion in output.outputs:
            cursor = self._cursors.get(completion.index)
            if cursor is None or not cursor.started:
                return True  # its first token goes at once (time to first token)
            if finish_reason(completion) is not None and not cursor.finished:
                return True
            new_tokens += len(completion.token_ids) - cursor.tokens
        return new_tokens >= self._interval_tokens


# ---------------------------------------------------------------- /v1/embeddings

# OpenAI's fields, and vLLM's additions (truncate_prompt_tokens, normalize, priority,
# request_id).
_EMBEDDING_FIELDS = {
    "model",
    "input",
    "encoding_format",
    "dimensions",
    "user",
    "truncate_prompt_tokens",
    "normalize",
    "priority",
    "request_id",
}
EMBEDDING_ENCODING_FORMATS = ("float", "base64")


@dataclass(kw_only=True)
class PoolingApiRequest:
    """A checked pooling request of ``input`` prompts (embeddings, classifications): its
    prompts and their one ``PoolingParams``."""

    model: str
    prompts: list[Prompt]
    params: PoolingParams
    client_request_id: str
    lora_id: int = 0
    priority: int = 0
    created_s: int = field(default_factory=lambda: int(time.time()))
    from_messages: bool = False  # the one prompt is a conversation (vLLM's chat form)

    @property
    def prompt_names(self) -> list[str]:
        return ["messages"] if self.from_messages else input_names(len(self.prompts))


@dataclass(kw_only=True)
class EmbeddingApiRequest(PoolingApiRequest):
    """A checked ``/v1/embeddings`` request."""

    encoding_format: str  # "float" or "base64" (little-endian float32, as OpenAI sends)


def parse_embedding_request(
    body: Any,
    llm: LLM,
    served_model_name: str | tuple[str, ...],
    client_request_id: str | None,
    max_prompts: int = 1024,
    trust_request_chat_template: bool = False,
) -> EmbeddingApiRequest:
    """The body of ``/v1/embeddings``, checked and tokenized: ``input`` as a string, token
    ids, or a batch of either, or (vLLM's chat form) ``messages``, one conversation
    rendered with the chat template (``pooling_input_prompts``; a request's own
    ``chat_template`` when ``trust_request_chat_template``); ``dimensions`` in [1, the
    model's hidden size];
    ``truncate_prompt_tokens`` keeps a prompt's last k tokens (-1: the context window), as
    vLLM does; a prompt longer than the context window is refused."""
    checked_body(body, _EMBEDDING_FIELDS | POOLING_CHAT_FIELDS, "embeddings")
    model, lora_id = served_model(body, llm, served_model_name)
    prompts, from_messages = pooling_input_prompts(
        body, llm, max_prompts, trust_request_chat_template
    )
    encoding_format = checked_encoding_format(body)
    dimensions = int_field(body, "dimensions", 1, llm.model_config.embedding_size)
    normalize = typed_field(body, "normalize", (bool,), "a boolean")
    priority = checked_priority(body, llm)
    return EmbeddingApiRequest(
        model=model,
        prompts=prompts,
        params=llm.embedding_params(normalize, dimensions),
        encoding_format=encoding_format,
        client_request_id=id_field(body, "request_id") or client_request_id or "",
        lora_id=lora_id,
        priority=priority,
        from_messages=from_messages,
    )


def input_names(count: int) -> list[str]:
    """Each of a pooling request's ``input`` prompts' field, as errors name it."""
    return ["input"] if count == 1 else [f"input[{i}]" for i in range(count)]


# vLLM's chat form of a pooling request (its EmbeddingChatRequest, ClassificationChatRequest):
# ``messages`` instead of ``input``, rendered by the chat template.
POOLING_CHAT_FIELDS = frozenset(
    {
        "messages",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template",
        "chat_template_kwargs",
    }
)


def pooling_input_prompts(
    body: dict, llm: LLM, max_prompts: int, trust_request_chat_template: bool
) -> tuple[list[Prompt], bool]:
    """The prompts of an embeddings or classify body, and whether they came from a
    conversation: ``input`` (``pooling_prompts``) or, as vLLM's chat form, ``messages``
    through the chat template, one prompt ending with the last message (no assistant turn
    unless ``add_generation_prompt``), cut as ``truncate_prompt_tokens`` says."""
    if body.get("messages") is None:
        for name in sorted(POOLING_CHAT_FIELDS - {"messages"}):
            if body.get(name) is not None:
                raise invalid_field(f"{name} is a chat setting: it needs messages", name)
        if body.get("input") is None:
            raise invalid_field(
                "input is required (a string, a list of strings, or token ids), or messages "
                "for a conversation rendered with the chat template",
                "input",
            )
        return pooling_prompts(body, llm, max_prompts, "input"), False
    if body.get("input") is not None:
        raise invalid_field(
            "messages and input are both set: give the prompts as input, or one "
            "conversation as messages",
            "messages",
        )
    chat_body = {name: body[name] for name in POOLING_CHAT_FIELDS if name in body}
    prompt = chat_prompt(chat_body, llm, trust_request_chat_template, opens_turn_default=False)
    truncate = truncate_prompt_tokens(body, llm)
    if truncate is not None and len(prompt.token_ids) > truncate:
        prompt = Prompt(None, prompt.token_ids[-truncate:])
    check_prompt_length(prompt, llm, "messages")
    return [prompt], True


def pooling_prompts(body: dict, llm: LLM, max_prompts: int, field: str) -> list[Prompt]:
    """The prompts of a pooling request's ``field`` (the embeddings' ``input``, a score's
    ``text_1``, ...): a string, token ids, or a batch of either, each cut to its last
    ``truncate_prompt_tokens`` tokens (-1: the context window), as vLLM does, and refused
    if longer than the context window."""
    prompts = _completion_prompts(body, llm, max_prompts, field)
    truncate = truncate_prompt_tokens(body, llm)
    for position, prompt in enumerate(prompts):
        if truncate is not None and len(prompt.token_ids) > truncate:
            prompts[position] = Prompt(None, prompt.token_ids[-truncate:])
        name = field if len(prompts) == 1 else f"{field}[{position}]"
        check_prompt_length(prompts[position], llm, name)
    return prompts


def truncate_prompt_tokens(body: dict, llm: LLM) -> int | None:
    """vLLM's ``truncate_prompt_tokens``: how many tokens a prompt keeps at most (-1: the
    context window); None: no cut."""
    max_model_len = llm.scheduler_config.max_model_len
    truncate = typed_field(body, "truncate_prompt_tokens", (int,), "an integer")
    if truncate == -1:
        truncate = max_model_len
    if truncate is not None and not 1 <= truncate <= max_model_len:
        raise invalid_field(
            f"truncate_prompt_tokens must be -1 or in [1, {max_model_len}] (the model's "
            f"context window), got {truncate}",
            "truncate_prompt_tokens",
        )
    return truncate


def check_prompt_length(prompt: Prompt, llm: LLM, name: str) -> None:
    """A pooling prompt longer than the context window is refused, naming its field."""
    max_model_len = llm.scheduler_config.max_model_len
    num_prompt_tokens = len(prompt.token_ids)
    if num_prompt_tokens > max_model_len:
        raise invalid_field(
            f"{name}: {num_prompt_tokens} prompt tokens exceed the model's context window "
            f"of {max_model_len} tokens (truncate_prompt_tokens can cut them)",
            name,
        )


def checked_priority(body: dict, llm: LLM) -> int:
    """vLLM's ``priority`` (lower first), checked against the engine's policy."""
    priority = typed_field(body, "priority", (int,), "an integer", 0)
    try:
        llm.check_priority(priority)
    except ValueError as error:
        raise invalid_field(str(error), "priority") from None
    return priority


def checked_encoding_format(body: dict) -> str:
    """A pooling body's ``encoding_format``: "float" (the default) or "base64"."""
    encoding_format = typed_field(body, "encoding_format", (str,), "a string", "float")
    if encoding_format not in EMBEDDING_ENCODING_FORMATS:
        raise invalid_field(
            f"encoding_format must be 'float' or 'base64', got {encoding_format!r:.100}",
            "encoding_format",
        )
    return encoding_format


def encoded_vector(values: list[float], encoding_format: str) -> list[float] | str:
    """A pooled vector as ``encoding_format`` sends it: the floats, or "base64" of their
    little-endian float32 bytes (as OpenAI sends embeddings)."""
    if encoding_format != "base64":
        return values
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")


def embedding_response(request: EmbeddingApiRequest, outputs: list[EmbeddingRequestOutput]) -> dict:
    """OpenAI's answer: one ``embedding`` object per input, in order, and the usage."""
    data = []
    for index, output in enumerate(outputs):
        values = encoded_vector(output.outputs.embedding, request.encoding_format)
        data.append({"object": "embedding", "embedding": values, "index": index})
    prompt_tokens = sum(len(output.prompt_token_ids) for output in outputs)
    return {
        "id": "embd-" + (request.client_request_id or uuid.uuid4().hex),
        "object": "list",
        "created": request.created_s,
        "model": request.model,
        "data": data,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }
