"""A worker process's main: build the ``Worker``, report ``Ready``, run every broadcast plan.

The scheduler starts one per rank (``multiprocessing`` spawn context) with one argument,
an encoded ``StartWorker``. With more than one rank they first form a tensor-parallel
process group (``gpu_worker/parallel.py``), each holding its share of the model. Every
rank receives every ``StepPlan`` from the step broadcaster and executes it; rank 0 alone
sends the ``StepResult`` back (every rank gathers the full logits and samples the same
tokens from them, so every rank's cached tokens are the ones rank 0 reports). The
process ends when the broadcaster closes (exit code 0) or on a failure, which it
reports as an ``EngineError`` on the result socket before exiting with code 1, so the
scheduler can say what went wrong rather than only that the worker is gone. A rank
whose peer dies fails in its next collective (gloo notices the closed connection).
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from pathlib import Path

import zmq

from pagedserve.gpu_worker.memory import default_kv_cache_bytes
from pagedserve.gpu_worker.parallel import (
    init_tensor_parallel,
    set_host_threads,
    shutdown_tensor_parallel,
)
from pagedserve.gpu_worker.runner_state import LaunchedStep
from pagedserve.gpu_worker.standin_device import standin_forward_ms
from pagedserve.gpu_worker.worker import Worker
from pagedserve.scheduler.broadcast import BroadcastClosedError, BroadcastHandle, StepReceiver
from pagedserve.scheduler.child_process import die_with_parent
from pagedserve.scheduler.engine_messages import EngineError, Ready, StartWorker
from pagedserve.scheduler.logs import configure_logging
from pagedserve.scheduler.messages import StepPlan, StepResult
from pagedserve.scheduler.serialization import decode_as, encode
from pagedserve.scheduler.step_profile import PROFILE

# With a step in flight the next plan is due within a step's time: poll for it at least
# this often (an idle worker's ring polls back off to 1 ms), or the plan waits out a sleep
# while the device runs out of work.
_PLAN_DUE_MAX_SLEEP_S = 50e-6

# How long the last message (an EngineError) may take to leave before the process exits.
_LINGER_MS = 2000


def main(start_frame: bytes) -> None:
    """The process's target: returns on a clean end, ``sys.exit(1)`` on a failure."""
    start = decode_as(start_frame, StartWorker)
    if start.scheduler_pid:
        die_with_parent(start.scheduler_pid)
    PROFILE.name_process(f"worker{start.rank}")
    # Warnings (a weight's dtype, a fallback), named, in the frontend's log format.
    configure_logging(logging.WARNING, "%(name)s %(levelname)s %(message)s")
    context = zmq.Context(io_threads=1)
    results = context.socket(zmq.PUSH)
    results.setsockopt(zmq.LINGER, _LINGER_MS)
    results.connect(start.result_endpoint)
    receiver: StepReceiver | None = None
    phase = "failed to start"
    try:
        # Subscribed before the model loads, so the welcome handshake is quick after it.
        reader_index = start.rank if start.reader_index is None else start.reader_index
        receiver = StepReceiver(
            BroadcastHandle(**start.broadcast), reader_index, remote=start.remote_reader
        )
        worker = build_worker(start)
        results.send(encode(ready_message(worker, start.rank)))
        # No deadline of its own: the frontend's covers start-up, and kills the engine.
        receiver.wait_ready(float("inf"))
        phase = "failed"
        serve(worker, receiver, results, start.rank)
    except Exception as error:
        traceback.print_exc()
        description = f"worker rank {start.rank} (pid {os.getpid()}) {phase}"
        results.send(encode(EngineError(None, f"{description}: {type(error).__name__}: {error}")))
        sys.exit(1)
    finally:
        if receiver is not None:
            receiver.close()
        results.close()
        context.term()
        shutdown_tensor_parallel()


