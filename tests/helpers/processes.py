"""What tests read of processes from /proc: liveness, process groups, children."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path


def stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (state, ppid, pgrp, ...)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def is_live(pid: int) -> bool:
    fields = stat_fields(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def _live_where(field: int, value: int) -> list[int]:
    pids = [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]
    return [
        pid
        for pid in pids
        if (fields := stat_fields(pid)) is not None
        and int(fields[field]) == value
        and fields[0] not in ("Z", "X")
    ]


def live_processes_in_group(process_group: int) -> list[int]:
    """Live processes whose process group is ``process_group``: the scheduler leads its
    own group, and its workers and helpers belong to it."""
    return _live_where(2, process_group)


def live_children(pid: int) -> list[int]:
    return _live_where(1, pid)


def wait_until(condition: Callable[[], bool], timeout_s: float) -> bool:
    deadline_s = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline_s:
            return False
        time.sleep(0.01)
    return True
