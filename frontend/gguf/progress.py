"""A conversion's progress events, sent to the logger and to the caller's callback."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

# The entry point's (gguf_convert.py): every message of a conversion under one name.
logger = logging.getLogger("pagedserve.frontend.gguf_convert")


@dataclass(frozen=True)
class ConversionProgress:
    """One progress event: `stage` is reading, dequantizing, writing, tokenizer or done;
    `done`/`total` count tensors while dequantizing and are 0 otherwise."""

    stage: str
    done: int
    total: int
    elapsed_s: float

    def __str__(self) -> str:
        count = f" {self.done}/{self.total} tensors" if self.total else ""
        return f"{self.stage}{count} ({self.elapsed_s:.1f} s)"


ProgressCallback = Callable[[ConversionProgress], None]


class Reporter:
    """Sends each progress event to the logger and to the caller's callback."""

    def __init__(self, gguf_name: str, callback: ProgressCallback | None) -> None:
        self._gguf_name = gguf_name
        self._callback = callback
        self._start = time.perf_counter()

    def __call__(self, stage: str, done: int = 0, total: int = 0) -> None:
        event = ConversionProgress(stage, done, total, time.perf_counter() - self._start)
        logger.info("converting %s: %s", self._gguf_name, event)
        if self._callback is not None:
            self._callback(event)
