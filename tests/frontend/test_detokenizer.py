"""Incremental detokenization and stop strings, on tokenizers shaped like the real ones.

What a user sees: the text never shows a replacement character for a character that is
merely split across tokens (emoji, CJK, byte-fallback tokens), it only grows while the
request runs, it ends equal to ``decode`` of all the output tokens, and a stop string is
found even when split across tokens, then cut from the text unless asked for.
"""

from __future__ import annotations

import random

import pytest

from helpers.tiny_tokenizers import (
    BYTE_LEVEL_SPECIALS,
    SENTENCEPIECE_SPECIALS,
    byte_fallback_tokenizer,
    byte_level_piece,
    byte_level_tokenizer,
    ids_of,
    save_for_transformers,
)
from pagedserve.frontend.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from pagedserve.frontend.tokenizer import Tokenizer
from pagedserve.scheduler.sampling_params import SamplingParams

SENTENCEPIECE_PIECES = ["▁Hello", "▁wor", "ld", "▁world", "世", "!", "▁STOP"]
BYTE_LEVEL_PIECES = [
    "Hello",
    " wor",
    "ld",
    " world",
    "!",
    " STOP",
    b" \xf0\x9f\x98",  # " 😀" less its last byte, as SmolLM2 splits it
    b"\xe4\xb8",  # the first two of 世's three bytes
    "assistant",
]
MIXED_TEXTS = [
    "Hello world!",
    "Hello 😀 world",
    "世界 and 日本語, 한국어",
    "emoji 🧑‍🚀 zwj, flags 🇫🇷, é and ü",
    "  leading spaces\nand\ttabs  ",
]


@pytest.fixture(scope="module")
def sentencepiece(tmp_path_factory) -> tuple[Tokenizer, object]:
    """(the engine's Tokenizer, the raw tokenizers.Tokenizer as the reference)."""
    raw = byte_fallback_tokenizer(SENTENCEPIECE_PIECES)
    path = tmp_path_factory.mktemp("sentencepiece")
    return Tokenizer(save_for_transformers(raw, path, SENTENCEPIECE_SPECIALS)), raw


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory) -> tuple[Tokenizer, object]:
    raw = byte_level_tokenizer(BYTE_LEVEL_PIECES)
    path = tmp_path_factory.mktemp("byte_level")
    return Tokenizer(save_for_transformers(raw, path, BYTE_LEVEL_SPECIALS)), raw


@pytest.fixture(params=["sentencepiece", "byte_level"])
def any_tokenizer(request) -> tuple[Tokenizer, object]:
    return request.getfixturevalue(request.param)


def stream(
    tokenizer: Tokenizer, token_ids: list[int], params: SamplingParams | None = None, chunk=1
) -> tuple[IncrementalDetokenizer, list[str], int]:
    """Feed ``token_ids`` ``chunk`` at a time, the last call marked finished, stopping
    where the detokenizer says. Returns it, its text after each call, tokens kept."""
    detokenizer = IncrementalDetokenizer(tokenizer, params or SamplingParams())
    texts, kept = [], 0
    for start in range(0, len(token_ids), chunk):
        new_ids = token_ids[start : start + chunk]
        num_kept = detokenizer.append(new_ids, finished=start + chunk >= len(token_ids))
        kept += num_kept
        texts.append(detokenizer.text)
        if detokenizer.finished:
            break
    return detokenizer, texts, kept


def assert_only_grows(texts: list[str]) -> None:
    for before, after in zip(texts, texts[1:]):
        assert after.startswith(before), (before, after)


# ---------------------------------------------------------------- characters split over tokens


