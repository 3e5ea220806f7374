"""The scheduler process's main: an ``EngineCore`` between the frontend and the workers.

Started by the frontend as ``python -m pagedserve.scheduler.engine_process`` (a fresh
interpreter: it imports only this package, zmq and msgpack, never torch nor the user's
script), it reads one encoded ``StartEngine`` from stdin, then::

    1. connects to the frontend's two sockets, starts the workers
       (``MultiprocExecutor``)                    -> Ready("scheduler", worker pids)
    2. while they load, reads ``StartStructuredOutput`` (the frontend sends it once its
       tokenizer has loaded) and builds the grammar tokenizer on a thread
    3. waits for every worker                     -> Ready("worker") each, forwarded
    4. builds the EngineCore on the blocks every
       rank holds (the smallest count), once the
       grammar tokenizer is done                  -> Ready("engine", cache sizes)
    5. serves: AddRequest / AbortRequest / StopSample / GetStats / ResetPrefixCache /
       LoadLoRA / UnloadLoRA /
       Shutdown in, one OutputBatch per step out
       (an AddRequest frame that does not decode but names its request ends that
       request with an EngineError for it; any other bad frame is a failure)
    6. on Shutdown or a failure: ends every request still in flight (on a failure
       after an EngineError naming the cause, each with finish_reason "error"), sends
       its final EngineStats, stops the workers, exits

Exit code 0 after a ``Shutdown``, 1 after a failure. The frontend owns the start-up
deadline: this process waits for its workers as long as it lives.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import traceback

import zmq

from pagedserve.scheduler.child_process import die_with_parent
from pagedserve.scheduler.engine_core import EngineCore
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
)
from pagedserve.scheduler.logs import configure_logging
from pagedserve.scheduler.messages import RequestOutputDelta
from pagedserve.scheduler.multiproc_executor import MultiprocExecutor, WorkerDiedError
from pagedserve.scheduler.serialization import (
    DecodeError,
    Message,
    decode,
    decode_as,
    encode,
)
from pagedserve.scheduler.step_profile import PROFILE
from pagedserve.scheduler.structured_output import StructuredOutput

# How long the last messages (final stats, an error) may take to reach the frontend
# once this process is ready to exit.
_LINGER_MS = 5000
# While requests run, the frontend hears from this process at least this often: tokens, or
# a Progress message (a step completed without tokens, or what a late step waits on).
PROGRESS_INTERVAL_S = 1.0


class EngineLoop:
    """Serves the frontend: applies its messages between steps and steps while any
    request is unfinished; when none is, blocks until a message arrives or a worker
    ends (it never spins idle)."""

    def __init__(
        self,
        engine: EngineCore,
        executor: MultiprocExecutor,
        inbox: zmq.Socket,
        outbox: zmq.Socket,
    ) -> None:
        self.engine = engine
        self.executor = executor
        self.inbox = inbox
        self.outbox = outbox
        # Final deltas of aborted requests, sent with the next batch.
        self._pending: list[RequestOutputDelta] = []
        self._stop = False
        self._idle_poller = zmq.Poller()
        self._idle_poller.register(inbox, zmq.POLLIN)
        for sentinel in executor.sentinels:
            self._idle_poller.register(sentinel, zmq.POLLIN)
        self._stepped = False  # a step ran since the last flush
        self._last_sent_s = time.monotonic()
        executor.on_wait = self._report_wait

    def run(self) -> None:
        """Serve until ``Shutdown``; a dead worker raises ``WorkerDiedError``."""
        engine = self.engine
        while not self._stop:
            if engine.has_unfinished_requests():
                # NOTE: a non-blocking look at the inbox between steps (one getsockopt,
                # about a microsecond); a dying worker is noticed inside the step.
                self._drain_inbox()
                if self._stop or not engine.has_unfinished_requests():
                    continue
                self._pending.extend(engine.step())
                self._stepped = True
                for request_id, why in engine.take_failures().items():
                    # Before the batch with its final delta: the frontend reads why first.
                    self.outbox.send(encode(EngineError(request_id, why, "INTERNAL")))
            else:
                events = dict(self._idle_poller.poll())
                if any(sentinel in events for sentinel in self.executor.sentinels):
                    self.executor.check_workers()
                self._drain_inbox()
            self._flush()

    def _drain_inbox(self) -> None:
        while not self._stop and self.inbox.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            try:
                message = decode(self.inbox.recv())
            except DecodeError as error:
                if error.request_id is None:
                    raise  # a frame that names no request: a broken peer
                # A frontend bug (a field its checks let through) ends that request,
                # not the server: every other request runs on.
                self.outbox.send(encode(EngineError(error.request_id, str(error))))
                continue
            self._handle(message)

    def _handle(self, message: Message) -> None:
        engine = self.engine
        if isinstance(message, AddRequest):
            try:
                engine.add_request(
                    message.request_id,
                    message.prompt_token_ids,
                    message.sampling_params,
                    frozenset(message.eos_token_ids),
                    arrival_time_s=message.arrival_time_s,
                    cache_namespace=message.cache_namespace,
                    lora_id=message.lora_id,
                    priority=message.priority,
                    pooling_params=message.pooling_params,
                )
            except ValueError as error:
                self.outbox.send(encode(EngineError(message.request_id, str(error))))
            except Exception as error:  # a request's failure is the request's
                engine.abort_request(message.request_id)  # whatever of it was queued
                why = f"the scheduler failed to queue it: {type(error).__name__}: {error}"
                self.outbox.send(encode(EngineError(message.request_id, why, "INTERNAL")))
        elif isinstance(message, AbortRequest):
            delta = engine.abort_request(message.request_id)
            if delta is not None:
                self._pending.append(delta)
        elif isinstance(message, StopSample):
            delta = engine.stop_sample(message.request_id, message.index)
            if delta is not None:
                self._pending.append(delta)
        elif isinstance(message, GetStats):
            # Deltas first: the stats describe the state after them.
            self._flush()
            self.outbox.send(encode(engine_stats(engine)))
        elif isinstance(message, ResetPrefixCache):
            engine.reset_prefix_cache()
        elif isinstance(message, LoadLoRA):
            engine.load_lora(message.lora_id, message.name, message.path)
        elif isinstance(message, UnloadLoRA):
            engine.unload_lora(message.lora_id)
        elif isinstance(message, Shutdown):
            self._stop = True
        else:
            raise RuntimeError(f"unexpected {type(message).__name__} from the frontend")

    def _flush(self) -> None:
        now_s = time.monotonic()
        if self._pending:
            started_ns = PROFILE.now()
            self.outbox.send(encode(OutputBatch(self._pending)))
            PROFILE.lap("outputs_send", started_ns)
            self._pending = []
            self._last_sent_s = now_s
        elif self._stepped and now_s - self._last_sent_s >= PROGRESS_INTERVAL_S:
            self.outbox.send(encode(Progress("", 0.0)))  # steps complete, without tokens
            self._last_sent_s = now_s
        self._stepped = False

    def _report_wait(self, waiting_on: str, waiting_s: float) -> None:
        """A step's result is late (the executor says so each second): tell the frontend,
        which judges whether the engine is stalled."""
        self.outbox.send(encode(Progress(waiting_on, waiting_s)))


def engine_stats(engine: EngineCore) -> EngineStats:
    try:
        engine.check_integrity()
        integrity_error = None
    except AssertionError as error:
        integrity_error = str(error) or repr(error)
    return EngineStats(engine.stats(), integrity_error)


def end_all_requests(engine: EngineCore, finish_reason: str | None) -> list[RequestOutputDelta]:
    """Abort every waiting, running and swapped request (their blocks return to the
    pools); each ends with one final delta, marked ``finish_reason`` when given."""
    deltas = []
    for request_id in list(engine.scheduler.requests):
        delta = engine.abort_request(request_id)
        if delta is not None:
            if finish_reason is not None:
                delta.finish_reason = finish_reason
            deltas.append(delta)
    return deltas


def serve(start: StartEngine, inbox: zmq.Socket, outbox: zmq.Socket, context: zmq.Context) -> int:
    """Steps 1-6 of the module docstring; returns the exit code."""
    executor: MultiprocExecutor | None = None
    engine: EngineCore | None = None
    exit_code = 0
    try:
        executor = MultiprocExecutor(
            start.worker,
            start.world_size,
            start.ipc_dir,
            context,
            start.executor_backend,
            start.ray_address,
        )
        scheduler_info = {
            "worker_pids": executor.worker_pids,
            "ring_name": executor.ring_name,
            "workers": executor.workers_description(),
        }
        outbox.send(encode(Ready("scheduler", os.getpid(), scheduler_info)))
        # Made after the workers are spawned: its grammar tokenizer builds on a thread
        # (holding the GIL, StructuredOutput's NOTE) while this thread only waits for them.
        vocabulary = decode_as(inbox.recv(), StartStructuredOutput)
        structured_output = StructuredOutput(
            vocabulary.grammar_vocabulary, vocabulary.disable_any_whitespace
        )
        cache = executor.wait_until_ready(on_ready=lambda ready: outbox.send(encode(ready)))
        engine = EngineCore(
            start.scheduler_config,
            cache["num_blocks"],
            start.worker.block_size,
            executor,
            seed=start.seed,
            num_host_blocks=cache["num_host_blocks"],
            enable_prefix_caching=start.enable_prefix_caching,
            structured_output=structured_output,
        )
        # Ready only once the grammar tokenizer is: built later, in the loop, it would pause
        # every stream.
        structured_output.wait_until_built()
        outbox.send(encode(Ready("engine", os.getpid(), cache)))
        EngineLoop(engine, executor, inbox, outbox).run()
        # The step in flight (async scheduling) ends some requests with its tokens; the
        # others end here. Either way each gets its final delta before the workers stop.
        deltas = engine.finish_in_flight()
        PROFILE.write()
        if engine.has_unfinished_requests():
            deltas += end_all_requests(engine, None)
        if deltas:
            outbox.send(encode(OutputBatch(deltas)))
    except Exception as error:
        exit_code = 1
        if not isinstance(error, WorkerDiedError):
            traceback.print_exc()
        message = str(error) if isinstance(error, WorkerDiedError) else _scheduler_failure(error)
        # The cause first, so a receiver knows it before the requests it ends.
        outbox.send(encode(EngineError(None, message)))
        if engine is not None:
            outbox.send(encode(OutputBatch(end_all_requests(engine, "error"))))
    finally:
        if engine is not None:
            outbox.send(encode(engine_stats(engine)))
        if executor is not None:
            executor.shutdown()
    return exit_code


def _scheduler_failure(error: Exception) -> str:
    return f"scheduler (pid {os.getpid()}) failed: {type(error).__name__}: {error}"


def main() -> int:
    start = decode_as(sys.stdin.buffer.read(), StartEngine)
    die_with_parent(start.frontend_pid)
    PROFILE.name_process("scheduler")
    # The frontend turns Ctrl-C into a shutdown; the engine's processes sit in their own
    # session, but a signal sent to the whole group must not kill them mid-cleanup.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    context = zmq.Context(io_threads=1)
    inbox = context.socket(zmq.PULL)
    inbox.setsockopt(zmq.LINGER, 0)
    inbox.connect(start.input_endpoint)
    outbox = context.socket(zmq.PUSH)
    # Never block a step on a frontend that reads late: it reads everything eventually.
    outbox.setsockopt(zmq.SNDHWM, 0)
    outbox.setsockopt(zmq.LINGER, _LINGER_MS)
    outbox.connect(start.output_endpoint)
    try:
        return serve(start, inbox, outbox, context)
    finally:
        inbox.close()
        outbox.close()
        context.term()


if __name__ == "__main__":
    # The scheduler package's warnings, named, on the inherited stderr (in the frontend's
    # log format).
    configure_logging(logging.WARNING, "%(name)s %(levelname)s %(message)s")
    sys.exit(main())
