"""Reasoning parsers (frontend/reasoning.py): thinking apart from the answer for Qwen3's
and DeepSeek-R1's formats, and a stream that adds up to the whole answer."""

from __future__ import annotations

import pytest

from pagedserve.frontend.reasoning import ReasoningParser, ReasoningStream, SplitOutput

QWEN3 = ReasoningParser("qwen3")
DEEPSEEK = ReasoningParser("deepseek_r1")
MISTRAL = ReasoningParser("mistral")

CASES = [
    # (text, qwen3's split, deepseek_r1's split)
    (
        "<think>\nCount the rs.\n</think>\n\nThree.",
        SplitOutput("\nCount the rs.\n", "\n\nThree."),
        SplitOutput("\nCount the rs.\n", "\n\nThree."),
    ),
    # The template opened <think> (R1), or thinking was off (Qwen3): no start tag.
    ("Count them.</think>Three.", SplitOutput("", "Count them.</think>Three."),
     SplitOutput("Count them.", "Three.")),
    ("Just the answer.", SplitOutput("", "Just the answer."), SplitOutput("Just the answer.", "")),
    # Cut short while thinking.
    ("<think>Hmm, let me", SplitOutput("Hmm, let me", ""), SplitOutput("Hmm, let me", "")),
    ("<think></think>Fast.", SplitOutput("", "Fast."), SplitOutput("", "Fast.")),
    # Marker-like text that is not a marker stays where it is.
    ("<thinking> aloud", SplitOutput("", "<thinking> aloud"), SplitOutput("<thinking> aloud", "")),
    ("<think>a </thin b</think>c", SplitOutput("a </thin b", "c"), SplitOutput("a </thin b", "c")),
    ("<", SplitOutput("", "<"), SplitOutput("<", "")),
]  # fmt: skip


@pytest.mark.parametrize(("text", "qwen3", "deepseek"), CASES)
def test_whole_outputs_split_as_each_format_says(text, qwen3, deepseek):
    assert QWEN3.parse(text, final=True) == qwen3
    assert DEEPSEEK.parse(text, final=True) == deepseek


@pytest.mark.parametrize(
    "parser", [QWEN3, DEEPSEEK, MISTRAL], ids=["qwen3", "deepseek_r1", "mistral"]
)
@pytest.mark.parametrize("text", [case[0] for case in CASES])
def test_a_stream_adds_up_to_the_whole_answer(parser, text):
    stream = ReasoningStream(parser)
    reasoning = content = ""
    for end in range(1, len(text) + 1):
        new_reasoning, new_content = stream.feed(text[:end], final=end == len(text))
        reasoning += new_reasoning
        content += new_content
        assert stream.content == content
    assert SplitOutput(reasoning, content) == parser.parse(text, final=True)


def test_markers_are_held_back_while_they_may_be_arriving():
    assert QWEN3.parse("<thi", final=False) == SplitOutput("", "")
    assert QWEN3.parse("<think>abc</th", final=False) == SplitOutput("abc", "")
    assert DEEPSEEK.parse("<th", final=False) == SplitOutput("", "")
    assert DEEPSEEK.parse("plan </thi", final=False) == SplitOutput("plan ", "")
    with pytest.raises(
        ValueError, match="reasoning_parser must be one of qwen3, deepseek_r1, mistral"
    ):
        ReasoningParser("o1")


def test_mistral_thinks_between_its_own_markers_as_qwen3_does():
    """Magistral's format: Qwen3's rule with [THINK] and [/THINK]."""
    for text, _qwen3, _deepseek in CASES:
        mistral_text = text.replace("</think>", "[/THINK]").replace("<think>", "[THINK]")
        want = QWEN3.parse(text, final=True)
        mistral = MISTRAL.parse(mistral_text, final=True)
        # The same split, with the markers that stay in the text written Mistral's way.
        assert mistral.reasoning == want.reasoning.replace("</think>", "[/THINK]")
        assert mistral.content == want.content.replace("</think>", "[/THINK]")
    assert MISTRAL.parse("[THI", final=False) == SplitOutput("", "")
    assert MISTRAL.parse("[THINK]plan[/TH", final=False) == SplitOutput("plan", "")
    assert MISTRAL.parse("<think>x</think>y", final=True) == SplitOutput("", "<think>x</think>y")


class _OneTokenMarkers:
    """A tokenizer whose markers are single tokens (ids 1 and 2), as Qwen3's and
    DeepSeek-R1's are; other text takes a token per character."""

    IDS = {"<think>": 1, "</think>": 2, "[THINK]": 1, "[/THINK]": 2}

    def single_token_id(self, text: str) -> int | None:
        return self.IDS.get(text)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(character) for character in text]


@pytest.mark.parametrize(
    ("parser", "text", "token_ids", "expected"),
    [
        # Counted on the ids: up to and including the closing marker's token.
        (QWEN3, "<think>ab</think>cd", [1, 97, 98, 2, 99, 100], 4),
        (DEEPSEEK, "ab</think>cd", [97, 98, 2, 99, 100], 3),
        # No thinking (Qwen3 with thinking off), or thinking to the end.
        (QWEN3, "just this", [106, 117], 0),
        (DEEPSEEK, "still thinking", [115, 116], 2),
        (QWEN3, "<think>cut", [1, 99, 117], 3),
        # The marker written in pieces: the thinking tokenized again.
        (DEEPSEEK, "ab</think>cd", [ord(c) for c in "ab</think>cd"], 10),
    ],
)
def test_reasoning_tokens_count_the_thinking_and_its_markers(parser, text, token_ids, expected):
    assert parser.num_reasoning_tokens(token_ids, text, _OneTokenMarkers()) == expected
