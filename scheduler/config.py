"""Scheduler limits, checked once at start-up."""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.scheduler.pooling_params import MODEL_TASKS
from pagedserve.scheduler.request_limits import check_int
from pagedserve.scheduler.speculative_config import (
    SPECULATIVE_METHODS,
    SpeculativeConfig,
)

ALLOCATION_POLICIES = ("paged", "max", "pow2", "oracle")
SCHEDULING_POLICIES = ("fcfs", "priority")


def check_priority(priority: object, scheduling_policy: str, field: str = "priority") -> None:
    """Raise ``ValueError`` naming ``field`` for a priority the engine cannot honour: not
    an integer, or not 0 when the engine schedules first come, first served (vLLM's
    rule: a priority an engine would silently ignore is refused)."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"{field} must be an integer (lower runs first), got {priority!r:.100}")
    check_int(field, priority, "priority")
    if priority != 0 and scheduling_policy != "priority":
        raise ValueError(
            f"{field}={priority}: this engine schedules first come, first served "
            f"(scheduling_policy {scheduling_policy!r}); start it with scheduling_policy "
            "'priority' (--scheduling-policy priority) to order requests by priority"
        )


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one step and of the batch.

    ``max_num_batched_tokens`` bounds the tokens of one forward pass (prefill chunks plus
    one per decoding request); ``max_num_seqs`` bounds the running requests.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    watermark_fraction: float = 0.01
    # None: recompute a preempted single-sequence request, swap a group of several
    # sequences (the paper's default); "recompute" or "swap" forces one.
    preemption_mode: str | None = None
    # How a request's KV slots are allocated: "paged" (blocks on demand, this engine),
    # or one of the paper's contiguous-reservation baselines: "max" (max_model_len at
    # admission), "pow2" (prompt + the power of two at or above max_tokens), "oracle"
    # (prompt + max_tokens: the actual output length on traces with ignore_eos).
    allocation_policy: str = "paged"
    # Speculative decoding (``speculative_config.py``): draft tokens per sequence per step,
    # at most (0: off); by prompt lookup (``ngram_proposer.py``, the suffix lengths looked
    # up), or from the workers' draft model or multi-token-prediction layer ("draft_model",
    # "mtp": the scheduler also reserves blocks for their guesses past a sequence's
    # scheduled tokens when they are free).
    num_speculative_tokens: int = 0
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    speculative_method: str = "ngram"
    # No sequence speculates in a step that starts with at least this many running
    # sequences (vLLM's ``disable_by_batch_size``); 0: always speculate.
    speculative_disable_by_batch_size: int = 0
    # "fcfs": requests run in arrival order; "priority": by each request's priority
    # (lower first, then arrival), and a queued request preempts running ones of a
    # strictly lower priority when it does not fit (scheduler.py).
    scheduling_policy: str = "fcfs"
    # vLLM's max_loras: the most distinct LoRA adapters one batch runs (0: no cap). Each
    # adapter costs every projection two small matmuls over its rows, so many adapters in
    # one step slow every request in it; past the cap a request waits for a slot.
    max_loras: int = 0
    # Tokens of context that every layer of the model attends to at most, back from each
    # query token and counting it (the largest layer window; 0 when some layer attends to the
    # whole context: Llama, Gemma 2's global layers). With a window, a sequence gives back
    # each block that lies wholly before its next query's window, so it holds about
    # sliding_window tokens of blocks however long it grows, and a request may outgrow the
    # KV cache (see check_request_fits). Set from the model by the engine.
    sliding_window: int = 0
    # What the model does (pooling_params.MODEL_TASKS): "generate" (a causal LM: generation
    # and embedding requests) or "classify" (a sequence classification model: classification
    # requests only; it has no LM head). Set from the model by the engine.
    model_task: str = "generate"
    # A LongRoPE model's original context (0: another model). A prompt longer than it is
    # rotated with the long factors at every position, a shorter one with the short factors
    # within it (gpu_worker/layers/rope_config.long_rope_switch), so their K/V differ at the
    # same tokens: the prefix cache keeps the two apart. Set from the model by the engine.
    long_rope_switch: int = 0
    # Plan step N+1 while step N runs (vLLM's async scheduling, ``schedule_ahead.py``):
    # the device does not wait for the scheduler between decode steps. Set by the engine.
    async_scheduling: bool = False

    def rotation_epoch(self, num_tokens: int) -> int:
        """Which rotation a sequence of ``num_tokens`` tokens has its K/V computed with:
        1 past a LongRoPE model's original context (the long factors), else 0."""
        return int(bool(self.long_rope_switch) and num_tokens > self.long_rope_switch)

    def rotation_epoch_end(self, epoch: int) -> int | None:
        """The most tokens a sequence stays in rotation ``epoch`` for (None: no end)."""
        return self.long_rope_switch if self.long_rope_switch and epoch == 0 else None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}) when chunked prefill is off, "
                "or a long prompt could never be scheduled"
            )
        if self.preemption_mode not in (None, "recompute", "swap"):
            raise ValueError(
                f"preemption_mode must be None, 'recompute' or 'swap', got {self.preemption_mode!r}"
            )
        if self.allocation_policy not in ALLOCATION_POLICIES:
            raise ValueError(
                f"allocation_policy must be one of {', '.join(ALLOCATION_POLICIES)}, "
                f"got {self.allocation_policy!r}"
            )
        if (
            isinstance(self.num_speculative_tokens, bool)
            or not isinstance(self.num_speculative_tokens, int)
            or self.num_speculative_tokens < 0
        ):
            raise ValueError(
                f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens!r}"
            )
        if self.num_speculative_tokens:
            # Validates the three (vLLM's names, in its messages).
            SpeculativeConfig(
                self.num_speculative_tokens,
                self.prompt_lookup_max,
                self.prompt_lookup_min,
            )
        switch = self.long_rope_switch
        if isinstance(switch, bool) or not isinstance(switch, int) or switch < 0:
            raise ValueError(f"long_rope_switch must be an integer >= 0, got {switch!r}")
        size = self.speculative_disable_by_batch_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 0 or size == 1:
            raise ValueError(
                f"speculative_disable_by_batch_size must be 0 (off) or an integer >= 2, got "
                f"{size!r}"
            )
        if self.speculative_method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_method must be one of {', '.join(SPECULATIVE_METHODS)}, got "
                f"{self.speculative_method!r}"
            )
        if self.num_speculative_tokens and self.allocation_policy != "paged":
            raise ValueError(
                f"speculative decoding needs allocation_policy 'paged' (draft tokens take "
                f"blocks on demand), got {self.allocation_policy!r}"
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                f"got {self.scheduling_policy!r}"
            )
        if self.scheduling_policy == "priority" and self.allocation_policy != "paged":
            raise ValueError(
                f"scheduling_policy 'priority' needs allocation_policy 'paged' (it preempts "
                f"to make room; the reservation baselines never do), got "
                f"{self.allocation_policy!r}"
            )
        if isinstance(self.max_loras, bool) or not isinstance(self.max_loras, int):
            raise ValueError(f"max_loras must be an integer, got {self.max_loras!r}")
        if self.max_loras < 0:
            raise ValueError(f"max_loras must be >= 1 (or 0: no cap), got {self.max_loras}")
        if (
            isinstance(self.sliding_window, bool)
            or not isinstance(self.sliding_window, int)
            or self.sliding_window < 0
        ):
            raise ValueError(
                f"sliding_window must be an integer >= 0 (tokens; 0: none), "
                f"got {self.sliding_window!r}"
            )
        if self.model_task not in MODEL_TASKS:
            raise ValueError(
                f"model_task must be one of {', '.join(MODEL_TASKS)}, got {self.model_task!r}"
            )
        if not 0.0 <= self.watermark_fraction < 1.0:
            raise ValueError(f"watermark_fraction must be in [0, 1), got {self.watermark_fraction}")
