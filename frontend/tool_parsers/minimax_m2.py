"""The ``minimax_m2`` reader: MiniMax-M2's ``<minimax:tool_call>`` blocks of ``<invoke>``
calls."""

from __future__ import annotations

import json
import re

from pagedserve.frontend.tool_parsers.base import (
    FUNCTION_NAME,
    OutputReader,
    ParsedCall,
    ParsedOutput,
    partial_marker_chars,
)
from pagedserve.frontend.tool_parsers.schema_values import schema_types, typed_value


class MiniMaxM2Reader(OutputReader):
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
    types its tool's schema gives it (``schema_types``); a parameter the schema does not
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
        if not FUNCTION_NAME.fullmatch(name):
            return None
        properties = self._schemas.get(name, {}).get("properties", {})
        arguments = {}
        for parameter in self.PARAMETER.finditer(invoke, header.end()):
            key = next(group for group in parameter.groups()[:3] if group is not None).strip()
            if not key:
                continue  # a value with no name is no argument
            kinds = schema_types(properties.get(key)) or ["string"]
            arguments[key] = typed_value(parameter.group(4), {"type": kinds})
        return ParsedCall(name, json.dumps(arguments, ensure_ascii=False))
