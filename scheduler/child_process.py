"""What every child process of the engine does first, and how its end is described.

A child must never outlive the process that started it: a scheduler without its
frontend, or a worker without its scheduler, would hold memory (the KV cache, shared
memory) and a device with nobody to serve. The parent's own cleanup covers an orderly
exit; ``die_with_parent`` covers the parent being killed outright.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def die_with_parent(expected_parent_pid: int) -> None:
    """Have the kernel SIGKILL this process when its parent dies (Linux only).

    Call first thing in a child's main. The kernel tracks the parent *thread* that
    started the child: a parent must start children from a thread that lives as long
    as they should (the main thread, normally). A parent that died before this call
    went unnoticed by the kernel, so the parent pid is compared too: a child already
    orphaned exits at once.
    """
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"prctl(PR_SET_PDEATHSIG): {os.strerror(error)}")
    if os.getppid() != expected_parent_pid:
        # os._exit: nothing of this process is worth cleaning up yet, and its parent,
        # which would read an exit status, is gone.
        os._exit(1)


def describe_exit(exit_code: int | None) -> str:
    """``exit code -9 (killed by SIGKILL)``: a process's end, as ``Popen.returncode`` and
    ``multiprocessing.Process.exitcode`` report it (negative: killed by that signal)."""
    if exit_code is None:
        return "no exit code (still running)"
    if exit_code < 0:
        try:
            name = signal.Signals(-exit_code).name
        except ValueError:
            name = f"signal {-exit_code}"
        return f"exit code {exit_code} (killed by {name})"
    return f"exit code {exit_code}"
