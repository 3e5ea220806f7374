"""Reasoning parsers (frontend/reasoning.py): thinking apart from the answer for each
format (Qwen3's, DeepSeek-R1's, MiniMax-M2's, ...), and a stream that adds up to the whole
answer."""

from __future__ import annotations

import re

import pytest

from pagedserve.frontend.reasoning import (
    ReasoningParser,
    ReasoningStream,
    SplitOutput,
    thinking_token_ids,
)

QWEN3 = ReasoningParser("qwen3")
DEEPSEEK = ReasoningParser("deepseek_r1")
MISTRAL = ReasoningParser("mistral")
GLM45 = ReasoningParser("glm45")
GRANITE = ReasoningParser("granite")
MINIMAX = ReasoningParser("minimax_m2")
MINIMAX_APPEND = ReasoningParser("minimax_m2_append_think")

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


GLM45_CASES = [
    # (text, the split): GLM-4.5 writes a newline before its <think>, which is layout.
    ("\n<think>Count the rs.</think>\nThree.", SplitOutput("Count the rs.", "\nThree.")),
    (" \n<think>\nHmm, let me", SplitOutput("\nHmm, let me", "")),
    ("<think></think>Fast.", SplitOutput("", "Fast.")),
    # Thinking off (the template wrote <think></think>): all answer, whitespace included.
    ("\nThree.", SplitOutput("", "\nThree.")),
    ("Three. <think>late</think>", SplitOutput("", "Three. <think>late</think>")),
    ("\n<thinking> aloud", SplitOutput("", "\n<thinking> aloud")),
    ("\n\n", SplitOutput("", "\n\n")),
]
GRANITE_CASES = [
    (
        "Here is my thought process:\nThe user greets me.\n\nHere is my response:\nHello!",
        SplitOutput("\nThe user greets me.\n\n", "\nHello!"),
    ),
    # "Here's" for "Here is", in either marker.
    ("Here's my thought process: a. Here is my response: b.", SplitOutput(" a. ", " b.")),
    ("Here is my thought process: a. Here's my response: b.", SplitOutput(" a. ", " b.")),
    ("\nHere's my thought process:x Here's my response:", SplitOutput("x ", "")),
    # Cut short while thinking: all thinking; a phrase that is not the marker stays in it.
    ("Here is my thought process: Here is my resp", SplitOutput(" Here is my resp", "")),
    ("Here is my thought process: Here is my reply: hi", SplitOutput(" Here is my reply: hi", "")),
    # Neither marker, or the answer's marker alone, or the first one not at the start.
    ("Hello! How can I help?", SplitOutput("", "Hello! How can I help?")),
    ("Here is the answer: 4.", SplitOutput("", "Here is the answer: 4.")),
    ("Here is my response: 4.", SplitOutput("", "Here is my response: 4.")),
    ("Sure. Here is my thought process: x", SplitOutput("", "Sure. Here is my thought process: x")),
    ("Here", SplitOutput("", "Here")),
]


@pytest.mark.parametrize(("text", "split"), GLM45_CASES)
def test_glm45_thinks_between_think_markers_after_its_newline(text, split):
    assert GLM45.parse(text, final=True) == split


@pytest.mark.parametrize(("text", "split"), GRANITE_CASES)
def test_granite_thinks_after_its_thought_phrase_until_its_response_phrase(text, split):
    assert GRANITE.parse(text, final=True) == split


# MiniMax-M2's template ends the prompt with "<think>\n": the output thinks from its start.
MB = "<minimax:tool_call>"
MINIMAX_CASES = [
    # (text, minimax_m2's split)
    (
        "The user greets me. A short reply will do.\n</think>\n\nHello! How can I help?",
        SplitOutput("The user greets me. A short reply will do.\n", "\n\nHello! How can I help?"),
    ),
    # Thinking, then calls: the answer (the tool-call reader's text) is the block.
    (
        f'Paris needs the tool.\n</think>\n\n{MB}\n<invoke name="get_weather">\n'
        '<parameter name="city">Paris</parameter>\n</invoke>\n</minimax:tool_call>',
        SplitOutput(
            "Paris needs the tool.\n",
            f'\n\n{MB}\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
            "</invoke>\n</minimax:tool_call>",
        ),
    ),
    # Cut off while thinking: all thinking, a marker's beginning included.
    ("Let me think about </thi", SplitOutput("Let me think about </thi", "")),
]


