"""``pagedserve serve`` as a child process of the tests (``ServerProcess``) on 127.0.0.1,
its ports read from ``--port-file``, and the name and chat template the tests serve with."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc

from helpers.processes import is_live, live_children, wait_until
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc

STARTUP_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0
SERVED_MODEL_NAME = "tiny-llama"
# A ChatML template, enough to test chat requests on the tiny tokenizer's byte vocabulary;
# as Qwen3's, chat_template_kwargs {"enable_thinking": false} opens the turn with an empty
# thinking block, and as a RAG template's, documents come first.
CHAT_TEMPLATE = (
    "{% for d in documents or [] %}<|im_start|>document\n{{ d['text'] }}<|im_end|>\n"
    "{% endfor %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)


class ServerProcess:
    """``pagedserve serve`` in a child process; its log goes to a file for diagnostics."""

    def __init__(
        self,
        model_dir: Path | None,
        workdir: Path,
        *flags: str,
        env: dict[str, str] | None = None,
    ):
        self.port_file = workdir / "port.json"
        self.log_path = workdir / "server.log"
        self.port_file.unlink(missing_ok=True)
        command = [
            sys.executable,
            "-m",
            "pagedserve.frontend.cli",
            "serve",
            *([] if model_dir is None else ["--model", str(model_dir)]),  # None: embedded
            "--port",
            "0",
            "--port-file",
            str(self.port_file),
            *flags,
        ]
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
        self.port: int | None = None
        self.metrics_port: int | None = None
        self.http_port: int | None = None
        self.channel: grpc.Channel | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_serving(self, timeout_s: float = STARTUP_TIMEOUT_S) -> ServerProcess:
        deadline_s = time.monotonic() + timeout_s
        while not self.port_file.exists():
            if self.process.poll() is not None:
                raise AssertionError(f"server exited {self.process.returncode}:\n{self.log()}")
            if time.monotonic() > deadline_s:
                self.kill()
                raise AssertionError(f"server not serving within {timeout_s} s:\n{self.log()}")
            time.sleep(0.05)
        served = json.loads(self.port_file.read_text())
        self.port = served["port"]
        self.metrics_port = served["metrics_port"]
        self.http_port = served["http_port"]
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        return self

    @property
    def http_url(self) -> str:
        """The HTTP API's root (``--http-port``)."""
        assert self.http_port is not None, "started without --http-port"
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def stub(self) -> pb_grpc.GenerationServiceStub:
        return pb_grpc.GenerationServiceStub(self.channel)

    def engine_pids(self) -> list[int]:
        """The scheduler process and its workers."""
        schedulers = live_children(self.pid)
        return schedulers + [w for s in schedulers for w in live_children(s)]

    def worker_pids(self) -> list[int]:
        """The worker processes (multiprocessing spawns them; the scheduler's other child
        is multiprocessing's resource tracker)."""

        def command(pid: int) -> bytes:
            try:
                return Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                return b""

        return [pid for pid in self.engine_pids() if b"spawn_main" in command(pid)]

    def stats(self) -> pb.GetStatsResponse:
        return self.stub.GetStats(pb.GetStatsRequest(), timeout=10)

    def assert_blocks_all_free(self, timeout_s: float = 5.0) -> None:
        """Nothing runs and every block is free (cancellations reach the scheduler
        asynchronously, so this waits for them a little)."""

        def settled() -> bool:
            stats = self.stats()
            engine = stats.engine
            return (
                stats.requests_running == 0
                and engine["num_running"] == engine["num_waiting"] == engine["num_swapped"] == 0
                and engine["num_free_blocks"] == engine["num_total_blocks"]
                and engine["num_free_host_blocks"] == engine["num_total_host_blocks"]
            )

        settled_in_time = wait_until(settled, timeout_s)
        stats = self.stats()
        assert stats.integrity_error == "", stats.integrity_error
        assert settled_in_time, stats

    def terminate(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM (drain), then the exit code; the engine's processes are gone too."""
        engine_pids = self.engine_pids()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"server did not exit within {timeout_s} s:\n{self.log()}"
            ) from None
        assert wait_until(lambda: not any(is_live(pid) for pid in engine_pids), 5.0), (
            f"engine processes left behind: {[p for p in engine_pids if is_live(p)]}"
        )
        return code

    def kill(self) -> None:
        """SIGKILL the server only: its scheduler and workers die with it, and
        multiprocessing's resource tracker (which outlives them) unlinks the ring."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
        if self.process.poll() is None:
            self.kill()
        self._log.close()


@contextlib.contextmanager
def serving(model_dir: Path, workdir: Path, *flags: str) -> Iterator[ServerProcess]:
    """A server on the tiny model with its HTTP API too (``served_model_name``
    SERVED_MODEL_NAME, a 4 MiB KV cache) and ``flags``, for a module's tests; stopped by
    SIGTERM at the end, which must drain cleanly (exit 0)."""
    server = ServerProcess(
        model_dir,
        workdir,
        "--kv-cache-bytes", str(4 << 20),
        "--http-port", "0",
        "--served-model-name", SERVED_MODEL_NAME,
        *flags,
    ).wait_serving()  # fmt: skip
    try:
        yield server
        assert server.terminate() == 0, server.log()
    finally:
        server.close()
