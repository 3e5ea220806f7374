"""The step profile and the stand-in device that tools/bench_step_overhead.py reads: with
``PAGEDSERVE_STEP_PROFILE`` set, the scheduler and worker processes of a real engine each
write their stages, counted once per step; with ``PAGEDSERVE_STANDIN_DEVICE_MS`` the worker
runs no forward (all logits tie, so greedy picks token 0) and its device timeline takes T
per forward, which the worker waits for when it reads a step's tokens."""

from __future__ import annotations

import json

import pytest

from pagedserve.frontend import LLM, SamplingParams
from pagedserve.gpu_worker.standin_device import STANDIN_ENV, standin_forward_ms
from pagedserve.scheduler.step_profile import PROFILE_ENV

SCHEDULER_STAGES = {
    "schedule",
    "plan_encode",
    "plan_send",
    "result_receive",
    "result_decode",
    "execute",
    "update",
    "outputs_send",
}
WORKER_STAGES = {
    "plan_decode",
    "apply_plan",
    "prepare_inputs",
    "forward",
    "sample",
    "wait",
    "device_wait",
    "result_build",
    "result_send",
}


def test_each_process_writes_its_stages_and_the_stand_in_replaces_the_forward(
    tiny_model_dirs, tmp_path, monkeypatch
):
    monkeypatch.setenv(PROFILE_ENV, str(tmp_path / "profile"))
    monkeypatch.setenv(STANDIN_ENV, "2")
    llm = LLM(tiny_model_dirs["llama"], multiprocess=True, num_blocks=64)
    try:
        params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
        outputs = llm.generate([[7, 8, 9], [10, 11]], params)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in outputs] == [[0] * 5, [0] * 5]
    records = {
        record["process"]: record["stages"]
        for record in (json.loads(p.read_text()) for p in (tmp_path / "profile").glob("*.json"))
    }
    assert set(records) == {"scheduler", "worker0"}
    scheduler, worker = records["scheduler"], records["worker0"]
    assert set(scheduler) == SCHEDULER_STAGES
    assert set(worker) == WORKER_STAGES
    steps = scheduler["schedule"]["count"]
    assert steps >= 5
    assert worker["forward"]["count"] == scheduler["execute"]["count"] == steps
    # The worker waited out each forward's 2 ms: the stand-in, not a model, ran.
    # (for a plan, or the device, until it is done: then the tokens are read at once)
    assert worker["device_wait"]["count"] == steps
    waited_ns = worker["wait"]["total_ns"] + worker["device_wait"]["total_ns"]
    assert waited_ns >= steps * 2_000_000 * 0.9


@pytest.mark.parametrize("value", ["-1", "nan", "fast"])
def test_a_bad_stand_in_time_is_refused_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv(STANDIN_ENV, value)
    with pytest.raises(ValueError, match=STANDIN_ENV):
        standin_forward_ms()
