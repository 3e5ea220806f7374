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

Where the workers run is the executor backend's (``distributed_executor_backend``):
``mp``, processes on this host (``LocalWorkers``); ``ray``, Ray actors placed on the
nodes of a running Ray cluster (``scheduler/ray_executor.py``), which take plans from the
ring on this host's node and over TCP on the others, in the same order. Each rank runs
the same ``gpu_worker/worker_process.py`` main either way.

A worker's exit is noticed the moment it happens: each worker's sentinel (a file
descriptor that becomes readable when it ends) is polled together with the result
socket, so a dead worker raises ``WorkerDiedError`` instead of leaving a step waiting
forever. When one rank dies the others fail in their next collective; the error names
the one that died first (see ``_death_error``).
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any, Protocol

import zmq

from pagedserve.scheduler.broadcast import StepBroadcaster
from pagedserve.scheduler.child_process import describe_exit
from pagedserve.scheduler.engine_messages import EngineError, Ready, StartWorker, WorkerSpec
from pagedserve.scheduler.messages import StepPlan, StepResult
from pagedserve.scheduler.serialization import Message, decode, encode
from pagedserve.scheduler.step_profile import PROFILE

if TYPE_CHECKING:  # imported where used: only the ray backend needs Ray
    from pagedserve.scheduler.ray_executor import RayWorkers

# A worker that fails sends an EngineError and then exits; its sentinel may fire before
# the message has crossed the socket, so a dying worker's last word is awaited this long.
_LAST_WORD_WAIT_S = 0.5
# Between checks of the workers' sentinels while the broadcast handshake runs.
_HANDSHAKE_SLICE_S = 0.1
# While a step's result is late, ``on_wait`` hears of it this often.
WAIT_REPORT_INTERVAL_S = 1.0
# distributed_executor_backend: worker processes on this host, or Ray actors on a cluster.
EXECUTOR_BACKENDS = ("mp", "ray")


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
        backend: str = "mp",
        ray_address: str = "auto",
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if backend not in EXECUTOR_BACKENDS:
            raise ValueError(
                f"distributed_executor_backend must be one of {list(EXECUTOR_BACKENDS)}, "
                f"got {backend!r}"
            )
        self.world_size = world_size
        self._results = context.socket(zmq.PULL)
        self._results.setsockopt(zmq.LINGER, 0)
        result_path = os.path.join(ipc_dir, "results.sock")
        self._results.bind(f"ipc://{result_path}")
        self._broadcaster: StepBroadcaster | None = None
        self._workers: Workers
        if backend == "ray":
            from pagedserve.scheduler.ray_executor import RayWorkers

            ray_workers = RayWorkers(worker_spec, world_size, ray_address)
            self._workers = ray_workers
            self._start_ray_workers(ray_workers, worker_spec, f"ipc://{result_path}", ipc_dir)
        else:
            self._workers = LocalWorkers()
            self._start_local_workers(worker_spec, f"ipc://{result_path}", ipc_dir)
        self._poller = zmq.Poller()
        self._poller.register(self._results, zmq.POLLIN)
        for sentinel in self._workers.sentinels:
            self._poller.register(sentinel, zmq.POLLIN)
        # Told every WAIT_REPORT_INTERVAL_S that a step's result is late: what it waits on
        # (the workers, named) and for how many seconds (the engine loop reports it).
        self.on_wait: Callable[[str, float], None] | None = None

    def _start_local_workers(self, spec: WorkerSpec, result_endpoint: str, ipc_dir: str) -> None:
        self._broadcaster = StepBroadcaster(self.world_size, ipc_dir=ipc_dir)
        # The ranks' rendezvous: a file, not a port, so nothing can take it first.
        init_method = (
            f"file://{os.path.join(ipc_dir, 'tensor_parallel.store')}"
            if self.world_size > 1
            else None
        )
        starts = [
            StartWorker(
                rank=rank,
                world_size=self.world_size,
                scheduler_pid=os.getpid(),
                broadcast=dataclasses.asdict(self._broadcaster.handle),
                result_endpoint=result_endpoint,
                worker=spec,
                distributed_init_method=init_method,
                # One GPU a rank: cuda:0, cuda:1, ...
                device=f"cuda:{rank}" if spec.device == "cuda" and self.world_size > 1 else None,
            )
            for rank in range(self.world_size)
        ]
        self._workers.start(starts)

    def _start_ray_workers(
        self, workers: RayWorkers, spec: WorkerSpec, result_endpoint: str, ipc_dir: str
    ) -> None:
        ranks = workers.place()  # ranks on this node first
        local = [rank for rank in ranks if rank.on_driver_node]
        remote = [rank for rank in ranks if not rank.on_driver_node]
        host = workers.driver_ip
        self._broadcaster = StepBroadcaster(
            len(local),
            len(remote),
            ipc_dir=ipc_dir,
            remote_bind=f"tcp://{host}:*",
            advertise_host=host,
        )
        remote_results = None
        if remote:
            self._results.bind(f"tcp://{host}:*")
            remote_results = self._results.getsockopt_string(zmq.LAST_ENDPOINT)
        handle = dataclasses.asdict(self._broadcaster.handle)
        starts = []
        for rank, placed in enumerate(ranks):
            readers = local if placed.on_driver_node else remote
            starts.append(
                StartWorker(
                    rank=rank,
                    world_size=self.world_size,
                    scheduler_pid=0,  # Ray ends the actors with their owner, this process
                    broadcast=handle,
                    result_endpoint=result_endpoint if placed.on_driver_node else remote_results,
                    worker=spec,
                    distributed_init_method=workers.rendezvous,
                    remote_reader=not placed.on_driver_node,
                    reader_index=readers.index(placed),
                    device="cuda:0" if spec.device.startswith("cuda") else spec.device,
                    ranks_on_host=sum(other.ip == placed.ip for other in ranks),
                )
            )
        workers.start(starts)

    @property
    def worker_pids(self) -> list[int]:
        return self._workers.pids

    @property
    def sentinels(self) -> list[int]:
        """File descriptors that become readable when a worker ends: poll them along with
        other sockets, then call ``check_workers``."""
        return self._workers.sentinels

    @property
    def ring_name(self) -> str | None:
        """The shared-memory segment of the step broadcast, if it uses one."""
        assert self._broadcaster is not None
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
                assert self._broadcaster is not None
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
        assert self._broadcaster is not None
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
        """The workers a step waits on, named for an operator: rank and pid (and node)."""
        return self._workers.describe()

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
        ended = self._workers.ended(_LAST_WORD_WAIT_S)
        silent = [worker for worker in ended if worker.silent]
        if silent:
            return WorkerDiedError(silent[0].description)
        if last_word is None and self._results.poll(_LAST_WORD_WAIT_S * 1000):
            message = decode(self._results.recv())
            if isinstance(message, EngineError):
                last_word = message
        if last_word is not None:
            exit_note = f" ({ended[0].how})" if ended else ""
            return WorkerDiedError(last_word.message + exit_note)
        return WorkerDiedError(ended[0].description)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """End the stream of plans (workers leave their loop and exit), wait for every
        worker, kill those that do not exit within ``timeout_s``, and release the ring
        and the sockets. Idempotent."""
        if self._broadcaster is not None:
            self._broadcaster.close()
        self._workers.shutdown(timeout_s)
        self._results.close()


