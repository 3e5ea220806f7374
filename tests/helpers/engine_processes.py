"""A multi-process engine's processes in tests: the live scheduler processes, a ``generate``
call on a thread to kill a process under, and the check that an ended engine left nothing."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

from helpers.processes import is_live, live_processes_in_group, wait_until
from pagedserve.frontend import LLM, SamplingParams

DEATH_NOTICED_WITHIN_S = 5.0
# Long enough that a process killed a few steps in dies mid-generation.
LONG = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)


def live_schedulers() -> set[int]:
    """The live scheduler processes on this machine (``/proc``)."""
    pids = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            command = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if b"pagedserve.scheduler.engine_process" in command and is_live(int(entry)):
            pids.add(int(entry))
    return pids


def assert_engine_gone(
    llm: LLM, scheduler_pid: int, worker_pids: list[int], ring: str | None
) -> None:
    """The engine stopped: its scheduler's process group, its workers and its shared-memory
    ring (``ring``: its name, or None) are gone."""
    assert not llm.engine.is_running
    assert wait_until(lambda: not live_processes_in_group(scheduler_pid), 5.0), (
        live_processes_in_group(scheduler_pid)
    )
    assert not any(is_live(pid) for pid in [scheduler_pid, *worker_pids])
    if ring is not None:
        assert not Path("/dev/shm", ring).exists()


def generate_in_thread(llm: LLM, prompts, params, after_steps: int):
    """Run ``generate`` on a thread; returns (thread, outcome, started) where ``started``
    is set once ``after_steps`` engine steps have returned outputs."""
    outcome: dict[str, object] = {}
    started = threading.Event()
    engine_step = llm.engine.step
    steps = 0

    def counting_step():
        nonlocal steps
        deltas = engine_step()
        steps += 1
        if steps >= after_steps:
            started.set()
        return deltas

    llm.engine.step = counting_step

    def run():
        try:
            outcome["result"] = llm.generate(prompts, params)
        except BaseException as error:
            outcome["error"] = error
        finally:
            outcome["ended_s"] = time.monotonic()
            started.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome, started


def kill_mid_generation(llm: LLM, pid: int) -> BaseException:
    """SIGKILL ``pid`` (a worker, an actor or the scheduler) a few steps into a long
    ``generate`` of 16 requests; the error that ``generate`` ended with, which it must do
    within ``DEATH_NOTICED_WITHIN_S`` of the kill."""
    thread, outcome, started = generate_in_thread(llm, [[i + 1] * 8 for i in range(16)], LONG, 5)
    assert started.wait(60) and "ended_s" not in outcome, "generate ended before the kill"
    killed_s = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    thread.join(DEATH_NOTICED_WITHIN_S + 5)
    assert not thread.is_alive(), f"generate hangs after pid {pid} died"
    assert outcome["ended_s"] - killed_s < DEATH_NOTICED_WITHIN_S
    return outcome["error"]
