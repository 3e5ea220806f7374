"""What every tool-call reader shares: the calls it finds (``ParsedCall``,
``ParsedOutput``), its base class (``OutputReader``), the base of the formats that write
their calls in a section of marker tokens (``SectionReader``), and the helpers that find
markers and read JSON."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

# OpenAI's rule for a function name.
FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
JSON_DECODER = json.JSONDecoder()
WHITESPACE = " \t\n\r"


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text, as OpenAI reports it
    id: str | None = None  # the model's own id for the call, where its format writes one


@dataclass(frozen=True)
class ParsedOutput:
    content: str
    calls: list[ParsedCall] = field(default_factory=list)


class OutputReader:
    """Reads a choice's output into content and calls (``ToolCalling.parse``)."""

    # Texts the model writes around calls (which must survive detokenization).
    markers: tuple[str, ...] = ()
    # Reads the whole output, thinking included (``ToolCalling.reads_whole_output``).
    reads_whole_output = False

    def __init__(self, schemas: dict[str, dict[str, Any]] | None = None) -> None:
        # Each tool's parameters schema, by name: the formats that write arguments as text
        # type them by it (``schema_values.py``).
        self._schemas = schemas or {}

    def parse(self, text: str, final: bool) -> ParsedOutput:
        raise NotImplementedError


def arguments_text(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def skip(text: str, position: int, characters: str) -> int:
    while position < len(text) and text[position] in characters:
        position += 1
    return position


def partial_marker_chars(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could begin ``marker``."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


class SectionReader(OutputReader):
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
        start, begin = first_marker(text, self.SECTION_BEGINS)
        if start < 0:
            if final:
                return ParsedOutput(text)
            held = max(partial_marker_chars(text, marker) for marker in self.SECTION_BEGINS)
            return ParsedOutput(text[: len(text) - held])
        body = text[start + len(begin) :]
        end, section_end = first_marker(body, self.SECTION_ENDS)
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


def first_marker(text: str, markers: tuple[str, ...]) -> tuple[int, str]:
    """Where the first of ``markers`` in ``text`` is, and which; (-1, "") when none is."""
    found = [(text.find(marker), marker) for marker in markers if marker in text]
    return min(found) if found else (-1, "")


def object_call(name: str, arguments: str) -> ParsedCall | None:
    """A call of ``name`` when ``arguments`` is a JSON object; else None (not a call)."""
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict):
        return None
    return ParsedCall(name, arguments_text(value))
