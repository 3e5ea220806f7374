"""How speculative decoding is set up, as vLLM's ``speculative_config`` dict says it.

Three ways to draft tokens: ``"ngram"``, prompt lookup (``ngram_proposer.py``, in the
scheduler: free, good on text that repeats itself); ``"draft_model"``, a small model of
the target's vocabulary run by the workers beside the target
(``gpu_worker/draft_model.py``: a forward pass per guessed token, good on any text the small
model predicts well); and ``"mtp"``, the target's own multi-token-prediction layer
(DeepSeek-V3's, GLM-4.5's: ``gpu_worker/next_token_drafter.py``, one layer's pass per guess
from the target's hidden states; vLLM's ``"deepseek_mtp"`` and ``"glm4_moe_mtp"`` name it
too). Either way the target checks the drafts in one pass and the output is what decoding a
token at a time gives.
"""

from __future__ import annotations

from dataclasses import dataclass

# vLLM's names for the methods and settings, as its ``speculative_config`` takes them.
SPECULATIVE_METHODS = ("ngram", "draft_model", "mtp")
# vLLM's older, per-family names for "mtp".
MTP_ALIASES = ("deepseek_mtp", "glm4_moe_mtp")
# The methods whose drafts the workers make after each step (the rest: the scheduler).
WORKER_DRAFTED_METHODS = ("draft_model", "mtp")
_PROMPT_LOOKUP_KEYS = ("prompt_lookup_max", "prompt_lookup_min")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Up to ``num_speculative_tokens`` draft tokens per sequence per step: by prompt
    lookup (``method="ngram"``: the most recent earlier occurrence of the sequence's last n
    tokens, n from ``prompt_lookup_max`` down to ``prompt_lookup_min``), or from the draft
    model at ``model`` (``method="draft_model"``: an HF directory or a GGUF file), or by the
    target's multi-token-prediction layer (``method="mtp"``, no ``model``).
    ``disable_by_batch_size``: no sequence speculates in a step that starts with at least
    that many running sequences (a large batch keeps the device busy already: checking
    drafts then costs more than the steps it saves); None: always speculate.
    ``draft_tensor_parallel_size``: the ranks the draft model splits over, which here are
    always the target's (the engine checks it against ``tensor_parallel_size``)."""

    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    method: str = "ngram"
    model: str | None = None
    disable_by_batch_size: int | None = None
    draft_tensor_parallel_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                f"got {self.method!r}"
            )
        for name in ("num_speculative_tokens", *_PROMPT_LOOKUP_KEYS):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"speculative_config.{name} must be an integer >= 1, got {value!r}"
                )
        size = self.disable_by_batch_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 2):
            raise ValueError(
                f"speculative_config.disable_by_batch_size must be an integer >= 2 (or null), "
                f"got {size!r}"
            )
        ranks = self.draft_tensor_parallel_size
        if ranks is not None and (
            isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1
        ):
            raise ValueError(
                f"speculative_config.draft_tensor_parallel_size must be an integer >= 1 (or "
                f"null), got {ranks!r}"
            )
        if ranks is not None and self.method != "draft_model":
            raise ValueError(
                "speculative_config.draft_tensor_parallel_size is for method 'draft_model'"
            )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )
        if self.method == "draft_model" and not (isinstance(self.model, str) and self.model):
            raise ValueError(
                "speculative_config.model (the draft model's directory or GGUF file) is "
                f"required for method 'draft_model', got {self.model!r}"
            )
        if self.method == "ngram" and self.model is not None:
            raise ValueError(
                f"speculative_config.model ({self.model!r}) is for method 'draft_model'; "
                "method 'ngram' drafts by prompt lookup, without a model"
            )
        if self.method == "mtp" and self.model is not None:
            raise ValueError(
                f"speculative_config.model ({self.model!r}) is for method 'draft_model'; "
                "method 'mtp' drafts with the target's own multi-token-prediction layer"
            )

    @classmethod
    def from_dict(cls, config: dict) -> SpeculativeConfig:
        """vLLM's ``speculative_config`` dict: ``{"method": "ngram",
        "num_speculative_tokens": 4, "prompt_lookup_max": 4}`` or ``{"model":
        "/models/draft", "num_speculative_tokens": 4}`` (a ``model`` without a ``method``
        is a draft model, as in vLLM); unknown keys refused."""
        if not isinstance(config, dict):
            raise TypeError(f"speculative_config must be a dict, got {config!r}")
        known = {
            "method",
            "model",
            "num_speculative_tokens",
            "disable_by_batch_size",
            "draft_tensor_parallel_size",
            *_PROMPT_LOOKUP_KEYS,
        }
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(
                f"speculative_config: unknown key(s) {', '.join(unknown)}; this engine takes "
                f"{', '.join(sorted(known))}"
            )
        if "num_speculative_tokens" not in config:
            raise ValueError("speculative_config.num_speculative_tokens is required")
        config = dict(config)
        if "method" not in config:
            config["method"] = "draft_model" if "model" in config else "ngram"
        if config["method"] in MTP_ALIASES:
            config["method"] = "mtp"
        lookup_keys = sorted(set(_PROMPT_LOOKUP_KEYS) & set(config))
        if config["method"] in WORKER_DRAFTED_METHODS and lookup_keys:
            raise ValueError(
                f"speculative_config: {', '.join(lookup_keys)} apply to method 'ngram' "
                f"(prompt lookup), not to {config['method']!r}"
            )
        return cls(**config)
