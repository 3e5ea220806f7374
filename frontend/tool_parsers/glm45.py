"""The ``glm45`` reader: GLM-4.5's and GLM-4.6's ``<tool_call>`` blocks of a name and
``<arg_key>`` / ``<arg_value>`` pairs."""

from __future__ import annotations

import json
import re

from pagedserve.frontend.tool_parsers.base import FUNCTION_NAME, ParsedCall
from pagedserve.frontend.tool_parsers.hermes import HermesReader
from pagedserve.frontend.tool_parsers.schema_values import typed_value


class Glm45Reader(HermesReader):
    """GLM-4.5's and GLM-4.6's calls, in ``<tool_call>`` blocks as Hermes' (content around
    them read the same way): the function's name, then each argument as a key and a value::

        <tool_call>get_weather
        <arg_key>city</arg_key>
        <arg_value>Beijing</arg_value>
        </tool_call>

    A value's text takes the type its tool's schema gives it, as Qwen3-Coder's do
    (``typed_value``); a string is kept as written, since the model writes it inline with
    no layout around it. A block that holds anything but a name and whole key/value pairs
    (one cut off by the output's end, say) is not a call and stays content."""

    KEY_START = "<arg_key>"
    KEY_END = "</arg_key>"
    VALUE_START = "<arg_value>"
    VALUE_END = "</arg_value>"
    markers = (HermesReader.START, HermesReader.END, KEY_START, KEY_END, VALUE_START, VALUE_END)
    ARGUMENT = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>\s*", re.DOTALL)

    def _call(self, body: str) -> ParsedCall | None:
        arguments_start = body.find(self.KEY_START)
        if arguments_start < 0:
            arguments_start = len(body)  # a call without arguments
        name = body[:arguments_start].strip()
        if not FUNCTION_NAME.fullmatch(name):
            return None
        properties = self._schemas.get(name, {}).get("properties", {})
        arguments = {}
        position = arguments_start
        while position < len(body):
            argument = self.ARGUMENT.match(body, position)
            if argument is None or not argument.group(1).strip():
                return None
            key = argument.group(1).strip()
            arguments[key] = typed_value(argument.group(2), properties.get(key))
            position = argument.end()
        return ParsedCall(name, json.dumps(arguments, ensure_ascii=False))
