"""Where a batch's lines come from and where its answers go (``batch_runner.py``): a local
file, standard input or output (``-``), or an HTTP(S) URL, as vLLM's ``run-batch`` takes
them (an object store's pre-signed URLs: GET the input, PUT the output).

The input is read as it goes, never whole: a file line by line (on a thread of its own, so
the event loop keeps serving the lines in flight), a URL as its body streams in. A line longer than
``MAX_LINE_BYTES`` is skipped to its end and reported as ``TOO_LONG``. An output URL gets
the answers once the batch ends, from a local file written as they come (``tmp_dir``); if
the upload fails that file is kept, and its path logged, so nothing is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import sys
import tempfile
import threading
from typing import IO

import aiohttp

from pagedserve.frontend.server import MAX_MESSAGE_BYTES

logger = logging.getLogger("pagedserve.batch")

# A line is at most one HTTP request body and its envelope.
MAX_LINE_BYTES = MAX_MESSAGE_BYTES + (64 << 10)
TOO_LONG = object()  # a line past the limit (skipped to its end)
URL_SCHEMES = ("http://", "https://")
# GET and PUT: connecting may take this long; a stalled transfer is given up after
# READ_TIMEOUT_S without a byte.
CONNECT_TIMEOUT_S = 30.0
READ_TIMEOUT_S = 300.0
# An upload is tried this many times, waiting 1, 2, 4 ... s between tries.
UPLOAD_ATTEMPTS = 4


class BatchFileError(OSError):
    """An input that cannot be read or an output that cannot be written; the message
    names it and why."""


def is_url(path: str) -> bool:
    return path.startswith(URL_SCHEMES)


def _timeout() -> aiohttp.ClientTimeout:
    return aiohttp.ClientTimeout(
        total=None, sock_connect=CONNECT_TIMEOUT_S, sock_read=READ_TIMEOUT_S
    )


class _LineCutter:
    """Lines cut out of chunks as they come; a line past ``max_bytes`` is dropped as it
    streams in and given as ``TOO_LONG``."""

    def __init__(self, max_bytes: int) -> None:
        self._max_bytes = max_bytes
        self._buffer = bytearray()
        self._scanned = 0  # bytes of the buffer known to hold no newline
        self._skipping = False  # inside a line past the limit: drop it up to its newline

    def take(self) -> bytes | object | None:
        """The next whole line (``TOO_LONG`` for one past the limit); None: feed more."""
        buffer = self._buffer
        newline = buffer.find(b"\n", self._scanned)
        if newline < 0:
            if len(buffer) > self._max_bytes:  # no end in sight: keep none of it
                self._skipping = True
                buffer.clear()
            self._scanned = len(buffer)
            return None
        line = bytes(buffer[: newline + 1])
        del buffer[: newline + 1]
        self._scanned = 0
        if self._skipping or len(line) > self._max_bytes:
            self._skipping = False
            return TOO_LONG
        return line

    def feed(self, chunk: bytes) -> None:
        self._buffer += chunk

    def end(self) -> bytes | object | None:
        """At the end of the input: a last line without its newline, or None."""
        if self._skipping:
            self._skipping = False
            return TOO_LONG
        if self._buffer:
            line = bytes(self._buffer)
            self._buffer.clear()
            return line
        return None


class FileLines:
    """The lines of a local file or of standard input, read on a daemon thread of their
    own with plain ``os.read`` calls: a read that blocks (a pipe with nothing to say yet)
    holds neither the event loop nor, once the batch is told to stop, the process's exit
    (a daemon thread blocked inside a buffered reader would abort the interpreter's)."""

    READ_BYTES = 1 << 16

    def __init__(self, file: IO[bytes], max_bytes: int = MAX_LINE_BYTES) -> None:
        self._file = file
        self._fd = file.fileno()
        self._lines = _LineCutter(max_bytes)
        self._at_end = False
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._serve_reads, name="pagedserve-batch-input", daemon=True
        )
        self._thread.start()

    async def next_line(self) -> bytes | object | None:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._requests.put((loop, future))
        return await future

    async def close(self) -> None:
        self._requests.put(None)  # the thread closes the file once its read is done

    def _serve_reads(self) -> None:
        while (request := self._requests.get()) is not None:
            loop, future = request
            try:
                outcome = (True, self._read_line())
            except Exception as error:
                outcome = (False, error)
            loop.call_soon_threadsafe(_settle, future, outcome)
        if self._file is not sys.stdin.buffer:
            self._file.close()

    def _read_line(self) -> bytes | object | None:
        while True:
            line = self._lines.take()
            if line is not None:
                return line
            if self._at_end:
                return self._lines.end()
            chunk = os.read(self._fd, self.READ_BYTES)
            if chunk:
                self._lines.feed(chunk)
            else:
                self._at_end = True


def _settle(future: asyncio.Future, outcome: tuple[bool, object]) -> None:
    if future.done():  # the caller stopped waiting (the batch was stopped)
        return
    succeeded, value = outcome
    if succeeded:
        future.set_result(value)
    else:
        future.set_exception(value)


