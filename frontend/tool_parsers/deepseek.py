"""The ``deepseek_v3`` and ``deepseek_v31`` readers: DeepSeek's calls in a section of its
marker tokens, the name and arguments laid out differently in V3 and V3.1."""

from __future__ import annotations

from pagedserve.frontend.tool_parsers.base import (
    FUNCTION_NAME,
    ParsedCall,
    SectionReader,
    object_call,
)


class DeepSeekV3Reader(SectionReader):
    """DeepSeek's calls (V3, R1 and the R1 distills of Qwen and Llama: ``deepseek_v3``;
    V3.1: ``deepseek_v31``), between its marker tokens::

        <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
        ```json
        {"city": "Paris"}
        ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

    Content and calls read as ``SectionReader`` says."""

    CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
    CALLS_END = "<｜tool▁calls▁end｜>"
    SECTION_BEGINS = (CALLS_BEGIN,)
    SECTION_ENDS = (CALLS_END,)
    CALL_BEGIN = "<｜tool▁call▁begin｜>"
    CALL_END = "<｜tool▁call▁end｜>"
    SEPARATOR = "<｜tool▁sep｜>"
    markers = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEPARATOR)

    def _call(self, inner: str) -> ParsedCall | None:
        head, separator, rest = inner.partition(self.SEPARATOR)
        if not separator:
            return None
        name, arguments = self._name_and_arguments(head, rest)
        if not FUNCTION_NAME.fullmatch(name):
            return None
        return object_call(name, arguments)

    @staticmethod
    def _name_and_arguments(head: str, rest: str) -> tuple[str, str]:
        """A call's name and arguments text, from either side of its separator."""
        name, _newline, arguments = rest.partition("\n")
        arguments = arguments.strip().removeprefix("```json").removeprefix("```")
        return name.strip(), arguments.removesuffix("```").strip()


class DeepSeekV31Reader(DeepSeekV3Reader):
    """DeepSeek V3.1's calls: V3's markers, each call's name first and its arguments bare::

    <｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>
    """

    @staticmethod
    def _name_and_arguments(head: str, rest: str) -> tuple[str, str]:
        return head.strip(), rest.strip()