@pytest.mark.parametrize(("text", "split"), MINIMAX_CASES)
def test_minimax_m2_thinks_from_the_start_until_its_end_marker(text, split):
    assert MINIMAX.parse(text, final=True) == split


def test_minimax_m2_reads_as_deepseek_r1_and_append_think_keeps_it_all_in_the_answer():
    """vLLM's minimax_m2 is DeepSeek-R1's rule; minimax_m2_append_think splits nothing: the
    answer is the output with the template's <think> put back, for clients that send the
    thinking back (MiniMax's template reads it from the assistant's content)."""
    for text, _qwen3, deepseek in CASES:
        assert MINIMAX.parse(text, final=True) == deepseek
    for text in [case[0] for case in CASES + MINIMAX_CASES]:
        assert MINIMAX_APPEND.parse(text, final=True) == SplitOutput("", "<think>" + text)
        # Nothing waits while it streams: no marker ends a part.
        assert MINIMAX_APPEND.parse(text, final=False) == SplitOutput("", "<think>" + text)
    assert MINIMAX.parse("plan </thi", final=False) == SplitOutput("plan ", "")
    assert MINIMAX.parse("<th", final=False) == SplitOutput("", "")
    assert set(MINIMAX.markers) == set(MINIMAX_APPEND.markers) == {"<think>", "</think>"}


@pytest.mark.parametrize(
    ("parser", "text"),
    [(GLM45, case[0]) for case in GLM45_CASES]
    + [(GRANITE, case[0]) for case in GRANITE_CASES]
    + [(parser, case[0]) for parser in (MINIMAX, MINIMAX_APPEND) for case in MINIMAX_CASES],
)
def test_a_stream_adds_up_however_it_is_cut(parser, text):
    """In two pieces split at every point (a marker in two chunks, or whole in one)."""
    whole = parser.parse(text, final=True)
    for cut in range(len(text)):
        stream = ReasoningStream(parser)
        first = stream.feed(text[:cut], final=False)
        last = stream.feed(text, final=True)
        assert SplitOutput(first[0] + last[0], first[1] + last[1]) == whole


def test_glm45_and_granite_hold_back_what_may_be_a_marker():
    assert GLM45.parse("\n", final=False) == SplitOutput("", "")
    assert GLM45.parse("\n<thi", final=False) == SplitOutput("", "")
    assert GLM45.parse("\n<think>abc</thi", final=False) == SplitOutput("abc", "")
    assert GLM45.parse("\nAn", final=False) == SplitOutput("", "\nAn")
    assert GRANITE.parse("Here's my", final=False) == SplitOutput("", "")
    assert GRANITE.parse("Here we go", final=False) == SplitOutput("", "Here we go")
    thinking = "Here is my thought process: plan. "
    assert GRANITE.parse(thinking + "Here", final=False) == SplitOutput(" plan. ", "")
    assert GRANITE.parse(thinking + "Here's my respo", final=False) == SplitOutput(" plan. ", "")
    assert GRANITE.parse(thinking + "Here is why", final=False) == SplitOutput(
        " plan. Here is why", ""
    )
    assert set(GRANITE.markers) == {
        "Here is my thought process:",
        "Here's my thought process:",
        "Here is my response:",
        "Here's my response:",
    }


@pytest.mark.parametrize(
    "parser",
    [QWEN3, DEEPSEEK, MISTRAL, GLM45, GRANITE, MINIMAX, MINIMAX_APPEND],
    ids=[
        "qwen3",
        "deepseek_r1",
        "mistral",
        "glm45",
        "granite",
        "minimax_m2",
        "minimax_m2_append_think",
    ],
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
        ValueError, match="reasoning_parser must be one of qwen3, deepseek_r1, mistral, seed_oss"
    ):
        ReasoningParser("o1")


