"""The frontend's handle on a multi-process engine: ``EngineCore``'s calls, over ZeroMQ.

``EngineClient`` has the methods ``LLM`` uses on an ``EngineCore`` (``add_request``,
``abort_request``, ``stop_sample``, ``has_unfinished_requests``, ``step``, ``stats``,
``check_integrity``, ``reset_prefix_cache``, ``check_request_fits``), so the offline loop
is the same in both modes. It starts the scheduler process, which starts the workers::

    frontend (this)           scheduler process              worker process(es)
    PUSH input.sock  ------>  PULL   AddRequest, AbortRequest, GetStats, ...
    PULL output.sock <------  PUSH   OutputBatch, EngineStats, EngineError, Ready
                              StepBroadcaster ---- plans ---> StepReceiver
                              PULL results.sock <- results -- PUSH (rank 0)

All sockets are ipc:// in a private temporary directory, removed at shutdown.

Lifecycle:

- Start-up is in two calls, so that the caller's own start-up (loading the tokenizer,
  seconds) runs while the workers load the model: the constructor starts the scheduler,
  which starts the workers at once, and returns; ``finish_start()`` sends what structured
  output needs (``StartStructuredOutput``) and waits. Until it returns, only
  ``shutdown()`` may be called. The scheduler reports ``Ready("scheduler")`` once it has
  started the workers, forwards each worker's ``Ready("worker")`` once its model is
  loaded, and sends ``Ready("engine")`` once the workers have joined the step broadcast.
  Past ``startup_timeout_s`` (counted from the constructor), or when a process fails
  first, ``finish_start()`` raises ``EngineStartupError`` naming the component that did
  not come up.
- A death is noticed at once: ``step()`` and every other wait poll the scheduler's
  socket together with a pidfd of the scheduler process; the scheduler polls its
  workers' sentinels the same way, even when idle, and exits after a worker's death.
- When a worker dies or fails, the scheduler sends an ``EngineError`` naming it (rank,
  pid, exit code or its own error), then ends every request in flight with a
  ``RequestOutputDelta(finished=True, finish_reason="error")`` (what a streaming
  frontend needs), its final stats, and exits. ``step()`` raises ``EngineDeadError``
  with that message as soon as it reads it, so ``LLM.generate`` fails loudly rather
  than return truncated outputs; a scheduler that dies outright makes it raise
  ``EngineDeadError`` naming the scheduler and its exit code.
- ``shutdown()`` (idempotent; also run when the client is garbage-collected and at
  interpreter exit) asks the scheduler to stop, keeps its final ``EngineStats``, waits
  for it, then SIGKILLs whatever is left of the engine's process group (the scheduler
  leads a session of its own, its workers and helpers belong to it) and removes the
  socket directory and the broadcast's shared memory.
- Children never outlive their parent: each asks the kernel to SIGKILL it when its
  parent dies (``child_process.die_with_parent``). NOTE: the kernel tracks the parent
  *thread*: create the engine on a thread that lives as long as it (the main thread).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import zmq

from pagedserve.scheduler import fault_injection
from pagedserve.scheduler.capacity import check_request_fits
from pagedserve.scheduler.child_process import describe_exit
from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.engine_messages import (
    AbortRequest,
    AddRequest,
    EngineError,
    EngineStats,
    GetStats,
    LoadLoRA,
    OutputBatch,
    Progress,
    Ready,
    ResetPrefixCache,
    Shutdown,
    StartEngine,
    StartStructuredOutput,
    StopSample,
    UnloadLoRA,
    WorkerSpec,
)
from pagedserve.scheduler.messages import RequestOutputDelta
from pagedserve.scheduler.pooling_params import PoolingParams
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.scheduler.serialization import Message, decode, encode
from pagedserve.scheduler.step_profile import PROFILE
from pagedserve.scheduler.structured_output import GrammarVocabulary

DEFAULT_STARTUP_TIMEOUT_S = 120.0  # loading a model takes seconds, a large one minutes
DEFAULT_SHUTDOWN_TIMEOUT_S = 5.0
# How long a stats query waits for the scheduler's answer (it comes between two steps).
STATS_TIMEOUT_S = 10.0
# A process that exits right after its last message: that message may still be
# crossing the socket when the exit is seen, so it is awaited this long.
_LAST_WORD_WAIT_S = 0.5
# Without a pidfd (not Linux) the scheduler's exit is checked this often while waiting.
_EXIT_POLL_S = 0.1


class EngineStartupError(RuntimeError):
    """The engine did not come up; the message names the component that did not."""


class RequestRefusedError(ValueError):
    """The scheduler refused one request (it repeats the frontend's checks); the engine
    runs on. ``request_id`` names it."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(f"request {request_id!r}: {message}")
        self.request_id = request_id
        self.reason = message


class RequestFailedError(RuntimeError):
    """One request failed in the engine (an error of the engine's own, caused by that
    request alone); it has ended, and the engine runs on. ``request_id`` names it."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(f"request {request_id!r}: {message}")
        self.request_id = request_id
        self.reason = message


class EngineDeadError(RuntimeError):
    """The engine's processes are gone (a component died or failed): every request that
    was in flight has ended. The message names the component and how it ended."""


@dataclass(frozen=True)
class EngineProgress:
    """The engine's pulse as the frontend last heard it: when a step last completed
    (monotonic seconds), and what the scheduler last said it waits on within a step ("":
    nothing) and when it said so."""

    last_step_s: float
    waiting_on: str
    waiting_reported_s: float


class EngineClient:
    """A scheduler process and its workers, driven like an in-process ``EngineCore``.

    Construct, then ``finish_start()`` (the module docstring's start-up). ``step()``
    blocks until the engine has produced outputs for this client's unfinished requests
    and returns their deltas. Not thread-safe: one thread drives it.
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        worker_spec: WorkerSpec,
        *,
        seed: int = 0,
        enable_prefix_caching: bool = False,
        world_size: int = 1,
        executor_backend: str = "mp",
        ray_address: str = "auto",
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
        shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
    ) -> None:
        if not startup_timeout_s > 0:
            raise ValueError(f"startup_timeout_s must be > 0, got {startup_timeout_s!r}")
        self._startup_deadline_s = time.monotonic() + startup_timeout_s
        self._startup_timeout_s = startup_timeout_s
        self.scheduler_config = scheduler_config
        self.block_size = worker_spec.block_size
        self._process = _SchedulerProcess(shutdown_timeout_s)
        # Holds the process object, not the client: a client dropped without shutdown()
        # still stops its processes, at collection or at interpreter exit.
        self._finalizer = weakref.finalize(self, self._process.stop)
        self._unfinished: set[str] = set()
        # Outputs ended by stop_sample, per unfinished request: their later deltas were
        # made before the engine heard, and are dropped (all but a request's final one).
        self._stopped_samples: dict[str, set[int]] = {}
        self._deltas: list[RequestOutputDelta] = []
        self._refusals: list[RequestRefusedError | RequestFailedError] = []
        self._last_stats: EngineStats | None = None
        #: What the scheduler last said of its progress (read by another thread: the
        #: liveness monitor's; each field is replaced whole).
        self.progress = EngineProgress(time.monotonic(), "", 0.0)
        try:
            self._process.start(
                StartEngine(
                    frontend_pid=os.getpid(),
                    input_endpoint=self._process.input_endpoint,
                    output_endpoint=self._process.output_endpoint,
                    ipc_dir=self._process.ipc_dir,
                    scheduler_config=scheduler_config,
                    seed=seed,
                    enable_prefix_caching=enable_prefix_caching,
                    world_size=world_size,
                    worker=worker_spec,
                    executor_backend=executor_backend,
                    ray_address=ray_address,
                )
            )
        except BaseException:
            self.shutdown()
            raise
        # Known once finish_start() returns.
        self.num_blocks = self.num_host_blocks = self.bytes_per_block = 0

    def finish_start(
        self,
        grammar_vocabulary: GrammarVocabulary | None = None,
        structured_outputs_disable_any_whitespace: bool = False,
    ) -> None:
        """Hand the scheduler what structured output matches grammars over (None: a model
        without a tokenizer) and wait until the engine serves; ``EngineStartupError``
        (the engine shut down) if it does not come up in time."""
        try:
            self._send(
                StartStructuredOutput(grammar_vocabulary, structured_outputs_disable_any_whitespace)
            )
            engine_ready = self._process.wait_until_ready(
                self._startup_deadline_s, self._startup_timeout_s
            )
        except EngineDeadError as error:
            self.shutdown()
            raise EngineStartupError(f"engine start-up failed: {error}") from None
        except BaseException:
            self.shutdown()
            raise
        self.num_blocks: int = engine_ready.info["num_blocks"]
        self.num_host_blocks: int = engine_ready.info["num_host_blocks"]
        self.bytes_per_block: int = engine_ready.info["bytes_per_block"]

    @property
    def scheduler_pid(self) -> int:
        return self._process.pid

    @property
    def worker_pids(self) -> list[int]:
        return list(self._process.worker_pids)

    @property
    def workers_description(self) -> str:
        """The workers by rank: pid, and with Ray's executor node and transport."""
        return self._process.workers_description

    @property
    def is_running(self) -> bool:
        """False once shut down or dead."""
        return not self._process.stopped

    @property
    def stats_available(self) -> bool:
        """Whether ``stats()`` can answer: while running, and after the end when the
        scheduler sent its final counters (not when it was killed outright)."""
        return self.is_running or self._last_stats is not None

    # ------------------------------------------------------------ EngineCore's calls

    def check_request_fits(
        self, num_prompt_tokens: int, max_tokens: int, num_sequences: int = 1
    ) -> None:
        """Raise ``ValueError`` for a request that could never run to completion (the
        scheduler's own check, on the limits it was started with)."""
        check_request_fits(
            num_prompt_tokens,
            max_tokens,
            self.scheduler_config,
            self.block_size,
            self.num_blocks,
            num_sequences,
        )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: frozenset[int],
        arrival_time_s: float | None = None,
        cache_namespace: str | None = None,
        lora_id: int = 0,
        priority: int = 0,
        pooling_params: PoolingParams | None = None,
    ) -> None:
        """Queue a request (``pooling_params``: an embedding request, as in
        ``EngineCore.add_request``). A request the scheduler refuses (it repeats the
        frontend's checks) makes a later ``step()`` raise ``ValueError``."""
        if request_id in self._unfinished:
            raise ValueError(f"request_id {request_id!r} is already in use")
        fault_injection.check("encoding", sampling_params.seed)
        self._send(
            AddRequest(
                request_id,
                list(prompt_token_ids),
                sampling_params,
                time.monotonic() if arrival_time_s is None else arrival_time_s,
                eos_token_ids=sorted(eos_token_ids),
                cache_namespace=cache_namespace,
                lora_id=lora_id,
                priority=priority,
                pooling_params=pooling_params,
            )
        )
        self._unfinished.add(request_id)

    def abort_request(self, request_id: str) -> None:
        """End a request. Unlike ``EngineCore.abort_request`` this returns nothing: the
        request ends for this client at once, and the final delta the scheduler sends
        for it is dropped when it arrives."""
        if request_id not in self._unfinished:
            return
        self._unfinished.discard(request_id)
        self._stopped_samples.pop(request_id, None)
        if self.is_running:
            self._send(AbortRequest(request_id))

    def stop_sample(self, request_id: str, index: int) -> None:
        """End output ``index`` of a parallel-sampling request (see
        ``EngineCore.stop_sample``). Returns nothing: the output ends for this client at
        once (its tokens still in flight are dropped), and the request's final delta, when
        this was its last sample, arrives through ``step`` like any other."""
        if request_id in self._unfinished and self.is_running:
            self._stopped_samples.setdefault(request_id, set()).add(index)
            self._send(StopSample(request_id, index))

    def has_unfinished_requests(self) -> bool:
        return bool(self._unfinished)

    def step(self, *, wait_when_idle: bool = False) -> list[RequestOutputDelta]:
        """Wait for the engine's next outputs; return the deltas of this client's
        unfinished requests (every batch that has arrived). Raises
        ``EngineDeadError`` if the engine dies, ``RequestRefusedError`` for a request
        the scheduler refused and ``RequestFailedError`` for one that failed in the engine
        (the others' deltas come with the next call).

        With a wake-up fd (``set_wakeup_fd``) it returns, possibly with no deltas, as
        soon as that fd is readable; ``wait_when_idle`` makes it wait (for outputs, the
        fd, or the engine's death) even with no unfinished request."""
        while not self._deltas and not self._refusals and (self._unfinished or wait_when_idle):
            message = self._receive(None, wake=True)
            if message is None:
                break  # woken up
            self._dispatch(message)
        while self._unfinished and (message := self._receive(0)) is not None:
            self._dispatch(message)
        if self._refusals:
            raise self._refusals.pop(0)
        deltas, self._deltas = self._deltas, []
        return deltas

    def set_wakeup_fd(self, fd: int) -> None:
        """Let another thread interrupt ``step``: a readable ``fd`` ends its wait (the
        caller drains the fd). For a thread that drives the engine and takes calls from
        others (frontend/async_engine.py)."""
        self._process.wake_poller.register(fd, zmq.POLLIN)
        self._process.wakeup_fd = fd

    def stats(self) -> dict[str, int]:
        return self.query_stats().stats

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` if the scheduler's block accounting is inconsistent."""
        integrity_error = self.query_stats().integrity_error
        if integrity_error is not None:
            raise AssertionError(integrity_error)

    def query_stats(self) -> EngineStats:
        """The scheduler's counters and its block integrity check, in one round trip
        (after the end: its final ones)."""
        if self.is_running:
            self._last_stats = None
            self._send(GetStats())
            deadline_s = time.monotonic() + STATS_TIMEOUT_S
            while self._last_stats is None:
                # A stalled scheduler never answers: the caller must not wait for ever.
                message = self._receive(max(0.0, deadline_s - time.monotonic()))
                if message is None:
                    raise TimeoutError(
                        f"the scheduler (pid {self.scheduler_pid}) did not answer GetStats "
                        f"within {STATS_TIMEOUT_S:g} s"
                    )
                self._dispatch(message)
        if self._last_stats is None:
            raise EngineDeadError(
                f"no stats: {self._process.death_message or 'the engine has stopped'}"
            )
        return self._last_stats

    def load_lora(self, lora_id: int, name: str, path: str) -> None:
        """Serve adapter ``lora_id``; requests sent after this call may use it."""
        self._send(LoadLoRA(lora_id, name, path))

    def unload_lora(self, lora_id: int) -> None:
        """Stop serving adapter ``lora_id`` (the workers drop it once its requests end)."""
        self._send(UnloadLoRA(lora_id))

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix; applied before any request sent after this call."""
        self._send(ResetPrefixCache())

    def shutdown(self) -> None:
        """Stop the engine's processes and free what they held; idempotent. Stats stay
        readable: they are the scheduler's final counters."""
        final_stats = self._finalizer()
        if final_stats is not None:
            self._last_stats = final_stats
        self._unfinished.clear()
        self._stopped_samples.clear()
        self._refusals.clear()

    # ------------------------------------------------------------ internals

    def _send(self, message: Message) -> None:
        try:
            self._process.send(message)
        except EngineDeadError:
            self._fail()
            raise

    def _receive(self, timeout_s: float | None, wake: bool = False) -> Message | None:
        try:
            return self._process.receive(timeout_s, wake)
        except EngineDeadError:
            self._fail()
            raise

    def _dispatch(self, message: Message) -> None:
        if isinstance(message, (OutputBatch, Progress)):
            self._note_progress(message)
        if isinstance(message, OutputBatch):
            unfinished = self._unfinished
            stopped_samples = self._stopped_samples
            for delta in message.deltas:
                if delta.request_id not in unfinished:
                    continue
                if stopped_samples and delta.index in stopped_samples.get(delta.request_id, ()):
                    if not delta.finished:
                        continue
                    delta = dataclasses.replace(delta, new_token_ids=[], logprobs=None)
                self._deltas.append(delta)
                if delta.finished:
                    unfinished.discard(delta.request_id)
                    stopped_samples.pop(delta.request_id, None)
        elif isinstance(message, Progress):
            pass  # noted above
        elif isinstance(message, EngineStats):
            self._last_stats = message
        elif isinstance(message, EngineError) and message.request_id is None:
            self._process.failure = message.message
            self._await_engine_end()
        elif isinstance(message, EngineError):
            # Raised by the next step(), wherever it was read (a stats query too).
            self._unfinished.discard(message.request_id)
            self._stopped_samples.pop(message.request_id, None)
            error_type = (
                RequestRefusedError if message.code == "INVALID_ARGUMENT" else RequestFailedError
            )
            self._refusals.append(error_type(message.request_id, message.message))
        else:
            raise RuntimeError(f"unexpected {type(message).__name__} from the scheduler")

    def _note_progress(self, message: OutputBatch | Progress) -> None:
        now_s = time.monotonic()
        if isinstance(message, Progress) and message.waiting_on:
            self.progress = EngineProgress(self.progress.last_step_s, message.waiting_on, now_s)
        else:  # tokens, or a step completed without any
            self.progress = EngineProgress(now_s, "", 0.0)

    def _await_engine_end(self) -> None:
        """After an engine-wide error the scheduler ends every request, sends its final
        stats and exits: read all that, then raise ``EngineDeadError``."""
        deadline_s = time.monotonic() + self._process.shutdown_timeout_s
        while (message := self._receive(max(0.0, deadline_s - time.monotonic()))) is not None:
            if isinstance(message, EngineStats):
                self._last_stats = message
        # It did not exit in time: killed, without asking again.
        self._process.death_message = self._process.failure
        self._fail()
        raise EngineDeadError(self._process.failure)

    def _fail(self) -> None:
        """The engine is gone: every request in flight has ended, nothing to return."""
        self._deltas.clear()
        self.shutdown()


def _socket_parent_dir() -> str | None:
    """Where the engine's socket directory is made: systemd's ``RuntimeDirectory=`` when the
    service has one (``$RUNTIME_DIRECTORY``, the first of several), which systemd removes
    when the service stops however it stopped, even by SIGKILL, when nothing of ours is
    left to clean up; else the temporary directory (``$TMPDIR``, /tmp)."""
    runtime_directory = os.environ.get("RUNTIME_DIRECTORY")
    return runtime_directory.split(":")[0] if runtime_directory else None


class _SchedulerProcess:
    """The scheduler process and the two sockets to it: everything that must be freed
    even when its ``EngineClient`` is collected without ``shutdown()``.

    Invariant: once ``stopped``, no process of this engine runs, and its socket
    directory and shared memory are gone.
    """

    def __init__(self, shutdown_timeout_s: float) -> None:
        self.shutdown_timeout_s = shutdown_timeout_s
        self.popen: subprocess.Popen | None = None
        self.pidfd: int | None = None
        self.worker_pids: list[int] = []
        self.workers_description = ""
        self.ring_name: str | None = None
        self.failure: str | None = None  # an engine-wide EngineError's message
        self.death_message: str | None = None
        self.ready = False  # Ready("engine") received: it serves, and can stop in order
        self.stopped = False
        self.ipc_dir = tempfile.mkdtemp(prefix="pagedserve-", dir=_socket_parent_dir())
        self.input_endpoint = f"ipc://{self.ipc_dir}/input.sock"
        self.output_endpoint = f"ipc://{self.ipc_dir}/output.sock"
        self.context = zmq.Context(io_threads=1)
        self.to_scheduler = self.context.socket(zmq.PUSH)
        # No high-water mark: a send never waits for a busy scheduler, which reads
        # everything between steps.
        self.to_scheduler.setsockopt(zmq.SNDHWM, 0)
        self.to_scheduler.setsockopt(zmq.LINGER, 0)
        self.to_scheduler.bind(self.input_endpoint)
        self.from_scheduler = self.context.socket(zmq.PULL)
        self.from_scheduler.setsockopt(zmq.LINGER, 0)
        self.from_scheduler.bind(self.output_endpoint)
        self.poller = zmq.Poller()
        self.poller.register(self.from_scheduler, zmq.POLLIN)
        # The same, and a wake-up fd when one is set (EngineClient.set_wakeup_fd).
        self.wake_poller = zmq.Poller()
        self.wake_poller.register(self.from_scheduler, zmq.POLLIN)
        self.wakeup_fd: int | None = None

    @property
    def pid(self) -> int:
        return -1 if self.popen is None else self.popen.pid

    def start(self, start: StartEngine) -> None:
        """Start the scheduler in a fresh interpreter and hand it its ``StartEngine``.

        A fresh interpreter, not a ``multiprocessing`` child: those re-import the
        parent's main script, and with it torch and whatever else the script imports,
        into a process that must stay light (and would demand an ``if __name__ ==
        "__main__"`` guard of every user script).
        """
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "pagedserve.scheduler.engine_process"],
            stdin=subprocess.PIPE,
            # Its own session and process group: the group id is its pid, so the whole
            # engine can be signalled at once, and a Ctrl-C at the terminal reaches only
            # the frontend, which shuts the engine down in order.
            start_new_session=True,
        )
        if hasattr(os, "pidfd_open"):
            self.pidfd = os.pidfd_open(self.popen.pid)
            self.poller.register(self.pidfd, zmq.POLLIN)
            self.wake_poller.register(self.pidfd, zmq.POLLIN)
        try:
            self.popen.stdin.write(encode(start))
            self.popen.stdin.close()
        except BrokenPipeError:
            pass  # it died at once: receive() reports how

    def wait_until_ready(self, deadline_s: float, timeout_s: float) -> Ready:
        """The ``Ready("engine")`` message; ``EngineStartupError`` on a failure or past
        ``deadline_s`` (``time.monotonic()``; ``timeout_s`` after the start), naming the
        component that did not come up."""
        scheduler_ready: Ready | None = None
        ready_ranks: set[int] = set()
        while True:
            # What has arrived is read even past the deadline: the caller may come late.
            remaining_s = max(0.0, deadline_s - time.monotonic())
            try:
                message = self.receive(remaining_s)
            except EngineDeadError as error:
                raise EngineStartupError(f"engine start-up failed: {error}") from None
            if message is None and remaining_s == 0:
                raise EngineStartupError(
                    "engine start-up timed out: "
                    + self._not_ready(scheduler_ready, ready_ranks, timeout_s)
                )
            if isinstance(message, Ready) and message.component == "scheduler":
                scheduler_ready = message
                self.worker_pids = message.info["worker_pids"]
                self.workers_description = message.info["workers"]
                self.ring_name = message.info["ring_name"]
            elif isinstance(message, Ready) and message.component == "worker":
                ready_ranks.add(message.info["rank"])
            elif isinstance(message, Ready) and message.component == "engine":
                self.ready = True
                return message
            elif isinstance(message, EngineError):
                self.failure = message.message  # the scheduler exits next
            elif message is not None:
                raise RuntimeError(f"unexpected {type(message).__name__} during start-up")

    def _not_ready(self, scheduler: Ready | None, ready_ranks: set[int], timeout_s: float) -> str:
        within = f"within {timeout_s:.3g} s"
        if scheduler is None:
            return f"the scheduler process (pid {self.pid}) did not report ready {within}"
        missing = [
            f"rank {rank} (pid {pid})"
            for rank, pid in enumerate(self.worker_pids)
            if rank not in ready_ranks
        ]
        if missing:
            return (
                f"worker {', '.join(missing)} did not report ready {within} "
                "(loading the model may take longer: raise startup_timeout_s)"
            )
        return f"the workers did not join the step broadcast {within}"

    def send(self, message: Message) -> None:
        frame = encode(message)
        while True:
            if self.stopped:
                raise EngineDeadError(self.death_message or "the engine has been shut down")
            try:
                self.to_scheduler.send(frame, zmq.NOBLOCK)
                return
            except zmq.Again:
                # Without a high-water mark only a missing peer blocks: the scheduler
                # is not connected (yet, or any more). NOTE: polled until it is, or has
                # exited.
                if not self.to_scheduler.poll(_EXIT_POLL_S * 1000, zmq.POLLOUT):
                    self._raise_if_exited()
                    if self.popen is not None and _has_exited(self.popen.pid):
                        return  # never delivered: receive() reads its last words, then fails

    def receive(self, timeout_s: float | None, wake: bool = False) -> Message | None:
        """The scheduler's next message, or None after ``timeout_s`` (0: only what has
        arrived) or, with ``wake``, once the wake-up fd is readable. ``EngineDeadError``
        once the scheduler has exited and everything it sent has been read."""
        if self.stopped:
            raise EngineDeadError(self.death_message or "the engine has been shut down")
        deadline_s = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            wait_s = None if deadline_s is None else max(0.0, deadline_s - time.monotonic())
            if self.pidfd is None:
                # NOTE: no pidfd, so the exit is checked on a timer.
                wait_s = _EXIT_POLL_S if wait_s is None else min(wait_s, _EXIT_POLL_S)
            poller = self.wake_poller if wake else self.poller
            events = dict(poller.poll(None if wait_s is None else wait_s * 1000))
            if self.from_scheduler in events:
                frame = self.from_scheduler.recv()
                started_ns = PROFILE.now()
                message = decode(frame)
                PROFILE.lap("outputs_decode", started_ns)
                return message
            self._raise_if_exited()
            if wake and self.wakeup_fd in events:
                return None
            if deadline_s is not None and time.monotonic() >= deadline_s:
                return None

    def _raise_if_exited(self) -> None:
        if self.popen is None or not _has_exited(self.popen.pid):
            return
        # Its last messages (error deltas, the cause, final stats) come first.
        if self.from_scheduler.poll(_LAST_WORD_WAIT_S * 1000):
            return
        exit_code = self._kill_and_reap()
        self.death_message = self.failure or (
            f"the scheduler process (pid {self.popen.pid}) died with {describe_exit(exit_code)}"
        )
        raise EngineDeadError(self.death_message)

    def stop(self) -> EngineStats | None:
        """Shut the engine down: ask, wait ``shutdown_timeout_s``, then kill (at once when
        it is still starting: nothing reads requests yet). Returns the scheduler's final
        stats when it sent them. Idempotent."""
        if self.stopped:
            return None
        final_stats = None
        try:
            if self.popen is not None and self.ready and self.death_message is None:
                final_stats = self._ask_to_stop()
                if self.failure is None:
                    self.death_message = "the engine has been shut down"
        finally:
            if self.popen is not None:
                self._kill_and_reap()
            self._release()
        return final_stats

    def _ask_to_stop(self) -> EngineStats | None:
        """Send ``Shutdown``; the scheduler's last word is its final stats, then it exits."""
        final_stats = None
        deadline_s = time.monotonic() + self.shutdown_timeout_s
        try:
            self.to_scheduler.send(encode(Shutdown()), zmq.NOBLOCK)
            while final_stats is None and (remaining_s := deadline_s - time.monotonic()) > 0:
                message = self.receive(remaining_s)
                if isinstance(message, EngineStats):
                    final_stats = message
            self.popen.wait(max(0.0, deadline_s - time.monotonic()))
        except (zmq.Again, EngineDeadError, subprocess.TimeoutExpired):
            pass  # not connected, exited, or too slow: killed next either way
        return final_stats

    def _kill_and_reap(self) -> int:
        """SIGKILL what is left of the engine's process group, reap the scheduler, and
        remove the broadcast's shared memory if the scheduler could not."""
        popen = self.popen
        if popen.returncode is None:
            # The group's id is the scheduler's pid, which cannot be reused while the
            # scheduler is unreaped (even as a zombie): the signal reaches only this
            # engine's processes (stragglers, multiprocessing's resource tracker).
            with contextlib.suppress(ProcessLookupError):
                os.killpg(popen.pid, signal.SIGKILL)
            popen.wait()
        if self.ring_name is not None and sys.platform.startswith("linux"):
            Path("/dev/shm", self.ring_name).unlink(missing_ok=True)
        return popen.returncode

    def _release(self) -> None:
        self.stopped = True
        self.death_message = self.death_message or "the engine has been shut down"
        self.to_scheduler.close()
        self.from_scheduler.close()
        self.context.term()
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def _has_exited(pid: int) -> bool:
    """Whether child ``pid`` has exited, without reaping it (``Popen`` still can)."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
