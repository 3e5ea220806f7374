"""The server under faults: cancelled calls, deadlines, overload, SIGTERM (drain), a worker
killed mid-generation, a bad start-up, and systemd's notifications. Each test runs a real
server process of its own and sends traffic only to 127.0.0.1, bounded in count and time."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from helpers.processes import is_live, wait_until
from pagedserve.frontend.client import stream_request
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc

# Long enough to still run when the test acts (about 5-10 ms a token on the tiny model).
LONG = pb.SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)


def long_request(prompt_start: int = 5, **fields) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[prompt_start, 300, 301, 302]), sampling=LONG, **fields
    )


def longest_request(prompt_start: int = 5) -> pb.GenerateRequest:
    """500 tokens, nearly the test model's whole window (512): for calls that must still be
    running a fraction of a second later (the tiny model streams over 1000 tokens a second
    on a quiet machine)."""
    return pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[prompt_start, 300, 301, 302]),
        sampling=pb.SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True),
    )


def health_status(server) -> int:
    stub = health_pb2_grpc.HealthStub(server.channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status


def test_cancelled_stream_and_passed_deadline_free_their_blocks(start_server):
    server = start_server("--kv-cache-bytes", str(4 << 20))
    stream = server.stub.GenerateStream(stream_request(longest_request()))
    first = next(stream)
    next(stream)
    assert first.prompt_token_ids
    assert server.stats().engine["num_running"] == 1
    stream.cancel()
    server.assert_blocks_all_free()
    with pytest.raises(grpc.RpcError) as caught:  # 500 tokens cannot come in 0.1 s
        server.stub.Generate(longest_request(), timeout=0.1)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    server.assert_blocks_all_free()
    stats = server.stats()
    assert stats.requests_cancelled == 2 and stats.requests_finished == 0
    # It serves on.
    reply = server.stub.Generate(
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2]), sampling=pb.SamplingParams())
    )
    assert reply.finished
    assert server.terminate() == 0


def test_more_calls_than_the_limit_get_resource_exhausted(start_server):
    server = start_server("--max-concurrent-requests", "2")
    streams = [server.stub.GenerateStream(stream_request(longest_request(5 + i))) for i in range(2)]
    for stream in streams:
        next(stream)
    with pytest.raises(grpc.RpcError) as caught:
        server.stub.Generate(long_request(), timeout=30)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_concurrent_requests is 2" in caught.value.details()
    for stream in streams:
        stream.cancel()
    server.assert_blocks_all_free()
    assert server.terminate() == 0


def test_sigterm_drains_calls_in_flight_then_exits_0(start_server):
    server = start_server()
    stream = server.stub.GenerateStream(stream_request(longest_request()))
    messages = [next(stream)]
    os.kill(server.pid, signal.SIGTERM)
    assert wait_until(
        lambda: health_status(server) == health_pb2.HealthCheckResponse.NOT_SERVING, 10
    )
    with pytest.raises(grpc.RpcError) as caught:
        server.stub.Generate(long_request(), timeout=10)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "shutting down" in caught.value.details()
    messages += list(stream)  # the call in flight runs to its end
    assert messages[-1].finished
    assert sum(len(c.token_ids) for m in messages for c in m.outputs) == 500
    assert server.terminate() == 0
    assert "draining: 1 calls in flight" in server.log()


def test_drain_timeout_ends_the_calls_left_with_unavailable(start_server):
    # 0.1 s cannot finish 500 tokens; on a quiet machine the 400 of LONG came within 0.5 s.
    server = start_server("--drain-timeout-s", "0.1")
    stream = server.stub.GenerateStream(stream_request(longest_request()))
    next(stream)
    started_s = time.monotonic()
    os.kill(server.pid, signal.SIGTERM)
    with pytest.raises(grpc.RpcError) as caught:
        list(stream)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "drain timeout 0.1 s" in caught.value.details()
    assert server.terminate() == 0
    assert time.monotonic() - started_s < 15


def test_worker_killed_mid_generation_fails_every_call_and_exits_1(start_server):
    server = start_server()
    # The pids are read before the calls start and the worker is killed the moment every
    # call has streamed once: on a fast machine 500 tokens take under half a second, and
    # reading /proc between the first token and the kill once let a call finish cleanly.
    engine_pids = server.engine_pids()
    (worker_pid,) = server.worker_pids()
    streams = [server.stub.GenerateStream(stream_request(longest_request(5 + i))) for i in range(3)]
    for stream in streams:
        next(stream)
    killed_s = time.monotonic()
    os.kill(worker_pid, signal.SIGKILL)
    for stream in streams:
        with pytest.raises(grpc.RpcError) as caught:
            list(stream)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert f"worker rank 0 (pid {worker_pid}) died" in caught.value.details()
    assert time.monotonic() - killed_s < 5
    assert server.process.wait(30) == 1
    assert wait_until(lambda: not any(is_live(pid) for pid in engine_pids), 5)
    assert "engine died" in server.log()


def test_bad_model_exits_2_before_serving_and_a_busy_port_exits_1(start_server, tmp_path):
    server = start_server("--dtype", "float32", "--max-model-len", "100000", wait=False)
    assert server.process.wait(120) == 2
    assert "max_model_len=100000 exceeds the model's context window 512" in server.log()
    assert not server.port_file.exists()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        server = start_server("--port", str(port), wait=False)
        assert server.process.wait(60) == 1
    assert f"cannot listen on 127.0.0.1:{port}" in server.log()


def test_systemd_notifications_ready_stopping_and_watchdog(start_server, tmp_path):
    address = str(tmp_path / "notify.sock")
    received: list[str] = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify_socket:
        notify_socket.bind(address)
        notify_socket.settimeout(0.2)
        stop = threading.Event()

        def listen() -> None:
            while not stop.is_set():
                try:
                    received.append(notify_socket.recv(4096).decode())
                except TimeoutError:
                    continue

        listener = threading.Thread(target=listen, daemon=True)
        listener.start()
        # The watchdog (WATCHDOG_USEC) is for this pid only once it is known: the
        # server checks WATCHDOG_PID, so the child is told its own pid is fine when
        # unset.
        server = start_server(env={"NOTIFY_SOCKET": address, "WATCHDOG_USEC": "400000"})
        assert wait_until(lambda: any("READY=1" in m for m in received), 10), received
        assert wait_until(lambda: sum("WATCHDOG=1" in m for m in received) >= 2, 10), received
        assert server.terminate() == 0
        assert wait_until(lambda: any("STOPPING=1" in m for m in received), 5), received
        stop.set()
        listener.join(5)
    ready = next(m for m in received if "READY=1" in m)
    assert f"STATUS=serving on 127.0.0.1:{server.port}" in ready


def test_while_the_model_loads_health_says_not_serving_and_calls_wait_for_nothing(
    start_server,
):
    with socket.socket() as probe:  # a free port, named up front: no port file yet
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = start_server("--port", str(port), wait=False)
    # Reconnects every 50 ms: by default a channel refused while the server imports waits
    # out a growing backoff (1 s, 1.6 s, 2.6 s, ...) and may first reach it once it serves.
    channel = grpc.insecure_channel(
        f"127.0.0.1:{port}",
        options=[
            ("grpc.initial_reconnect_backoff_ms", 50),
            ("grpc.min_reconnect_backoff_ms", 50),
            ("grpc.max_reconnect_backoff_ms", 50),
        ],
    )
    health = health_pb2_grpc.HealthStub(channel)
    stub = pb_grpc.GenerationServiceStub(channel)
    short = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[5, 6]), sampling=pb.SamplingParams(max_tokens=2)
    )
    statuses, refusals = [], []
    deadline_s = time.monotonic() + 120
    while time.monotonic() < deadline_s:
        try:
            status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
        except grpc.RpcError:
            time.sleep(0.02)  # not listening yet
            continue
        statuses.append(status)
        if status == health_pb2.HealthCheckResponse.SERVING:
            break
        try:
            stub.Generate(short, timeout=5)
        except grpc.RpcError as error:
            refusals.append((error.code(), error.details()))
        # (A call may also succeed: the engine can come up between the two calls.)
    assert statuses[-1] == health_pb2.HealthCheckResponse.SERVING
    # The port opens before the worker has loaded the model (it imports torch and
    # reads the weights for seconds): a client sees the start-up state first.
    assert statuses[0] == health_pb2.HealthCheckResponse.NOT_SERVING, statuses
    assert refusals, statuses
    assert set(refusals) == {(grpc.StatusCode.UNAVAILABLE, "the engine is still starting")}
    channel.close()
    server.wait_serving()
    assert server.terminate() == 0
