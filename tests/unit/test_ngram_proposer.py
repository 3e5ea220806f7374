"""Prompt lookup (scheduler/ngram_proposer.py): which draft tokens a sequence proposes,
and vLLM's speculative_config checked with the field named."""

from __future__ import annotations

from pagedserve.scheduler.ngram_proposer import propose


def test_the_longest_suffix_picks_its_most_recent_earlier_occurrence():
    #            0  1  2  3  4  5  6  7  8  9 10 11 12 13
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 6, 1, 2, 3]
    # The suffix [1, 2, 3] occurred at 4 (most recent) and 0: what followed it at 4.
    assert propose(tokens, 4, 2, 4) == [7, 8, 5, 6]
    assert propose(tokens, 2, 2, 4) == [7, 8]
    # A longer suffix wins over a more recent shorter one: [6, 2, 3] is new, [2, 3] is not.
    assert propose([2, 3, 4, 5, 9, 3, 0, 6, 2, 3], 3, 2, 3) == [4, 5, 9]
    tokens = [5, 6, 7, 1, 9, 9, 6, 7, 2, 8, 6, 7]
    assert propose(tokens, 3, 2, 3) == [2, 8, 6]  # [6, 7] most recently at 6
    # The drafts may run up to the end of the sequence.
    assert propose([4, 4, 4, 4], 5, 2, 2) == [4]


def test_no_draft_without_an_earlier_occurrence_or_room():
    assert propose([1, 2, 3, 4, 5], 4, 2, 4) == []
    assert propose([1, 2, 1, 3], 4, 2, 4) == []  # only 1-grams repeat; min is 2
    assert propose([1, 2, 1, 3, 1], 4, 1, 4) == [3, 1]
    assert propose([1, 2, 1, 2], 0, 2, 4) == []
    assert propose([7], 4, 1, 4) == []


def test_matches_are_whole_tokens_not_bytes():
    # Packed as little-endian uint32, [256, 1] and [1, 256] share bytes across the token
    # boundary: 256 = 00 01 00 00, 1 = 01 00 00 00. Only token-aligned matches count.
    tokens = [0x0100, 0x0001, 0x00010000, 42, 0x0100, 0x0001]
    assert propose(tokens, 2, 2, 2) == [0x00010000, 42]
    misaligned = [0x01000000, 0x00000000, 9, 0x00000001, 0x00000000]
    assert propose(misaligned, 2, 2, 2) == []
    assert propose([2**32 - 1, 5, 2**32 - 1, 5], 1, 1, 2) == [2**32 - 1]
