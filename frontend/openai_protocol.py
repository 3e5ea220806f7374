"""The OpenAI-compatible HTTP API's completions and chat requests: JSON bodies in, the
engine's requests out (prompts, one ``SamplingParams`` per prompt). Their answers are
``openai_answers.py``'s (whole) and ``openai_streams.py``'s (chunks).

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

import dataclasses
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedserve.frontend import tool_calls
from pagedserve.frontend.call_errors import CallError
from pagedserve.frontend.chat_request import ChatReading, tool_constraint
from pagedserve.frontend.generation_config import DEFAULT_FIELDS, limit_max_tokens
from pagedserve.frontend.openai_fields import (
    checked_body,
    checked_priority,
    id_field,
    int_field,
    invalid_field,
    served_model,
    typed_field,
)
from pagedserve.frontend.openai_prompts import (
    Prompt,
    chat_prompt,
    completion_prompts,
    message_text,
)
from pagedserve.frontend.reasoning import ReasoningParser
from pagedserve.frontend.request_contract import check_output_room, clamped_logit_bias
from pagedserve.frontend.tool_calls import ToolCallError, ToolCalling
from pagedserve.scheduler.capacity import max_sequence_tokens
from pagedserve.scheduler.sampling_params import (
    STRUCTURED_OUTPUT_KINDS,
    SamplingParams,
    StructuredOutputsParams,
)
from pagedserve.scheduler.structured_output import grammar_text

if TYPE_CHECKING:
    from pagedserve.frontend.llm import LLM


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
        prompts = completion_prompts(body, llm, max_prompts)
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
    return message_text(last, f"messages[{len(body['messages']) - 1}]")
