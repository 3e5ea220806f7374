"""The ``openai`` reader: gpt-oss's calls, harmony messages addressed to a function."""

from __future__ import annotations

from pagedserve.frontend import harmony
from pagedserve.frontend.tool_parsers.base import OutputReader, ParsedCall, ParsedOutput


class HarmonyReader(OutputReader):
    """gpt-oss's calls, messages of OpenAI's harmony format (``harmony.py``) addressed
    ``to=functions.NAME``, the recipient before ``<|channel|>`` or after it::

        <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}

    Each is a call of NAME whose arguments are its body as written (JSON; the open one's
    grows while it streams). The final channel's messages and the preambles (commentary
    addressed to nobody) are content, one a line; the thinking (the analysis channel) is
    neither, as in vLLM's ``openai`` parser: ``--reasoning-parser openai_gptoss`` reports
    it. The reader takes the whole output (``reads_whole_output``), so it reads the same
    with and without that reasoning parser."""

    markers = harmony.MARKERS
    reads_whole_output = True

    def parse(self, text: str, final: bool) -> ParsedOutput:
        messages = harmony.read_messages(text, final)
        calls = [
            ParsedCall(message.function_name, message.text)
            for message in messages
            if message.function_name is not None
        ]
        return ParsedOutput(harmony.content_text(messages), calls)
