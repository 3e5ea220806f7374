"""The ``pythonic`` reader (and ``llama4_pythonic``): an output that is a Python list of
calls."""

from __future__ import annotations

import ast
import json

from pagedserve.frontend.tool_parsers.base import OutputReader, ParsedCall, ParsedOutput


class PythonicReader(OutputReader):
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
