"""The ``kimi_k2`` reader: Kimi K2's calls in a section of its marker tokens, each with
the model's own id."""

from __future__ import annotations

from pagedserve.frontend.tool_parsers.base import (
    FUNCTION_NAME,
    ParsedCall,
    SectionReader,
    object_call,
)


class KimiK2Reader(SectionReader):
    """Kimi K2's calls, a section of marker tokens after any content (whitespace may stand
    between the markers)::

        <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0
        <|tool_call_argument_begin|>{"city": "Beijing"}<|tool_call_end|><|tool_calls_section_end|>

    A call's id is ``functions.NAME:INDEX`` (some outputs leave out ``functions.``), its
    arguments a JSON object; some checkpoints spell the section's markers
    ``<|tool_call_section_begin|>`` / ``<|tool_call_section_end|>``. Content and calls read
    as ``SectionReader`` says. A call keeps the model's id, as vLLM's ``kimi_k2`` reports
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
        if not FUNCTION_NAME.fullmatch(name):
            return None
        call = object_call(name, arguments)
        return None if call is None else ParsedCall(call.name, call.arguments, model_id)
