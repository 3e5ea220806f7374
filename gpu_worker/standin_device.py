"""A stand-in for an asynchronous device, to measure the CPU work around a step on a CPU.

With ``PAGEDSERVE_STANDIN_DEVICE_MS=T`` a worker's model runs no forward pass: each forward
is queued on a device timeline of its own, which it keeps busy for T milliseconds after
the work queued before it, and returns zeros at once (the logits are zeros). A GPU runs
the forward while the CPU goes on; the timeline models that: the host is free until it
waits for the step's event (``DeadlineEvent``: done when the timeline reaches the end of
that forward), where a real forward on this CPU would compete with the engine's own
work. What the host does on the step's tensors meanwhile (the logits, the sampling) runs
at once on the host and costs its host time (on a GPU those are device work too: this
model charges their host time, never less). With T = 0 the forward costs nothing, so a
step's time is all the CPU work around it. The tokens are meaningless (every logit ties):
for benchmarks only (tools/bench_step_overhead.py), never for serving.
"""

from __future__ import annotations

import logging
import os
import time

import torch

from pagedserve.gpu_worker.step_events import DeadlineEvent

STANDIN_ENV = "PAGEDSERVE_STANDIN_DEVICE_MS"

log = logging.getLogger(__name__)


def standin_forward_ms() -> float | None:
    """T from the environment, or None when the real model runs."""
    value = os.environ.get(STANDIN_ENV)
    if not value:
        return None
    try:
        forward_ms = float(value)
    except ValueError:
        forward_ms = float("nan")
    if not 0.0 <= forward_ms < float("inf"):
        raise ValueError(f"{STANDIN_ENV} must be a number of milliseconds >= 0, got {value!r}")
    return forward_ms


class StandinModel:
    """``model`` with its forward and logits replaced; everything else is the model's."""

    def __init__(
        self, model: torch.nn.Module, forward_ms: float, hidden_size: int, vocab_size: int
    ):
        self._model = model
        self._forward_s = forward_ms / 1000.0
        self._hidden_size = hidden_size
        self._vocab_size = vocab_size
        # When the device timeline is done with everything queued so far.
        self._busy_until_s = 0.0
        log.warning(
            "%s=%s: a stand-in device; no forward runs and every token is meaningless",
            STANDIN_ENV,
            forward_ms,
        )

    def __call__(self, input_ids: torch.Tensor, positions, metadata) -> torch.Tensor:
        self._busy_until_s = max(time.monotonic(), self._busy_until_s) + self._forward_s
        return torch.zeros(input_ids.shape[0], self._hidden_size)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.zeros(hidden.shape[0], self._vocab_size)

    def step_event(self) -> DeadlineEvent:
        """Marks the work queued so far (ModelRunner.launch's event)."""
        return DeadlineEvent(self._busy_until_s)

    def __getattr__(self, name: str):
        return getattr(self._model, name)
