"""Tool (function) calling in chat requests, as OpenAI's API defines it and vLLM serves it.

The request's ``tools`` go to the chat template; ``tool_choice`` decides how calls come out:

- ``"none"``: the answer is text (the model still sees the tools).
- a named function (``{"type": "function", "function": {"name": ...}}``): the output is
  constrained (structured output) to that function's parameters schema, and the whole
  output is the call's arguments. Works with any model.
- ``"required"``: the output is constrained to a JSON array of ``{"name", "parameters"}``
  objects, one per call (at most one when ``parallel_tool_calls`` is false). Any model.
- ``"auto"`` (the default when tools are given): the model decides, and the server's
  tool-call parser (``--enable-auto-tool-choice --tool-call-parser NAME``) finds the calls
  in the model's own format; the rest of the output stays content.

One method reads a choice's output for both a whole answer and a stream:
``ToolCalling.parse(text, final)``. With ``final=False`` it reports only what more text
cannot change (content that is a prefix of the final content, calls that stay; only the
last call's arguments may still grow), so a stream's deltas add up to the whole answer.
Calls and their deltas are plain data (``ToolCall``, ``ToolCallDelta``); each API writes
them in its own format, and ``chat_request.py`` reads them together with the thinking.
Field names in errors are OpenAI's (``tools[0].function.name``); the gRPC API renames them.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from pagedserve.frontend import harmony
from pagedserve.frontend.outputs import ToolCall
from pagedserve.frontend.request_contract import decode_json

# --tool-call-parser: the model families whose output format the server can read.
TOOL_CALL_PARSERS = (
    "hermes",
    "llama3_json",
    "llama4_json",  # vLLM's name for Llama 4 of the same reader
    "pythonic",
    "llama4_pythonic",  # vLLM's name for Llama 4 of the same reader
    "mistral",
    "qwen3_coder",
    "seed_oss",
    "deepseek_v3",
    "deepseek_v31",
    "glm45",
    "kimi_k2",
    "minimax_m2",
    "granite",
    "phi4_mini_json",
    "openai",
)
TOOL_CHOICE_MODES = ("none", "auto", "required")

# OpenAI's rule for a function name.
_FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
# A function without parameters takes none (OpenAI: "omitting parameters defines a
# function with an empty parameter list").
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
# What OpenAI's function tool holds.
_FUNCTION_FIELDS = ("name", "description", "parameters", "strict")


class ToolCallError(ValueError):
    """A request's tools, tool choice or tool messages are wrong; ``field`` names where."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Tool:
    """One function the model may call."""

    name: str
    parameters: dict[str, Any]  # a JSON schema
    # As the chat template gets it: OpenAI's {"type": "function", "function": {...}}.
    definition: dict[str, Any]


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text, as OpenAI reports it
    id: str | None = None  # the model's own id for the call, where its format writes one


@dataclass(frozen=True)
class ParsedOutput:
    content: str
    calls: list[ParsedCall] = field(default_factory=list)


@dataclass(frozen=True)
class ToolCallDelta:
    """What a stream adds to one call of a choice: a call's first delta names it (``id``,
    ``name``) with its arguments so far; later ones add arguments text only."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


def parse_tools(tools: Any) -> list[Tool]:
    """The request's ``tools``: function tools with distinct names."""
    if not isinstance(tools, list) or not tools:
        raise ToolCallError(
            f"tools must be a non-empty list of function tools, got {tools!r:.200}", "tools"
        )
    parsed: list[Tool] = []
    for position, tool in enumerate(tools):
        name = f"tools[{position}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise ToolCallError(
                f"{name}.type must be 'function' (the only kind of tool), got {kind!r:.100}",
                f"{name}.type",
            )
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ToolCallError(
                f"{name}.function must be an object with a name, got {function!r:.200}",
                f"{name}.function",
            )
        function_name = function.get("name")
        if not isinstance(function_name, str) or not _FUNCTION_NAME.fullmatch(function_name):
            raise ToolCallError(
                f"{name}.function.name must be 1 to 64 letters, digits, '_' or '-', got "
                f"{function_name!r:.100}",
                f"{name}.function.name",
            )
        if any(other.name == function_name for other in parsed):
            raise ToolCallError(
                f"{name}.function.name: {function_name!r} names two tools; names must differ",
                f"{name}.function.name",
            )
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise ToolCallError(
                f"{name}.function.description must be a string, got {description!r:.100}",
                f"{name}.function.description",
            )
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise ToolCallError(
                f"{name}.function.parameters must be a JSON schema (an object), got "
                f"{parameters!r:.200}",
                f"{name}.function.parameters",
            )
        # The template sees the function as the client wrote it, in its order (a template's
        # tojson prints keys as they come), without fields OpenAI does not define.
        definition_function = {
            key: value for key, value in function.items() if key in _FUNCTION_FIELDS
        }
        parsed.append(
            Tool(
                function_name,
                _NO_PARAMETERS if parameters is None else parameters,
                {"type": "function", "function": definition_function},
            )
        )
    return parsed


def call_id() -> str:
    """A new tool call's id, in OpenAI's form."""
    return "call_" + uuid.uuid4().hex[:24]


def with_ids(calls: list[ParsedCall]) -> list[ToolCall]:
    """A whole answer's calls, each with the model's id or a new one."""
    return [ToolCall(call.id or call_id(), call.name, call.arguments) for call in calls]