def test_seed_oss_thinks_between_its_own_markers_as_deepseek_r1_does():
    """Seed-OSS's format: DeepSeek-R1's rule with <seed:think> and </seed:think>."""
    seed = ReasoningParser("seed_oss")
    for text, _qwen3, deepseek in CASES:
        seed_text = text.replace("</think>", "</seed:think>").replace("<think>", "<seed:think>")
        split = seed.parse(seed_text, final=True)
        assert split == SplitOutput(
            deepseek.reasoning.replace("<think>", "<seed:think>"),
            deepseek.content.replace("</think>", "</seed:think>"),
        )
    # The thinking budget's reflections are part of the thinking.
    budget = "a <seed:cot_budget_reflect>used 3</seed:cot_budget_reflect> b</seed:think>Done."
    assert seed.parse(budget, final=True) == SplitOutput(
        budget.partition("</seed:think>")[0], "Done."
    )
    assert seed.parse("plan </seed:thi", final=False) == SplitOutput("plan ", "")


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
    """A tokenizer whose markers are single tokens (ids 1 and 2), as Qwen3's,
    DeepSeek-R1's, GLM-4.5's and MiniMax-M2's are; other text takes a token per character."""

    IDS = {"<think>": 1, "</think>": 2, "[THINK]": 1, "[/THINK]": 2, "\n": 10}

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
        # GLM-4.5's newline before <think> is part of the thinking's tokens.
        (GLM45, "\n<think>ab</think>cd", [10, 1, 97, 98, 2, 99, 100], 5),
        (GLM45, "\nab", [10, 97, 98], 0),
        # Granite's markers are phrases: the thinking, both phrases included, tokenized again.
        (GRANITE, "Here's my thought process: a Here's my response: b", list(range(50)), 48),
        (GRANITE, "Here's my thought process: a", list(range(28)), 28),
        (GRANITE, "Hi", [72, 105], 0),
        # MiniMax-M2 thinks from the start; kept in the answer, the thinking counts the same.
        (MINIMAX, "ab</think>cd", [97, 98, 2, 99, 100], 3),
        (MINIMAX_APPEND, "ab</think>cd", [97, 98, 2, 99, 100], 3),
        (MINIMAX_APPEND, "still thinking", [115, 116], 2),
    ],
)
def test_reasoning_tokens_count_the_thinking_and_its_markers(parser, text, token_ids, expected):
    assert parser.num_reasoning_tokens(token_ids, text, _OneTokenMarkers()) == expected


class _EveryTextOneToken(_OneTokenMarkers):
    """A tokenizer that would take any marker for one token: only the format can say that
    a gate on one token does not fit."""

    def single_token_id(self, text: str) -> int | None:
        return 7


def test_grammars_wait_for_single_marker_tokens_and_not_for_granite_s_phrases(caplog):
    assert thinking_token_ids("qwen3", _OneTokenMarkers()) == (1, [2], None)
    assert thinking_token_ids("deepseek_r1", _OneTokenMarkers()) == (None, [2], None)
    # MiniMax-M2's template opens the thinking: the gate waits for </think> alone.
    for name in ("minimax_m2", "minimax_m2_append_think"):
        assert thinking_token_ids(name, _OneTokenMarkers()) == (None, [2], None)
    # GLM-4.5 writes a newline before <think>: the gate lets it pass undecided.
    assert thinking_token_ids("glm45", _OneTokenMarkers()) == (1, [2], [10])
    # Two spellings of each phrase: no one token ends Granite's thinking, and the log says
    # that grammars hold throughout.
    with caplog.at_level("WARNING"):
        assert thinking_token_ids("granite", _EveryTextOneToken()) == (None, None, None)
    assert "reasoning_parser granite: its markers are phrases" in caplog.text
    assert thinking_token_ids("granite", _OneTokenMarkers()) == (None, None, None)
    for name in ("glm45", "granite"):
        assert thinking_token_ids(name, None) == (None, None, None)
    with pytest.raises(
        ValueError, match="glm45, granite, minimax_m2, minimax_m2_append_think, openai_gptoss"
    ):
        thinking_token_ids("granite4", None)


# ---------------------------------------------------------------- gpt-oss (harmony)

GPTOSS = ReasoningParser("openai_gptoss")
ANALYSIS = "<|channel|>analysis<|message|>"
NEXT = "<|end|><|start|>assistant"  # one message ends, the next opens
FINAL = "<|channel|>final<|message|>"
WEATHER_CALL = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"

