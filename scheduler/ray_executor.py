"""Workers placed on a Ray cluster: ``distributed_executor_backend="ray"``.

The operator starts Ray on each node (``ray start --head`` on one, ``ray start
--address=HEAD:6379`` on the others: docs/operations.md, "Several nodes"). The scheduler
process connects to that cluster as a driver (``ray_address``; ``auto``: the cluster this
host's ``ray start`` joined), reserves one bundle a rank in a placement group (a GPU and a
CPU each, packed: one node's GPUs fill before the next; or a CPU each, spread over the
nodes), and starts a ``RayWorker`` actor in each bundle, which runs the same worker main as a local
worker process (``gpu_worker/worker_process.py``)::

    scheduler process (Ray driver) ---- ring ----------> ranks on its own node
        StepBroadcaster ------------ ZeroMQ over TCP --> ranks on other nodes
        results (PULL) <--- ipc:// (same node) / tcp:// (other nodes) --- ranks

Ranks on the scheduler's node come first; the ranks meet at a TCP store on rank 0's
host. A rank's device is its bundle's GPU (Ray sets ``CUDA_VISIBLE_DEVICES``: ``cuda:0``
inside the actor). The engine's ``PAGEDSERVE_*`` environment and its ``OMP_NUM_THREADS`` (or
its absence: Ray would set one thread) travel to the actors.

Liveness: an actor's ``run`` returns when its worker ends (0: the plans stopped; 1: it
failed and said why), and a killed actor's ``run`` fails with Ray's error. A thread waits
on them and writes a byte to a pipe for each that ends: the pipe's read end is the
executor's sentinel, polled with its sockets as a local process's is. The actors belong
to this process: Ray ends them when it ends, however it ends.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pagedserve.scheduler.child_process import describe_exit
from pagedserve.scheduler.engine_messages import StartWorker, WorkerSpec
from pagedserve.scheduler.multiproc_executor import EndedWorker
from pagedserve.scheduler.serialization import encode

# How long the cluster may take to grant every rank's bundle: a node that is still
# joining is waited for; resources that never come are an error naming what is missing.
PLACEMENT_TIMEOUT_S = 60.0
# The watcher thread's wait on the actors, between looks at whether to stop.
_WATCH_SLICE_S = 0.5
# Environment the actors get from the engine: the engine's own switches, and its
# OMP_NUM_THREADS under another name (RayWorker.run).
_FORWARDED_ENV_PREFIXES = ("PAGEDSERVE_",)
_ENGINE_OMP_ENV = "PAGEDSERVE_ENGINE_OMP_NUM_THREADS"


class RayWorker:
    """One rank, as a Ray actor (made remote below)."""

    def node_info(self) -> dict[str, Any]:
        return {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}

    def free_port(self, host: str) -> int:
        """A TCP port free on ``host`` (this actor's node's address) now: the rendezvous,
        if this is rank 0."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((host, 0))
            return probe.getsockname()[1]

    def run(self, start_frame: bytes) -> int:
        """The worker's main until it ends; its exit code (0 or 1)."""
        # Ray sets OMP_NUM_THREADS to the actor's one CPU where the engine's environment
        # left it unset: a CPU rank would compute on one core. The engine's own value, or
        # none (the worker then divides the host's cores among its ranks, as a local one).
        engine_value = os.environ.pop(_ENGINE_OMP_ENV, "")
        if engine_value:
            os.environ["OMP_NUM_THREADS"] = engine_value
        else:
            os.environ.pop("OMP_NUM_THREADS", None)
        from pagedserve.gpu_worker.worker_process import main

        try:
            main(start_frame)
        except SystemExit as exit_:
            return exit_.code if isinstance(exit_.code, int) else 1
        return 0


_RemoteWorker = ray.remote(RayWorker)


@dataclass(frozen=True)
class PlacedRank:
    """Where one rank's actor runs."""

    node_id: str
    ip: str
    pid: int
    on_driver_node: bool


