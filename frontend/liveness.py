"""Whether the engine makes progress: work pending and no step completed is a stalled node.

While it has requests, the scheduler sends tokens or a ``Progress`` message at least every
second (``engine_process.PROGRESS_INTERVAL_S``); while a step's result is late it says what
it waits on (a worker, named by rank and pid). ``LivenessMonitor`` watches that pulse from
the event loop::

    work pending, no step completed for stall_timeout_s   -> stalled: the server's health
                                                              turns NOT_SERVING / 503, new
                                                              calls are refused, systemd's
                                                              watchdog is no longer pinged
    a step completes again                                -> serving again
    stalled for stall_exit_timeout_s more                 -> every call in flight ends
                                                              UNAVAILABLE naming the stalled
                                                              process; the server exits 1

A step longer than ``stall_timeout_s`` counts as a stall: raise it for a model whose steps
are that slow.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedserve.frontend.async_engine import AsyncEngine

logger = logging.getLogger("pagedserve.server")

DEFAULT_STALL_TIMEOUT_S = 30.0
DEFAULT_STALL_EXIT_TIMEOUT_S = 30.0
CHECK_INTERVAL_S = 0.25
# A waiting report older than this is stale: the scheduler itself has gone quiet.
_WAITING_REPORT_FRESH_S = 3.0


class LivenessMonitor:
    """Calls ``on_stalled(why)`` when the engine stalls, ``on_recovered()`` when it makes
    progress again, and ``on_dead(why)`` (once; the monitor then ends) when it stays stalled
    past the exit timeout."""

    def __init__(
        self,
        stall_timeout_s: float,
        stall_exit_timeout_s: float,
        on_stalled: Callable[[str], object],
        on_recovered: Callable[[], object],
        on_dead: Callable[[str], object],
    ) -> None:
        self.stall_timeout_s = stall_timeout_s
        self.stall_exit_timeout_s = stall_exit_timeout_s
        self._on_stalled = on_stalled
        self._on_recovered = on_recovered
        self._on_dead = on_dead
        self.stalled: str | None = None  # why, while stalled

    async def run(self, engine: AsyncEngine) -> None:
        """Watch ``engine`` until it is declared dead (or the task is cancelled)."""
        busy_since_s = time.monotonic()
        while True:
            await asyncio.sleep(CHECK_INTERVAL_S)
            progress = engine.progress
            now_s = time.monotonic()
            if progress is None or engine.num_open_requests == 0:
                busy_since_s = now_s  # idle: nothing is owed
                self._recovered()
                continue
            quiet_s = now_s - max(busy_since_s, progress.last_step_s)
            if quiet_s < self.stall_timeout_s:
                self._recovered()
                continue
            if progress.waiting_on and now_s - progress.waiting_reported_s < (
                _WAITING_REPORT_FRESH_S
            ):
                culprit = progress.waiting_on
            else:
                culprit = f"the scheduler (pid {engine.scheduler_pid})"
            why = (
                f"the engine has completed no step for {quiet_s:.0f} s with "
                f"{engine.num_open_requests} requests pending: {culprit} makes no progress"
            )
            if self.stalled is None:
                self.stalled = why
                logger.error("%s; unhealthy until it does", why)
                await _maybe_await(self._on_stalled(why))
            if quiet_s >= self.stall_timeout_s + self.stall_exit_timeout_s:
                logger.error("%s; giving up", why)
                await _maybe_await(self._on_dead(why))
                return

    def _recovered(self) -> None:
        if self.stalled is not None:
            self.stalled = None
            logger.warning("the engine makes progress again; serving")
            asyncio.ensure_future(_maybe_await(self._on_recovered()))


async def _maybe_await(result: object) -> None:
    if asyncio.iscoroutine(result):
        await result