HARMONY_CASES = [
    # (text, the split)
    (ANALYSIS + "Simple question." + NEXT + FINAL + "The capital is Paris.<|return|>",
     SplitOutput("Simple question.", "The capital is Paris.")),
    # <|return|> is an end-of-sequence token: usually not in the text.
    (ANALYSIS + "Simple." + NEXT + FINAL + "Paris.", SplitOutput("Simple.", "Paris.")),
    # Several analysis messages: one a line, as vLLM joins them.
    (ANALYSIS + "First, a < b." + NEXT + ANALYSIS + "Then c." + NEXT + FINAL + "Done.",
     SplitOutput("First, a < b.\nThen c.", "Done.")),
    # A preamble (commentary to nobody) is for the user; a call is in neither part.
    (ANALYSIS + "Need a tool." + NEXT + "<|channel|>commentary<|message|>Checking." + NEXT
     + WEATHER_CALL + '{"city":"Paris"}<|call|>', SplitOutput("Need a tool.", "Checking.")),
    (ANALYSIS + "Need a tool." + NEXT
     + ' to=functions.get_weather<|channel|>commentary json<|message|>{"city":"Rome"}',
     SplitOutput("Need a tool.", "")),
    # A call from the analysis channel is no thinking either.
    ("<|channel|>analysis to=functions.get_time<|message|>{}" + NEXT + FINAL + "Noon.",
     SplitOutput("", "Noon.")),
    # Cut off while thinking: all thinking; cut off in the next header: no answer yet.
    (ANALYSIS + "Let me thi", SplitOutput("Let me thi", "")),
    (ANALYSIS + "Hmm." + NEXT + "<|channel|>fin", SplitOutput("Hmm.", "")),
    # An empty message is a line of its own; one cut off empty is none.
    (ANALYSIS + NEXT + ANALYSIS + "b" + NEXT + FINAL, SplitOutput("\nb", "")),
    # Not harmony (a constrained output, bare JSON): all answer.
    ('{"city": "Paris"}', SplitOutput("", '{"city": "Paris"}')),
]  # fmt: skip


@pytest.mark.parametrize(("text", "split"), HARMONY_CASES)
def test_gptoss_thinks_on_the_analysis_channel_and_answers_on_the_final_one(text, split):
    assert GPTOSS.parse(text, final=True) == split
    assert not any("<|" in part or "analysis" in part for part in (split.reasoning, split.content))


@pytest.mark.parametrize("text", [case[0] for case in HARMONY_CASES])
def test_a_gptoss_stream_adds_up_to_the_whole_answer_however_it_is_cut(text):
    """A character at a time (every marker arrives in pieces), and in two pieces split at
    every point: the deltas add up to the whole, and no marker leaks into a delta."""
    whole = GPTOSS.parse(text, final=True)
    stream = ReasoningStream(GPTOSS)
    reasoning = content = ""
    for end in range(1, len(text) + 1):
        new_reasoning, new_content = stream.feed(text[:end], final=end == len(text))
        assert "<|" not in new_reasoning + new_content
        reasoning += new_reasoning
        content += new_content
    assert SplitOutput(reasoning, content) == whole
    for cut in range(len(text)):
        stream = ReasoningStream(GPTOSS)
        first = stream.feed(text[:cut], final=False)
        last = stream.feed(text, final=True)
        assert SplitOutput(first[0] + last[0], first[1] + last[1]) == whole


def test_gptoss_holds_back_what_may_be_a_marker():
    assert GPTOSS.parse("<|chan", final=False) == SplitOutput("", "")
    assert GPTOSS.parse(ANALYSIS + "abc<|en", final=False) == SplitOutput("abc", "")
    assert GPTOSS.parse(ANALYSIS + "a <b", final=False) == SplitOutput("a <b", "")
    assert GPTOSS.parse(ANALYSIS + "abc" + NEXT + "<|channel|>final<|mess", final=False) == (
        SplitOutput("abc", "")
    )
    # Plain text is settled as it comes.
    assert GPTOSS.parse("{", final=False) == SplitOutput("", "{")


class _HarmonyMarkers:
    """A tokenizer that holds harmony's markers as single tokens (as o200k_harmony does);
    other text takes a token per character."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        token_ids: list[int] = []
        for piece in re.split(r"(<\|[a-z]+\|>)", text):
            token_ids.extend([0] if piece.startswith("<|") else map(ord, piece))
        return token_ids


def test_gptoss_reasoning_tokens_run_to_the_end_of_the_last_analysis_message():
    text = ANALYSIS + "ab" + NEXT + FINAL + "cd"
    token_ids = _HarmonyMarkers().encode(text)
    # <|channel|> a n a l y s i s <|message|> a b <|end|>
    assert GPTOSS.num_reasoning_tokens(token_ids, text, _HarmonyMarkers()) == 13
    assert GPTOSS.num_reasoning_tokens([1, 2, 3], ANALYSIS + "cut", _HarmonyMarkers()) == 3
    assert GPTOSS.num_reasoning_tokens([1, 2], FINAL + "hi", _HarmonyMarkers()) == 0
