"""The executor across processes: step plans out to worker processes, results back.

``MultiprocExecutor`` owns the worker processes, the step broadcaster and the socket
results arrive on. ``execute(plan)`` is the in-process ``Worker.execute`` over the wire::

    scheduler                          worker rank 0 .. N-1
    encode(plan) -> StepBroadcaster ->  StepReceiver -> Worker.execute(plan)
    StepResult  <- ZeroMQ PULL     <--  ZeroMQ PUSH (rank 0 only)

Workers are started with the ``spawn`` context (their main is
``gpu_worker/worker_process.py``); this process never imports torch. A worker's exit is
noticed the moment it happens: each process's sentinel (a pipe that reaches end of file
when the process ends) is polled together with the result socket, so a dead worker
raises ``WorkerDiedError`` instead of leaving a step waiting forever.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess

import zmq

from pagedserve.scheduler.broadcast import StepBroadcaster
from pagedserve.scheduler.child_process import describe_exit
from pagedserve.scheduler.engine_messages import EngineError, Ready, StartWorker, WorkerSpec
from pagedserve.scheduler.messages import StepPlan, StepResult
from pagedserve.scheduler.serialization import Message, decode, encode

# A worker that fails sends an EngineError and then exits; its sentinel may fire before
# the message has crossed the socket, so a dying worker's last word is awaited this long.
_LAST_WORD_WAIT_S = 0.5
# Between checks of the workers' sentinels while the broadcast handshake runs.
_HANDSHAKE_SLICE_S = 0.1


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
        if world_size != 1:
            raise NotImplementedError(
                f"world_size={world_size}: tensor parallelism is not built yet; use 1"
            )
        self.world_size = world_size
        self._broadcaster = StepBroadcaster(world_size, ipc_dir=ipc_dir)
        self._results = context.socket(zmq.PULL)
        self._results.setsockopt(zmq.LINGER, 0)
        result_path = os.path.join(ipc_dir, "results.sock")
        self._results.bind(f"ipc://{result_path}")
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

    def wait_until_ready(self, on_ready: Callable[[Ready], None]) -> Ready:
        """Wait for every worker's ``Ready`` (each passed to ``on_ready`` as it comes),
        then for every worker to join the step broadcast. Returns rank 0's ``Ready``.
        Raises ``WorkerDiedError`` for a worker that ends first. No deadline: loading a
        model takes what it takes, and the frontend, which owns the start-up deadline,
        kills the engine when it passes."""
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
                return ready[0]
            except TimeoutError:
                self.check_workers()

    def execute(self, plan: StepPlan) -> StepResult:
        self._broadcaster.broadcast(encode(plan))
        message = self._receive(waiting_for=f"the result of step {plan.step_id}")
        if not isinstance(message, StepResult) or message.step_id != plan.step_id:
            raise RuntimeError(
                f"expected the StepResult of step {plan.step_id}, got {_describe(message)}"
            )
        return message

    def _receive(self, waiting_for: str) -> Message:
        """The next message from the workers (``waiting_for`` says what it should be);
        ``WorkerDiedError`` for a worker's ``EngineError`` or its end."""
        while True:
            events = dict(self._poller.poll())
            if self._results in events:
                message = decode(self._results.recv())
                if isinstance(message, EngineError):
                    raise WorkerDiedError(message.message)
                return message
            if events:
                self.check_workers()
            else:
                raise RuntimeError(f"woke without an event while waiting for {waiting_for}")

    def check_workers(self) -> None:
        """Raise ``WorkerDiedError`` if any worker has ended, with its own last word
        (an ``EngineError``) when it sent one."""
        ended = wait(self.sentinels, timeout=0)
        if not ended:
            return
        dead = [process for process in self._processes if process.sentinel in ended]
        # The sentinel closes a moment before the process can be reaped.
        dead[0].join(_LAST_WORD_WAIT_S)
        if self._results.poll(_LAST_WORD_WAIT_S * 1000):
            message = decode(self._results.recv())
            if isinstance(message, EngineError):
                raise WorkerDiedError(f"{message.message} ({describe_exit(dead[0].exitcode)})")
        rank = self._processes.index(dead[0])
        raise WorkerDiedError(
            f"worker rank {rank} (pid {dead[0].pid}) died with {describe_exit(dead[0].exitcode)}"
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


def _worker_main(start_frame: bytes) -> None:
    """The spawned process's target. It lives here, and imports the worker's main only
    once in the child, because pickling a target by reference imports its module in the
    parent too, and the worker's module brings torch into the scheduler."""
    from pagedserve.gpu_worker.worker_process import main

    main(start_frame)


def _describe(message: Message) -> str:
    step_id = getattr(message, "step_id", None)
    return type(message).__name__ + ("" if step_id is None else f" of step {step_id}")
