"""The readers of outputs that are JSON calls and nothing else: ``llama3_json`` (and
``llama4_json``: objects separated by ``;``), and the JSON arrays of ``granite`` and
``phi4_mini_json``."""

from __future__ import annotations

from typing import Any

from pagedserve.frontend.tool_parsers.base import (
    JSON_DECODER,
    WHITESPACE,
    OutputReader,
    ParsedCall,
    ParsedOutput,
    arguments_text,
    skip,
)


class Llama3JsonReader(OutputReader):
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
        position = skip(body, 0, WHITESPACE)
        while position < len(body):
            try:
                item, position = JSON_DECODER.raw_decode(body, position)
            except ValueError:
                return ParsedOutput(text)
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                return ParsedOutput(text)
            arguments = item.get("parameters", item.get("arguments", {}))
            if not isinstance(arguments, (dict, str)):
                return ParsedOutput(text)
            calls.append(ParsedCall(item["name"], arguments_text(arguments)))
            position = skip(body, position, WHITESPACE + ";")
        if not calls:
            return ParsedOutput(text)
        return ParsedOutput("", calls)

    def _looks_like_calls(self, stripped: str) -> bool:
        return stripped.startswith("{") or stripped.startswith(self.PYTHON_TAG)


class JsonArrayReader(OutputReader):
    """An output that is (after whitespace, and one of ``MARKERS``) a JSON array of
    ``{"name", "arguments"}`` objects and nothing more: IBM Granite 3.x's calls (after
    3.0's ``<|tool_call|>`` token or 3.1's ``<tool_call>`` text, or none), Phi-4-mini's
    (``functools[...]``). Read when the output is complete (the same text could still turn
    out not to be calls); anything else is content."""

    MARKERS: tuple[str, ...] = ()
    MARKER_REQUIRED = False

    def __init__(self, schemas: dict[str, dict[str, Any]] | None = None) -> None:
        super().__init__(schemas)
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
            items, position = JSON_DECODER.raw_decode(body)
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
            calls.append(ParsedCall(item["name"], arguments_text(arguments)))
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


class GraniteReader(JsonArrayReader):
    MARKERS = ("<|tool_call|>", "<tool_call>")


class Phi4MiniReader(JsonArrayReader):
    MARKERS = ("functools",)
    MARKER_REQUIRED = True