def test_emoji_split_over_byte_fallback_tokens_appears_whole(sentencepiece):
    tokenizer, raw = sentencepiece
    token_ids = ids_of(raw, ["▁Hello", "▁", "<0xF0>", "<0x9F>", "<0x98>", "<0x80>", "!"])
    _, texts, _ = stream(tokenizer, token_ids)
    # Three bytes of four are not a character yet: nothing is shown for them.
    assert texts == ["Hello", "Hello ", "Hello ", "Hello ", "Hello ", "Hello 😀", "Hello 😀!"]
    assert texts[-1] == raw.decode(token_ids)


def test_emoji_split_over_byte_level_pieces_appears_whole(byte_level):
    tokenizer, raw = byte_level
    pieces = ["Hello", b" \xf0\x9f\x98", b"\x80", "!"]
    token_ids = ids_of(raw, [byte_level_piece(p) for p in pieces])
    assert raw.decode(token_ids[:2]).endswith(REPLACEMENT_CHAR)  # what a naive decode shows
    _, texts, _ = stream(tokenizer, token_ids)
    assert texts == ["Hello", "Hello", "Hello 😀", "Hello 😀!"]


def test_cjk_split_over_bytes_and_whole_pieces(sentencepiece, byte_level):
    tokenizer, raw = sentencepiece
    # 世 is a piece, 界 (E7 95 8C) three byte tokens; the text's leading space goes, as
    # decode drops it.
    token_ids = ids_of(raw, ["▁", "世", "<0xE7>", "<0x95>", "<0x8C>", "!"])
    assert stream(tokenizer, token_ids)[1] == ["", "世", "世", "世", "世界", "世界!"]
    tokenizer, raw = byte_level
    pieces = [b"\xe4\xb8", b"\x96", b"\xe7", b"\x95", b"\x8c"]  # 世 as SmolLM2 splits it
    token_ids = ids_of(raw, [byte_level_piece(p) for p in pieces])
    assert stream(tokenizer, token_ids)[1] == ["", "世", "世", "世", "世界"]


@pytest.mark.parametrize("text", MIXED_TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_final_text_equals_decode_and_never_shows_a_split_character(any_tokenizer, text, chunk):
    tokenizer, raw = any_tokenizer
    token_ids = raw.encode(text, add_special_tokens=False).ids
    detokenizer, texts, kept = stream(tokenizer, token_ids, chunk=chunk)
    assert kept == len(token_ids) and detokenizer.finished
    assert texts[-1] == raw.decode(token_ids) == tokenizer.decode(token_ids)
    assert all(REPLACEMENT_CHAR not in t for t in texts)
    assert_only_grows(texts)


def test_random_cuts_at_character_boundaries_end_equal_to_decode(any_tokenizer):
    tokenizer, raw = any_tokenizer
    rng = random.Random(0)
    for _ in range(20):
        token_ids = raw.encode(rng.choice(MIXED_TEXTS) * 2, add_special_tokens=False).ids
        cuts = [
            n for n in range(1, len(token_ids)) if REPLACEMENT_CHAR not in raw.decode(token_ids[:n])
        ]
        cut = rng.choice(cuts)
        final = stream(tokenizer, token_ids[:cut], chunk=rng.choice([1, 2, 5]))[1][-1]
        assert final == raw.decode(token_ids[:cut])


def test_byte_level_text_equals_decode_even_for_invalid_utf8(byte_level):
    """Byte-level decoding replaces each invalid byte run and leaves the rest alone, so
    any token stream, however broken, ends equal to decode."""
    tokenizer, raw = byte_level
    rng = random.Random(1)
    for _ in range(50):
        token_ids = [rng.randrange(raw.get_vocab_size()) for _ in range(rng.randrange(1, 30))]
        params = SamplingParams(skip_special_tokens=rng.random() < 0.5)
        final = stream(tokenizer, token_ids, params, chunk=rng.choice([1, 3]))[1][-1]
        assert final == raw.decode(token_ids, skip_special_tokens=params.skip_special_tokens)


def test_output_ending_inside_a_character_shows_replacement_chars_as_decode_does(sentencepiece):
    tokenizer, raw = sentencepiece
    token_ids = ids_of(raw, ["▁Hello", "▁", "<0xF0>", "<0x9F>"])
    detokenizer, texts, _ = stream(tokenizer, token_ids)
    assert texts[-2] == "Hello "  # still waiting for the rest of the character
    assert texts[-1] == raw.decode(token_ids) == "Hello " + REPLACEMENT_CHAR * 2


# ---------------------------------------------------------------- special tokens


def test_skip_special_tokens_on_and_off(sentencepiece):
    tokenizer, raw = sentencepiece
    token_ids = ids_of(raw, ["<s>", "▁Hello", "</s>", "<s>", "▁world"])
    skipped = stream(tokenizer, token_ids)[1][-1]
    assert skipped == raw.decode(token_ids, skip_special_tokens=True) == "Hello world"
    kept = stream(tokenizer, token_ids, SamplingParams(skip_special_tokens=False))[1][-1]
    assert kept == raw.decode(token_ids, skip_special_tokens=False) == "<s> Hello</s><s> world"


def test_without_spaces_between_special_tokens_text_segments_decode_on_their_own(sentencepiece):
    tokenizer, raw = sentencepiece
    token_ids = ids_of(raw, ["<s>", "▁Hello", "▁", "<0xF0>", "</s>", "<s>", "▁world"])
    params = SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=False)
    _, texts, _ = stream(tokenizer, token_ids, params)
    # Each segment loses its leading space, as the whole text does; the byte left
    # incomplete before </s> shows as decode shows it.
    assert texts[-1] == "<s>Hello " + REPLACEMENT_CHAR + "</s><s>world"
    assert_only_grows(texts)


