"""The shared-memory ring: real reader processes (spawn), real shared memory. Every
reader gets every message in order and intact; the writer waits for the slowest reader
and never overwrites; late readers start with the next message; errors say why."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections.abc import Callable, Iterator

import pytest

from pagedserve.scheduler.shm_ring_buffer import (
    MessageTooLargeError,
    RingClosedError,
    ShmRingReader,
    ShmRingWriter,
)

CTX = mp.get_context("spawn")
TIMEOUT_S = 10.0  # per blocking call: bounds a test that hangs, never reached when passing
PAYLOAD_BYTES = 64


def message(index: int) -> bytes:
    """Distinct content and length per message (0..60 bytes): a reordered, lost,
    repeated or half-overwritten message cannot compare equal to the expected one."""
    return (index.to_bytes(4, "little") * 16)[: (index * 7) % 61]


def read_messages(
    name: str,
    reader_index: int,
    count: int,
    out: mp.Queue,
    attached: mp.Event | None = None,
    go: mp.Event | None = None,
    delay_s: float = 0.0,
    each: bool = False,
) -> None:
    """Child process: attach, optionally wait for ``go``, read ``count`` messages and
    report them (one by one when ``each``, else as one list)."""
    reader = ShmRingReader(name, reader_index, open_timeout_s=TIMEOUT_S)
    try:
        if attached is not None:
            attached.set()
        if go is not None:
            go.wait(TIMEOUT_S)
        received = []
        for _ in range(count):
            data = reader.read(timeout_s=TIMEOUT_S)
            if each:
                out.put((reader_index, data))
            received.append(data)
            time.sleep(delay_s)
        out.put((reader_index, received))
    finally:
        reader.close()


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
def make_writer() -> Iterator[Callable[..., ShmRingWriter]]:
    writers: list[ShmRingWriter] = []

    def make(num_readers: int, num_chunks: int = 4, **kwargs: object) -> ShmRingWriter:
        writer = ShmRingWriter(num_readers, num_chunks, PAYLOAD_BYTES, **kwargs)
        writers.append(writer)
        return writer

    yield make
    for writer in writers:
        writer.close()
        writer.unlink()
        assert not os.path.exists(f"/dev/shm/{writer.name}")


def results_by_reader(out: mp.Queue, num_readers: int) -> dict[int, list[bytes]]:
    return dict(out.get(timeout=TIMEOUT_S) for _ in range(num_readers))


def test_every_reader_receives_every_message_in_order_across_many_wraps(spawn, make_writer):
    writer = make_writer(num_readers=3, num_chunks=4, write_timeout_s=TIMEOUT_S)
    out = CTX.Queue()
    num_messages = 400  # 100 times around a 4-chunk ring
    processes = [spawn(read_messages, writer.name, index, num_messages, out) for index in range(3)]
    writer.wait_for_readers([0, 1, 2], timeout_s=TIMEOUT_S)
    for index in range(num_messages):
        writer.write(message(index))

    expected = [message(index) for index in range(num_messages)]
    assert results_by_reader(out, 3) == {0: expected, 1: expected, 2: expected}
    for process in processes:
        process.join(TIMEOUT_S)
        assert process.exitcode == 0


def test_slow_reader_holds_the_writer_back_and_nothing_is_lost(spawn, make_writer):
    writer = make_writer(num_readers=2, num_chunks=4, write_timeout_s=TIMEOUT_S)
    fast_out, slow_out, go = CTX.Queue(), CTX.Queue(), CTX.Event()
    num_messages = 16
    spawn(read_messages, writer.name, 0, num_messages, fast_out, None, None, 0.0, True)
    spawn(read_messages, writer.name, 1, num_messages, slow_out, None, go, 0.01)
    writer.wait_for_readers([0, 1], timeout_s=TIMEOUT_S)

    for index in range(4):  # fills the ring
        writer.write(message(index))
    assert [fast_out.get(timeout=TIMEOUT_S) for _ in range(4)] == [
        (0, message(index)) for index in range(4)
    ]
    # Reader 0 has read everything; reader 1 nothing: message 5 would overwrite message 1.
    started_s = time.perf_counter()
    with pytest.raises(TimeoutError, match=r"message 5: reader\(s\) \[1\] have not read message 1"):
        writer.write(message(4), timeout_s=0.3)
    assert time.perf_counter() - started_s >= 0.3
    assert writer.num_published == 4

    go.set()
    started_s = time.perf_counter()
    for index in range(4, num_messages):
        writer.write(message(index))
    # The slow reader sleeps 10 ms per message, so the last 12 writes wait on it.
    assert time.perf_counter() - started_s >= 0.09

    expected = [message(index) for index in range(num_messages)]
    fast = [fast_out.get(timeout=TIMEOUT_S)[1] for _ in range(4, num_messages)]
    assert fast == expected[4:]
    assert fast_out.get(timeout=TIMEOUT_S) == (0, expected)
    assert slow_out.get(timeout=TIMEOUT_S) == (1, expected)


def test_late_reader_starts_with_the_next_message_and_never_blocks_before(spawn, make_writer):
    writer = make_writer(num_readers=2, num_chunks=4, write_timeout_s=TIMEOUT_S)
    out, attached = CTX.Queue(), CTX.Event()
    spawn(read_messages, writer.name, 0, 20, out)
    writer.wait_for_readers([0], timeout_s=TIMEOUT_S)
    # Reader 1 is not there: 10 messages through a 4-chunk ring must not wait for it.
    for index in range(10):
        writer.write(message(index), timeout_s=TIMEOUT_S)
    assert writer.admitted_readers() == [0]

    spawn(read_messages, writer.name, 1, 10, out, attached)
    assert attached.wait(TIMEOUT_S)
    for index in range(10, 20):
        writer.write(message(index))
    assert writer.admitted_readers() == [0, 1]

    assert results_by_reader(out, 2) == {
        0: [message(index) for index in range(20)],
        1: [message(index) for index in range(10, 20)],
    }


def test_oversized_message_is_refused_and_leaves_the_ring_untouched(make_writer):
    writer = make_writer(num_readers=1)
    with ShmRingReader(writer.name, 0) as reader:
        writer.write(b"before")
        assert writer.fits(PAYLOAD_BYTES) and not writer.fits(PAYLOAD_BYTES + 1)
        with pytest.raises(MessageTooLargeError, match="65 bytes exceeds .* payload of 64 bytes"):
            writer.write(b"x" * (PAYLOAD_BYTES + 1))
        writer.write(b"y" * PAYLOAD_BYTES)
        assert reader.read(TIMEOUT_S) == b"before"
        assert reader.read(TIMEOUT_S) == b"y" * PAYLOAD_BYTES
        assert writer.num_published == 2


def test_writer_timeout_names_the_stalled_reader(make_writer):
    writer = make_writer(num_readers=3, num_chunks=2)
    readers = [ShmRingReader(writer.name, index) for index in range(3)]
    try:
        writer.wait_for_readers([0, 1, 2], timeout_s=TIMEOUT_S)
        writer.write(b"a")
        writer.write(b"b")
        for reader in readers[:2]:
            assert reader.read(TIMEOUT_S) == b"a"
        with pytest.raises(TimeoutError) as error:
            writer.write(b"c", timeout_s=0.05)
        assert str(error.value) == (
            f"ring {writer.name!r}: waited 0.05 s to publish message 3: reader(s) [2] have "
            f"not read message 1 in that chunk (stalled, or exited without close())"
        )
        # The stalled reader leaving releases the writer.
        readers[2].close()
        writer.write(b"c", timeout_s=TIMEOUT_S)
        assert [readers[0].read(TIMEOUT_S) for _ in range(2)] == [b"b", b"c"]
    finally:
        for reader in readers:
            reader.close()


def test_reader_drains_then_sees_the_writer_close(make_writer):
    writer = make_writer(num_readers=1)
    with ShmRingReader(writer.name, 0) as reader:
        writer.wait_for_readers([0], timeout_s=TIMEOUT_S)
        writer.write(b"last")
        writer.close()
        assert reader.read(TIMEOUT_S) == b"last"
        with pytest.raises(RingClosedError, match="the writer has closed"):
            reader.read(TIMEOUT_S)


def test_reader_errors_name_the_problem(make_writer):
    writer = make_writer(num_readers=2)
    with pytest.raises(ValueError, match=r"reader_index must be in \[0, 2\)"):
        ShmRingReader(writer.name, 2)
    with (
        ShmRingReader(writer.name, 1),
        pytest.raises(RuntimeError, match="reader index 1 is already attached"),
    ):
        ShmRingReader(writer.name, 1)
    with (
        ShmRingReader(writer.name, 0) as reader,
        pytest.raises(TimeoutError, match="reader 0: no admission from the writer within 0.05 s"),
    ):
        reader.read(timeout_s=0.05)
    with pytest.raises(TimeoutError, match="no ring 'psring_missing' after 0.05 s"):
        ShmRingReader("psring_missing", 0, open_timeout_s=0.05)


def test_segment_names_are_unique_and_the_creator_unlinks(make_writer):
    first, second = make_writer(num_readers=1), make_writer(num_readers=1)
    assert first.name != second.name
    assert first.name.startswith(f"psring_{os.getpid()}_")
    with ShmRingReader(first.name, 0):
        pass  # a reader closing does not remove the segment
    assert os.path.exists(f"/dev/shm/{first.name}")
    first.close()
    first.unlink()
    assert not os.path.exists(f"/dev/shm/{first.name}")
