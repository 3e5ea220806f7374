"""The multi-process engine: frontend, scheduler process and worker process, for real.

Same tokens as the in-process engine; a worker or scheduler killed mid-run ends every
request with an error naming it, promptly; start-up failures name the component; and no
process, socket directory or shared-memory segment outlives the engine. Processes are
checked through /proc (a zombie is not a live process: this machine's init does not
reap orphans, which is not the engine's doing).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgpack
import pytest

from helpers.engine_processes import (
    DEATH_NOTICED_WITHIN_S,
    LONG,
    assert_engine_gone,
    kill_mid_generation,
    live_schedulers,
)
from helpers.processes import is_live, live_children, stat_fields, wait_until
from pagedserve.frontend import LLM, SamplingParams
from pagedserve.frontend.engine_client import (
    EngineClient,
    EngineDeadError,
    EngineStartupError,
    RequestRefusedError,
)
from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.engine_messages import AddRequest, WorkerSpec
from pagedserve.scheduler.serialization import WIRE_FIELDS, encode

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPT_LENGTHS = [1, 5, 16, 17, 31, 64, 100, 150]


def random_prompts(seed: int, vocab_size: int = 512) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]


def token_ids(outputs) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in outputs]


# ---------------------------------------------------------------- /proc helpers


def cpu_seconds(pid: int) -> float:
    fields = stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


@pytest.fixture
def make_llm() -> Iterator[Callable[..., LLM]]:
    """Multi-process LLMs that are shut down when the test ends, whatever happens."""
    made: list[LLM] = []

    def make(model_dir: Path, **kwargs) -> LLM:
        llm = LLM(model_dir, multiprocess=True, **kwargs)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.shutdown()


@pytest.fixture(scope="module")
def shared_llm(tiny_model_dirs) -> Iterator[LLM]:
    llm = LLM(tiny_model_dirs["llama"], num_blocks=64, multiprocess=True)
    yield llm
    llm.shutdown()


# ---------------------------------------------------------------- same tokens


def test_same_greedy_tokens_as_in_process(tiny_model_dirs, shared_llm):
    prompts = random_prompts(seed=3)
    expected = token_ids(LLM(tiny_model_dirs["llama"], num_blocks=64).generate(prompts, GREEDY))
    outputs = shared_llm.generate(prompts, GREEDY)
    assert token_ids(outputs) == expected
    # The scheduler's time queued crosses the wire too.
    assert all(output.queue_time_s is not None for output in outputs)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_same_tokens_under_forced_preemption(tiny_model_dirs, make_llm, mode):
    # 16 blocks of 16 tokens hold 256 tokens; the eight requests need 70 blocks in all.
    settings = dict(num_blocks=16, max_num_batched_tokens=64, preemption_mode=mode)
    prompts = random_prompts(seed=4)
    in_process = LLM(tiny_model_dirs["llama"], **settings)
    expected = token_ids(in_process.generate(prompts, GREEDY))
    llm = make_llm(tiny_model_dirs["llama"], **settings)
    assert token_ids(llm.generate(prompts, GREEDY)) == expected
    assert llm.stats()[f"num_{mode}_preemptions"] > 0
    assert llm.stats()["num_preemptions"] == in_process.stats()["num_preemptions"]


def test_stats_and_prefix_cache_reset_over_the_wire(shared_llm):
    prompt = list(range(1, 50))  # three full blocks of 16
    shared_llm.reset_prefix_cache()
    before = shared_llm.stats()["prefix_cache_hits"]
    first = shared_llm.generate(prompt, GREEDY)[0]
    second = shared_llm.generate(prompt, GREEDY)[0]
    assert (
        second.num_cached_tokens == 48 and second.outputs[0].token_ids == first.outputs[0].token_ids
    )
    assert shared_llm.stats()["prefix_cache_hits"] == before + 48
    shared_llm.reset_prefix_cache()
    assert shared_llm.generate(prompt, GREEDY)[0].num_cached_tokens == 0


def test_request_that_cannot_fit_is_refused_before_it_is_sent(shared_llm):
    with pytest.raises(ValueError, match="prompts\\[0\\]: prompt is 600 tokens; max_model_len"):
        shared_llm.generate([[1] * 600], GREEDY)


def test_a_request_the_scheduler_cannot_decode_is_refused_and_the_engine_runs_on(shared_llm):
    # A frontend bug: a field its checks let through, which the scheduler's decoder
    # refuses. That request ends with an error naming the field; the engine is untouched.
    engine = shared_llm.engine
    frame = msgpack.unpackb(
        encode(AddRequest("bad", [1, 2, 3], GREEDY, 0.0, eos_token_ids=[])), raw=False
    )
    frame[3][WIRE_FIELDS[SamplingParams].index("ignore_eos")] = {}
    engine._process.to_scheduler.send(msgpack.packb(frame))
    engine._unfinished.add("bad")
    with pytest.raises(RequestRefusedError, match="ignore_eos: expected bool, got dict") as raised:
        engine.step()
    assert raised.value.request_id == "bad" and not engine.has_unfinished_requests()
    assert engine.is_running
    prompts = random_prompts(seed=5)[:3]
    assert len(token_ids(shared_llm.generate(prompts, GREEDY))[2]) == GREEDY.max_tokens
    assert shared_llm.stats()["num_free_blocks"] == 64


def test_scheduler_never_imports_torch_and_sleeps_when_idle(shared_llm):
    scheduler_pid = shared_llm.engine.scheduler_pid
    (worker_pid,) = shared_llm.engine.worker_pids
    assert "libtorch" not in Path(f"/proc/{scheduler_pid}/maps").read_text()
    assert "libtorch" in Path(f"/proc/{worker_pid}/maps").read_text()
    shared_llm.generate([1, 2, 3], GREEDY)
    used_before = cpu_seconds(scheduler_pid)
    time.sleep(1.0)
    # Blocked on its sockets: no clock tick of CPU in a second (one tick is 10 ms).
    assert cpu_seconds(scheduler_pid) - used_before < 0.02


# ---------------------------------------------------------------- deaths


def test_worker_killed_mid_generation_fails_every_request_and_leaves_nothing(
    tiny_model_dirs, make_llm
):
    llm = make_llm(tiny_model_dirs["llama"], num_blocks=256)
    engine = llm.engine
    scheduler_pid, worker_pids = engine.scheduler_pid, engine.worker_pids
    ring = engine._process.ring_name
    error = kill_mid_generation(llm, worker_pids[0])
    assert isinstance(error, EngineDeadError), error
    assert (
        f"worker rank 0 (pid {worker_pids[0]}) died with exit code -9 (killed by SIGKILL)"
        in str(error)
    )
    assert not engine.has_unfinished_requests()
    assert_engine_gone(llm, scheduler_pid, worker_pids, ring)
    # The scheduler ended every request before it exited: its final accounting is clean
    # (the autouse integrity check reads the same final stats).
    assert llm.stats()["num_free_blocks"] == 256
    with pytest.raises(EngineDeadError, match="worker rank 0"):
        llm.generate([1, 2, 3], GREEDY)


def test_after_a_worker_death_the_scheduler_names_the_cause_then_ends_each_request(
    tiny_model_dirs, make_llm
):
    # The wire protocol a streaming frontend relies on, read off the socket directly.
    llm = make_llm(tiny_model_dirs["llama"], num_blocks=256)
    engine, connection = llm.engine, llm.engine._process
    request_ids = [f"r{i}" for i in range(4)]
    for index, request_id in enumerate(request_ids):
        engine.add_request(request_id, [index + 1] * 8, LONG, frozenset())
    assert engine.step()  # the requests are running
    os.kill(engine.worker_pids[0], signal.SIGKILL)
    messages = []
    with pytest.raises(EngineDeadError, match="exit code 1"):
        while (message := connection.receive(DEATH_NOTICED_WITHIN_S)) is not None:
            messages.append(message)
    kinds = [type(message).__name__ for message in messages]
    cause = kinds.index("EngineError")
    assert kinds[cause:] == ["EngineError", "OutputBatch", "EngineStats"], kinds
    assert messages[cause].request_id is None
    assert f"worker rank 0 (pid {engine.worker_pids[0]}) died" in messages[cause].message
    ended = messages[cause + 1].deltas
    assert sorted(delta.request_id for delta in ended) == request_ids
    assert all(delta.finished and delta.finish_reason == "error" for delta in ended)
    final = messages[cause + 2]
    assert final.integrity_error is None
    assert final.stats["num_free_blocks"] == 256 and final.stats["num_running"] == 0


def test_scheduler_killed_mid_generation_takes_its_workers_along(tiny_model_dirs, make_llm):
    llm = make_llm(tiny_model_dirs["llama"], num_blocks=256)
    engine = llm.engine
    scheduler_pid, worker_pids = engine.scheduler_pid, engine.worker_pids
    ring = engine._process.ring_name
    error = kill_mid_generation(llm, scheduler_pid)
    assert isinstance(error, EngineDeadError), error
    assert f"scheduler process (pid {scheduler_pid}) died with exit code -9" in str(error)
    # The worker dies with its parent (PR_SET_PDEATHSIG), the frontend removes the ring.
    assert_engine_gone(llm, scheduler_pid, worker_pids, ring)
    assert not llm.engine.stats_available


FRONTEND_SCRIPT = """
import sys
from pagedserve.frontend import LLM
llm = LLM(sys.argv[1], num_blocks=64, multiprocess=True)
engine = llm.engine
print(engine.scheduler_pid, engine.worker_pids[0], engine._process.ring_name,
      engine._process.ipc_dir, flush=True)
