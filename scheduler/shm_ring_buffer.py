"""A shared-memory ring buffer: one writer process, N reader processes, every reader
receives every message in order.

The scheduler writes one ``StepPlan`` per step; each worker reads it. The ring is a
fixed number of fixed-size chunks in one ``multiprocessing.shared_memory`` segment::

    segment (sizes in bytes; every area starts on a 64-byte boundary)
    +------------------------------------------------------------------------------+
    | control   magic | num_readers | num_chunks | chunk_payload_bytes | writer_state |
    |           reader_epoch[R] u8   (each byte written only by its reader)          |
    |           writer_epoch[R] u8   (written only by the writer: admission acks)     |
    |           start_seq[R]    u64  (written only by the writer)                     |
    +------------------------------------------------------------------------------+
    | chunk 0   seq u64 | payload_len u64 | read_flag[R] u8 | pad to 64             |
    |           payload: chunk_payload_bytes                                        |
    +------------------------------------------------------------------------------+
    | chunk 1   ...                                                                 |
    +------------------------------------------------------------------------------+
    | chunk K-1 ...                                                                 |
    +------------------------------------------------------------------------------+

Message ``seq`` (1, 2, 3, ...) lives in chunk ``(seq - 1) % K``. A chunk's ``seq`` field
is the number of the message it holds (0: never written); ``read_flag[r]`` is 1 once
reader ``r`` has copied that message out (or when ``r`` does not have to read it).

Publication protocol (why a reader never sees a half-written chunk):

    writer                                    reader r (expects message s)
    1. wait until read_flag[*] == 1           1. wait until chunk.seq == s
    2. payload_len, payload                   2. read payload_len, copy the payload
    3. read_flag[*] = 0 for admitted readers  3. read_flag[r] = 1
    4. chunk.seq = s          (publish)

The reader only looks at the payload after it has seen ``seq == s``, and the writer
stores ``seq`` after everything else. On x86-64 (TSO) stores become visible in program
order and loads are not reordered with other loads, nor with later stores, so a reader
that sees ``seq == s`` sees the whole payload, and the writer that sees ``read_flag[r]
== 1`` knows reader ``r`` has finished copying. Python adds no reordering of its own:
each store is a separate interpreter step, an opaque call for the C compiler. Even a
torn 8-byte ``seq`` store is harmless: a reader compares ``seq`` for *equality* with the
one number it expects, and a mix of old and new bytes equals the new value only once
every differing byte is written.

On a weaker memory model (aarch64, POWER) this is not enough: the writer would need a
release fence before step 4 and the reader an acquire fence after step 1 (and a release
before its step 3), i.e. ``std::atomic`` stores/loads from a small C extension. Pure
Python has no fences, so ``ShmRingWriter`` refuses to run off x86-64
(``shared_memory_ring_supported()``); callers send over ZeroMQ there instead.

Readers that attach late (admission):

Reader ``r`` asks to attach by making ``reader_epoch[r]`` odd, and to detach by making it
even again. Only the writer admits: when it notices a changed epoch (at every ``write``,
while it waits, and in ``wait_for_readers``) it sets ``start_seq[r]`` to the next message
it will publish, marks ``r``'s read flag 1 in every chunk, and acks by copying the epoch
into ``writer_epoch[r]``. The reader starts at ``start_seq[r]`` once it sees the ack.
Because each byte has one writer there is no lost update, and the writer, which owns the
sequence, never races a reader over where that reader starts. The writer waits only for
admitted readers: a slot nobody holds, or a reader still waiting for its ack, never holds
back the others, and a new reader receives exactly the messages published after the
writer noticed it (the writer looks right before it publishes, so "noticed" is at most
one message after the reader asked).

Limits: a reader that dies without ``close()`` stays admitted, so the writer times out on
it (the error names its index) and its index cannot be attached again; forcing a slot
free is not implemented. NOTE: the read flags of all readers of a chunk share one cache
line, which each reader's flag store pulls over once per message: negligible at a few
readers and one message per step.
"""

from __future__ import annotations

import os
import platform
import secrets
import time
from multiprocessing import resource_tracker, shared_memory

_MAGIC = int.from_bytes(b"PSRING01", "little")
_ALIGN = 64  # a cache line: no chunk header shares a line with another chunk's payload
_WRITER_OPEN = 1
_WRITER_CLOSED = 2

# Control-area u64 word indices.
_W_MAGIC, _W_NUM_READERS, _W_NUM_CHUNKS, _W_PAYLOAD_BYTES, _W_WRITER_STATE = range(5)
_CONTROL_FIXED_BYTES = 64
# Chunk-header byte offsets.
_CHUNK_SEQ, _CHUNK_LEN, _CHUNK_FLAGS = 0, 8, 16

