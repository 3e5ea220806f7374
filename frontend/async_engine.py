"""The multi-process engine for asyncio code (the gRPC server): one thread drives it.

``EngineClient`` blocks while it waits for the scheduler, and is not thread-safe. Here a
thread of its own owns it and takes calls from the event loop through a queue; a pipe
wakes it out of ``step`` as soon as a call is queued, so a new request or an abort reaches
the scheduler at once rather than after the step in flight. Deltas travel back to the loop
(``call_soon_threadsafe``), which decodes them through each request's ``RequestTracker``
and wakes the coroutine that streams it::

    event loop (gRPC handlers)          engine thread              scheduler process
    submit()/abort()/stats() ---queue+pipe---> EngineClient calls ----ZeroMQ---->
    RequestStream <--- trackers <--- deltas --- step() <--------------ZeroMQ-----

Stop strings are found on the loop (in the tracker), which tells the engine to abort the
request or stop that sample. If the engine dies, every open stream fails with
``EngineDeadError`` naming what died, and ``on_dead`` runs on the loop.

The engine thread also builds the engine (``LLM(multiprocess=True)``, from the factory it
is given): its children die with the thread that started them, and this one outlives them
(it shuts the engine down before it ends); meanwhile the event loop stays free to answer
health checks while a model loads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from pagedserve.frontend.engine_client import (
    EngineClient,
    EngineDeadError,
    EngineProgress,
    RequestFailedError,
    RequestRefusedError,
)
from pagedserve.frontend.outputs import EmbeddingRequestOutput, RequestOutput
from pagedserve.frontend.request_tracker import EmbeddingTracker, EngineAction, RequestTracker
from pagedserve.scheduler import fault_injection
from pagedserve.scheduler.engine_messages import EngineStats
from pagedserve.scheduler.messages import RequestOutputDelta
from pagedserve.scheduler.pooling_params import PROMPT_ONLY_SAMPLING_PARAMS, PoolingParams
from pagedserve.scheduler.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedserve.frontend.llm import LLM

logger = logging.getLogger(__name__)

_Call = Callable[[EngineClient], Any]


class RequestStream:
    """One request's output as it grows. ``async for output in stream`` yields the same
    ``RequestOutput`` (updated in place) each time something new arrived, several
    deltas at once when the reader is slower than the engine, and ends after the one in
    which it finished. Raises the request's error if it failed (engine death, refusal,
    or the server ending it)."""

    def __init__(self, tracker: RequestTracker | EmbeddingTracker) -> None:
        self.tracker = tracker
        self.error: BaseException | None = None
        self._changed = asyncio.Event()

    @property
    def output(self) -> RequestOutput | EmbeddingRequestOutput:
        return self.tracker.output

    @property
    def done(self) -> bool:
        return self.error is not None or self.tracker.finished

    def notify(self) -> None:
        self._changed.set()

    def fail(self, error: BaseException) -> None:
        if not self.done:
            self.error = error
            self._changed.set()

    async def __aiter__(self) -> AsyncIterator[RequestOutput | EmbeddingRequestOutput]:
        while True:
            await self._changed.wait()
            self._changed.clear()
            if self.error is not None:
                raise self.error
            # Read before the yield: the output changes in place, and the last delta may
            # land while the reader is still sending what it was given; it must get one
            # more turn to see it.
            finished = self.tracker.finished
            yield self.tracker.output
            if finished:
                return


class AsyncEngine:
    """``submit``, ``abort``, ``stats`` and ``shutdown`` are called on the event loop."""

    def __init__(
        self,
        make_llm: Callable[[], LLM],
        on_dead: Callable[[str], None] | None = None,
    ) -> None:
        self._make_llm = make_llm
        self._on_dead = on_dead
        self.llm: LLM | None = None  # set once the engine is up
        self._ready: asyncio.Future | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, RequestStream] = {}  # open requests (loop thread only)
        self._calls: deque[tuple[_Call, concurrent.futures.Future | None]] = deque()
        self._wake_read_fd, self._wake_write_fd = os.pipe()
        os.set_blocking(self._wake_read_fd, False)
        os.set_blocking(self._wake_write_fd, False)
        self._stopping = False
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pagedserve-engine", daemon=True)
        self.dead_message: str | None = None

    # ------------------------------------------------------------ event loop side

    def start(self) -> None:
        """Start the thread, which builds the engine; ``wait_ready`` awaits that."""
        self._loop = asyncio.get_running_loop()
        self._ready = self._loop.create_future()
        self._thread.start()

    async def wait_ready(self) -> LLM:
        """The engine once it is up; raises what its start-up raised."""
        return await asyncio.shield(self._ready)

    @property
    def num_open_requests(self) -> int:
        return len(self._streams)

    @property
    def progress(self) -> EngineProgress | None:
        """The engine's pulse as last heard (``liveness.py``); None until it is up."""
        return None if self.llm is None else self.llm.engine.progress

    @property
    def scheduler_pid(self) -> int | None:
        return None if self.llm is None else self.llm.engine.scheduler_pid

    def declare_dead(self, message: str) -> None:
        """End the engine as if it had died (it stalled past the liveness limit): every
        open request fails with ``EngineDeadError(message)``; ``shutdown`` then kills its
        processes, stalled or not."""
        self._on_engine_dead(message)

    def submit(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams | PoolingParams,
        cache_namespace: str | None = None,
        lora_id: int = 0,
        priority: int = 0,
    ) -> RequestStream:
        """Queue a request (already validated); its stream reports what it makes: a
        ``RequestOutput``, or for ``PoolingParams`` (an embedding request) an
        ``EmbeddingRequestOutput``. ``lora_id``: the LoRA adapter (``LLM.lora_ids``; 0:
        the base model). ``priority``: lower runs first (``LLM.check_priority`` has
        passed it)."""
        if self.dead_message is not None:
            raise EngineDeadError(self.dead_message)
        if self.llm is None:
            raise EngineDeadError("the engine is still starting")
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        eos_token_ids = self.llm.eos_token_ids
        pooling_params = params if isinstance(params, PoolingParams) else None
        if pooling_params is not None:
            tracker = EmbeddingTracker(request_id, prompt, prompt_token_ids)
            params = PROMPT_ONLY_SAMPLING_PARAMS
        else:
            tracker = RequestTracker(
                request_id, prompt, prompt_token_ids, params, self.llm.tokenizer, eos_token_ids
            )
        stream = RequestStream(tracker)
        self._streams[request_id] = stream
        token_ids = list(prompt_token_ids)

        def add(engine: EngineClient) -> None:
            try:
                engine.add_request(
                    request_id,
                    token_ids,
                    params,
                    eos_token_ids,
                    cache_namespace=cache_namespace,
                    lora_id=lora_id,
                    priority=priority,
                    pooling_params=pooling_params,
                )
            except EngineDeadError:
                raise
            except Exception as error:  # a request's failure is the request's, not the engine's
                why = f"the frontend could not send it: {type(error).__name__}: {error}"
                self._post(self._on_failed, RequestFailedError(request_id, why))

        self._call(add)
        return stream

    def load_lora(self, lora_id: int, name: str, path: str) -> None:
        """Tell the engine to serve adapter ``lora_id`` (``LLM.register_lora`` checked
        it); requests submitted after this call may use it."""
        self._call(lambda engine: engine.load_lora(lora_id, name, path))

    def unload_lora(self, lora_id: int) -> None:
        """Tell the engine to drop adapter ``lora_id`` once its requests have ended."""
        self._call(lambda engine: engine.unload_lora(lora_id))

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks in use stay with their requests, unfindable);
        later requests compute their prompts again."""
        self._call(lambda engine: engine.reset_prefix_cache())

    def abort(self, request_id: str) -> None:
        """End a request that is still open (a cancelled call); its blocks are freed."""
        if self._streams.pop(request_id, None) is not None:
            self._call(lambda engine: engine.abort_request(request_id))

    def fail_all(self, error: BaseException) -> None:
        """End every open request with ``error`` (the server stopping), in the engine too."""
        for request_id, stream in list(self._streams.items()):
            stream.fail(error)
            self.abort(request_id)

    async def stats(self) -> EngineStats:
        """The scheduler's counters and its integrity check (one round trip)."""
        return await self._call_with_result(lambda engine: engine.query_stats())

    async def shutdown(self) -> None:
        """Fail what is still open, stop the engine's processes, end the thread."""
        for stream in list(self._streams.values()):
            stream.fail(EngineDeadError("the engine is shutting down"))
        self._streams.clear()
        if self._thread.is_alive():
            self._stopping = True
            self._wake()
            await asyncio.get_running_loop().run_in_executor(None, self._stopped.wait)
        for fd in (self._wake_read_fd, self._wake_write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._wake_read_fd = self._wake_write_fd = -1

    def _call(self, call: _Call, future: concurrent.futures.Future | None = None) -> None:
        self._calls.append((call, future))
        self._wake()

    async def _call_with_result(self, call: _Call) -> Any:
        if self.dead_message is not None:
            raise EngineDeadError(self.dead_message)
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._call(call, future)
        return await asyncio.wrap_future(future)

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_write_fd, b"\0")  # a full pipe is already a wake-up

    def _on_deltas(self, deltas: list[RequestOutputDelta]) -> None:
        for delta in deltas:
            stream = self._streams.get(delta.request_id)
            if stream is None:
                continue  # aborted meanwhile
            request_id = delta.request_id
            try:
                params = getattr(stream.tracker, "params", None)
                fault_injection.check("output_processing", getattr(params, "seed", None))
                action = stream.tracker.apply(delta)
            except Exception as error:  # this request's output alone cannot be made
                logger.exception("the output of %s failed", request_id)
                why = f"its output could not be made: {type(error).__name__}: {error}"
                stream.fail(RequestFailedError(request_id, why))
                self.abort(request_id)
                continue
            if action is EngineAction.ABORT_REQUEST:
                self._call(lambda engine, r=request_id: engine.abort_request(r))
            elif action is EngineAction.STOP_SAMPLE:
                index = delta.index
                self._call(lambda engine, r=request_id, i=index: engine.stop_sample(r, i))
            if stream.tracker.finished:
                del self._streams[request_id]
            stream.notify()

    def _on_refused(self, error: RequestRefusedError) -> None:
        stream = self._streams.pop(error.request_id, None)
        if stream is not None:
            stream.fail(ValueError(error.reason))

    def _on_failed(self, error: RequestFailedError) -> None:
        stream = self._streams.get(error.request_id)
        if stream is not None:
            stream.fail(error)
            self.abort(error.request_id)  # whatever of it reached the engine

    def _on_engine_dead(self, message: str) -> None:
        if self.dead_message is not None:
            return
        self.dead_message = message
        logger.error("engine died: %s", message)
        for stream in self._streams.values():
            stream.fail(EngineDeadError(message))
        self._streams.clear()
        if self._on_dead is not None:
            self._on_dead(message)

    # ------------------------------------------------------------ engine thread

    def _post(self, callback: Callable[..., None], *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody listens
            self._loop.call_soon_threadsafe(callback, *args)

    def _on_started(self, llm: LLM | None, error: BaseException | None) -> None:
        if self._ready.done():
            return
        if error is not None:
            self._ready.set_exception(error)
        else:
            self.llm = llm
            self._ready.set_result(llm)

    def _run(self) -> None:
        llm = None
        try:
            llm = self._make_llm()
            engine = llm.engine
            if not isinstance(engine, EngineClient):
                raise TypeError("AsyncEngine needs a multi-process LLM (multiprocess=True)")
            engine.set_wakeup_fd(self._wake_read_fd)
        except BaseException as error:
            if llm is not None:
                llm.shutdown()
            self._fail_calls(EngineDeadError(f"the engine did not start: {error}"))
            self._post(self._on_started, None, error)
            self._stopped.set()
            return
        self._post(self._on_started, llm, None)
        try:
            while not self._stopping:
                self._drain_wakeups()
                self._run_calls(engine)
                if self._stopping:
                    break
                try:
                    deltas = engine.step(wait_when_idle=True)
                except RequestRefusedError as error:
                    self._post(self._on_refused, error)
                    continue
                except RequestFailedError as error:
                    self._post(self._on_failed, error)
                    continue
                if deltas:
                    self._post(self._on_deltas, deltas)
        except EngineDeadError as error:
            self._fail_calls(error)
            self._post(self._on_engine_dead, str(error))
        except BaseException as error:  # a defect: say so, and stop like a dead engine
            logger.exception("the engine thread failed")
            self._fail_calls(EngineDeadError(f"the engine thread failed: {error!r}"))
            self._post(self._on_engine_dead, f"the engine thread failed: {error!r}")
        finally:
            try:
                engine.shutdown()
            finally:
                self._fail_calls(EngineDeadError("the engine has been shut down"))
                self._stopped.set()

    def _drain_wakeups(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self._wake_read_fd, 4096):
                pass

    def _run_calls(self, engine: EngineClient) -> None:
        while self._calls:
            call, future = self._calls.popleft()
            if future is not None and not future.set_running_or_notify_cancel():
                continue
            try:
                result = call(engine)
            except EngineDeadError as error:
                if future is not None:
                    future.set_exception(error)
                raise
            except Exception as error:
                if future is None:
                    raise  # a call without an answer cannot fail: a defect
                future.set_exception(error)
            else:
                if future is not None:
                    future.set_result(result)

    def _fail_calls(self, error: BaseException) -> None:
        while self._calls:
            _call, future = self._calls.popleft()
            if future is not None and not future.done():
                with contextlib.suppress(concurrent.futures.InvalidStateError):
                    future.set_exception(error)
