"""OpenAI's harmony format, in which gpt-oss writes its chat outputs: a run of messages,
each a header and a body, read into plain ``HarmonyMessage`` values for
``--reasoning-parser openai_gptoss`` (``reasoning.py``) and ``--tool-call-parser openai``
(``tool_calls.py``).

The chat template's generation prompt ends with ``<|start|>assistant``, so the output
opens with the first message's header; later messages open with ``<|start|>`` again::

    <|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>...
    |-- header -------|           |-- body -------|
    ...commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>

A header names the channel (``analysis``: the thinking; ``final``: the answer;
``commentary``: tool calls, or, addressed to nobody, a preamble meant for the user) and
may name a recipient (``to=functions.NAME``), before ``<|channel|>`` or after it. A body
runs to ``<|end|>``, ``<|call|>`` or ``<|return|>`` (the last two are end-of-sequence
tokens, so they are seldom in the text) or to the output's end (cut off by a length
limit). The markers are special tokens of the o200k_harmony tokenizer: the readers list
them (``MARKERS``) so that the output text keeps them (``skip_special_tokens=False``).

``read_messages(text, final)`` reports only what more text cannot change: a message counts
once its header's ``<|message|>`` is written, and the last characters of an open body are
held back while they may begin the marker that ends it. Several messages of one kind read
as one text, one message a line, as vLLM joins them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

START = "<|start|>"
CHANNEL = "<|channel|>"
MESSAGE = "<|message|>"
CONSTRAIN = "<|constrain|>"
END = "<|end|>"
CALL = "<|call|>"
RETURN = "<|return|>"
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, END, CALL, RETURN)

# What ends a body: its end markers, or, when the model wrote none, the next message.
_BODY_ENDS = (END, CALL, RETURN, START)
_LONGEST_BODY_END = max(len(marker) for marker in _BODY_ENDS)
# How the first header may open (the prompt wrote "<|start|>assistant" before it).
_HEADER_OPENINGS = (CHANNEL, "to=", CONSTRAIN, MESSAGE, START)
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")
_FUNCTIONS = "functions."


@dataclass(frozen=True)
class HarmonyMessage:
    """One message of an output, as far as it is settled."""

    channel: str | None  # "analysis", "commentary", "final"; None: the header names none
    recipient: str | None  # "functions.get_weather", "browser.search"; None: the user
    text: str  # the body (of an open one, what more text cannot change)
    complete: bool  # its body ended (an end marker, or the output's end)
    end_chars: int  # where it ends in the output text, its end marker included

    @property
    def function_name(self) -> str | None:
        """The function the message calls (``to=functions.NAME``); None: not a call."""
        if self.recipient is None or not self.recipient.startswith(_FUNCTIONS):
            return None
        return self.recipient[len(_FUNCTIONS) :]

    @property
    def is_reasoning(self) -> bool:
        """The thinking: the analysis channel, a call made from it aside."""
        return self.channel == "analysis" and self.function_name is None

    @property
    def is_content(self) -> bool:
        """Text for the user: the final channel, a preamble (commentary addressed to
        nobody), or a message whose header names no channel."""
        return self.recipient is None and self.channel in (None, "final", "commentary")


def read_messages(text: str, final: bool) -> list[HarmonyMessage]:
    """The messages of an output ``text``; ``final``: the output ended (otherwise only what
    more text cannot change). An output that does not open with a header (structured
    output holds from the first token, so a constrained one is bare JSON) is one message
    without a channel: content."""
    opening = text.lstrip()
    if not final and (not opening or any(o.startswith(opening) for o in _HEADER_OPENINGS)):
        return []  # the first header may be arriving
    if not opening.startswith(_HEADER_OPENINGS):
        return [HarmonyMessage(None, None, text, final, len(text))]
    # NOTE: a stream reads its whole text again at each delta, as every reader here does;
    # the scans are str.find, linear in the text.
    messages: list[HarmonyMessage] = []
    position = 0
    while True:
        header_end = text.find(MESSAGE, position)
        if header_end < 0:
            return messages  # a header still being written (or cut off: no body)
        header = text[position:header_end]
        body_start = header_end + len(MESSAGE)
        body_end, marker = _body_end(text, body_start)
        if body_end < 0:
            body = text[body_start:]
            if not final:
                body = body[: len(body) - _held_back_chars(body)]
            messages.append(_message(header, body, final, len(text)))
            return messages
        after = body_end + len(marker)
        messages.append(_message(header, text[body_start:body_end], True, after))
        # A <|start|> belongs to the next message's header.
        position = body_end if marker == START else after


def reasoning_text(messages: list[HarmonyMessage]) -> str:
    """The thinking of ``messages``: the analysis channel's texts, one a line."""
    return _joined(messages, lambda message: message.is_reasoning)


def content_text(messages: list[HarmonyMessage]) -> str:
    """The answer of ``messages``: the final channel's texts and the preambles, one a
    line."""
    return _joined(messages, lambda message: message.is_content)


def _joined(messages: list[HarmonyMessage], wanted: Callable[[HarmonyMessage], bool]) -> str:
    # An open message counts once it holds text, so that a stream never sends a line
    # break the output's end could take back (an empty message cut off is none).
    return "\n".join(
        message.text
        for message in messages
        if wanted(message) and (message.complete or message.text)
    )


def _message(header: str, body: str, complete: bool, end_chars: int) -> HarmonyMessage:
    recipient = _RECIPIENT.search(header)
    channel = _CHANNEL_NAME.search(header)
    return HarmonyMessage(
        channel.group(1) if channel else None,
        recipient.group(1) if recipient else None,
        body,
        complete,
        end_chars,
    )


def _body_end(text: str, body_start: int) -> tuple[int, str]:
    """Where the body starting at ``body_start`` ends, and the marker that ends it;
    (-1, "") when none is written yet."""
    found = [(text.find(marker, body_start), marker) for marker in _BODY_ENDS]
    found = [(index, marker) for index, marker in found if index >= 0]
    return min(found) if found else (-1, "")


def _held_back_chars(body: str) -> int:
    """How many characters at the end of an open ``body`` could begin the marker that ends
    it. Each marker holds one ``<``, its first character, so only the last ``<`` can
    begin one."""
    start = body.rfind("<")
    tail = body[start:]
    if start < 0 or len(tail) >= _LONGEST_BODY_END:
        return 0
    return len(tail) if any(marker.startswith(tail) for marker in _BODY_ENDS) else 0
