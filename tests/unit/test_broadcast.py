"""Step broadcast: ring for normal messages, ZeroMQ for oversized ones and for remote
readers, one order for everyone. Real reader processes (spawn), real shared memory, real
ZeroMQ over ipc:// in a temporary directory (and tcp:// on loopback)."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import time
from collections.abc import Callable, Iterator

import pytest

from pagedserve.scheduler.broadcast import (
    BroadcastClosedError,
    BroadcastHandle,
    StepBroadcaster,
    StepReceiver,
)
from pagedserve.scheduler.shm_ring_buffer import shared_memory_ring_supported

CTX = mp.get_context("spawn")
TIMEOUT_S = 10.0  # per blocking call: bounds a test that hangs, never reached when passing
CHUNK_PAYLOAD_BYTES = 256


def message(index: int) -> bytes:
    """Every third message is larger than a ring chunk; each has distinct content."""
    size = 3000 if index % 3 == 0 else 8 + index % 50
    return (index.to_bytes(4, "little") * (size // 4 + 1))[:size]


def receive_until_closed(
    handle_fields: dict,
    reader_index: int,
    remote: bool,
    out: mp.Queue,
    got_first: mp.Event | None = None,
) -> None:
    """Child process: receive until the broadcaster closes, then report everything."""
    handle = BroadcastHandle(**handle_fields)
    with StepReceiver(handle, reader_index, remote=remote) as receiver:
        received = []
        while True:
            try:
                received.append(receiver.receive(timeout_s=TIMEOUT_S))
            except BroadcastClosedError:
                break
            if got_first is not None:
                got_first.set()
        out.put(((reader_index, remote), received))


@pytest.fixture
def spawn() -> Iterator[Callable[..., mp.Process]]:
    """Start child processes; whatever happens, none outlives the test."""
    started: list[mp.Process] = []

    def start(target: Callable[..., None], *args: object) -> mp.Process:
        process = CTX.Process(target=target, args=args, daemon=True)
        process.start()
        started.append(process)
        return process

    yield start
    for process in started:
        process.join(timeout=TIMEOUT_S if process.exitcode is None else 0)
        if process.is_alive():
            process.kill()
            process.join()


@pytest.fixture
def make_broadcaster(tmp_path) -> Iterator[Callable[..., StepBroadcaster]]:
    made: list[StepBroadcaster] = []

    def make(num_local_readers: int, num_remote_readers: int = 0, **kwargs) -> StepBroadcaster:
        broadcaster = StepBroadcaster(
            num_local_readers,
            num_remote_readers,
            ipc_dir=str(tmp_path),
            num_chunks=4,
            chunk_payload_bytes=CHUNK_PAYLOAD_BYTES,
            send_timeout_s=TIMEOUT_S,
            **kwargs,
        )
        made.append(broadcaster)
        return broadcaster

    yield make
    for broadcaster in made:
        broadcaster.close()
        ring_name = broadcaster.handle.ring_name
        assert ring_name is None or not os.path.exists(f"/dev/shm/{ring_name}")
    assert not list(tmp_path.glob("*.sock"))


def collect(out: mp.Queue, count: int) -> dict[tuple[int, bool], list[bytes]]:
    return dict(out.get(timeout=TIMEOUT_S) for _ in range(count))


@pytest.mark.parametrize(
    "use_ring",
    [
        pytest.param(
            True,
            marks=pytest.mark.skipif(not shared_memory_ring_supported(), reason="not x86-64"),
        ),
        False,
    ],
    ids=["ring+zmq", "zmq-only"],
)
def test_mixed_small_and_oversized_messages_arrive_in_order_at_two_readers(
    spawn, make_broadcaster, use_ring
):
    broadcaster = make_broadcaster(2, use_ring=use_ring)
    assert (broadcaster.handle.ring_name is not None) == use_ring
    # Broadcast before any reader exists: nobody is ready, nobody receives these.
    for index in range(1000, 1005):
        broadcaster.broadcast(message(index))
    out = CTX.Queue()
    handle = dataclasses.asdict(broadcaster.handle)
    for index in range(2):
        spawn(receive_until_closed, handle, index, False, out)
    # The handshake: without it the first messages go to SUB sockets whose
    # subscriptions have not reached the publisher yet, and are lost.
    broadcaster.wait_for_readers(timeout_s=TIMEOUT_S)
    num_messages = 60  # 20 oversized, so the 4-chunk ring wraps and meets markers often
    for index in range(num_messages):
        broadcaster.broadcast(message(index))
    broadcaster.close()

    expected = [message(index) for index in range(num_messages)]
    assert collect(out, 2) == {(0, False): expected, (1, False): expected}


@pytest.mark.skipif(not shared_memory_ring_supported(), reason="not x86-64")
def test_remote_reader_gets_everything_over_tcp_alongside_a_ring_reader(spawn, make_broadcaster):
    broadcaster = make_broadcaster(1, 1)
    assert broadcaster.handle.remote_endpoint.startswith("tcp://127.0.0.1:")
    out = CTX.Queue()
    handle = dataclasses.asdict(broadcaster.handle)
    spawn(receive_until_closed, handle, 0, False, out)
    spawn(receive_until_closed, handle, 0, True, out)
    broadcaster.wait_for_readers(timeout_s=TIMEOUT_S)
    for index in range(30):
        broadcaster.broadcast(message(index))
    broadcaster.close()

    expected = [message(index) for index in range(30)]
    assert collect(out, 2) == {(0, False): expected, (0, True): expected}


def test_reader_joining_mid_stream_gets_a_gap_free_suffix(spawn, make_broadcaster):
    broadcaster = make_broadcaster(2)
    out, got_first = CTX.Queue(), CTX.Event()
    handle = dataclasses.asdict(broadcaster.handle)
    spawn(receive_until_closed, handle, 0, False, out)
    broadcaster.wait_for_readers(timeout_s=TIMEOUT_S, local_indices=[0])

    spawn(receive_until_closed, handle, 1, False, out, got_first)
    sent = []
    deadline_s = time.monotonic() + TIMEOUT_S
    # Keep broadcasting while reader 1 starts; it is welcomed by one of these calls.
    while not got_first.is_set() and time.monotonic() < deadline_s:
        sent.append(message(len(sent)))
        broadcaster.broadcast(sent[-1])
        time.sleep(0.002)
    for _ in range(20):
        sent.append(message(len(sent)))
        broadcaster.broadcast(sent[-1])
    broadcaster.close()

    results = collect(out, 2)
    assert results[(0, False)] == sent
    late = results[(1, False)]
    assert 20 < len(late) < len(sent)
    assert late == sent[-len(late) :]


@pytest.mark.skipif(not shared_memory_ring_supported(), reason="not x86-64")
def test_ring_reader_skips_what_was_sent_between_its_welcome_and_its_ring_admission(
    make_broadcaster,
):
    broadcaster = make_broadcaster(1)
    with StepReceiver(broadcaster.handle, 0) as receiver:
        # The broadcaster welcomes the reader, which has not joined the ring yet.
        deadline_s = time.monotonic() + TIMEOUT_S
        while True:
            with pytest.raises(TimeoutError) as error:
                broadcaster.wait_for_readers(timeout_s=0.01)
            if "local 0 (not in the ring yet)" in str(error.value):
                break
            assert time.monotonic() < deadline_s
        broadcaster.broadcast(message(0))  # oversized: reaches the reader's socket only
        receiver.wait_ready(timeout_s=TIMEOUT_S)
        broadcaster.broadcast(message(3))  # oversized; this one admits the reader
        broadcaster.broadcast(message(4))  # fits a chunk
        assert receiver.receive(timeout_s=TIMEOUT_S) == message(3)
        assert receiver.receive(timeout_s=TIMEOUT_S) == message(4)


def test_errors_name_the_problem(make_broadcaster, tmp_path):
    broadcaster = make_broadcaster(2)
    with pytest.raises(ValueError, match=r"reader_index must be in \[0, 2\) for a local"):
        StepReceiver(broadcaster.handle, 2)
    with pytest.raises(ValueError, match=r"must be in \[0, 0\) for a remote reader, got 0"):
        StepReceiver(broadcaster.handle, 0, remote=True)
    with pytest.raises(
        TimeoutError,
        match=r"within 0.05 s: local 0 \(no subscription yet\), local 1 \(no subscription yet\)$",
    ):
        broadcaster.wait_for_readers(timeout_s=0.05)
    # The broadcaster is not answering (it is not inside broadcast / wait_for_readers).
    with (
        StepReceiver(broadcaster.handle, 0) as receiver,
        pytest.raises(
            TimeoutError, match="WL0.: no welcome from the broadcaster within the timeout"
        ),
    ):
        receiver.receive(timeout_s=0.05)
    with pytest.raises(ValueError, match="over the 100-byte limit of a unix socket path"):
        StepBroadcaster(1, ipc_dir=str(tmp_path / ("d" * 100)), use_ring=False)