# Waiting: spin this long (cheap when the other side is about to publish or read), then
# sleep, doubling from the first sleep up to the longest one.
DEFAULT_SPIN_S = 50e-6
_FIRST_SLEEP_S = 20e-6
DEFAULT_MAX_SLEEP_S = 1e-3


class MessageTooLargeError(ValueError):
    """A message longer than a chunk's payload: send it another way (``broadcast.py``
    sends it over ZeroMQ). The ring is unchanged."""


class RingClosedError(EOFError):
    """The writer closed the ring and every message it published has been read."""


def shared_memory_ring_supported() -> bool:
    """True where the publication protocol is safe without fences: x86-64 (TSO)."""
    return platform.machine().lower() in ("x86_64", "amd64")


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class _Layout:
    """Byte offsets of one ring, computed the same way by the writer and the readers."""

    def __init__(self, num_readers: int, num_chunks: int, chunk_payload_bytes: int) -> None:
        self.num_readers = num_readers
        self.num_chunks = num_chunks
        self.chunk_payload_bytes = chunk_payload_bytes
        self.reader_epoch = _CONTROL_FIXED_BYTES
        self.writer_epoch = self.reader_epoch + num_readers
        self.start_seq = _round_up(self.writer_epoch + num_readers, 8)
        self.control_bytes = _round_up(self.start_seq + 8 * num_readers, _ALIGN)
        self.header_bytes = _round_up(_CHUNK_FLAGS + num_readers, _ALIGN)
        self.chunk_stride = self.header_bytes + _round_up(chunk_payload_bytes, _ALIGN)
        self.total_bytes = self.control_bytes + num_chunks * self.chunk_stride

    def chunk(self, seq: int) -> int:
        """Byte offset of the chunk that holds message ``seq``."""
        return self.control_bytes + ((seq - 1) % self.num_chunks) * self.chunk_stride


class _Waiter:
    """Spin-then-sleep polling with a deadline.

    NOTE: busy-wait. The first ``spin_s`` of a wait burns a core (the common case, the
    other side a few microseconds from done, costs no sleep/wake latency); after that
    each poll sleeps, doubling up to ``max_sleep_s``, which bounds both the CPU an idle
    waiter uses and the latency it adds once the wait has been long anyway.
    """

    def __init__(self, timeout_s: float | None, spin_s: float, max_sleep_s: float) -> None:
        self.start_s = time.perf_counter()
        self.deadline_s = float("inf") if timeout_s is None else self.start_s + timeout_s
        self.spin_s = spin_s
        self.max_sleep_s = max_sleep_s
        self.sleep_s = _FIRST_SLEEP_S

    def pause(self) -> bool:
        """Wait a little; False once the deadline has passed."""
        now_s = time.perf_counter()
        if now_s >= self.deadline_s:
            return False
        if now_s - self.start_s < self.spin_s:
            return True
        time.sleep(min(self.sleep_s, self.deadline_s - now_s))
        self.sleep_s = min(self.sleep_s * 2, self.max_sleep_s)
        return True


def _open_untracked(name: str) -> shared_memory.SharedMemory:
    """Attach to an existing segment without registering it with this process's
    resource tracker: on Python < 3.13 every attach registers, and a tracker that is not
    the creator's unlinks the segment when its process exits, under the writer's feet.
    Only the creator (the writer) is tracked, so a crashed writer's segment is still
    cleaned up."""
    register = resource_tracker.register
    resource_tracker.register = lambda *args, **kwargs: None
    try:
        return shared_memory.SharedMemory(name=name)
    finally:
        resource_tracker.register = register


