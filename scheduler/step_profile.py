"""Where an engine step's CPU time goes, stage by stage, in every process of an engine.

Off unless ``PAGEDSERVE_STEP_PROFILE`` names a folder (child processes inherit it). Then
each process adds the nanoseconds of each named stage of each step to its totals and, at
exit, writes them to ``<folder>/<process>-<pid>.json``: ``{"process", "pid", "stages":
{name: {"total_ns", "count"}}}``. tools/bench_step_overhead.py reads them. Off, a stage
costs one attribute read: ``now()`` and ``lap()`` return 0 without reading the clock.

Usage, around consecutive stages::

    started_ns = PROFILE.now()
    plan = scheduler.schedule()
    started_ns = PROFILE.lap("schedule", started_ns)
"""

from __future__ import annotations

import atexit
import json
import os
import time
from pathlib import Path

PROFILE_ENV = "PAGEDSERVE_STEP_PROFILE"


class StepProfile:
    def __init__(self, folder: str | None) -> None:
        self.enabled = bool(folder)
        self._folder = Path(folder) if folder else None
        self._process = f"process-{os.getpid()}"
        self._totals_ns: dict[str, int] = {}
        self._counts: dict[str, int] = {}
        if self.enabled:
            atexit.register(self.write)

    def name_process(self, process: str) -> None:
        """What this process is (``scheduler``, ``worker0``, ``frontend``), for its file."""
        self._process = process

    def now(self) -> int:
        return time.perf_counter_ns() if self.enabled else 0

    def lap(self, stage: str, started_ns: int) -> int:
        """Add the time since ``started_ns`` to ``stage``; the clock now, for the next."""
        if not self.enabled:
            return 0
        now_ns = time.perf_counter_ns()
        self._totals_ns[stage] = self._totals_ns.get(stage, 0) + now_ns - started_ns
        self._counts[stage] = self._counts.get(stage, 0) + 1
        return now_ns

    def take(self) -> dict[str, dict[str, int]]:
        """The stages' totals so far (``{name: {"total_ns", "count"}}``), then zero: how
        a benchmark reads the process it runs in."""
        stages = self._stages()
        self._totals_ns, self._counts = {}, {}
        return stages

    def write(self) -> None:
        """This process's totals to its file (again at exit: the file holds the last)."""
        if not self.enabled or not self._counts:
            return
        record = {"process": self._process, "pid": os.getpid(), "stages": self._stages()}
        self._folder.mkdir(parents=True, exist_ok=True)
        path = self._folder / f"{self._process}-{os.getpid()}.json"
        path.write_text(json.dumps(record, indent=1))

    def _stages(self) -> dict[str, dict[str, int]]:
        return {
            stage: {"total_ns": self._totals_ns[stage], "count": self._counts[stage]}
            for stage in self._totals_ns
        }


PROFILE = StepProfile(os.environ.get(PROFILE_ENV))