def chat_message_tool_fields(message: dict, name: str) -> dict[str, Any]:
    """What a chat message adds to the template for tool calling: an assistant's
    ``tool_calls`` (arguments as objects, which is how chat templates print them) or a
    tool result's ``tool_call_id``."""
    fields: dict[str, Any] = {}
    tool_calls = message.get("tool_calls")
    if tool_calls is not None:
        if message.get("role") != "assistant":
            raise ToolCallError(
                f"{name}.tool_calls: only an assistant's message makes tool calls, this one's "
                f"role is {message.get('role')!r}",
                f"{name}.tool_calls",
            )
        if not isinstance(tool_calls, list):
            raise ToolCallError(
                f"{name}.tool_calls must be a list, got {tool_calls!r:.200}", f"{name}.tool_calls"
            )
        fields["tool_calls"] = [
            _message_tool_call(call, f"{name}.tool_calls[{position}]")
            for position, call in enumerate(tool_calls)
        ]
    if message.get("role") == "tool":
        tool_call_id = message.get("tool_call_id")
        if not isinstance(tool_call_id, str) or not tool_call_id:
            raise ToolCallError(
                f"{name}.tool_call_id must name the call this message answers (a string), "
                f"got {tool_call_id!r:.100}",
                f"{name}.tool_call_id",
            )
        fields["tool_call_id"] = tool_call_id
    if isinstance(message.get("name"), str):
        fields["name"] = message["name"]
    return fields


def _message_tool_call(call: Any, name: str) -> dict[str, Any]:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise ToolCallError(
            f"{name} must be {{id, type: 'function', function: {{name, arguments}}}}, got "
            f"{call!r:.200}",
            name,
        )
    function = call["function"]
    function_name = function.get("name")
    if not isinstance(function_name, str) or not function_name:
        raise ToolCallError(
            f"{name}.function.name must be a string, got {function_name!r:.100}",
            f"{name}.function.name",
        )
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = (
                decode_json(f"{name}.function.arguments", arguments) if arguments.strip() else {}
            )
        except ValueError as error:
            raise ToolCallError(str(error), f"{name}.function.arguments") from None
    if not isinstance(arguments, dict):
        raise ToolCallError(
            f"{name}.function.arguments must be a JSON object, got {arguments!r:.200}",
            f"{name}.function.arguments",
        )
    result: dict[str, Any] = {
        "type": "function",
        "function": {"name": function_name, "arguments": arguments},
    }
    if isinstance(call.get("id"), str):
        result["id"] = call["id"]
    return result


class ToolCalling:
    """A chat request's tool calling: its tools, the choice, and how its output reads."""

    def __init__(
        self,
        tools: list[Tool],
        tool_choice: Any,
        parallel_tool_calls: bool,
        tool_call_parser: str | None,
    ) -> None:
        self.tools = tools
        self.parallel_tool_calls = parallel_tool_calls
        self.named: Tool | None = None
        if tool_choice is None:
            tool_choice = "auto"
        if isinstance(tool_choice, dict):
            self.mode = "named"
            self.named = self._named_tool(tool_choice)
        elif tool_choice in TOOL_CHOICE_MODES:
            self.mode = tool_choice
        else:
            raise ToolCallError(
                f"tool_choice must be 'none', 'auto', 'required' or "
                f"{{'type': 'function', 'function': {{'name': ...}}}}, got {tool_choice!r:.200}",
                "tool_choice",
            )
        self._reader = self._output_reader(tool_call_parser)

    def _named_tool(self, tool_choice: dict) -> Tool:
        function = tool_choice.get("function")
        if tool_choice.get("type") != "function" or not isinstance(function, dict):
            raise ToolCallError(
                f"tool_choice must be {{'type': 'function', 'function': {{'name': ...}}}} to "
                f"name a function, got {tool_choice!r:.200}",
                "tool_choice",
            )
        wanted = function.get("name")
        for tool in self.tools:
            if tool.name == wanted:
                return tool
        names = ", ".join(tool.name for tool in self.tools)
        raise ToolCallError(
            f"tool_choice.function.name={wanted!r:.100} is not one of the tools ({names})",
            "tool_choice.function.name",
        )

    def _output_reader(self, tool_call_parser: str | None) -> _OutputReader:
        if self.mode == "none":
            return _TextReader()
        if self.mode == "named":
            assert self.named is not None
            return _NamedReader(self.named.name)
        if self.mode == "required":
            return _RequiredReader()
        if tool_call_parser is None:
            raise ToolCallError(
                "tool_choice='auto' (the default when tools are given) needs a server "
                "started with --enable-auto-tool-choice and --tool-call-parser "
                f"({', '.join(TOOL_CALL_PARSERS)}) to find calls in the model's output; "
                "'required' or a named function work with any model",
                "tool_choice",
            )
        if tool_call_parser == "hermes":
            return _HermesReader()
        if tool_call_parser in ("llama3_json", "llama4_json"):
            return _Llama3JsonReader()
        if tool_call_parser in ("pythonic", "llama4_pythonic"):
            return _PythonicReader()
        if tool_call_parser == "mistral":
            return _MistralReader()
        if tool_call_parser == "qwen3_coder":
            return _Qwen3CoderReader({tool.name: tool.parameters for tool in self.tools})
        if tool_call_parser == "seed_oss":
            return _SeedOssReader({tool.name: tool.parameters for tool in self.tools})
        if tool_call_parser in ("deepseek_v3", "deepseek_v31"):
            return _DeepSeekReader(v31=tool_call_parser == "deepseek_v31")
        if tool_call_parser == "glm45":
            return _Glm45Reader({tool.name: tool.parameters for tool in self.tools})
        if tool_call_parser == "kimi_k2":
            return _KimiK2Reader()
        if tool_call_parser == "minimax_m2":
            return _MiniMaxM2Reader({tool.name: tool.parameters for tool in self.tools})
        if tool_call_parser == "granite":
            return _GraniteReader()
        if tool_call_parser == "phi4_mini_json":
            return _Phi4MiniReader()
        if tool_call_parser == "openai":
            return _HarmonyReader()
        raise ValueError(
            f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
            f"got {tool_call_parser!r}"
        )

    def constraint(self) -> tuple[str, dict[str, Any]] | None:
        """The JSON schema the output must follow, and the field to name when it does
        not compile; None when the model writes freely."""
        if self.named is not None:
            position = self.tools.index(self.named)
            return f"tools[{position}].function.parameters", self.named.parameters
        if self.mode != "required":
            return None
        one_call = [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [tool.name]},
                    "parameters": tool.parameters,
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for tool in self.tools
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": one_call}}
        if not self.parallel_tool_calls:
            schema["maxItems"] = 1
        return "tools", schema

    @property
    def markers(self) -> tuple[str, ...]:
        """The texts the reader finds calls by (the output text must keep them)."""
        return self._reader.markers

    @property
    def reads_whole_output(self) -> bool:
        """Whether ``parse`` takes the whole output, thinking included, rather than the
        answer the reasoning parser leaves: harmony's calls (gpt-oss) sit among its
        thinking messages, and its reader leaves the thinking out itself."""
        return self._reader.reads_whole_output

    def parse(self, text: str, final: bool) -> ParsedOutput:
        """The content and calls in a choice's output ``text``; ``final``: the output is
        complete (otherwise only what more text cannot change)."""
        parsed = self._reader.parse(text, final)
        if not self.parallel_tool_calls and len(parsed.calls) > 1:
            return ParsedOutput(parsed.content, parsed.calls[:1])
        return parsed

    def finish_reason(self, reason: str | None, parsed: ParsedOutput) -> str | None:
        """OpenAI's: "tool_calls" when the model chose to call (auto, required) and
        stopped on its own; a named call ends with "stop", as OpenAI's does."""
        if reason == "stop" and parsed.calls and self.mode in ("auto", "required"):
            return "tool_calls"
        return reason


