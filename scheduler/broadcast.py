"""Step broadcast: the scheduler sends each encoded ``StepPlan`` to every worker, in order.

``StepBroadcaster`` (in the scheduler) and ``StepReceiver`` (one per worker) carry
opaque bytes. Normal messages go through the shared-memory ring
(``shm_ring_buffer.py``); a message too large for a ring chunk goes over a ZeroMQ
XPUB/SUB socket, and the ring carries a small marker in its place, so a reader never
reorders: it reads the ring and, at a marker, takes that message from ZeroMQ::

    broadcast seq:   7          8                    9
    ring:          [I|plan 7] [Z|seq 8]            [I|plan 9]
    ZeroMQ "MO":               [D|seq 8|big plan 8]

Readers that cannot map the ring (another host, over ``tcp://``; or every reader where
the ring is unsupported, see ``shared_memory_ring_supported``) get every message over
ZeroMQ, in order, with no ring.

ZeroMQ wire format: three frames ``[topic, header, payload]``; ``header`` is one kind
byte (``D`` data, ``W`` welcome, ``E`` end of stream) and the message's broadcast
sequence number (u64, little-endian). Topics: ``MO`` carries what ring readers need too
(oversized messages, end of stream), ``MA`` what only ZeroMQ-only readers need (a copy of
each ring message); ZeroMQ-only readers subscribe to ``M`` (both), ring readers to ``MO``.
Each reader also subscribes to its own ``W<L|R><index>.`` topic.

The slow joiner: a SUB socket that connects late silently misses what was published
before its subscription reached the publisher. The handshake closes that gap. The XPUB
socket receives every subscription; when the broadcaster sees a reader's own ``W...``
topic (sent after its data topic, on the same pipe, so that one is in place too) it
answers with a welcome that carries the next sequence number. A reader ignores everything
before its welcome, and a ring reader only asks to join the ring after it, so every ring
marker it reads points at a ZeroMQ message published after its subscription was active.
``StepBroadcaster.wait_for_readers()`` blocks until every reader is welcomed (and admitted
to the ring): call it before the first broadcast. A reader that joins later receives the
messages broadcast after its welcome.
"""

from __future__ import annotations

import os
import secrets
import tempfile
import time
from dataclasses import dataclass

import zmq

from pagedserve.scheduler.shm_ring_buffer import (
    RingClosedError,
    ShmRingReader,
    ShmRingWriter,
    shared_memory_ring_supported,
)

_TOPIC_ALL = b"MA"  # only ZeroMQ-only readers need it
_TOPIC_OVERFLOW = b"MO"  # every reader needs it
_KIND_DATA, _KIND_WELCOME, _KIND_END = b"D", b"W", b"E"
_RING_INLINE, _RING_ON_ZMQ = b"I", b"Z"
_SUBSCRIBE = 1  # first byte of a subscription message on an XPUB socket
_MAX_IPC_PATH = 100  # sun_path is 108 bytes on Linux, 104 on macOS
_COPY_THRESHOLD_BYTES = 64 * 1024  # below this, zmq copying is cheaper than tracking


class BroadcastClosedError(EOFError):
    """The broadcaster closed and every message it sent has been received."""


@dataclass(frozen=True)
class BroadcastHandle:
    """What a receiver needs to connect. Flat strings and ints, so it travels as plain
    data (``dataclasses.asdict`` / ``BroadcastHandle(**fields)``)."""

    ring_name: str | None  # None: no ring, local readers use ZeroMQ only
    local_endpoint: str  # ipc://
    remote_endpoint: str | None  # tcp://, when remote readers were asked for
    num_local_readers: int
    num_remote_readers: int


def _reader_key(index: int, remote: bool) -> bytes:
    # The trailing dot keeps one reader's topic from being a prefix of another's
    # (W L1. vs W L10.): SUB filters match prefixes.
    return f"W{'R' if remote else 'L'}{index}.".encode()


def _header(kind: bytes, seq: int) -> bytes:
    return kind + seq.to_bytes(8, "little")


