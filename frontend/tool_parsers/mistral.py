"""The ``mistral`` reader: Mistral's calls after its ``[TOOL_CALLS]`` token, a JSON array
or (v11 tokenizer on) ``name[ARGS]{...}`` calls."""

from __future__ import annotations

from pagedserve.frontend.tool_parsers.base import (
    FUNCTION_NAME,
    JSON_DECODER,
    WHITESPACE,
    OutputReader,
    ParsedCall,
    ParsedOutput,
    arguments_text,
    partial_marker_chars,
    skip,
)


class MistralReader(OutputReader):
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
        first = segments[0].lstrip(WHITESPACE)
        if first.startswith("[") or (not first and not final and len(segments) == 1):
            return self._array_calls(first)
        calls = []
        for segment in segments:
            name, separator, rest = segment.partition(self.ARGS)
            name = name.strip()
            if not separator or not FUNCTION_NAME.fullmatch(name):
                break  # still being written, or not a call
            try:
                arguments, _end = JSON_DECODER.raw_decode(rest, skip(rest, 0, WHITESPACE))
            except ValueError:
                break
            if not isinstance(arguments, dict):
                break
            calls.append(ParsedCall(name, arguments_text(arguments)))
        return calls

    @staticmethod
    def _array_calls(body: str) -> list[ParsedCall]:
        calls: list[ParsedCall] = []
        position = 1
        while True:
            position = skip(body, position, WHITESPACE + ",")
            try:
                item, position = JSON_DECODER.raw_decode(body, position)
            except ValueError:
                return calls
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                return calls
            arguments = item.get("arguments", {})
            if not isinstance(arguments, (dict, str)):
                return calls
            calls.append(ParsedCall(item["name"], arguments_text(arguments)))