class ToolCallStream:
    """One streamed choice's tool calling: the content and call deltas of each chunk."""

    def __init__(self, calling: ToolCalling) -> None:
        self._calling = calling
        self._content_chars = 0
        self._call_ids: list[str] = []
        self._argument_chars: list[int] = []
        self.last: ParsedOutput = ParsedOutput("")

    def feed(self, text: str, final: bool) -> tuple[str, list[ToolCallDelta]]:
        """What is new in the choice's output ``text`` (all of it so far): content, and
        the calls' deltas (a call's first names it and carries its id: the model's, or a
        new one)."""
        parsed = self._calling.parse(text, final)
        self.last = parsed
        content = parsed.content[self._content_chars :]
        self._content_chars = len(parsed.content)
        deltas: list[ToolCallDelta] = []
        for index, call in enumerate(parsed.calls):
            if index == len(self._call_ids):
                self._call_ids.append(call.id or call_id())
                self._argument_chars.append(len(call.arguments))
                deltas.append(
                    ToolCallDelta(index, call.arguments, self._call_ids[index], call.name)
                )
            elif len(call.arguments) > self._argument_chars[index]:
                new_arguments = call.arguments[self._argument_chars[index] :]
                self._argument_chars[index] = len(call.arguments)
                deltas.append(ToolCallDelta(index, new_arguments))
        return content, deltas

    def finish_reason(self, reason: str | None) -> str | None:
        """The choice's finish reason as ``ToolCalling.finish_reason`` says, by the calls
        read so far (all of them once the output ended)."""
        return self._calling.finish_reason(reason, self.last)


# ---------------------------------------------------------------- output readers


class _OutputReader:
    # Texts the model writes around calls (which must survive detokenization).
    markers: tuple[str, ...] = ()
    # Reads the whole output, thinking included (``ToolCalling.reads_whole_output``).
    reads_whole_output = False

    def parse(self, text: str, final: bool) -> ParsedOutput:
        raise NotImplementedError


class _TextReader(_OutputReader):
    """tool_choice "none": all content."""

    def parse(self, text: str, final: bool) -> ParsedOutput:
        return ParsedOutput(text)


class _NamedReader(_OutputReader):
    """A named function: the whole output is its arguments (growing while it streams)."""

    def __init__(self, name: str) -> None:
        self._name = name

    def parse(self, text: str, final: bool) -> ParsedOutput:
        return ParsedOutput("", [ParsedCall(self._name, text)])


