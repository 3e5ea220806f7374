"""Draft tokens for speculative decoding by prompt lookup (vLLM's "ngram" method).

A sequence's last n tokens often occurred before in its own prompt or output (code being
edited, a document being summarised or quoted, a list being continued): the tokens that
followed that earlier occurrence are a cheap guess at what comes next. The scheduler
schedules a decoding sequence with its guesses after its last token; the worker scores
them all in one forward pass and keeps the longest prefix its own sampling agrees with,
plus the token it sampled at the first disagreement (``gpu_worker/model_runner.py``), so
the output is what decoding one token at a time would give, only in fewer steps.
"""

from __future__ import annotations

from array import array

_TOKEN_BYTES = 4  # array("I") items: token ids are below 2**32


def propose(
    token_ids: list[int], max_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int
) -> list[int]:
    """Up to ``max_tokens`` draft tokens to follow ``token_ids``: what followed the most
    recent earlier occurrence of its longest matching suffix (``prompt_lookup_max`` tokens
    down to ``prompt_lookup_min``); none when no suffix occurred before."""
    num_tokens = len(token_ids)
    if max_tokens < 1 or num_tokens <= prompt_lookup_min:
        return []
    # NOTE: the search runs in C (bytes.rfind over the packed ids), not in a Python loop
    # over tokens: it repeats for every decoding sequence at every step.
    data = array("I", token_ids).tobytes()
    for size in range(min(prompt_lookup_max, num_tokens - 1), prompt_lookup_min - 1, -1):
        pattern = data[-size * _TOKEN_BYTES :]
        # An occurrence must end before the last token, so something follows it.
        end = len(data) - _TOKEN_BYTES
        while True:
            start = data.rfind(pattern, 0, end)
            if start < 0:
                break
            if start % _TOKEN_BYTES == 0:
                first = start // _TOKEN_BYTES + size
                return token_ids[first : first + max_tokens]
            end = start + len(pattern) - 1  # a match across token boundaries: look earlier
    return []