class ShmRingWriter:
    """The writing end: creates the segment, publishes messages, unlinks at the end.

    Invariant: message ``s`` overwrites message ``s - num_chunks`` only after every
    admitted reader has read it (or was admitted after it): the writer waits, and raises
    ``TimeoutError`` naming the readers it waited for, rather than overwrite unread data.
    Not thread-safe: one thread writes.
    """

    def __init__(
        self,
        num_readers: int,
        num_chunks: int = 8,
        chunk_payload_bytes: int = 1 << 20,
        *,
        write_timeout_s: float = 30.0,
        name_prefix: str = "psring",
        spin_s: float = DEFAULT_SPIN_S,
        max_sleep_s: float = DEFAULT_MAX_SLEEP_S,
    ) -> None:
        if not shared_memory_ring_supported():
            raise NotImplementedError(
                f"the shared-memory ring relies on x86-64 store ordering; this machine is "
                f"{platform.machine()!r} (use the ZeroMQ transport)"
            )
        for field_name, value in (
            ("num_readers", num_readers),
            ("num_chunks", num_chunks),
            ("chunk_payload_bytes", chunk_payload_bytes),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{field_name} must be an integer >= 1, got {value!r}")
        if num_readers > 255:
            raise ValueError(f"num_readers must be <= 255, got {num_readers}")
        self.layout = _Layout(num_readers, num_chunks, chunk_payload_bytes)
        self.write_timeout_s = write_timeout_s
        self._spin_s = spin_s
        self._max_sleep_s = max_sleep_s
        self._shm = self._create_segment(name_prefix, self.layout.total_bytes)
        self._unlinked = False
        self._buf = self._shm.buf
        self._words = self._buf.cast("Q")
        self._next_seq = 1
        # Readers' epochs as last seen: one bytes comparison per write tells whether any
        # reader attached or detached since.
        self._seen_epochs = bytes(num_readers)
        self._admitted = [False] * num_readers
        # What step 3 of the publication writes into a chunk's read flags: 0 for an
        # admitted reader (it must read this message), 1 for everyone else.
        self._clear_pattern = b"\x01" * num_readers
        self._all_read = b"\x01" * num_readers
        self._init_segment()

    @staticmethod
    def _create_segment(name_prefix: str, size: int) -> shared_memory.SharedMemory:
        # pid + random suffix: two engines on one machine (or one engine restarted while
        # a stale segment lingers) never pick the same name; create=True refuses to open
        # an existing one, so a collision is retried, never shared.
        while True:
            name = f"{name_prefix}_{os.getpid()}_{secrets.token_hex(4)}"
            try:
                return shared_memory.SharedMemory(name=name, create=True, size=size)
            except FileExistsError:
                continue

    def _init_segment(self) -> None:
        layout, words = self.layout, self._words
        for seq in range(1, layout.num_chunks + 1):
            base = layout.chunk(seq)
            words[(base + _CHUNK_SEQ) // 8] = 0
            self._buf[base + _CHUNK_FLAGS : base + _CHUNK_FLAGS + layout.num_readers] = (
                self._all_read
            )
        words[_W_NUM_READERS] = layout.num_readers
        words[_W_NUM_CHUNKS] = layout.num_chunks
        words[_W_PAYLOAD_BYTES] = layout.chunk_payload_bytes
        words[_W_WRITER_STATE] = _WRITER_OPEN
        # Last: a reader that sees the magic sees a fully initialised segment.
        words[_W_MAGIC] = _MAGIC

    @property
    def name(self) -> str:
        """The segment's name: what a reader needs to attach."""
        return self._shm.name

    @property
    def max_payload_bytes(self) -> int:
        return self.layout.chunk_payload_bytes

    def fits(self, num_bytes: int) -> bool:
        """Whether a message of ``num_bytes`` goes in the ring (else: send it elsewhere)."""
        return num_bytes <= self.layout.chunk_payload_bytes

    @property
    def num_published(self) -> int:
        return self._next_seq - 1

    def admitted_readers(self) -> list[int]:
        """Indices of the readers the writer currently waits for."""
        self._sync_readers()
        return [index for index, admitted in enumerate(self._admitted) if admitted]

    def write(self, data: bytes | bytearray | memoryview, timeout_s: float | None = None) -> None:
        """Publish one message to every admitted reader.

        Blocks while the chunk it needs still holds a message some admitted reader has
        not read; raises ``TimeoutError`` after ``timeout_s`` (default
        ``write_timeout_s``) and ``MessageTooLargeError`` when ``fits(len(data))`` is
        False.
        """
        num_bytes = len(data)
        layout = self.layout
        if num_bytes > layout.chunk_payload_bytes:
            raise MessageTooLargeError(
                f"message of {num_bytes} bytes exceeds the ring's chunk payload of "
                f"{layout.chunk_payload_bytes} bytes (ring {self.name!r})"
            )
        seq = self._next_seq
        base = layout.chunk(seq)
        flags = base + _CHUNK_FLAGS
        flags_end = flags + layout.num_readers
        buf = self._buf
        self._sync_readers()
        if buf[flags:flags_end] != self._all_read:
            self._wait_until_read(seq, flags, flags_end, timeout_s)
        payload = base + layout.header_bytes
        self._words[(base + _CHUNK_LEN) // 8] = num_bytes
        buf[payload : payload + num_bytes] = data
        # Admit / release readers now, not earlier: one that asked while the payload was
        # being copied starts with this message.
        self._sync_readers()
        buf[flags:flags_end] = self._clear_pattern
        self._words[(base + _CHUNK_SEQ) // 8] = seq  # publish: the last store
        self._next_seq = seq + 1

    def _wait_until_read(
        self, seq: int, flags: int, flags_end: int, timeout_s: float | None
    ) -> None:
        timeout_s = self.write_timeout_s if timeout_s is None else timeout_s
        waiter = _Waiter(timeout_s, self._spin_s, self._max_sleep_s)
        while self._buf[flags:flags_end] != self._all_read:
            # A reader that detaches (or closes after a crash is noticed) frees its flags.
            self._sync_readers()
            if not waiter.pause():
                flag_bytes = bytes(self._buf[flags:flags_end])
                lagging = [index for index, flag in enumerate(flag_bytes) if flag == 0]
                raise TimeoutError(
                    f"ring {self.name!r}: waited {timeout_s:.3g} s to publish message {seq}: "
                    f"reader(s) {lagging} have not read message {seq - self.layout.num_chunks} "
                    f"in that chunk (stalled, or exited without close())"
                )

    def _sync_readers(self) -> None:
        """Admit readers that asked to attach and release those that detached."""
        layout = self.layout
        epochs_at = layout.reader_epoch
        epochs = bytes(self._buf[epochs_at : epochs_at + layout.num_readers])
        if epochs == self._seen_epochs:
            return
        for index, (epoch, seen) in enumerate(zip(epochs, self._seen_epochs)):
            if epoch != seen:
                self._set_admitted(index, admitted=bool(epoch & 1), epoch=epoch)
        self._seen_epochs = epochs
        self._clear_pattern = bytes(0 if admitted else 1 for admitted in self._admitted)

    def _set_admitted(self, index: int, admitted: bool, epoch: int) -> None:
        layout, buf = self.layout, self._buf
        # Whether joining or leaving, the reader owes nothing for what is in the ring now.
        for seq in range(1, layout.num_chunks + 1):
            buf[layout.chunk(seq) + _CHUNK_FLAGS + index] = 1
        self._words[layout.start_seq // 8 + index] = self._next_seq
        self._admitted[index] = admitted
        buf[layout.writer_epoch + index] = epoch  # the ack, after start_seq

    def wait_for_readers(self, reader_indices: list[int], timeout_s: float) -> None:
        """Block until every reader in ``reader_indices`` has attached and is admitted;
        they receive every message written after this returns."""
        waiter = _Waiter(timeout_s, self._spin_s, self._max_sleep_s)
        while True:
            self._sync_readers()
            missing = [index for index in reader_indices if not self._admitted[index]]
            if not missing:
                return
            if not waiter.pause():
                raise TimeoutError(
                    f"ring {self.name!r}: reader(s) {missing} did not attach within "
                    f"{timeout_s:.3g} s"
                )

    def close(self) -> None:
        """Mark the ring closed (readers drain what is published, then get
        ``RingClosedError``) and unmap it here. Idempotent."""
        if self._buf is None:
            return
        self._words[_W_WRITER_STATE] = _WRITER_CLOSED
        self._words.release()
        self._buf = self._words = None
        self._shm.close()

    def unlink(self) -> None:
        """Remove the segment's name (readers keep their mappings until they close).
        Idempotent; only the writer unlinks."""
        if not self._unlinked:
            self._unlinked = True
            self._shm.unlink()

    def __enter__(self) -> ShmRingWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
        self.unlink()


class ShmRingReader:
    """One reading end, reader ``reader_index`` of the ring named ``name``.

    Invariant: ``read`` returns messages ``start_seq, start_seq + 1, ...`` with no gap and
    no repeat, each exactly as written; ``start_seq`` is the first message the writer
    published after it admitted this reader (see the module docstring).
    """

    def __init__(
        self,
        name: str,
        reader_index: int,
        *,
        open_timeout_s: float = 5.0,
        spin_s: float = DEFAULT_SPIN_S,
        max_sleep_s: float = DEFAULT_MAX_SLEEP_S,
    ) -> None:
        self._spin_s = spin_s
        self._max_sleep_s = max_sleep_s
        self._shm = self._open(name, open_timeout_s)
        self._buf = self._shm.buf
        self._words = self._buf.cast("Q")
        words = self._words
        self.layout = _Layout(words[_W_NUM_READERS], words[_W_NUM_CHUNKS], words[_W_PAYLOAD_BYTES])
        if not 0 <= reader_index < self.layout.num_readers:
            self._release()
            raise ValueError(
                f"reader_index must be in [0, {self.layout.num_readers}) for ring "
                f"{name!r}, got {reader_index}"
            )
        self.name = name
        self.reader_index = reader_index
        epoch_at = self.layout.reader_epoch + reader_index
        epoch = self._buf[epoch_at]
        if epoch & 1:
            self._release()
            raise RuntimeError(
                f"ring {name!r}: reader index {reader_index} is already attached (another "
                f"reader holds it, or one exited without close())"
            )
        self._epoch = (epoch + 1) % 256
        self._buf[epoch_at] = self._epoch  # ask to attach; the writer admits
        self._next_seq = 0  # 0: not admitted yet

    def _open(self, name: str, open_timeout_s: float) -> shared_memory.SharedMemory:
        waiter = _Waiter(open_timeout_s, 0.0, 10e-3)
        while True:
            try:
                shm = _open_untracked(name)
            except (FileNotFoundError, ValueError):
                # ValueError: created but not sized yet (mmap of an empty file).
                shm = None
            if shm is not None:
                # The writer stores the magic last; a reader racing the writer's set-up
                # waits for it.
                if len(shm.buf) >= _CONTROL_FIXED_BYTES:
                    with shm.buf.cast("Q") as words:
                        ready = words[_W_MAGIC] == _MAGIC
                    if ready:
                        return shm
                shm.close()
            if not waiter.pause():
                raise TimeoutError(
                    f"no ring {name!r} after {open_timeout_s:.3g} s (the writer has not "
                    f"created it yet, or has already unlinked it)"
                )

    @property
    def is_admitted(self) -> bool:
        """Whether the writer has admitted this reader (it then receives every message
        published from ``start_seq`` on)."""
        return self._next_seq != 0 or self._check_admitted()

    def _check_admitted(self) -> bool:
        layout = self.layout
        if self._buf[layout.writer_epoch + self.reader_index] != self._epoch:
            return False
        self._next_seq = self._words[layout.start_seq // 8 + self.reader_index]
        return True

    def read(self, timeout_s: float | None = None, max_sleep_s: float | None = None) -> bytes:
        """The next message, as a copy. Blocks up to ``timeout_s`` (None: forever);
        raises ``TimeoutError``, or ``RingClosedError`` once the writer has closed and
        nothing published is left. ``max_sleep_s``: the longest sleep between polls for
        this read (a reader expecting a message soon), instead of the ring's."""
        if not self._message_ready():
            self._wait(timeout_s, max_sleep_s)
        seq = self._next_seq
        base = self.layout.chunk(seq)
        num_bytes = self._words[(base + _CHUNK_LEN) // 8]
        payload = base + self.layout.header_bytes
        data = bytes(self._buf[payload : payload + num_bytes])
        # After the copy: from here on the writer may reuse the chunk.
        self._buf[base + _CHUNK_FLAGS + self.reader_index] = 1
        self._next_seq = seq + 1
        return data

    def _message_ready(self) -> bool:
        """Whether message ``_next_seq`` is published (admitting this reader first)."""
        seq = self._next_seq
        if seq == 0:
            if not self._check_admitted():
                return False
            seq = self._next_seq
        published = self._words[(self.layout.chunk(seq) + _CHUNK_SEQ) // 8]
        if published == seq:
            return True
        if published > seq:
            raise RuntimeError(
                f"ring {self.name!r}, reader {self.reader_index}: message {seq} was "
                f"overwritten by {published} before it was read (ring invariant broken)"
            )
        return False

    def _wait(self, timeout_s: float | None, max_sleep_s: float | None = None) -> None:
        max_sleep_s = self._max_sleep_s if max_sleep_s is None else max_sleep_s
        waiter = _Waiter(timeout_s, self._spin_s, max_sleep_s)
        while not self._message_ready():
            # Closed is checked before the message again: a message published just
            # before close() must still be read.
            if self._words[_W_WRITER_STATE] == _WRITER_CLOSED and not self._message_ready():
                raise RingClosedError(f"ring {self.name!r}: the writer has closed")
            if not waiter.pause():
                what = f"message {self._next_seq}" if self._next_seq else "admission"
                raise TimeoutError(
                    f"ring {self.name!r}, reader {self.reader_index}: no {what} from the "
                    f"writer within {timeout_s:.3g} s"
                )

    def close(self) -> None:
        """Detach (the writer stops waiting for this reader) and unmap. Idempotent."""
        if self._buf is None:
            return
        self._buf[self.layout.reader_epoch + self.reader_index] = (self._epoch + 1) % 256
        self._release()

    def _release(self) -> None:
        self._words.release()
        self._buf = self._words = None
        self._shm.close()

    def __enter__(self) -> ShmRingReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