def _arguments_text(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def _skip(text: str, position: int, characters: str) -> int:
    while position < len(text) and text[position] in characters:
        position += 1
    return position


_JSON = json.JSONDecoder()
_WHITESPACE = " \t\n\r"


class _RequiredReader(_OutputReader):
    """tool_choice "required": the (constrained) output is a JSON array of
    ``{"name", "parameters"}`` objects; each call counts once its object is complete. An
    output with no complete call (cut short) stays content, so nothing is lost."""

    def parse(self, text: str, final: bool) -> ParsedOutput:
        calls: list[ParsedCall] = []
        position = _skip(text, 0, _WHITESPACE)
        if text.startswith("[", position):
            position += 1
            while True:
                position = _skip(text, position, _WHITESPACE + ",")
                try:
                    item, position = _JSON.raw_decode(text, position)
                except ValueError:
                    break
                if not (
                    isinstance(item, dict)
                    and isinstance(item.get("name"), str)
                    and isinstance(item.get("parameters"), dict)
                ):
                    break
                calls.append(ParsedCall(item["name"], _arguments_text(item["parameters"])))
        if final and not calls:
            return ParsedOutput(text)
        return ParsedOutput("", calls)


def partial_marker_chars(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could begin ``marker``."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


class _HermesReader(_OutputReader):
    """Hermes' and Qwen's format: each call a ``<tool_call>{"name": ..., "arguments":
    {...}}</tool_call>`` block. Text before the first block is content; after it, text
    between or after blocks is content unless it is only whitespace; a block that does not
    hold a call stays content as written; the last block may lack its end tag when the
    output ended there."""

    START = "<tool_call>"
    END = "</tool_call>"
    markers = (START, END)

    def parse(self, text: str, final: bool) -> ParsedOutput:
        content: list[str] = []
        calls: list[ParsedCall] = []
        position = 0
        after_block = False
        while True:
            start = text.find(self.START, position)
            if start < 0:
                tail = text[position:]
                if not final:  # held back: the start of a block may be arriving
                    tail = tail[: len(tail) - partial_marker_chars(tail, self.START)]
                if not (after_block and not tail.strip()):
                    content.append(tail)
                break
            segment = text[position:start]
            if not (after_block and not segment.strip()):
                content.append(segment)
            after_block = True
            body_start = start + len(self.START)
            end = text.find(self.END, body_start)
            if end < 0:
                if final:  # the output ended inside the block
                    call = self._call(text[body_start:])
                    if call is None:
                        content.append(text[start:])
                    else:
                        calls.append(call)
                break  # else: nothing after an open block is settled
            call = self._call(text[body_start:end])
            if call is None:
                content.append(text[start : end + len(self.END)])
            else:
                calls.append(call)
            position = end + len(self.END)
        return ParsedOutput("".join(content), calls)

    @staticmethod
    def _call(body: str) -> ParsedCall | None:
        try:
            item = json.loads(body)
        except (ValueError, RecursionError):  # not JSON, or nested past the decoder's reach
            return None
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        arguments = item.get("arguments", {})
        if not isinstance(arguments, (dict, str)):
            return None
        return ParsedCall(item["name"], _arguments_text(arguments))


class _Llama3JsonReader(_OutputReader):
    """Llama 3.1's JSON tool calls: an output that starts (after whitespace, and an
    optional ``<|python_tag|>``) with ``{`` is one or more ``{"name": ...,
    "parameters": {...}}`` objects separated by ``;``. Read when the output is complete
    (the same text could still turn out not to be calls); anything else is content."""

    PYTHON_TAG = "<|python_tag|>"
    markers = (PYTHON_TAG,)

    def parse(self, text: str, final: bool) -> ParsedOutput:
        stripped = text.lstrip()
        if not final:
            undecided = not stripped or self.PYTHON_TAG.startswith(stripped)
            if undecided or self._looks_like_calls(stripped):
                return ParsedOutput("")
            return ParsedOutput(text)
        if not self._looks_like_calls(stripped):
            return ParsedOutput(text)
        body = stripped.removeprefix(self.PYTHON_TAG)
        calls: list[ParsedCall] = []
        position = _skip(body, 0, _WHITESPACE)
        while position < len(body):
            try:
                item, position = _JSON.raw_decode(body, position)
            except ValueError:
                return ParsedOutput(text)
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                return ParsedOutput(text)
            arguments = item.get("parameters", item.get("arguments", {}))
            if not isinstance(arguments, (dict, str)):
                return ParsedOutput(text)
            calls.append(ParsedCall(item["name"], _arguments_text(arguments)))
            position = _skip(body, position, _WHITESPACE + ";")
        if not calls:
            return ParsedOutput(text)
        return ParsedOutput("", calls)

    def _looks_like_calls(self, stripped: str) -> bool:
        return stripped.startswith("{") or stripped.startswith(self.PYTHON_TAG)


class _JsonArrayReader(_OutputReader):
    """An output that is (after whitespace, and one of ``MARKERS``) a JSON array of
    ``{"name", "arguments"}`` objects and nothing more: IBM Granite 3.x's calls (after
    3.0's ``<|tool_call|>`` token or 3.1's ``<tool_call>`` text, or none), Phi-4-mini's
    (``functools[...]``). Read when the output is complete (the same text could still turn
    out not to be calls); anything else is content."""

    MARKERS: tuple[str, ...] = ()
    MARKER_REQUIRED = False

    def __init__(self) -> None:
        self.markers = self.MARKERS

    def parse(self, text: str, final: bool) -> ParsedOutput:
        stripped = text.lstrip()
        if not final:
            undecided = not stripped or any(m.startswith(stripped) for m in self.MARKERS)
            if undecided or self._body(stripped) is not None:
                return ParsedOutput("")
            return ParsedOutput(text)
        body = self._body(stripped)
        if body is None:
            return ParsedOutput(text)
        try:
            items, position = _JSON.raw_decode(body)
        except ValueError:
            return ParsedOutput(text)
        if body[position:].strip() or not isinstance(items, list) or not items:
            return ParsedOutput(text)
        calls = []
        for item in items:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                return ParsedOutput(text)
            arguments = item.get("arguments", item.get("parameters", {}))
            if not isinstance(arguments, (dict, str)):
                return ParsedOutput(text)
            calls.append(ParsedCall(item["name"], _arguments_text(arguments)))
        return ParsedOutput("", calls)

    def _body(self, stripped: str) -> str | None:
        """The JSON after the marker, when the output reads as calls so far; else None."""
        for marker in self.MARKERS:
            if stripped.startswith(marker):
                stripped = stripped[len(marker) :].lstrip()
                # The array may not have begun yet.
                return stripped if not stripped or stripped.startswith("[") else None
        if self.MARKER_REQUIRED:
            return None
        return stripped if stripped.startswith("[") else None


class _GraniteReader(_JsonArrayReader):
    MARKERS = ("<|tool_call|>", "<tool_call>")


class _Phi4MiniReader(_JsonArrayReader):
    MARKERS = ("functools",)
    MARKER_REQUIRED = True


class _PythonicReader(_OutputReader):
    """Llama 3.2's and Llama 4's (and ToolACE's) pythonic calls: an output that is a Python
    list of calls with keyword arguments of literal values, ``[get_weather(city="Paris"),
    get_time(zone="CET")]`` (Llama 4 may wrap it in ``<|python_start|>`` ...
    ``<|python_end|>``). Read when the output is complete; anything else is content."""

    START = "<|python_start|>"
    END = "<|python_end|>"
    markers = (START, END)

    def parse(self, text: str, final: bool) -> ParsedOutput:
        stripped = text.strip()
        looks_like_calls = stripped.startswith(("[", self.START))
        if not final:
            undecided = not stripped or self.START.startswith(stripped)
            return ParsedOutput("" if undecided or looks_like_calls else text)
        if not looks_like_calls:
            return ParsedOutput(text)
        body = stripped.removeprefix(self.START).removesuffix(self.END).strip()
        calls = self._calls(body)
        return ParsedOutput(text) if not calls else ParsedOutput("", calls)

    @staticmethod
    def _calls(body: str) -> list[ParsedCall]:
        """The calls of a Python list expression, or none when it is anything else."""
        try:
            tree = ast.parse(body, mode="eval").body
        except (SyntaxError, RecursionError, MemoryError):  # not Python, or nested too deep
            return []
        if not isinstance(tree, ast.List) or not tree.elts:
            return []
        calls = []
        for element in tree.elts:
            if (
                not isinstance(element, ast.Call)
                or not isinstance(element.func, ast.Name)
                or element.args
                or any(keyword.arg is None for keyword in element.keywords)  # **kwargs
            ):
                return []
            try:
                arguments = {
                    keyword.arg: ast.literal_eval(keyword.value) for keyword in element.keywords
                }
                # A set or bytes literal has no JSON form: not a call then.
                arguments_text = json.dumps(arguments, ensure_ascii=False)
            except (ValueError, SyntaxError, TypeError, RecursionError):
                return []
            calls.append(ParsedCall(element.func.id, arguments_text))
        return calls


class _MistralReader(_OutputReader):
    """Mistral's calls, after its ``[TOOL_CALLS]`` token: a JSON array of ``{"name",
    "arguments"}`` objects (Mistral 7B v0.3, Mixtral 8x22B), or, from its v11 tokenizer on
    (Mistral Small 3.2, Devstral, Magistral), each call as ``name[ARGS]{...}`` after a
    ``[TOOL_CALLS]`` of its own. Text before the first ``[TOOL_CALLS]`` is content; a call
    counts once its JSON is complete; an output whose calls do not read stays content."""

    TOOL_CALLS = "[TOOL_CALLS]"
    ARGS = "[ARGS]"
    markers = (TOOL_CALLS, ARGS)

    def parse(self, text: str, final: bool) -> ParsedOutput:
        start = text.find(self.TOOL_CALLS)
        if start < 0:
            if final:
                return ParsedOutput(text)
            return ParsedOutput(text[: len(text) - partial_marker_chars(text, self.TOOL_CALLS)])
        calls = self._calls(text[start:].split(self.TOOL_CALLS)[1:], final)
        if final and not calls:
            return ParsedOutput(text)
        return ParsedOutput(text[:start], calls)

    def _calls(self, segments: list[str], final: bool) -> list[ParsedCall]:
        first = segments[0].lstrip(_WHITESPACE)
        if first.startswith("[") or (not first and not final and len(segments) == 1):
            return self._array_calls(first)
        calls = []
        for segment in segments:
            name, separator, rest = segment.partition(self.ARGS)
            name = name.strip()
            if not separator or not _FUNCTION_NAME.fullmatch(name):
                break  # still being written, or not a call
            try:
                arguments, _end = _JSON.raw_decode(rest, _skip(rest, 0, _WHITESPACE))
            except ValueError:
                break
            if not isinstance(arguments, dict):
                break
            calls.append(ParsedCall(name, _arguments_text(arguments)))
        return calls

    @staticmethod
    def _array_calls(body: str) -> list[ParsedCall]:
        calls: list[ParsedCall] = []
        position = 1
        while True:
            position = _skip(body, position, _WHITESPACE + ",")
            try:
                item, position = _JSON.raw_decode(body, position)
            except ValueError:
                return calls
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                return calls
            arguments = item.get("arguments", {})
            if not isinstance(arguments, (dict, str)):
                return calls
            calls.append(ParsedCall(item["name"], _arguments_text(arguments)))


class _Qwen3CoderReader(_HermesReader):
    """Qwen3-Coder's XML calls, in ``<tool_call>`` blocks as Hermes' (content around them
    read the same way)::

        <tool_call>
        <function=get_weather>
        <parameter=city>
        Paris
        </parameter>
        </function>
        </tool_call>

    A parameter's text takes the type its tool's schema gives it (a number, a boolean, an
    object or array as JSON; a string as written); a parameter the schema does not type
    is JSON when it reads as JSON, else a string."""

    FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.DOTALL)
    PARAMETER = re.compile(
        r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL
    )

    def __init__(self, schemas: dict[str, dict[str, Any]]) -> None:
        self._schemas = schemas

    def _call(self, body: str) -> ParsedCall | None:
        function = self.FUNCTION.search(body)
        if function is None:
            return None
        name = function.group(1).strip()
        if not _FUNCTION_NAME.fullmatch(name):
            return None
        properties = self._schemas.get(name, {}).get("properties", {})
        arguments = {}
        for parameter in self.PARAMETER.finditer(function.group(2)):
            key = parameter.group(1).strip()
            value = parameter.group(2)
            # The value sits on lines of its own: one newline each side is layout.
            value = value.removeprefix("\n").removesuffix("\n")
            arguments[key] = _typed_value(value, properties.get(key))
        return ParsedCall(name, json.dumps(arguments, ensure_ascii=False))


class _SeedOssReader(_Qwen3CoderReader):
    """Seed-OSS's calls: Qwen3-Coder's XML in ``<seed:tool_call>`` blocks."""

    START = "<seed:tool_call>"
    END = "</seed:tool_call>"
    markers = (START, END)


class _SectionReader(_OutputReader):
    """Calls in one section between marker tokens, each call between markers of its own
    (DeepSeek's, Kimi K2's). Text before the section is content; so is text after it,
    once the section holds calls, unless it is only whitespace. A call counts once its
    end marker is written (or the output ended inside it and it reads whole); the first
    block that is not a call ends the calls; an output whose calls do not read stays
    content, markers and all."""

    SECTION_BEGINS: tuple[str, ...] = ()
    SECTION_ENDS: tuple[str, ...] = ()
    CALL_BEGIN = ""
    CALL_END = ""

    def parse(self, text: str, final: bool) -> ParsedOutput:
        start, begin = _first_marker(text, self.SECTION_BEGINS)
        if start < 0:
            if final:
                return ParsedOutput(text)
            held = max(partial_marker_chars(text, marker) for marker in self.SECTION_BEGINS)
            return ParsedOutput(text[: len(text) - held])
        body = text[start + len(begin) :]
        end, section_end = _first_marker(body, self.SECTION_ENDS)
        ended = end >= 0
        region = body[:end] if ended else body
        calls = self._calls(region, output_ended_inside=final and not ended)
        if final and not calls:
            return ParsedOutput(text)
        content = text[:start]
        # Without calls the whole output is content: text after the section waits for them.
        tail = body[end + len(section_end) :] if ended else ""
        if calls and tail.strip():
            content += tail
        return ParsedOutput(content, calls)

    def _calls(self, region: str, output_ended_inside: bool) -> list[ParsedCall]:
        calls = []
        for block in region.split(self.CALL_BEGIN)[1:]:
            inner, closed, _rest = block.partition(self.CALL_END)
            if not closed and not output_ended_inside:
                break  # still being written
            call = self._call(inner)
            if call is None:
                break
            calls.append(call)
        return calls

    def _call(self, inner: str) -> ParsedCall | None:
        raise NotImplementedError


def _first_marker(text: str, markers: tuple[str, ...]) -> tuple[int, str]:
    """Where the first of ``markers`` in ``text`` is, and which; (-1, "") when none is."""
    found = [(text.find(marker), marker) for marker in markers if marker in text]
    return min(found) if found else (-1, "")


class _DeepSeekReader(_SectionReader):
    """DeepSeek's calls (V3, R1 and the R1 distills of Qwen and Llama: ``deepseek_v3``;
    V3.1: ``deepseek_v31``), between its marker tokens::

        <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
        ```json
        {"city": "Paris"}
        ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

    V3.1 writes ``<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}
    <｜tool▁call▁end｜>`` (the name first, the arguments bare). Content and calls read
    as ``_SectionReader`` says."""

    CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
    CALLS_END = "<｜tool▁calls▁end｜>"
    SECTION_BEGINS = (CALLS_BEGIN,)
    SECTION_ENDS = (CALLS_END,)
    CALL_BEGIN = "<｜tool▁call▁begin｜>"
    CALL_END = "<｜tool▁call▁end｜>"
    SEPARATOR = "<｜tool▁sep｜>"
    markers = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEPARATOR)

    def __init__(self, v31: bool) -> None:
        self._v31 = v31

    def _call(self, inner: str) -> ParsedCall | None:
        head, separator, rest = inner.partition(self.SEPARATOR)
        if not separator:
            return None
        if self._v31:
            name, arguments = head.strip(), rest.strip()
        else:
            name, _newline, arguments = rest.partition("\n")
            name = name.strip()
            arguments = arguments.strip().removeprefix("```json").removeprefix("```")
            arguments = arguments.removesuffix("```").strip()
        if not _FUNCTION_NAME.fullmatch(name):
            return None
        return _object_call(name, arguments)