def test_byte_level_special_tokens_are_kept_verbatim(byte_level):
    tokenizer, raw = byte_level
    token_ids = [1, *raw.encode("assistant\nHi 😀", add_special_tokens=False).ids, 2]
    for spaces in (True, False):
        params = SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=spaces)
        text = stream(tokenizer, token_ids, params)[1][-1]
        assert text == raw.decode(token_ids, skip_special_tokens=False)
        assert text == "<|im_start|>assistant\nHi 😀<|im_end|>"
    assert stream(tokenizer, token_ids)[1][-1] == "assistant\nHi 😀"


def test_special_token_ids_are_those_decode_skips(byte_level):
    tokenizer, raw = byte_level
    assert tokenizer.special_token_ids == {0, 1, 2}
    assert tokenizer.decode([1, 300, 2]) == raw.decode([300])


# ---------------------------------------------------------------- stop strings


def test_stop_string_split_across_tokens_is_found_and_cut(sentencepiece):
    tokenizer, raw = sentencepiece
    token_ids = ids_of(raw, ["▁Hello", "▁wor", "ld", "!", "▁world"])
    detokenizer, texts, kept = stream(tokenizer, token_ids, SamplingParams(stop=["world"]))
    assert (texts[-1], kept, detokenizer.stop_string) == ("Hello ", 3, "world")
    # One that spans three tokens: "o" | " wor" | "l".
    detokenizer, _, kept = stream(tokenizer, token_ids, SamplingParams(stop="o worl"))
    assert (detokenizer.text, kept) == ("Hell", 3)


def test_stop_string_kept_with_include_stop_str_in_output(byte_level):
    tokenizer, raw = byte_level
    token_ids = ids_of(raw, [byte_level_piece(p) for p in ["Hello", " wor", "ld", "!"]])
    params = SamplingParams(stop=["o w"], include_stop_str_in_output=True)
    detokenizer, _, kept = stream(tokenizer, token_ids, params)
    # " wor" completes "o w"; the "or" after it, in the same token, is cut.
    assert (detokenizer.text, kept, detokenizer.stop_string) == ("Hello w", 2, "o w")


