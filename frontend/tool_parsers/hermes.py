"""The ``hermes`` reader: Hermes' and Qwen's ``<tool_call>`` blocks of JSON calls, and the
base of the formats that write other calls in such blocks (``qwen3_coder.py``,
``glm45.py``)."""

from __future__ import annotations

import json

from pagedserve.frontend.tool_parsers.base import (
    OutputReader,
    ParsedCall,
    ParsedOutput,
    arguments_text,
    partial_marker_chars,
)


class HermesReader(OutputReader):
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
        return ParsedCall(item["name"], arguments_text(arguments))