class _KimiK2Reader(_SectionReader):
    """Kimi K2's calls, a section of marker tokens after any content (whitespace may stand
    between the markers)::

        <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0
        <|tool_call_argument_begin|>{"city": "Beijing"}<|tool_call_end|><|tool_calls_section_end|>

    A call's id is ``functions.NAME:INDEX`` (some outputs leave out ``functions.``), its
    arguments a JSON object; some checkpoints spell the section's markers
    ``<|tool_call_section_begin|>`` / ``<|tool_call_section_end|>``. Content and calls read
    as ``_SectionReader`` says. A call keeps the model's id, as vLLM's ``kimi_k2`` reports
    it: Kimi's chat template writes the id back into the next prompt, where it tells the
    model which function each result answers."""

    SECTION_BEGINS = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
    SECTION_ENDS = ("<|tool_calls_section_end|>", "<|tool_call_section_end|>")
    CALL_BEGIN = "<|tool_call_begin|>"
    CALL_END = "<|tool_call_end|>"
    ARGUMENTS = "<|tool_call_argument_begin|>"
    markers = (*SECTION_BEGINS, *SECTION_ENDS, CALL_BEGIN, ARGUMENTS, CALL_END)

    def _calls(self, region: str, output_ended_inside: bool) -> list[ParsedCall]:
        calls = super()._calls(region, output_ended_inside)
        # A client answers each call by its id: an id the model repeats gets a new one.
        ids = [call.id for call in calls]
        return [
            call if call.id not in ids[:position] else ParsedCall(call.name, call.arguments)
            for position, call in enumerate(calls)
        ]

    def _call(self, inner: str) -> ParsedCall | None:
        head, separator, arguments = inner.partition(self.ARGUMENTS)
        model_id = head.strip()
        name, colon, index = model_id.removeprefix("functions.").rpartition(":")
        if not separator or not colon or not (index.isascii() and index.isdigit()):
            return None
        if not _FUNCTION_NAME.fullmatch(name):
            return None
        call = _object_call(name, arguments)
        return None if call is None else ParsedCall(call.name, call.arguments, model_id)


