"""A chat request as both APIs serve it, whatever their wire format (``openai_protocol.py``
reads OpenAI's JSON, ``grpc_convert.py`` the proto): the conversation and its tools through
the chat template, a required or named tool choice made the output's constraint, and each
output read back as thinking, answer and tool calls, whole or as stream deltas that add up
to the whole.

::

    output text   <think>Paris is big.</think>On it.<tool_call>{...}</tool_call>
                  |-- reasoning.py ---------|-- tool_calls.py reads the answer --|
    read as       reasoning "Paris is big."  content "On it."  calls [get_weather]

Harmony's tool-call reader (gpt-oss, ``--tool-call-parser openai``) reads the whole output
instead: its calls are messages among the thinking ones (``harmony.py``).

Errors name fields as OpenAI's API does (``tool_choice``, ``tools[0].function.parameters``);
the gRPC API renames them to its own (``grpc_convert.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from jinja2 import TemplateError

from pagedserve.frontend.chat_template import DEFAULT_CHAT_OPTIONS, ChatTemplateOptions
from pagedserve.frontend.outputs import ToolCall
from pagedserve.frontend.reasoning import ReasoningParser, ReasoningStream
from pagedserve.frontend.tool_calls import (
    ToolCallDelta,
    ToolCallError,
    ToolCalling,
    ToolCallStream,
    with_ids,
)
from pagedserve.scheduler.sampling_params import StructuredOutputsParams
from pagedserve.scheduler.structured_output import grammar_text

if TYPE_CHECKING:
    from pagedserve.frontend.llm import LLM


def render_chat_prompt(
    llm: LLM,
    conversation: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    field: str,
    options: ChatTemplateOptions = DEFAULT_CHAT_OPTIONS,
    check_size: bool = False,
) -> tuple[str, list[int]]:
    """The prompt text and token ids of ``conversation`` (each message as the template gets
    it: role, content, and tool calling's fields) with ``tools`` (OpenAI's function-tool
    definitions; None: no tools), rendered as ``options`` say (``LLM.render_chat``);
    ``check_size``: refuse a text too long for the window before tokenizing it (a request
    that does not truncate its prompt).
    ``ValueError`` naming ``field`` when the template refuses the messages (its
    ``raise_exception``) or the prompt is not one the engine takes; one starting with the
    setting's name (``chat_template.SETTING_NAMES``) for that setting's errors."""
    try:
        text = llm.render_chat(conversation, field, tools, options)
    except TemplateError as error:
        raise ValueError(f"{field}: the chat template refused them: {error}") from None
    except (ArithmeticError, LookupError, TypeError, AttributeError) as error:
        # A template is code: on these messages it failed (a division by zero, an index
        # out of range, a string added to a number). The request's input, not the server.
        raise ValueError(
            f"{field}: the chat template failed on them: {type(error).__name__}: {error}"
        ) from None
    if check_size:
        llm.check_prompt_size(text, field)
    token_ids = llm.encode_prompt(llm.tokenizer.encode(text, add_special_tokens=False), field)
    return text, token_ids


def tool_constraint(calling: ToolCalling, llm: LLM) -> StructuredOutputsParams | None:
    """The structured output that makes a required or named tool choice's calls (the output
    constrained to the calls' JSON), compiled; None when the model writes freely (auto).
    ``ToolCallError`` naming the tools' field when a schema does not compile, or
    ``tool_choice`` when the model has no tokenizer to constrain over. The caller refuses
    a request that sets another constraint beside it."""
    constraint = calling.constraint()
    if constraint is None:
        return None
    name, schema = constraint
    if llm.grammar_vocabulary is None:
        raise ToolCallError(
            "tool_choice: a required or named tool choice constrains the output over the "
            f"model's tokenizer, and {str(llm.model_path)!r} has none (or only a slow one)",
            "tool_choice",
        )
    params = StructuredOutputsParams(json=schema)
    try:
        grammar_text(params)
    except (ValueError, TypeError) as error:
        raise ToolCallError(f"{name}: {error}", name) from None
    return params


@dataclass(frozen=True)
class ChatAnswer:
    """A whole chat output, read: the answer's content (without the calls and the
    thinking), the thinking ("" when none or not reported), the calls (each with a new id)
    and the finish reason ("tool_calls" when the model chose to call)."""

    content: str
    reasoning: str
    tool_calls: list[ToolCall]
    finish_reason: str | None


@dataclass(frozen=True)
class ChatDelta:
    """What one stream message adds to a chat output: content, thinking, call deltas."""

    content: str
    reasoning: str
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass(frozen=True)
class ChatReading:
    """How a chat request's outputs read: ``tool_calling`` finds the calls (None: no tools,
    or tool_choice "none"), ``reasoning`` the thinking (None: the server runs no reasoning
    parser), which is reported unless ``include_reasoning`` is false. With neither, an
    output reads as its text."""

    tool_calling: ToolCalling | None = None
    reasoning: ReasoningParser | None = None
    include_reasoning: bool = True

    def keeps_special_tokens(self, llm: LLM) -> bool:
        """Whether the output text must keep special tokens (``skip_special_tokens=False``
        unless the request says otherwise): the readers find calls and thinking by
        markers the tokenizer may count as special, as vLLM's parsers ask."""
        markers = (() if self.tool_calling is None else self.tool_calling.markers) + (
            () if self.reasoning is None else self.reasoning.markers
        )
        return llm.tokenizer is not None and any(
            marker in llm.tokenizer.special_token_texts for marker in markers
        )

    def whole(self, text: str, finish_reason: str | None) -> ChatAnswer:
        """A finished output's ``text`` read, and its ``finish_reason`` as the answer
        reports it."""
        reasoning = ""
        answer = text
        if self.reasoning is not None:
            split = self.reasoning.parse(text, final=True)
            answer, reasoning = split.content, split.reasoning
        calls: list[ToolCall] = []
        if self.tool_calling is not None:
            read = text if self.tool_calling.reads_whole_output else answer
            parsed = self.tool_calling.parse(read, final=True)
            answer, calls = parsed.content, with_ids(parsed.calls)
            finish_reason = self.tool_calling.finish_reason(finish_reason, parsed)
        return ChatAnswer(answer, reasoning if self.include_reasoning else "", calls, finish_reason)

    def stream(self) -> ChatAnswerStream:
        """A reader for one streamed output."""
        return ChatAnswerStream(self)


