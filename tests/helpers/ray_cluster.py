"""A Ray cluster of two nodes on this machine, as an operator starts one: ``ray start
--head`` and ``ray start --address``, each in the foreground (``--block``) as a process the
test owns: the head with two CPUs, the other with one. ``stop`` ends both and whatever they
started; nothing outlives the test.

Everything stays on this machine: the nodes are reached at 127.0.0.1, and they advertise
this machine's own address (Ray turns a loopback ``--node-ip-address`` into it), which the
kernel routes over the loopback interface too."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The cluster's ray command: the one installed beside this Python.
RAY = str(Path(sys.executable).with_name("ray"))
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 20.0


# Run in a process of its own, so the test's process never becomes a Ray driver.
_WAIT_FOR_NODES = """
import sys, time
import ray
address, count, timeout_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
ray.init(address=address, log_to_driver=False)
deadline_s = time.monotonic() + timeout_s
while sum(node["Alive"] for node in ray.nodes()) < count:
    if time.monotonic() > deadline_s:
        sys.exit(f"fewer than {count} nodes alive after {timeout_s} s: {ray.nodes()}")
    time.sleep(0.2)
ray.shutdown()
"""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(0.2)
        return probe.connect_ex(("127.0.0.1", port)) == 0


class RayCluster:
    """Two nodes: ``node_a``, the head (2 CPUs), and ``node_b`` (1 CPU). CPU ranks spread
    over nodes (``ray_executor``): two ranks take one node each, three take the head twice."""

    def __init__(self, log_dir: Path) -> None:
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        self._log_dir = log_dir
        # Short: Ray's socket paths under it must fit AF_UNIX's 107 bytes.
        self._temp_dir = tempfile.mkdtemp(prefix="psray-", dir="/tmp")
        self._nodes: list[subprocess.Popen] = []

    def start(self) -> None:
        common = ["--block", "--num-gpus=0", "--disable-usage-stats"]
        self._start("head", ["--head", f"--port={self.port}", "--include-dashboard=false",
                             f"--temp-dir={self._temp_dir}", "--num-cpus=2",
                             '--resources={"node_a": 1}', *common])  # fmt: skip
        deadline_s = time.monotonic() + START_TIMEOUT_S
        while not _listening(self.port):
            if time.monotonic() > deadline_s or self._nodes[0].poll() is not None:
                self.stop()
                raise RuntimeError(f"the Ray head did not listen on {self.address}: {self.log()}")
            time.sleep(0.2)
        self._start("node_b", [f"--address={self.address}", "--num-cpus=1",
                               '--resources={"node_b": 1}', *common])  # fmt: skip
        # Both nodes registered before any engine places its ranks (CPU ranks spread over
        # the nodes there are when it asks).
        waited = subprocess.run(
            [sys.executable, "-c", _WAIT_FOR_NODES, self.address, "2", str(START_TIMEOUT_S)],
            capture_output=True,
            text=True,
            timeout=START_TIMEOUT_S + 30,
        )
        if waited.returncode != 0:
            self.stop()
            raise RuntimeError(f"the Ray cluster did not come up: {waited.stderr[-2000:]}")

    def _start(self, name: str, arguments: list[str]) -> None:
        log = open(self._log_dir / f"ray_{name}.log", "w")  # noqa: SIM115 (the node's lifetime)
        self._nodes.append(
            subprocess.Popen(
                [RAY, "start", *arguments],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own group: stop() ends what it started
            )
        )

    def log(self) -> str:
        return "; ".join(
            f"{path.name}: {path.read_text()[-2000:]}" for path in self._log_dir.glob("ray_*.log")
        )

    def stop(self) -> None:
        """The worker node first, then the head (which the worker node's drain asks)."""
        for node in reversed(self._nodes):
            node.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.wait(STOP_TIMEOUT_S)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.pid, signal.SIGKILL)  # anything the node left in its group
            node.wait()
        self._nodes.clear()
        shutil.rmtree(self._temp_dir, ignore_errors=True)