@dataclass(frozen=True)
class EndedWorker:
    """A worker that has ended: its rank, how (``exit code 1``), whether it ended without
    an ``EngineError`` first (killed, crashed: ``silent``), and the whole line for an
    operator (rank, pid, node, how)."""

    rank: int
    how: str
    silent: bool
    description: str


class Workers(Protocol):
    """Where the executor's workers run: started from their ``StartWorker``s, watched,
    named and stopped (``LocalWorkers``, ``ray_executor.RayWorkers``)."""

    @property
    def pids(self) -> list[int]: ...

    @property
    def sentinels(self) -> list[int]: ...

    def start(self, starts: list[StartWorker]) -> None: ...

    def ended(self, timeout_s: float) -> list[EndedWorker]:
        """The workers that have ended, waiting up to ``timeout_s`` for a first one."""
        ...

    def describe(self) -> str: ...

    def shutdown(self, timeout_s: float) -> None: ...


class LocalWorkers:
    """Worker processes on this host, started with the ``spawn`` context; a process's
    sentinel is a pipe that reaches end of file when it ends."""

    def __init__(self) -> None:
        self._processes: list[BaseProcess] = []

    def start(self, starts: list[StartWorker]) -> None:
        spawn = multiprocessing.get_context("spawn")
        for start in starts:
            # daemon: multiprocessing's own exit handler terminates any left running.
            process = spawn.Process(
                target=_worker_main,
                args=(encode(start),),
                name=f"pagedserve-worker-{start.rank}",
                daemon=True,
            )
            process.start()
            self._processes.append(process)

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self._processes]

    @property
    def sentinels(self) -> list[int]:
        return [process.sentinel for process in self._processes]

    def ended(self, timeout_s: float) -> list[EndedWorker]:
        ended = wait(self.sentinels, timeout=timeout_s)
        workers = []
        for rank, process in enumerate(self._processes):
            if process.sentinel not in ended:
                continue
            # The sentinel closes a moment before the process can be reaped.
            process.join(_LAST_WORD_WAIT_S)
            how = describe_exit(process.exitcode)
            workers.append(
                EndedWorker(
                    rank,
                    how,
                    silent=process.exitcode not in (1, None),
                    description=f"worker rank {rank} (pid {process.pid}) died with {how}",
                )
            )
        return workers

    def describe(self) -> str:
        if len(self._processes) == 1:
            return f"worker rank 0 (pid {self._processes[0].pid})"
        ranks = ", ".join(
            f"rank {rank} pid {process.pid}" for rank, process in enumerate(self._processes)
        )
        return f"the workers ({ranks})"

    def shutdown(self, timeout_s: float) -> None:
        deadline_s = time.monotonic() + timeout_s
        for process in self._processes:
            process.join(max(0.0, deadline_s - time.monotonic()))
            if process.exitcode is None:
                process.kill()
                process.join()


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
