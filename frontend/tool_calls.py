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

The readers of the models' own formats (tool_choice "auto") live in ``tool_parsers/``, one
module per format; ``tool_parsers/registry.py`` maps each ``--tool-call-parser`` name to one.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from pagedserve.frontend.outputs import ToolCall
from pagedserve.frontend.request_contract import decode_json
from pagedserve.frontend.tool_parsers.base import (
    FUNCTION_NAME,
    JSON_DECODER,
    WHITESPACE,
    OutputReader,
    ParsedCall,
    ParsedOutput,
    arguments_text,
    skip,
)
from pagedserve.frontend.tool_parsers.registry import TOOL_CALL_PARSERS, new_reader

TOOL_CHOICE_MODES = ("none", "auto", "required")

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
        if not isinstance(function_name, str) or not FUNCTION_NAME.fullmatch(function_name):
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

    def _output_reader(self, tool_call_parser: str | None) -> OutputReader:
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
        return new_reader(tool_call_parser, {tool.name: tool.parameters for tool in self.tools})

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


# ---------------------------------------------------------------- tool_choice's own readers


class _TextReader(OutputReader):
    """tool_choice "none": all content."""

    def parse(self, text: str, final: bool) -> ParsedOutput:
        return ParsedOutput(text)


class _NamedReader(OutputReader):
    """A named function: the whole output is its arguments (growing while it streams)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self._name = name

    def parse(self, text: str, final: bool) -> ParsedOutput:
        return ParsedOutput("", [ParsedCall(self._name, text)])


class _RequiredReader(OutputReader):
    """tool_choice "required": the (constrained) output is a JSON array of
    ``{"name", "parameters"}`` objects; each call counts once its object is complete. An
    output with no complete call (cut short) stays content, so nothing is lost."""

    def parse(self, text: str, final: bool) -> ParsedOutput:
        calls: list[ParsedCall] = []
        position = skip(text, 0, WHITESPACE)
        if text.startswith("[", position):
            position += 1
            while True:
                position = skip(text, position, WHITESPACE + ",")
                try:
                    item, position = JSON_DECODER.raw_decode(text, position)
                except ValueError:
                    break
                if not (
                    isinstance(item, dict)
                    and isinstance(item.get("name"), str)
                    and isinstance(item.get("parameters"), dict)
                ):
                    break
                calls.append(ParsedCall(item["name"], arguments_text(item["parameters"])))
        if final and not calls:
            return ParsedOutput(text)
        return ParsedOutput("", calls)