class UrlLines:
    """The lines of a body streamed from an HTTP(S) GET."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        response: aiohttp.ClientResponse,
        max_bytes: int = MAX_LINE_BYTES,
    ) -> None:
        self._session = session
        self._response = response
        self._lines = _LineCutter(max_bytes)

    @classmethod
    async def open(cls, url: str, max_bytes: int = MAX_LINE_BYTES) -> UrlLines:
        session = aiohttp.ClientSession(timeout=_timeout())
        try:
            response = await session.get(url)
        except (aiohttp.ClientError, asyncio.TimeoutError) as error:
            await session.close()
            raise BatchFileError(f"cannot read the input {url!r}: {error!r}") from None
        if response.status != 200:
            response.release()
            await session.close()
            raise BatchFileError(
                f"cannot read the input {url!r}: GET answered {response.status} {response.reason}"
            )
        return cls(session, response, max_bytes)

    async def next_line(self) -> bytes | object | None:
        while True:
            line = self._lines.take()
            if line is not None:
                return line
            try:
                chunk = await self._response.content.readany()
            except (aiohttp.ClientError, asyncio.TimeoutError) as error:
                raise BatchFileError(f"reading the input failed: {error!r}") from None
            if not chunk:
                return self._lines.end()
            self._lines.feed(chunk)

    async def close(self) -> None:
        self._response.release()
        await self._session.close()


async def open_input(path: str, max_bytes: int = MAX_LINE_BYTES) -> FileLines | UrlLines:
    """The lines of ``path`` (``-``: standard input; http(s): a GET); ``BatchFileError``
    if it cannot be read."""
    if is_url(path):
        return await UrlLines.open(path, max_bytes)
    if path == "-":
        return FileLines(sys.stdin.buffer, max_bytes)
    try:
        return FileLines(open(path, "rb"), max_bytes)  # noqa: SIM115 (FileLines closes it)
    except OSError as error:
        raise BatchFileError(f"cannot read the input file {path!r}: {error.strerror}") from None


class Output:
    """Where the answers are written as they come (``file``); ``finish()`` delivers them
    (an output URL's upload) once the batch has ended."""

    def __init__(self, path: str, file: IO[str], upload_from: str | None = None) -> None:
        self.path = path
        self.file = file
        self._upload_from = upload_from  # the local file an output URL is sent from

    async def finish(self) -> None:
        """Close the output; for a URL, PUT the answers there (``BatchFileError`` if that
        fails, the local file then kept)."""
        if self.file is not sys.stdout:
            self.file.close()
        else:
            self.file.flush()
        if self._upload_from is None:
            return
        await _upload(self.path, self._upload_from)
        os.unlink(self._upload_from)

    def discard(self) -> None:
        """Close it, keeping whatever was written (nothing is uploaded)."""
        with contextlib.suppress(OSError):
            if self.file is not sys.stdout:
                self.file.close()


def open_output(path: str, tmp_dir: str | None = None) -> Output:
    """The output ``path`` (``-``: standard output; http(s): a local file in ``tmp_dir``,
    PUT there at the end); ``BatchFileError`` if it cannot be written."""
    if path == "-":
        return Output(path, sys.stdout)
    if is_url(path):
        try:
            file = tempfile.NamedTemporaryFile(  # noqa: SIM115 (Output closes it)
                mode="w",
                encoding="utf-8",
                dir=tmp_dir,
                prefix="pagedserve-batch-",
                suffix=".jsonl",
                delete=False,
            )
        except OSError as error:
            raise BatchFileError(
                f"cannot write the output's local copy in {tmp_dir or tempfile.gettempdir()!r}: "
                f"{error.strerror}"
            ) from None
        return Output(path, file, upload_from=file.name)
    try:
        return Output(path, open(path, "w", encoding="utf-8"))  # noqa: SIM115 (Output closes it)
    except OSError as error:
        raise BatchFileError(f"cannot write the output file {path!r}: {error.strerror}") from None


async def _upload(url: str, local_path: str) -> None:
    delay_s = 1.0
    for attempt in range(1, UPLOAD_ATTEMPTS + 1):
        try:
            async with aiohttp.ClientSession(timeout=_timeout()) as session:
                with open(local_path, "rb") as body:
                    async with session.put(url, data=body) as response:
                        if response.status in (200, 201, 204):
                            logger.info("answers uploaded to %s", url)
                            return
                        failure = f"PUT answered {response.status} {response.reason}"
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as error:
            failure = repr(error)
        if attempt == UPLOAD_ATTEMPTS:
            raise BatchFileError(
                f"cannot upload the answers to {url!r} ({failure}, {attempt} tries); they are "
                f"kept in {local_path}"
            )
        logger.warning("upload to %s failed (%s); trying again in %.0f s", url, failure, delay_s)
        await asyncio.sleep(delay_s)
        delay_s *= 2