class StepBroadcaster:
    """Writer side: one instance, in the scheduler process.

    Invariant: every ready reader receives every message broadcast after it became
    ready, exactly once and in broadcast order; a message is never dropped (the ring
    waits for its slowest reader, the XPUB socket is set not to drop and times out
    instead). Not thread-safe: one thread broadcasts.
    """

    def __init__(
        self,
        num_local_readers: int,
        num_remote_readers: int = 0,
        *,
        ipc_dir: str | None = None,
        remote_bind: str = "tcp://127.0.0.1:*",
        advertise_host: str | None = None,
        use_ring: bool | None = None,
        num_chunks: int = 8,
        chunk_payload_bytes: int = 1 << 20,
        send_timeout_s: float = 30.0,
    ) -> None:
        if num_local_readers < 0 or num_remote_readers < 0:
            raise ValueError(
                f"reader counts must be >= 0, got num_local_readers={num_local_readers}, "
                f"num_remote_readers={num_remote_readers}"
            )
        if use_ring is None:
            use_ring = shared_memory_ring_supported()
        use_ring = use_ring and num_local_readers > 0
        self.send_timeout_s = send_timeout_s
        self._next_seq = 1
        self._welcomed: set[bytes] = set()
        self._num_zmq_only_readers = num_remote_readers + (0 if use_ring else num_local_readers)
        self._ipc_path = self._ipc_socket_path(ipc_dir)
        self._ring: ShmRingWriter | None = None
        self._context = zmq.Context(io_threads=1)
        self._xpub = self._context.socket(zmq.XPUB)
        try:
            # Block (then time out) rather than drop when a subscriber's queue is full.
            self._xpub.setsockopt(zmq.XPUB_NODROP, 1)
            # Pass every subscription up, duplicates included: a reader restarted under
            # the same index must be welcomed again even before its predecessor's pipe
            # is gone.
            self._xpub.setsockopt(zmq.XPUB_VERBOSE, 1)
            self._xpub.setsockopt(zmq.SNDTIMEO, int(send_timeout_s * 1000))
            self._xpub.setsockopt(zmq.LINGER, 1000)
            self._xpub.bind(f"ipc://{self._ipc_path}")
            remote_endpoint = None
            if num_remote_readers:
                self._xpub.bind(remote_bind)
                remote_endpoint = self._xpub.getsockopt_string(zmq.LAST_ENDPOINT)
                if advertise_host is not None:
                    port = remote_endpoint.rsplit(":", 1)[1]
                    remote_endpoint = f"tcp://{advertise_host}:{port}"
            if use_ring:
                self._ring = ShmRingWriter(
                    num_local_readers,
                    num_chunks,
                    chunk_payload_bytes,
                    write_timeout_s=send_timeout_s,
                    name_prefix="psbcast",
                )
        except BaseException:
            self._release()
            raise
        self.handle = BroadcastHandle(
            ring_name=None if self._ring is None else self._ring.name,
            local_endpoint=f"ipc://{self._ipc_path}",
            remote_endpoint=remote_endpoint,
            num_local_readers=num_local_readers,
            num_remote_readers=num_remote_readers,
        )

    @staticmethod
    def _ipc_socket_path(ipc_dir: str | None) -> str:
        # pid + random suffix: two engines on one machine never share a socket.
        directory = ipc_dir if ipc_dir is not None else tempfile.gettempdir()
        path = os.path.join(directory, f"psbcast-{os.getpid()}-{secrets.token_hex(4)}.sock")
        if len(path.encode()) > _MAX_IPC_PATH:
            raise ValueError(
                f"ipc socket path {path!r} is {len(path.encode())} bytes, over the "
                f"{_MAX_IPC_PATH}-byte limit of a unix socket path: pass a shorter ipc_dir"
            )
        return path

    @property
    def num_broadcast(self) -> int:
        return self._next_seq - 1

    def broadcast(self, payload: bytes) -> None:
        """Send one message to every ready reader; raises ``TimeoutError`` when a
        reader has not taken older messages within ``send_timeout_s``."""
        self._answer_subscriptions()
        seq = self._next_seq
        ring = self._ring
        if ring is not None and ring.fits(len(payload) + 1):
            if self._num_zmq_only_readers:
                self._send(_TOPIC_ALL, _header(_KIND_DATA, seq), payload)
            # NOTE: one copy of the payload to prepend the kind byte; cheap next to the
            # ring's own copy at this size (at most a chunk).
            ring.write(_RING_INLINE + payload)
        elif ring is not None:
            # ZeroMQ first: when a reader meets the marker, the message is already sent.
            self._send(_TOPIC_OVERFLOW, _header(_KIND_DATA, seq), payload)
            ring.write(_RING_ON_ZMQ + seq.to_bytes(8, "little"))
        else:
            self._send(_TOPIC_ALL, _header(_KIND_DATA, seq), payload)
        self._next_seq = seq + 1

    def _send(self, topic: bytes, header: bytes, payload: bytes) -> None:
        try:
            self._xpub.send_multipart(
                [topic, header, payload], copy=len(payload) < _COPY_THRESHOLD_BYTES
            )
        except zmq.Again as error:
            raise TimeoutError(
                f"broadcast at {self.handle.local_endpoint}: a ZeroMQ reader has not taken "
                f"its queued messages within {self.send_timeout_s:.3g} s (stalled, or gone "
                f"without closing)"
            ) from error

    def _answer_subscriptions(self) -> None:
        """Welcome each reader whose own topic has just been subscribed."""
        # NOTE: polled on every broadcast; the EVENTS check costs about a microsecond.
        while self._xpub.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            subscription = self._xpub.recv()
            if subscription[0] == _SUBSCRIBE and subscription[1:2] == b"W":
                key = subscription[1:]
                self._send(key, _header(_KIND_WELCOME, self._next_seq), b"")
                self._welcomed.add(key)

    def wait_for_readers(
        self,
        timeout_s: float,
        local_indices: list[int] | None = None,
        remote_indices: list[int] | None = None,
    ) -> None:
        """Block until the given readers (default: all) are welcomed and, for ring
        readers, admitted to the ring: from then on each receives every message. Raises
        ``TimeoutError`` naming the readers still missing."""
        if local_indices is None:
            local_indices = list(range(self.handle.num_local_readers))
        if remote_indices is None:
            remote_indices = list(range(self.handle.num_remote_readers))
        deadline_s = time.monotonic() + timeout_s
        while True:
            missing = self._readers_not_ready(local_indices, remote_indices)
            if not missing:
                return
            remaining_s = deadline_s - time.monotonic()
            if remaining_s <= 0:
                raise TimeoutError(
                    f"broadcast at {self.handle.local_endpoint}: readers not ready within "
                    f"{timeout_s:.3g} s: {', '.join(missing)}"
                )
            # Wakes on a subscription; the short cap lets ring admissions be seen too.
            self._xpub.poll(timeout=min(remaining_s, 0.01) * 1000)

    def _readers_not_ready(self, local_indices: list[int], remote_indices: list[int]) -> list[str]:
        self._answer_subscriptions()
        admitted = set(self._ring.admitted_readers()) if self._ring is not None else set()
        missing = []
        for index in local_indices:
            if _reader_key(index, remote=False) not in self._welcomed:
                missing.append(f"local {index} (no subscription yet)")
            elif self._ring is not None and index not in admitted:
                missing.append(f"local {index} (not in the ring yet)")
        missing += [
            f"remote {index} (no subscription yet)"
            for index in remote_indices
            if _reader_key(index, remote=True) not in self._welcomed
        ]
        return missing

    def close(self) -> None:
        """Tell every reader the stream has ended, then release the ring (unlinked: the
        broadcaster created it) and the sockets. Idempotent."""
        if self._xpub.closed:
            return
        # A stalled reader must not hold the close for the whole send timeout.
        self._xpub.setsockopt(zmq.SNDTIMEO, 1000)
        try:
            self._send(_TOPIC_OVERFLOW, _header(_KIND_END, self._next_seq), b"")
        except TimeoutError:
            pass  # a stalled reader must not keep the broadcaster from closing
        finally:
            self._release()

    def _release(self) -> None:
        if self._ring is not None:
            self._ring.close()
            self._ring.unlink()
        self._xpub.close()
        self._context.term()
        # libzmq removes the socket file it bound; this covers a bind that never happened.
        if os.path.exists(self._ipc_path):
            os.unlink(self._ipc_path)

    def __enter__(self) -> StepBroadcaster:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class StepReceiver:
    """Reader side: one per worker.

    ``reader_index`` is the reader's place among the local readers (0 ..
    num_local_readers-1) or, with ``remote=True``, among the remote ones. A remote
    reader, or any reader when the handle has no ring, takes everything from ZeroMQ.

    Invariant: ``receive`` returns consecutive broadcast messages, starting with the
    first one broadcast after this reader's welcome, with no gap (a gap raises).
    """

    def __init__(self, handle: BroadcastHandle, reader_index: int, *, remote: bool = False) -> None:
        limit = handle.num_remote_readers if remote else handle.num_local_readers
        if not 0 <= reader_index < limit:
            raise ValueError(
                f"reader_index must be in [0, {limit}) for a "
                f"{'remote' if remote else 'local'} reader, got {reader_index}"
            )
        # A handle with remote readers always has a tcp endpoint (checked above).
        endpoint = handle.remote_endpoint if remote else handle.local_endpoint
        self.handle = handle
        self.reader_index = reader_index
        self._uses_ring = not remote and handle.ring_name is not None
        self._key = _reader_key(reader_index, remote)
        self._context = zmq.Context(io_threads=1)
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.connect(endpoint)
        # Data topic first, own topic second: seeing the second, the broadcaster knows
        # the first is active (both travel in order on one pipe).
        self._sub.setsockopt(zmq.SUBSCRIBE, _TOPIC_OVERFLOW if self._uses_ring else b"M")
        self._sub.setsockopt(zmq.SUBSCRIBE, self._key)
        self._ring: ShmRingReader | None = None
        # 0 until welcomed; then the next broadcast seq expected (ZeroMQ-only readers
        # follow it; ring readers take the seq from each marker).
        self._next_seq = 0

    @property
    def is_ready(self) -> bool:
        return self._next_seq != 0

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Wait for the broadcaster's welcome (it answers while it broadcasts or waits
        in ``wait_for_readers``), then ask to join the ring."""
        deadline_s = time.monotonic() + timeout_s
        while self._next_seq == 0:
            topic, header, _ = self._recv(deadline_s, waiting_for="welcome from the broadcaster")
            if topic == self._key and header[:1] == _KIND_WELCOME:
                self._next_seq = int.from_bytes(header[1:9], "little")
            elif header[:1] == _KIND_END:
                raise BroadcastClosedError("the step broadcaster has closed")
            # Anything else predates the welcome: not ours to deliver.
        if self._uses_ring and self._ring is None:
            self._ring = ShmRingReader(
                self.handle.ring_name,
                self.reader_index,
                open_timeout_s=max(deadline_s - time.monotonic(), 0.0),
            )

    def receive(self, timeout_s: float | None = None, max_sleep_s: float | None = None) -> bytes:
        """The next message. Raises ``TimeoutError`` after ``timeout_s`` (None: wait
        forever) and ``BroadcastClosedError`` once the broadcaster has closed.
        ``max_sleep_s``: the ring's longest sleep between polls, for this wait (ZeroMQ
        wakes its reader itself)."""
        deadline_s = float("inf") if timeout_s is None else time.monotonic() + timeout_s
        if self._next_seq == 0 or (self._uses_ring and self._ring is None):
            self.wait_ready(float("inf") if timeout_s is None else timeout_s)
        if self._ring is None:
            return self._receive_from_zmq(self._next_seq, deadline_s)
        try:
            frame = self._ring.read(
                None if timeout_s is None else deadline_s - time.monotonic(), max_sleep_s
            )
        except RingClosedError as error:
            raise BroadcastClosedError("the step broadcaster has closed") from error
        kind = frame[:1]
        if kind == _RING_INLINE:
            # NOTE: a second copy (the ring's read made the first); a plan is a few KiB.
            return frame[1:]
        if kind == _RING_ON_ZMQ:
            # The ring's frame is taken: its payload must be too, whatever the deadline (a
            # timeout here would lose the message; the broadcaster sent it with the frame).
            seq = int.from_bytes(frame[1:9], "little")
            return self._receive_from_zmq(seq, max(deadline_s, time.monotonic() + 60.0))
        raise RuntimeError(f"step broadcast: unknown ring frame kind {kind!r}")

    def _receive_from_zmq(self, seq: int, deadline_s: float) -> bytes:
        """The ZeroMQ message numbered ``seq``; older ones (sent before this reader
        joined the ring) are skipped."""
        while True:
            topic, header, payload = self._recv(deadline_s, waiting_for=f"message {seq}")
            if topic == self._key:
                continue  # a repeated welcome (the subscription was re-sent)
            kind, got = header[:1], int.from_bytes(header[1:9], "little")
            if kind == _KIND_END:
                raise BroadcastClosedError("the step broadcaster has closed")
            if got < seq and self._ring is not None:
                continue
            if got != seq:
                raise RuntimeError(
                    f"step broadcast: expected message {seq}, got {got}: messages were lost"
                )
            self._next_seq = seq + 1
            return payload

    def _recv(self, deadline_s: float, waiting_for: str) -> list[bytes]:
        remaining_s = deadline_s - time.monotonic()
        timeout_ms = None if remaining_s == float("inf") else max(int(remaining_s * 1000), 0)
        if not self._sub.poll(timeout=timeout_ms):
            raise TimeoutError(
                f"step receiver {self._key.decode()}: no {waiting_for} within the timeout "
                f"(is the broadcaster running?)"
            )
        frames = self._sub.recv_multipart()
        if len(frames) != 3:
            raise RuntimeError(f"step broadcast: expected 3 frames, got {len(frames)}")
        return frames

    def close(self) -> None:
        """Leave the ring (the broadcaster stops waiting for this reader) and close the
        socket. Idempotent."""
        if self._ring is not None:
            self._ring.close()
            self._ring = None
        if not self._sub.closed:
            self._sub.close()
            self._context.term()

    def __enter__(self) -> StepReceiver:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