def build_worker(start: StartWorker) -> Worker:
    """The same ``Worker`` the in-process engine builds, from the spec's plain fields,
    as rank ``start.rank`` of ``start.world_size`` (joining the process group first)."""
    spec = start.worker
    device = start.device or spec.device
    ranks_on_host = start.world_size if start.ranks_on_host is None else start.ranks_on_host
    parallel = init_tensor_parallel(
        start.rank, start.world_size, start.distributed_init_method, device, ranks_on_host
    )
    # Ranks on one CPU share its memory; GPU ranks each have a device of their own.
    ranks_sharing_memory = ranks_on_host if device == "cpu" else 1
    if standin_forward_ms() is not None:
        # The stand-in's forward runs off the host, and its host work is small: more
        # threads would only spin in OpenMP's wait after each op, on the cores the
        # scheduler and the frontend need (docs/BENCHMARKS.md, "Per-step CPU cost").
        # NOTE: a CUDA worker still samples on the host, over the whole vocabulary; one
        # thread there too once the sampler runs on the device (issue 36).
        set_host_threads(1)
    return Worker(
        Path(spec.model_path),
        spec.dtype,
        spec.block_size,
        spec.num_blocks,
        spec.kv_cache_bytes,
        device,
        swap_space_bytes=spec.swap_space_bytes,
        kv_cache_bytes_from_free_memory=lambda: default_kv_cache_bytes(ranks_sharing_memory),
        parallel=parallel,
        cuda_graph_max_batch=spec.cuda_graph_max_batch,
        cuda_graph_max_len=spec.cuda_graph_max_len,
        lora_modules=[(name, path) for name, path in spec.lora_modules],
        enable_lora=spec.enable_lora,
        quantization=spec.quantization,
        kv_cache_dtype=spec.kv_cache_dtype,
        speculative_model=None if spec.speculative_model is None else Path(spec.speculative_model),
        num_speculative_tokens=spec.num_speculative_tokens,
        speculative_method=spec.speculative_method,
    )


def ready_message(worker: Worker, rank: int) -> Ready:
    return Ready(
        component="worker",
        pid=os.getpid(),
        info={
            "rank": rank,
            "num_blocks": worker.num_blocks,
            "num_host_blocks": worker.num_host_blocks,
            "bytes_per_block": worker.bytes_per_block,
        },
    )


def serve(worker: Worker, receiver: StepReceiver, results: zmq.Socket, rank: int) -> None:
    """Execute plans in broadcast order until the broadcaster closes.

    A step is launched (queued on the device), then finished (its tokens read, its result
    sent). With async scheduling the next plan often arrives while the device still runs
    the step before it: when that plan ``follows`` it, it is launched first, so the device
    has the next step queued while the host reads this one's tokens and the scheduler
    plans the one after (vLLM's and SGLang's overlap, on the worker's side). Results
    still leave in plan order, one per plan."""
    in_flight: LaunchedStep | None = None
    while True:
        started_ns = PROFILE.now()
        try:
            payload = _next_plan(receiver, in_flight)
        except BroadcastClosedError:
            PROFILE.write()
            return
        # Blocked: for the scheduler's next plan, or the device, whichever comes first.
        PROFILE.lap("wait", started_ns)
        if payload is None:  # the device finished the step before another plan came
            assert in_flight is not None
            _send_result(worker.finish(in_flight), results, rank)
            in_flight = None
            continue
        started_ns = PROFILE.now()
        plan = decode_as(payload, StepPlan)
        started_ns = PROFILE.lap("plan_decode", started_ns)
        if in_flight is not None and not worker.follows(plan, in_flight):
            _send_result(worker.finish(in_flight), results, rank)
            in_flight = None
        launched = worker.launch(plan, in_flight)
        if in_flight is not None:
            _send_result(worker.finish(in_flight), results, rank)
        in_flight = launched


def _next_plan(receiver: StepReceiver, in_flight: LaunchedStep | None) -> bytes | None:
    """The next plan; with a step in flight, None if the device finishes it first (the
    scheduler may be waiting for its result before it plans again)."""
    if in_flight is None:
        # NOTE: an idle worker polls the ring (spin, then sleeps of up to 1 ms): a
        # few hundred wake-ups a second, the price of microsecond hand-offs mid-run.
        return receiver.receive()
    while True:
        try:
            return receiver.receive(in_flight.event.poll_s(), _PLAN_DUE_MAX_SLEEP_S)
        except TimeoutError:
            if in_flight.event.query():
                return None


def _send_result(result: StepResult, results: zmq.Socket, rank: int) -> None:
    if rank == 0:
        started_ns = PROFILE.now()
        results.send(encode(result))
        PROFILE.lap("result_send", started_ns)
