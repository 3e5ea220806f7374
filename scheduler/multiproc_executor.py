"""The executor across processes: step plans out to worker processes, results back.

``MultiprocExecutor`` owns the worker processes, the step broadcaster and the socket
results arrive on. ``execute(plan)`` is the in-process ``Worker.execute`` over the wire::

    scheduler                          worker rank 0 .. N-1
    encode(plan) -> StepBroadcaster ->  StepReceiver -> Worker.execute(plan)
    StepResult  <- ZeroMQ PULL     <--  ZeroMQ PUSH (rank 0 only)

Workers are started with the ``spawn`` context (their main is
``gpu_worker/worker_process.py``); this process never imports torch. With
``world_size`` > 1 the workers are tensor-parallel ranks: they meet through a
torch.distributed file store in the engine's private socket directory, and each holds
its own KV heads in a cache of as many blocks as the others (the scheduler plans one
block space: it takes the smallest count any rank reports).

A worker's exit is noticed the moment it happens: each process's sentinel (a pipe that
reaches end of file when the process ends) is polled together with the result socket,
so a dead worker raises ``WorkerDiedError`` instead of leaving a step waiting forever.
When one rank dies the others fail in their next collective; the error names the one
that died first (see ``_death_error``).
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from typing import Any

import zmq

from pagedserve.scheduler.broadcast import StepBroadcaster
from pagedserve.scheduler.child_process import describe_exit
from pagedserve.scheduler.engine_messages import EngineError, Ready, StartWorker, WorkerSpec
from pagedserve.scheduler.messages import StepPlan, StepResult
from pagedserve.scheduler.serialization import Message, decode, encode
from pagedserve.scheduler.step_profile import PROFILE

# A worker that fails sends an EngineError and then exits; its sentinel may fire before
# the message has crossed the socket, so a dying worker's last word is awaited this long.
_LAST_WORD_WAIT_S = 0.5
# Between checks of the workers' sentinels while the broadcast handshake runs.
_HANDSHAKE_SLICE_S = 0.1
# While a step's result is late, ``on_wait`` hears of it this often.
WAIT_REPORT_INTERVAL_S = 1.0


class WorkerDiedError(RuntimeError):
    """A worker process has ended (killed, crashed, or failed and said why): the engine
    cannot run another step. The message names the rank, the pid and how it ended."""


class MultiprocExecutor:
    """Runs each step plan on every worker process and returns rank 0's result.

    Invariant: workers receive plans in the order ``execute`` is called, and each call
    returns the result of its own plan (checked by ``step_id``); one plan is in flight
    at a time. Not thread-safe: the engine loop's thread calls it.
    """

    def __init__(
        self,
        worker_spec: WorkerSpec,
        world_size: int,
        ipc_dir: str,
        context: zmq.Context,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self._broadcaster = StepBroadcaster(world_size, ipc_dir=ipc_dir)
        self._results = context.socket(zmq.PULL)
        self._results.setsockopt(zmq.LINGER, 0)
        result_path = os.path.join(ipc_dir, "results.sock")
        self._results.bind(f"ipc://{result_path}")
        # The ranks' rendezvous: a file, not a port, so nothing can take it first.
        init_method = (
            f"file://{os.path.join(ipc_dir, 'tensor_parallel.store')}" if world_size > 1 else None
        )
        spawn = multiprocessing.get_context("spawn")
        self._processes: list[BaseProcess] = []
        for rank in range(world_size):
            start = StartWorker(
                rank=rank,
                world_size=world_size,
                scheduler_pid=os.getpid(),
                broadcast=dataclasses.asdict(self._broadcaster.handle),
                result_endpoint=f"ipc://{result_path}",
                worker=worker_spec,
                distributed_init_method=init_method,
            )
            # daemon: multiprocessing's own exit handler terminates any left running.
            process = spawn.Process(
                target=_worker_main,
                args=(encode(start),),
                name=f"pagedserve-worker-{rank}",
                daemon=True,
            )
            process.start()
            self._processes.append(process)
        self._poller = zmq.Poller()
        self._poller.register(self._results, zmq.POLLIN)
        for process in self._processes:
            self._poller.register(process.sentinel, zmq.POLLIN)
        # Told every WAIT_REPORT_INTERVAL_S that a step's result is late: what it waits on
        # (the workers, named) and for how many seconds (the engine loop reports it).
        self.on_wait: Callable[[str, float], None] | None = None

    @property
    def worker_pids(self) -> list[int]:
        return [process.pid for process in self._processes]

    @property
    def sentinels(self) -> list[int]:
        """File descriptors that become readable when a worker ends: poll them along with
        other sockets, then call ``check_workers``."""
        return [process.sentinel for process in self._processes]

    @property
    def ring_name(self) -> str | None:
        """The shared-memory segment of the step broadcast, if it uses one."""
        return self._broadcaster.handle.ring_name

    def wait_until_ready(self, on_ready: Callable[[Ready], None]) -> dict[str, Any]:
        """Wait for every worker's ``Ready`` (each passed to ``on_ready`` as it comes),
        then for every worker to join the step broadcast. Returns the cache every rank
        can hold (``cache_sizes``). Raises ``WorkerDiedError`` for a worker that ends
        first. No deadline: loading a model takes what it takes, and the frontend, which
        owns the start-up deadline, kills the engine when it passes."""
        ready: dict[int, Ready] = {}
        while len(ready) < self.world_size:
            message = self._receive(waiting_for="Ready")
            if isinstance(message, Ready):
                ready[message.info["rank"]] = message
                on_ready(message)
            else:
                raise RuntimeError(f"expected Ready from a worker, got {type(message).__name__}")
        while True:
            try:
                # NOTE: polled in slices so a worker that dies mid-handshake is noticed.
                self._broadcaster.wait_for_readers(_HANDSHAKE_SLICE_S)
                return cache_sizes([ready[rank] for rank in range(self.world_size)])
            except TimeoutError:
                self.check_workers()

    def execute(self, plan: StepPlan) -> StepResult:
        self.submit(plan)
        return self.collect(plan)

    def submit(self, plan: StepPlan) -> None:
        """Send a plan to every worker; they run plans in the order sent."""
        started_ns = PROFILE.now()
        payload = encode(plan)
        started_ns = PROFILE.lap("plan_encode", started_ns)
        self._broadcaster.broadcast(payload)
        PROFILE.lap("plan_send", started_ns)

    def collect(self, plan: StepPlan) -> StepResult:
        """The result of ``plan``, the oldest plan sent whose result is not yet taken."""
        started_ns = PROFILE.now()
        message = self._receive(waiting_for=f"the result of step {plan.step_id}")
        PROFILE.lap("result_receive", started_ns)
        if not isinstance(message, StepResult) or message.step_id != plan.step_id:
            raise RuntimeError(
                f"expected the StepResult of step {plan.step_id}, got {_describe(message)}"
            )
        return message

    def _receive(self, waiting_for: str) -> Message:
        """The next message from the workers (``waiting_for`` says what it should be);
        ``WorkerDiedError`` for a worker's ``EngineError`` or its end."""
        started_s = time.monotonic()
        timeout_ms = None if self.on_wait is None else WAIT_REPORT_INTERVAL_S * 1000
        while True:
            events = dict(self._poller.poll(timeout_ms))
            if self._results in events:
                frame = self._results.recv()
                decode_started_ns = PROFILE.now()
                message = decode(frame)
                PROFILE.lap("result_decode", decode_started_ns)
                if isinstance(message, EngineError):
                    raise self._death_error(message)
                return message
            if events:
                self.check_workers()
            elif self.on_wait is not None:
                self.on_wait(self.workers_description(), time.monotonic() - started_s)
            else:
                raise RuntimeError(f"woke without an event while waiting for {waiting_for}")

    def workers_description(self) -> str:
        """The workers a step waits on, named for an operator: rank and pid."""
        if self.world_size == 1:
            return f"worker rank 0 (pid {self._processes[0].pid})"
        ranks = ", ".join(
            f"rank {rank} pid {process.pid}" for rank, process in enumerate(self._processes)
        )
        return f"the workers ({ranks})"

    def check_workers(self) -> None:
        """Raise ``WorkerDiedError`` if any worker has ended, naming the cause."""
        if wait(self.sentinels, timeout=0):
            raise self._death_error(None)

    def _death_error(self, last_word: EngineError | None) -> WorkerDiedError:
        """What ended the engine, once a worker has ended or sent ``last_word``.

        A worker that fails says why (an ``EngineError``), then exits with code 1; so
        does a rank whose peer died, in its next collective. A worker that ended any
        other way (killed, crashed) said nothing and is the cause; otherwise the first
        word that arrived names it.
        """
        # The worker that spoke exits next: wait for it, so that a peer that died
        # before it (its sentinel a moment behind) is seen too.
        ended = wait(self.sentinels, timeout=_LAST_WORD_WAIT_S)
        dead = [process for process in self._processes if process.sentinel in ended]
        for process in dead:
            # The sentinel closes a moment before the process can be reaped.
            process.join(_LAST_WORD_WAIT_S)
        silent = [process for process in dead if process.exitcode not in (1, None)]
        if silent:
            process = silent[0]
            rank = self._processes.index(process)
            return WorkerDiedError(
                f"worker rank {rank} (pid {process.pid}) died with "
                f"{describe_exit(process.exitcode)}"
            )
        if last_word is None and self._results.poll(_LAST_WORD_WAIT_S * 1000):
            message = decode(self._results.recv())
            if isinstance(message, EngineError):
                last_word = message
        if last_word is not None:
            exit_note = f" ({describe_exit(dead[0].exitcode)})" if dead else ""
            return WorkerDiedError(last_word.message + exit_note)
        process = dead[0]
        return WorkerDiedError(
            f"worker rank {self._processes.index(process)} (pid {process.pid}) died with "
            f"{describe_exit(process.exitcode)}"
        )

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """End the stream of plans (workers leave their loop and exit), wait for every
        worker, kill those that do not exit within ``timeout_s``, and release the ring
        and the sockets. Idempotent."""
        self._broadcaster.close()
        deadline_s = time.monotonic() + timeout_s
        for process in self._processes:
            process.join(max(0.0, deadline_s - time.monotonic()))
            if process.exitcode is None:
                process.kill()
                process.join()
        self._results.close()


def cache_sizes(ready_by_rank: list[Ready]) -> dict[str, Any]:
    """The KV cache the scheduler plans with, from every rank's ``Ready``: the smallest
    device and host block counts (ranks that sized their pools from free memory may
    differ; a rank's extra blocks stay unused), and the bytes per block of one rank
    (every rank holds as many KV heads)."""
    return {
        "num_blocks": min(ready.info["num_blocks"] for ready in ready_by_rank),
        "num_host_blocks": min(ready.info["num_host_blocks"] for ready in ready_by_rank),
        "bytes_per_block": ready_by_rank[0].info["bytes_per_block"],
        "tensor_parallel_size": len(ready_by_rank),
    }


def _worker_main(start_frame: bytes) -> None:
    """The spawned process's target. It lives here, and imports the worker's main only
    once in the child, because pickling a target by reference imports its module in the
    parent too, and the worker's module brings torch into the scheduler."""
    from pagedserve.gpu_worker.worker_process import main

    main(start_frame)


def _describe(message: Message) -> str:
    step_id = getattr(message, "step_id", None)
    return type(message).__name__ + ("" if step_id is None else f" of step {step_id}")
