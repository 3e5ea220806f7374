"""The ``qwen3_coder`` and ``seed_oss`` readers: Qwen3-Coder's XML calls in Hermes'
``<tool_call>`` blocks, and the same calls in Seed-OSS's ``<seed:tool_call>`` blocks."""

from __future__ import annotations

import json
import re

from pagedserve.frontend.tool_parsers.base import FUNCTION_NAME, ParsedCall
from pagedserve.frontend.tool_parsers.hermes import HermesReader
from pagedserve.frontend.tool_parsers.schema_values import typed_value


class Qwen3CoderReader(HermesReader):
    """Qwen3-Coder's XML calls, in ``<tool_call>`` blocks as Hermes' (content around them
    read the same way)::

        <tool_call>
        <function=get_weather>
        <parameter=city>
        Paris
        </parameter>
        </function>
        </tool_call>

    A parameter's text takes the type its tool's schema gives it (a number, a boolean, an
    object or array as JSON; a string as written); a parameter the schema does not type
    is JSON when it reads as JSON, else a string."""

    FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.DOTALL)
    PARAMETER = re.compile(
        r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL
    )

    def _call(self, body: str) -> ParsedCall | None:
        function = self.FUNCTION.search(body)
        if function is None:
            return None
        name = function.group(1).strip()
        if not FUNCTION_NAME.fullmatch(name):
            return None
        properties = self._schemas.get(name, {}).get("properties", {})
        arguments = {}
        for parameter in self.PARAMETER.finditer(function.group(2)):
            key = parameter.group(1).strip()
            value = parameter.group(2)
            # The value sits on lines of its own: one newline each side is layout.
            value = value.removeprefix("\n").removesuffix("\n")
            arguments[key] = typed_value(value, properties.get(key))
        return ParsedCall(name, json.dumps(arguments, ensure_ascii=False))


class SeedOssReader(Qwen3CoderReader):
    """Seed-OSS's calls: Qwen3-Coder's XML in ``<seed:tool_call>`` blocks."""

    START = "<seed:tool_call>"
    END = "</seed:tool_call>"
    markers = (START, END)