sys.stdin.read()  # until the test kills this process
"""


def test_frontend_killed_outright_takes_the_engine_along(tiny_model_dirs):
    # As under systemd with RuntimeDirectory=: the sockets go in the directory systemd
    # removes when the service stops (short, like /run/NAME: socket paths are limited).
    runtime_directory = Path(tempfile.mkdtemp(prefix="ps-run-"))
    frontend = subprocess.Popen(
        [sys.executable, "-c", FRONTEND_SCRIPT, str(tiny_model_dirs["llama"])],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "RUNTIME_DIRECTORY": f"{runtime_directory}:/elsewhere"},
    )
    try:
        scheduler, worker, ring, ipc_dir = frontend.stdout.readline().split()
        assert Path(ipc_dir).parent == runtime_directory
        assert Path("/dev/shm", ring).exists()
        frontend.kill()
        frontend.wait()
        # The scheduler dies with its parent (PR_SET_PDEATHSIG), the worker with the
        # scheduler, and multiprocessing's resource tracker unlinks the ring after them.
        assert wait_until(lambda: not is_live(int(scheduler)) and not is_live(int(worker)), 5.0)
        assert wait_until(lambda: not Path("/dev/shm", ring).exists(), 5.0)
    finally:
        frontend.kill()
        frontend.wait()
        # Nobody of ours is left to remove the socket directory: systemd's part.
        shutil.rmtree(runtime_directory, ignore_errors=True)


# ---------------------------------------------------------------- start-up


def test_worker_that_cannot_load_the_model_fails_start_up_naming_it(tiny_model_dirs, tmp_path):
    # A valid config.json (the frontend reads it) but no weights (only the worker reads
    # those): the failure happens inside the worker process.
    shutil.copy(tiny_model_dirs["llama"] / "config.json", tmp_path / "config.json")
    schedulers_before = live_schedulers()
    started_s = time.monotonic()
    with pytest.raises(EngineStartupError) as raised:
        LLM(tmp_path, num_blocks=16, multiprocess=True)
    assert time.monotonic() - started_s < 60
    message = str(raised.value)
    assert message.startswith("engine start-up failed: worker rank 0 (pid ")
    assert "failed to start: ValueError: model: " in message
    assert "has no *.safetensors or pytorch_model*.bin weight files" in message
    assert wait_until(lambda: live_schedulers() <= schedulers_before, 5.0)


def test_a_tokenizer_that_cannot_load_fails_start_up_and_stops_the_engine(
    tiny_model_dirs, tmp_path
):
    # The engine starts before the tokenizer loads (they overlap): a tokenizer that fails
    # must take the already started scheduler and worker down with it.
    shutil.copytree(tiny_model_dirs["llama"], tmp_path, dirs_exist_ok=True)
    (tmp_path / "tokenizer.json").write_text('{"not": "a tokenizer"}')
    (tmp_path / "tokenizer_config.json").write_text('{"tokenizer_class": "TokenizersBackend"}')
    schedulers_before = live_schedulers()
    with pytest.raises(Exception) as raised:
        LLM(tmp_path, num_blocks=16, multiprocess=True)
    assert not isinstance(raised.value, EngineStartupError), raised.value
    assert wait_until(lambda: live_schedulers() <= schedulers_before, 5.0)


def test_a_scheduler_killed_before_the_start_ends_fails_it_promptly(tiny_model_dirs):
    """Killed after it started the worker (its Ready unread): the second half of the
    start-up reports the death instead of waiting on a socket nobody reads."""
    client = EngineClient(
        SchedulerConfig(max_model_len=512),
        WorkerSpec(str(tiny_model_dirs["llama"]), "float32", 16, 16, None, "cpu", 0),
    )
    scheduler = client.scheduler_pid
    try:
        assert wait_until(lambda: live_children(scheduler), 10.0)
        time.sleep(1.0)  # its Ready("scheduler") follows the spawn
        os.kill(scheduler, signal.SIGKILL)
        outcome: list[BaseException | None] = []

        def finish() -> None:
            try:
                client.finish_start()
                outcome.append(None)
            except BaseException as error:  # noqa: BLE001 - reported below
                outcome.append(error)

        thread = threading.Thread(target=finish, daemon=True)
        thread.start()
        thread.join(DEATH_NOTICED_WITHIN_S)
        assert not thread.is_alive(), "finish_start() hung on a dead scheduler"
        assert isinstance(outcome[0], EngineStartupError), outcome
        assert str(outcome[0]) == (
            f"engine start-up failed: the scheduler process (pid {scheduler}) died with "
            "exit code -9 (killed by SIGKILL)"
        )
    finally:
        client.shutdown()
    assert not client.is_running


def test_start_up_past_its_timeout_names_what_did_not_come_up(tiny_model_dirs):
    schedulers_before = live_schedulers()
    started_s = time.monotonic()
    with pytest.raises(EngineStartupError) as raised:
        # Importing torch alone takes the worker longer than this.
        LLM(tiny_model_dirs["llama"], num_blocks=16, multiprocess=True, startup_timeout_s=0.5)
    assert time.monotonic() - started_s < 10
    assert str(raised.value).startswith("engine start-up timed out: ")
    # Which one is late depends on the machine's load; either way it is named.
    assert (
        "worker rank 0 (pid " in str(raised.value)
        or "the scheduler process (pid " in str(raised.value)
    ) and "did not report ready within 0.5 s" in str(raised.value)
    assert wait_until(lambda: live_schedulers() <= schedulers_before, 5.0)


# ---------------------------------------------------------------- shutdown


def test_shutdown_leaves_no_process_socket_or_shared_memory(tiny_model_dirs, make_llm):
    llm = make_llm(tiny_model_dirs["llama"], num_blocks=64)
    engine = llm.engine
    scheduler_pid, worker_pids = engine.scheduler_pid, engine.worker_pids
    ring, ipc_dir = engine._process.ring_name, engine._process.ipc_dir
    assert ring is not None and Path("/dev/shm", ring).exists()
    expected = llm.generate([[5, 6, 7], [8] * 20], GREEDY)
    llm.shutdown()
    assert_engine_gone(llm, scheduler_pid, worker_pids, ring)
    assert not os.path.exists(ipc_dir)
    llm.shutdown()  # idempotent
    # The final counters stay readable; the engine does not.
    assert llm.stats()["num_free_blocks"] == 64
    llm.check_integrity()
    with pytest.raises(EngineDeadError, match="the engine has been shut down"):
        llm.generate([5, 6, 7], GREEDY)
    assert len(expected) == 2


def test_a_with_block_shuts_the_engine_down_even_after_an_error(tiny_model_dirs):
    with (
        pytest.raises(ValueError, match="out of the with block"),
        LLM(tiny_model_dirs["llama"], num_blocks=64, multiprocess=True) as llm,
    ):
        engine = llm.engine
        scheduler_pid, worker_pids = engine.scheduler_pid, engine.worker_pids
        ring = engine._process.ring_name
        assert len(llm.generate([5, 6, 7], GREEDY)[0].outputs[0].token_ids) == 24
        raise ValueError("out of the with block")
    assert_engine_gone(llm, scheduler_pid, worker_pids, ring)


def test_generation_config_eos_reaches_the_scheduler(tiny_model_dirs, tmp_path, make_llm):
    # The frontend sends each request's EOS ids (from generation_config.json) with it.
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dirs["llama"], model_dir)
    reference = LLM(model_dir, num_blocks=64).generate([1, 2, 3], GREEDY)[0].outputs[0]
    eos = reference.token_ids[5]
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    params = SamplingParams(max_tokens=24, temperature=0.0)
    output = make_llm(model_dir, num_blocks=64).generate([1, 2, 3], params)[0].outputs[0]
    assert output.finish_reason == "stop"
    assert output.token_ids == reference.token_ids[: reference.token_ids.index(eos) + 1]
