"""When a launched step's device work is done: the worker reads its tokens after that.

A step's forward pass and sampling are queued on the device (``ModelRunner.launch``); the
worker may prepare and queue the next plan's step before reading this one's tokens
(``worker_process.serve``). Each launched step carries one of these, asked whether the
device is done (``query``) and waited on (``synchronize``).
"""

from __future__ import annotations

import time
from typing import Protocol

import torch

# How long a worker waits for the next plan before asking a GPU again whether the step
# in flight is done (an event's query is a few microseconds).
_CUDA_POLL_S = 0.0002


class StepEvent(Protocol):
    def query(self) -> bool:
        """Whether the step's device work is done."""
        ...

    def synchronize(self) -> None:
        """Wait until it is."""
        ...

    def poll_s(self) -> float:
        """How long to wait for something else before asking again."""
        ...


class DoneEvent:
    """A CPU worker's: its ops ran as they were called, so the step is done at launch."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def poll_s(self) -> float:
        return 0.0


class CudaStepEvent:
    """Recorded on the current stream after the step's sampling."""

    def __init__(self, device: torch.device) -> None:
        self._event = torch.cuda.Event()
        self._event.record(torch.cuda.current_stream(device))

    def query(self) -> bool:
        return self._event.query()

    def synchronize(self) -> None:
        self._event.synchronize()

    def poll_s(self) -> float:
        return _CUDA_POLL_S


class DeadlineEvent:
    """The stand-in device's (standin_device.py): done at a known time."""

    def __init__(self, done_at_s: float) -> None:
        self.done_at_s = done_at_s

    def query(self) -> bool:
        return time.monotonic() >= self.done_at_s

    def synchronize(self) -> None:
        remaining_s = self.done_at_s - time.monotonic()
        if remaining_s > 0:
            time.sleep(remaining_s)

    def poll_s(self) -> float:
        return max(0.0, self.done_at_s - time.monotonic())


def step_event(device: torch.device) -> StepEvent:
    """Marks the work queued so far on ``device``."""
    if device.type == "cuda":
        return CudaStepEvent(device)
    return DoneEvent()