def _object_call(name: str, arguments: str) -> ParsedCall | None:
    """A call of ``name`` when ``arguments`` is a JSON object; else None (not a call)."""
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict):
        return None
    return ParsedCall(name, _arguments_text(value))


class _Glm45Reader(_HermesReader):
    """GLM-4.5's and GLM-4.6's calls, in ``<tool_call>`` blocks as Hermes' (content around
    them read the same way): the function's name, then each argument as a key and a value::

        <tool_call>get_weather
        <arg_key>city</arg_key>
        <arg_value>Beijing</arg_value>
        </tool_call>

    A value's text takes the type its tool's schema gives it, as Qwen3-Coder's do
    (``_typed_value``); a string is kept as written, since the model writes it inline with
    no layout around it. A block that holds anything but a name and whole key/value pairs
    (one cut off by the output's end, say) is not a call and stays content."""

    KEY_START = "<arg_key>"
    KEY_END = "</arg_key>"
    VALUE_START = "<arg_value>"
    VALUE_END = "</arg_value>"
    markers = (_HermesReader.START, _HermesReader.END, KEY_START, KEY_END, VALUE_START, VALUE_END)
    ARGUMENT = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>\s*", re.DOTALL)

    def __init__(self, schemas: dict[str, dict[str, Any]]) -> None:
        self._schemas = schemas

    def _call(self, body: str) -> ParsedCall | None:
        arguments_start = body.find(self.KEY_START)
        if arguments_start < 0:
            arguments_start = len(body)  # a call without arguments
        name = body[:arguments_start].strip()
        if not _FUNCTION_NAME.fullmatch(name):
            return None
        properties = self._schemas.get(name, {}).get("properties", {})
        arguments = {}
        position = arguments_start
        while position < len(body):
            argument = self.ARGUMENT.match(body, position)
            if argument is None or not argument.group(1).strip():
                return None
            key = argument.group(1).strip()
            arguments[key] = _typed_value(argument.group(2), properties.get(key))
            position = argument.end()
        return ParsedCall(name, json.dumps(arguments, ensure_ascii=False))