def test_stop_string_inside_a_split_character_stops_at_its_last_byte(sentencepiece):
    tokenizer, raw = sentencepiece
    token_ids = ids_of(raw, ["▁Hello", "▁", "<0xF0>", "<0x9F>", "<0x98>", "<0x80>", "!"])
    detokenizer, _, kept = stream(tokenizer, token_ids, SamplingParams(stop="😀"))
    assert (detokenizer.text, kept) == ("Hello ", 6)


def test_the_first_stop_string_to_complete_wins(sentencepiece):
    tokenizer, raw = sentencepiece
    token_ids = ids_of(raw, ["▁Hello", "▁wor", "ld", "!"])
    params = SamplingParams(stop=["world", "lo w"])
    assert stream(tokenizer, token_ids, params)[0].stop_string == "lo w"
    # Both complete with "ld": the text ends where the earlier one begins.
    detokenizer = stream(tokenizer, token_ids, SamplingParams(stop=["ld", "o world"]))[0]
    assert (detokenizer.stop_string, detokenizer.text) == ("o world", "Hell")


def test_text_that_may_begin_a_stop_string_is_held_back_until_it_cannot(sentencepiece):
    tokenizer, raw = sentencepiece
    token_ids = ids_of(raw, ["▁Hello", "▁wor", "ld", "!"])
    _, texts, _ = stream(tokenizer, token_ids, SamplingParams(stop=["world!?"]))
    # Six characters are held back while running: a stop string may start in them.
    assert texts == ["", "Hel", "Hello", "Hello world!"]
    assert_only_grows(texts)


def test_stop_strings_count_only_after_min_tokens(sentencepiece):
    tokenizer, raw = sentencepiece
    token_ids = ids_of(raw, ["▁Hello", "▁wor", "ld", "▁Hello", "▁world"])
    params = SamplingParams(stop=["world"], min_tokens=3, max_tokens=16)
    detokenizer, _, kept = stream(tokenizer, token_ids, params)
    assert (detokenizer.text, kept) == ("Hello world Hello ", 5)


def test_stop_string_can_be_a_kept_special_token(byte_level):
    tokenizer, raw = byte_level
    token_ids = [*raw.encode("Hi", add_special_tokens=False).ids, 2, 1]
    params = SamplingParams(stop="<|im_end|>", skip_special_tokens=False)
    detokenizer, _, kept = stream(tokenizer, token_ids, params)
    assert (detokenizer.text, kept) == ("Hi", 3)


def test_no_append_after_the_end(sentencepiece):
    tokenizer, raw = sentencepiece
    detokenizer = IncrementalDetokenizer(tokenizer, SamplingParams(stop="H"))
    assert detokenizer.append(ids_of(raw, ["▁Hello", "▁wor"])) == 1
    with pytest.raises(RuntimeError, match="after the output has finished"):
        detokenizer.append([5])


# ---------------------------------------------------------------- the embedded tokenizer


@pytest.mark.slow
def test_embedded_tokenizer_streams_emoji_and_cjk_as_decode_does(embedded_model_dir):
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(embedded_model_dir))
    tokenizer = Tokenizer(embedded_model_dir)
    text = "Hello 😀 世界, 日本語 🧑‍🚀 and <|im_end|> it's fine"
    token_ids = reference.encode(text, add_special_tokens=False)
    for skip in (True, False):
        params = SamplingParams(skip_special_tokens=skip)
        _, texts, _ = stream(tokenizer, token_ids, params)
        assert texts[-1] == reference.decode(token_ids, skip_special_tokens=skip)
        assert all(REPLACEMENT_CHAR not in t for t in texts)
        assert_only_grows(texts)
    # "😀 世" spans pieces split inside both characters.
    detokenizer, _, kept = stream(tokenizer, token_ids, SamplingParams(stop="😀 世"))
    assert detokenizer.text == "Hello "
    assert "😀 世" in reference.decode(token_ids[:kept])
    assert "😀 世" not in reference.decode(token_ids[: kept - 1])
