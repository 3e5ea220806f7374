"""Reasoning models' thinking, apart from their answer, as vLLM's ``--reasoning-parser``
serves it: a chat answer's ``message.reasoning_content`` holds what the model wrote between
``<think>`` and ``</think>``, and ``message.content`` the rest (streams send
``delta.reasoning_content`` then ``delta.content``).

- ``qwen3`` (Qwen3, QwQ): the output thinks when it starts with ``<think>``, until
  ``</think>`` or its end; an output that does not start so (thinking switched off) is all
  answer.
- ``deepseek_r1`` (DeepSeek-R1 and its distills, whose chat template opens the ``<think>``
  itself): the output thinks from its start (a ``<think>`` there is skipped) until
  ``</think>``; one that never closes it is all thinking.
- ``mistral`` (Magistral): as ``qwen3``, between ``[THINK]`` and ``[/THINK]``.
- ``seed_oss`` (ByteDance's Seed-OSS): as ``deepseek_r1``, between ``<seed:think>`` and
  ``</seed:think>`` (its thinking budget's reflections stay in the thinking).
- ``glm45`` (GLM-4.5, GLM-4.6): as ``qwen3``, with whitespace before the ``<think>`` in
  neither part: the model writes ``\n<think>`` (its template puts the newline after the
  assistant's header), and ``<think></think>`` in the prompt when thinking is off.
- ``granite`` (IBM Granite 3.2 and later, asked to think): as ``qwen3``, with phrases for
  markers: the thinking follows "Here is my thought process:" and the answer "Here is my
  response:" (either written "Here's" too); an output that does not start with the first
  is all answer.
- ``minimax_m2`` (MiniMax-M2, whose chat template opens the ``<think>`` itself): as
  ``deepseek_r1``.
- ``minimax_m2_append_think`` (MiniMax-M2, as its own deployment guide serves it): no
  split: the whole output is answer, with the template's ``<think>`` put back before it,
  so a client that sends the answer back in later turns keeps the thinking there (MiniMax
  asks for it; the template reads it from the content).
- ``openai_gptoss`` (gpt-oss, whose output is messages in OpenAI's harmony format,
  ``harmony.py``): the analysis channel's messages are the thinking, the final channel's
  and the preambles (commentary addressed to nobody) the answer, one message a line, as
  vLLM joins them; the markers and channel names are in neither. A message that calls a
  function is in neither (``--tool-call-parser openai`` reads it, from the whole output).
  An output cut off while it thinks is all thinking.

Like tool calls (``tool_calls.py``), one reading serves whole answers and streams:
``parse(text, final)`` reports only what more text cannot change, so a stream's deltas add
up to the whole answer. The tool-call reader then reads the answer part only (harmony's,
``--tool-call-parser openai``, the whole output: its calls sit among the thinking messages).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedserve.frontend import harmony
from pagedserve.frontend.tool_parsers.base import partial_marker_chars

if TYPE_CHECKING:
    from pagedserve.frontend.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

THINK_START = "<think>"
THINK_END = "</think>"


# Granite's markers are phrases, and quantized Granites write "Here's" for "Here is".
GRANITE_THINKING = ("Here is my thought process:", "Here's my thought process:")
GRANITE_ANSWER = ("Here is my response:", "Here's my response:")


@dataclass(frozen=True)
class _Format:
    starts: tuple[str, ...]  # the markers that open the thinking (any one)
    ends: tuple[str, ...]  # the markers that close it (the first one written)
    # The chat template opens the thinking in the prompt: the output thinks from its start.
    opened_by_template: bool = False
    # Whitespace before the opening marker is layout, in neither part (GLM-4.5's "\n<think>").
    skips_leading_whitespace: bool = False
    # The thinking stays in the answer, markers and all, after the opening marker the
    # template wrote (vLLM's minimax_m2_append_think): clients that keep it in the history.
    keeps_thinking_in_answer: bool = False

    @property
    def markers(self) -> tuple[str, ...]:
        return (*self.starts, *self.ends)


_FORMATS = {
    "qwen3": _Format((THINK_START,), (THINK_END,)),
    "deepseek_r1": _Format((THINK_START,), (THINK_END,), opened_by_template=True),
    "mistral": _Format(("[THINK]",), ("[/THINK]",)),
    "seed_oss": _Format(("<seed:think>",), ("</seed:think>",), opened_by_template=True),
    "glm45": _Format((THINK_START,), (THINK_END,), skips_leading_whitespace=True),
    "granite": _Format(GRANITE_THINKING, GRANITE_ANSWER, skips_leading_whitespace=True),
    "minimax_m2": _Format((THINK_START,), (THINK_END,), opened_by_template=True),
    "minimax_m2_append_think": _Format(
        (THINK_START,), (THINK_END,), opened_by_template=True, keeps_thinking_in_answer=True
    ),
}
# gpt-oss: channels of OpenAI's harmony format, not a pair of markers (harmony.py).
HARMONY = "openai_gptoss"
REASONING_PARSERS = (*_FORMATS, HARMONY)


@dataclass(frozen=True)
class SplitOutput:
    reasoning: str
    content: str


# The whitespace a model may write before opening its thinking, as single tokens.
_LEAD_WHITESPACE = ("\n", "\n\n", " ")


def thinking_token_ids(
    name: str, tokenizer: Tokenizer | None
) -> tuple[int | None, list[int] | None, list[int] | None]:
    """(think_start_token_id, think_end_token_ids, think_lead_token_ids) for
    ``GrammarVocabulary``: the tokens a grammar waits behind under parser ``name``
    (``scheduler/structured_output.py``'s ``ThinkingGate``): ``</think>``'s one token, or
    harmony's final header, ``<|channel|>final<|message|>`` as the model writes it; the
    whitespace tokens that may come before ``<think>`` where the parser skips them (GLM-4.5
    writes a newline first). (None, None, None) when the vocabulary does not hold the markers
    as single tokens (Granite's are phrases): grammars then constrain the thinking too."""
    if name not in REASONING_PARSERS:
        raise ValueError(
            f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, got {name!r}"
        )
    if tokenizer is None:
        return None, None, None
    if name == HARMONY:
        # The output thinks from its start (the template's prompt ends "<|start|>assistant").
        channel = tokenizer.single_token_id(harmony.CHANNEL)
        message = tokenizer.single_token_id(harmony.MESSAGE)
        if channel is None or message is None:
            logger.warning(
                "reasoning_parser %s: the tokenizer does not hold %s and %s as single tokens; "
                "structured output will constrain the thinking too",
                name,
                harmony.CHANNEL,
                harmony.MESSAGE,
            )
            return None, None, None
        final = tokenizer.encode("final", add_special_tokens=False)
        return None, [channel, *final, message], None
    markers = _FORMATS[name]
    if len(markers.starts) > 1 or len(markers.ends) > 1:
        # The gate waits for one token; Granite's phrases, two spellings each, are none.
        logger.warning(
            "reasoning_parser %s: its markers are phrases, not single tokens; structured "
            "output will constrain the thinking too",
            name,
        )
        return None, None, None
    start = tokenizer.single_token_id(markers.starts[0])
    end = tokenizer.single_token_id(markers.ends[0])
    if end is None or (not markers.opened_by_template and start is None):
        logger.warning(
            "reasoning_parser %s: the tokenizer does not hold %s and %s as single tokens; "
            "structured output will constrain the thinking too",
            name,
            markers.starts[0],
            markers.ends[0],
        )
        return None, None, None
    # DeepSeek-R1's template opens the thinking in the prompt: it thinks from the start.
    if markers.opened_by_template:
        return None, [end], None
    lead = None
    if markers.skips_leading_whitespace:
        found = {tokenizer.single_token_id(text) for text in _LEAD_WHITESPACE} - {None}
        lead = sorted(found) or None
    return start, [end], lead


class ReasoningParser:
    """Splits a choice's output into its thinking and its answer."""

    def __init__(self, name: str) -> None:
        if name not in REASONING_PARSERS:
            raise ValueError(
                f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, got {name!r}"
            )
        self.name = name
        # None: harmony's channels (gpt-oss), read by harmony.py.
        self._format = _FORMATS.get(name)
        self.markers: tuple[str, ...] = (
            harmony.MARKERS if self._format is None else self._format.markers
        )

    def parse(self, text: str, final: bool) -> SplitOutput:
        """The thinking and the answer in ``text``; with ``final=False`` only what more
        text cannot change (a possible marker start is held back)."""
        if self._format is None:
            messages = harmony.read_messages(text, final)
            return SplitOutput(harmony.reasoning_text(messages), harmony.content_text(messages))
        if self._format.keeps_thinking_in_answer:
            return SplitOutput("", self._format.starts[0] + text)
        return self._split(text, final)

    def _split(self, text: str, final: bool) -> SplitOutput:
        """``parse`` by the format's markers: the thinking between them, the answer after."""
        assert self._format is not None
        markers = self._format
        lead_chars = len(text) - len(text.lstrip()) if markers.skips_leading_whitespace else 0
        rest = text[lead_chars:]
        start = next((marker for marker in markers.starts if rest.startswith(marker)), None)
        if start is None:
            if not final and any(marker.startswith(rest) for marker in markers.starts):
                return SplitOutput("", "")  # an opening marker may be arriving
            if not markers.opened_by_template:
                return SplitOutput("", text)  # it does not think
        body_start = 0 if start is None else lead_chars + len(start)
        ends = [(text.find(marker, body_start), marker) for marker in markers.ends]
        end, end_marker = min(((at, marker) for at, marker in ends if at >= 0), default=(-1, ""))
        if end < 0:
            reasoning = text[body_start:]
            if not final:
                held = max(partial_marker_chars(reasoning, marker) for marker in markers.ends)
                reasoning = reasoning[: len(reasoning) - held]
            return SplitOutput(reasoning, "")
        return SplitOutput(text[body_start:end], text[end + len(end_marker) :])

    def num_reasoning_tokens(
        self, token_ids: list[int], text: str, tokenizer: Tokenizer | None
    ) -> int:
        """How many of an output's tokens (``token_ids``, read as ``text``) are its thinking,
        the markers included: the Responses API's ``reasoning_tokens``. Counted on the ids
        when the closing marker is one token of the vocabulary (Qwen3, DeepSeek-R1,
        Magistral, GLM-4.5, MiniMax-M2); else (Granite's phrases) the thinking's text is
        tokenized again, which can differ from the ids the model chose by a token or two.
        Harmony's thinking (gpt-oss) runs from the output's start to the end of its last
        analysis message, and is tokenized again. Thinking kept in the answer
        (``minimax_m2_append_think``) counts all the same: the model spent those tokens
        thinking."""
        if self._format is None:
            return self._harmony_reasoning_tokens(token_ids, text, tokenizer)
        split = self._split(text, final=True)
        if not split.reasoning and split.content == text:
            return 0  # no thinking (qwen3 and mistral: the output did not open it)
        # The answer follows the closing marker: what comes before it is the thinking.
        thinking = text[: len(text) - len(split.content)]
        end_marker = next(
            (marker for marker in self._format.ends if thinking.endswith(marker)), None
        )
        if end_marker is None:
            return len(token_ids)  # it thought to the end
        end_id = None if tokenizer is None else tokenizer.single_token_id(end_marker)
        if end_id is not None and end_id in token_ids:
            return token_ids.index(end_id) + 1
        if tokenizer is None:
            return 0
        return min(len(token_ids), len(tokenizer.encode(thinking, add_special_tokens=False)))

    @staticmethod
    def _harmony_reasoning_tokens(
        token_ids: list[int], text: str, tokenizer: Tokenizer | None
    ) -> int:
        thinking = [m for m in harmony.read_messages(text, final=True) if m.is_reasoning]
        if not thinking:
            return 0
        end_chars = thinking[-1].end_chars
        if end_chars == len(text):
            return len(token_ids)  # it thought to the end
        if tokenizer is None:
            return 0
        # The markers are special tokens: they tokenize again as the ids they were.
        thinking_text = text[:end_chars]
        return min(len(token_ids), len(tokenizer.encode(thinking_text, add_special_tokens=False)))


class ReasoningStream:
    """One streamed choice's thinking and answer: what each chunk adds to either."""

    def __init__(self, parser: ReasoningParser) -> None:
        self._parser = parser
        self._reasoning_chars = 0
        #: The answer so far (settled), which the tool-call reader reads in turn.
        self.content = ""

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        """New thinking and new answer text, given the choice's whole output so far."""
        split = self._parser.parse(text, final)
        reasoning = split.reasoning[self._reasoning_chars :]
        self._reasoning_chars = len(split.reasoning)
        content = split.content[len(self.content) :]
        self.content = split.content
        return reasoning, content