class _MiniMaxM2Reader(_OutputReader):
    """MiniMax-M2's calls: ``<minimax:tool_call>`` blocks of ``<invoke>`` elements, each one
    call, its function and its parameters named in attributes (quoted or not); one block
    may hold several calls::

        <minimax:tool_call>
        <invoke name="get_weather">
        <parameter name="city">Paris</parameter>
        <parameter name="days">3</parameter>
        </invoke>
        </minimax:tool_call>

    A call counts once its ``</invoke>`` is written, so a stream sends each call as soon as
    it is whole, before its block ends; an invoke the output's end cut off is no call (its
    last value may be cut short), as vLLM's ``minimax_m2`` reads it. A value is the text
    between its tags as written: the chat template writes values inline, so whitespace
    there belongs to the value (a file's last newline, a line's indentation). It takes the
    types its tool's schema gives it (``_schema_types``); a parameter the schema does not
    type, of a tool or a function not in the request, stays a string. Text before the
    first block is content, and so is text between or after blocks unless it is only
    whitespace; a block that holds no call stays content as written."""

    START = "<minimax:tool_call>"
    END = "</minimax:tool_call>"
    INVOKE_END = "</invoke>"
    markers = (START, END)
    # A name attribute: double-quoted, single-quoted or bare, as vLLM's reader takes it.
    NAME_ATTRIBUTE = r"""\s+name\s*=\s*(?:"([^"]*)"|'([^']*)'|([^\s>]*))\s*>"""
    INVOKE = re.compile(r"<invoke" + NAME_ATTRIBUTE)
    PARAMETER = re.compile(r"<parameter" + NAME_ATTRIBUTE + r"(.*?)</parameter>", re.DOTALL)

    def __init__(self, schemas: dict[str, dict[str, Any]]) -> None:
        self._schemas = schemas

    def parse(self, text: str, final: bool) -> ParsedOutput:
        content: list[str] = []
        calls: list[ParsedCall] = []
        position = 0
        after_calls = False  # whitespace after a block of calls is layout, not content
        while True:
            start = text.find(self.START, position)
            if start < 0:
                tail = text[position:]
                if not final:  # held back: the start of a block may be arriving
                    tail = tail[: len(tail) - partial_marker_chars(tail, self.START)]
                if not (after_calls and not tail.strip()):
                    content.append(tail)
                break
            segment = text[position:start]
            if not (after_calls and not segment.strip()):
                content.append(segment)
            body_start = start + len(self.START)
            end = text.find(self.END, body_start)
            closed = end >= 0
            block_calls = self._calls(text[body_start:end] if closed else text[body_start:])
            if block_calls:
                calls.extend(block_calls)
                after_calls = True
            elif closed:
                content.append(text[start : end + len(self.END)])
            elif final:  # the output ended inside a block without a call: all content
                content.append(text[start:])
            if not closed:
                break  # the rest is the open block's: its next call may be arriving
            position = end + len(self.END)
        return ParsedOutput("".join(content), calls)

    def _calls(self, body: str) -> list[ParsedCall]:
        """The block's whole invokes that are calls; what follows the last ``</invoke>``
        is an invoke still being written (or cut off), which more text cannot change."""
        calls = []
        for invoke in body.split(self.INVOKE_END)[:-1]:
            call = self._call(invoke)
            if call is not None:
                calls.append(call)
        return calls

    def _call(self, invoke: str) -> ParsedCall | None:
        header = self.INVOKE.search(invoke)
        if header is None:
            return None
        name = next(group for group in header.groups() if group is not None).strip()
        if not _FUNCTION_NAME.fullmatch(name):
            return None
        properties = self._schemas.get(name, {}).get("properties", {})
        arguments = {}
        for parameter in self.PARAMETER.finditer(invoke, header.end()):
            key = next(group for group in parameter.groups()[:3] if group is not None).strip()
            if not key:
                continue  # a value with no name is no argument
            kinds = _schema_types(properties.get(key)) or ["string"]
            arguments[key] = _typed_value(parameter.group(4), {"type": kinds})
        return ParsedCall(name, json.dumps(arguments, ensure_ascii=False))