class ChatAnswerStream:
    """One streamed chat output: what each message adds to its thinking, its answer and its
    calls. Only what more text cannot change is reported, so the deltas add up to
    ``ChatReading.whole`` of the final text (call ids aside)."""

    def __init__(self, reading: ChatReading) -> None:
        self._include_reasoning = reading.include_reasoning
        self._reasoning = None if reading.reasoning is None else ReasoningStream(reading.reasoning)
        self._tool_calls = (
            None if reading.tool_calling is None else ToolCallStream(reading.tool_calling)
        )
        self._reads_whole_output = (
            reading.tool_calling is not None and reading.tool_calling.reads_whole_output
        )
        self._text_chars = 0

    def feed(self, text: str, final: bool) -> ChatDelta:
        """What is new, given the output's whole ``text`` so far; ``final``: it ended."""
        reasoning = ""
        if self._reasoning is not None:
            # The thinking apart; the answer is what the splitter settled.
            reasoning, content = self._reasoning.feed(text, final)
            answer = self._reasoning.content
        else:
            content, answer = text[self._text_chars :], text
            self._text_chars = len(text)
        calls: list[ToolCallDelta] = []
        if self._tool_calls is not None:
            # The content is what the tool-call reader settled, not the raw answer.
            read = text if self._reads_whole_output else answer
            content, calls = self._tool_calls.feed(read, final)
        return ChatDelta(content, reasoning if self._include_reasoning else "", calls)

    def finish_reason(self, reason: str | None) -> str | None:
        """The output's finish reason as the answer reports it ("tool_calls" when the model
        chose to call), once the last text was fed."""
        return reason if self._tool_calls is None else self._tool_calls.finish_reason(reason)
