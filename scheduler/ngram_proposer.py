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
from dataclasses import dataclass

# vLLM's names for the settings, as its ``speculative_config`` takes them.
SPECULATIVE_METHODS = ("ngram",)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Prompt-lookup speculation: up to ``num_speculative_tokens`` draft tokens per step,
    from the most recent earlier occurrence of the sequence's last n tokens, n from
    ``prompt_lookup_max`` down to ``prompt_lookup_min``."""

    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    method: str = "ngram"

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {', '.join(SPECULATIVE_METHODS)} "
                f"(prompt lookup), got {self.method!r}"
            )
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"speculative_config.{name} must be an integer >= 1, got {value!r}"
                )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )

    @classmethod
    def from_dict(cls, config: dict) -> SpeculativeConfig:
        """vLLM's ``speculative_config`` dict (``{"method": "ngram",
        "num_speculative_tokens": 4, "prompt_lookup_max": 4}``); unknown keys refused."""
        if not isinstance(config, dict):
            raise TypeError(f"speculative_config must be a dict, got {config!r}")
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(
                f"speculative_config: unknown key(s) {', '.join(unknown)}; this engine takes "
                f"{', '.join(sorted(known))}"
            )
        if "num_speculative_tokens" not in config:
            raise ValueError("speculative_config.num_speculative_tokens is required")
        return cls(**config)


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