class RayWorkers:
    """The executor's ``Workers`` as Ray actors (see the module docstring)."""

    def __init__(self, spec: WorkerSpec, world_size: int, address: str) -> None:
        self._world_size = world_size
        env = {
            name: value
            for name, value in os.environ.items()
            if name.startswith(_FORWARDED_ENV_PREFIXES)
        }
        env[_ENGINE_OMP_ENV] = os.environ.get("OMP_NUM_THREADS", "")
        ray.init(
            address=address,
            namespace="pagedserve",
            log_to_driver=False,
            configure_logging=False,
            runtime_env={"env_vars": env},
        )
        self.driver_node_id = ray.get_runtime_context().get_node_id()
        self.driver_ip = _node_addresses()[self.driver_node_id]
        gpu = spec.device.startswith("cuda")
        bundle = {"GPU": 1.0, "CPU": 1.0} if gpu else {"CPU": 1.0}
        # GPU ranks fill a node before the next (its GPUs share NVLink); CPU ranks spread,
        # each to cores of its own.
        strategy = "PACK" if gpu else "SPREAD"
        self._group = placement_group([bundle] * world_size, strategy=strategy)
        try:
            ray.get(self._group.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            available = ray.available_resources()
            remove_placement_group(self._group)
            raise RuntimeError(
                f"the Ray cluster at {address!r} did not grant tensor_parallel_size="
                f"{world_size} bundles of {bundle} within {PLACEMENT_TIMEOUT_S:.0f} s; it has "
                f"{_resources(available)} free"
            ) from None
        self._actors = [
            _RemoteWorker.options(
                num_cpus=1,
                num_gpus=1 if gpu else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._group, index),
            ).remote()
            for index in range(world_size)
        ]
        self._placed: list[PlacedRank] = []
        self.rendezvous = ""
        self._runs: list[ray.ObjectRef] = []
        self._ended: dict[int, int | BaseException] = {}
        self._lock = threading.Lock()
        self._read_fd, self._write_fd = os.pipe()
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None

    def place(self) -> list[PlacedRank]:
        """Where each rank runs, in rank order: the scheduler's node first, then by
        address. Sets ``rendezvous`` (a TCP store on rank 0's host)."""
        infos = ray.get([actor.node_info.remote() for actor in self._actors])
        addresses = _node_addresses()
        for info in infos:
            info["ip"] = addresses[info["node_id"]]
        order = sorted(
            range(self._world_size),
            key=lambda i: (infos[i]["node_id"] != self.driver_node_id, infos[i]["ip"], i),
        )
        self._actors = [self._actors[i] for i in order]
        self._placed = [
            PlacedRank(
                infos[i]["node_id"],
                infos[i]["ip"],
                infos[i]["pid"],
                infos[i]["node_id"] == self.driver_node_id,
            )
            for i in order
        ]
        port = ray.get(self._actors[0].free_port.remote(self._placed[0].ip))
        self.rendezvous = f"tcp://{self._placed[0].ip}:{port}"
        return self._placed

    def start(self, starts: list[StartWorker]) -> None:
        self._runs = [actor.run.remote(encode(start)) for actor, start in zip(self._actors, starts)]
        self._watcher = threading.Thread(
            target=self._watch, name="pagedserve-ray-watcher", daemon=True
        )
        self._watcher.start()

    def _watch(self) -> None:
        pending = {ref: rank for rank, ref in enumerate(self._runs)}
        while pending and not self._stopping.is_set():
            done, _ = ray.wait(list(pending), num_returns=1, timeout=_WATCH_SLICE_S)
            for ref in done:
                rank = pending.pop(ref)
                outcome: int | BaseException
                try:
                    outcome = ray.get(ref)
                except Exception as error:  # the actor died: its error says how
                    outcome = error
                with self._lock:
                    self._ended[rank] = outcome
                os.write(self._write_fd, b"x")

    @property
    def pids(self) -> list[int]:
        return [placed.pid for placed in self._placed]

    @property
    def sentinels(self) -> list[int]:
        return [self._read_fd]

    def ended(self, timeout_s: float) -> list[EndedWorker]:
        wait([self._read_fd], timeout=timeout_s)
        with self._lock:
            ended = dict(self._ended)
        workers = []
        for rank, outcome in sorted(ended.items()):
            if isinstance(outcome, BaseException):
                how = f"its Ray actor's end ({_first_line(outcome)})"
                silent = True
            else:
                how = describe_exit(outcome)
                silent = outcome != 1
            workers.append(EndedWorker(rank, how, silent, f"{self._name(rank)} died with {how}"))
        return workers

    def _name(self, rank: int) -> str:
        placed = self._placed[rank]
        transport = "" if placed.on_driver_node else ", plans over TCP"
        return (
            f"worker rank {rank} (pid {placed.pid}) on node {placed.ip} "
            f"({placed.node_id[:12]}{transport})"
        )

    def describe(self) -> str:
        return (
            "the workers (" + ", ".join(self._name(rank) for rank in range(len(self._placed))) + ")"
        )

    def shutdown(self, timeout_s: float) -> None:
        if not ray.is_initialized():
            return
        deadline_s = time.monotonic() + timeout_s
        if self._runs:
            ray.wait(self._runs, num_returns=len(self._runs), timeout=max(0.0, timeout_s))
        self._stopping.set()
        for actor in self._actors:
            ray.kill(actor)
        if self._watcher is not None:
            self._watcher.join(max(0.0, deadline_s - time.monotonic()) + _WATCH_SLICE_S)
        remove_placement_group(self._group)
        ray.shutdown()
        os.close(self._read_fd)
        os.close(self._write_fd)


def _node_addresses() -> dict[str, str]:
    """Each live node's id -> the address it serves on (its ``ray start --node-ip-address``),
    which the engine's TCP endpoints use too."""
    return {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes() if node["Alive"]}


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def _resources(resources: dict[str, float]) -> str:
    shown = {name: value for name, value in resources.items() if name in ("CPU", "GPU")}
    return ", ".join(f"{value:g} {name}" for name, value in sorted(shown.items())) or "nothing"