class _HarmonyReader(_OutputReader):
    """gpt-oss's calls, messages of OpenAI's harmony format (``harmony.py``) addressed
    ``to=functions.NAME``, the recipient before ``<|channel|>`` or after it::

        <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}

    Each is a call of NAME whose arguments are its body as written (JSON; the open one's
    grows while it streams). The final channel's messages and the preambles (commentary
    addressed to nobody) are content, one a line; the thinking (the analysis channel) is
    neither, as in vLLM's ``openai`` parser: ``--reasoning-parser openai_gptoss`` reports
    it. The reader takes the whole output (``reads_whole_output``), so it reads the same
    with and without that reasoning parser."""

    markers = harmony.MARKERS
    reads_whole_output = True

    def parse(self, text: str, final: bool) -> ParsedOutput:
        messages = harmony.read_messages(text, final)
        calls = [
            ParsedCall(message.function_name, message.text)
            for message in messages
            if message.function_name is not None
        ]
        return ParsedOutput(harmony.content_text(messages), calls)


def _typed_value(text: str, schema: Any) -> Any:
    """A parameter's text as its JSON schema types it (``_Qwen3CoderReader``,
    ``_Glm45Reader``, ``_MiniMaxM2Reader``)."""
    kinds = schema.get("type") if isinstance(schema, dict) else None
    kinds = [kinds] if isinstance(kinds, str) else list(kinds or [])
    if kinds == ["string"] or (isinstance(schema, dict) and "enum" in schema and not kinds):
        return text
    stripped = text.strip()
    if "null" in kinds and stripped.lower() == "null":
        return None
    if "boolean" in kinds and stripped.lower() in ("true", "false"):
        return stripped.lower() == "true"
    if "integer" in kinds:
        try:
            return int(stripped)
        except ValueError:
            pass
    if "number" in kinds:
        try:
            number = float(stripped)
            return int(number) if number.is_integer() and "." not in stripped else number
        except ValueError:
            pass
    try:
        value = json.loads(stripped)
    except (ValueError, RecursionError):
        try:
            value = ast.literal_eval(stripped)  # Python's literals (True, single quotes)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return text
    if kinds and "string" in kinds and not isinstance(value, (dict, list)):
        return text
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return text
    return value


def _schema_types(schema: Any) -> list[str]:
    """The JSON types a parameter's schema allows, as vLLM's ``minimax_m2`` reads them: its
    ``type`` (one or a list), the types of its ``enum``'s values, and those of its
    ``anyOf`` / ``oneOf`` / ``allOf`` alternatives (``{"anyOf": [{"type": "integer"},
    {"type": "null"}]}`` is an integer or null); none when the schema says nothing of them."""
    if not isinstance(schema, dict):
        return []
    kinds = schema.get("type")
    found = [kinds] if isinstance(kinds, str) else []
    if isinstance(kinds, list):
        found += [kind for kind in kinds if isinstance(kind, str)]
    values = schema.get("enum")
    found += [_json_type(value) for value in (values if isinstance(values, list) else [])]
    for key in ("anyOf", "oneOf", "allOf"):
        alternatives = schema.get(key)
        for alternative in alternatives if isinstance(alternatives, list) else []:
            found += _schema_types(alternative)
    return list(dict.fromkeys(found))  # each once, in the schema's order


def _json_type(value: Any) -> str:
    """The JSON type of a value an ``enum`` lists."""
    if value is None:
        return "null"
    if isinstance(value, bool):  # before int: a bool is an int to Python
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, (list, tuple)):
        return "array"
    if isinstance(value, dict):
        return "object"
    return "string"
