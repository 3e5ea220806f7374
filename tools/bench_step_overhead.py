"""Where a decode step's CPU time goes, stage by stage, with the forward pass taken away.

Runs ``--batch`` requests (equal short prompts, EOS ignored, greedy: after one prefill step
every step decodes the whole batch) through ``LLM(...)`` in one process and through
``LLM(..., multiprocess=True)`` (scheduler and worker processes), synchronous and with
async scheduling (``multi-process-async``: the next plan made while a step runs), with the
worker's model
replaced by a stand-in device (gpu_worker/standin_device.py): each forward keeps a device
timeline busy for ``--forward-ms`` T after the work queued before it and returns zeros at
once, leaving the CPU free as a GPU's forward does; the worker waits for the timeline when
it reads a step's tokens. With T = 0 a step's time is all CPU work around the forward;
with T > 0 it shows what the engine hides behind the device: a step takes T + CPU work
without overlap, max(T, CPU work) with perfect overlap.

Each process of the engine records its stages (scheduler/step_profile.py,
``PAGEDSERVE_STEP_PROFILE``): the scheduler's ``schedule`` (``schedule_ahead``, ``submit``
and ``collect`` with async scheduling), ``update``, the plan's
``plan_encode`` / ``plan_send``, ``result_receive`` (waiting for the worker, ``result_decode``
included) and ``outputs_send``; the worker's ``plan_decode``, ``apply_plan``,
``prepare_inputs``, ``forward`` (queueing it), ``sample``, ``wait`` (blocked on the next
plan or the device, whichever comes first), ``device_wait`` (for the device, when a step's
tokens are read), ``result_build``, ``result_send``; the
frontend's ``outputs_decode`` and ``outputs_process``. Figures are per step, over every
step of the run (the prefill step included), and ``step_us`` is the wall time of
``generate`` over the steps. Runs alternate between the modes ``--repeats`` times after a
warm-up; medians are reported. Machines are shared and noisy: compare within one run.

Example (from the repository root), on the tests' tiny Llama:

    .venv/bin/python -c "import sys; sys.path.insert(0, 'tests'); \\
        from helpers.tiny_models import make_tiny_model; from pathlib import Path; \\
        make_tiny_model('llama', Path('/tmp/tiny-llama'))"
    .venv/bin/python tools/bench_step_overhead.py --model /tmp/tiny-llama --batch 64 256 \\
        --forward-ms 0 5 --json /tmp/step_overhead.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Before pagedserve is imported: this process's own profile (the in-process engine's and
# the frontend's stages) is on only if the variable is set when the module loads.
_PROFILE_ROOT = Path(tempfile.mkdtemp(prefix="step_profile_"))
os.environ["PAGEDSERVE_STEP_PROFILE"] = str(_PROFILE_ROOT / "frontend")

from pagedserve.frontend import LLM, SamplingParams  # noqa: E402
from pagedserve.gpu_worker.standin_device import STANDIN_ENV  # noqa: E402
from pagedserve.scheduler.step_profile import PROFILE, PROFILE_ENV  # noqa: E402

# multi-process-async: worker processes with async scheduling (scheduler/schedule_ahead.py).
MODES = ("in-process", "multi-process", "multi-process-async")


def run_once(
    model: Path, mode: str, batch: int, forward_ms: float, args: argparse.Namespace, tag: str
) -> dict[str, Any]:
    """One engine, one ``generate`` of ``batch`` requests; its steps' stages."""
    folder = _PROFILE_ROOT / tag
    os.environ[PROFILE_ENV] = str(folder)  # the engine's child processes write here
    os.environ[STANDIN_ENV] = str(forward_ms)
    prompts = [[1 + (i % 400)] * args.prompt_tokens for i in range(batch)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    llm = LLM(
        model,
        multiprocess=mode != "in-process",
        async_scheduling=mode == "multi-process-async",
        num_blocks=args.num_blocks,
        max_num_seqs=batch,
        max_num_batched_tokens=max(batch * args.prompt_tokens, 2048),
        enable_prefix_caching=False,
    )
    try:
        PROFILE.take()  # start-up is not a step
        started_s = time.perf_counter()
        outputs = llm.generate(prompts, params)
        wall_s = time.perf_counter() - started_s
        frontend = PROFILE.take()
    finally:
        llm.shutdown()
    assert all(len(o.outputs[0].token_ids) == args.max_tokens for o in outputs)
    processes: dict[str, dict[str, dict[str, int]]] = {"frontend": frontend}
    for path in sorted(folder.glob("*.json")) if folder.exists() else []:
        record = json.loads(path.read_text())
        processes[record["process"]] = record["stages"]
    engine = frontend if mode == "in-process" else processes["scheduler"]
    steps = engine["update"]["count"]
    return {
        "steps": steps,
        "wall_s": wall_s,
        "step_us": wall_s / steps * 1e6,
        "stages_us": {
            process: {name: stage["total_ns"] / steps / 1e3 for name, stage in stages.items()}
            for process, stages in processes.items()
        },
    }


def median_record(runs: list[dict[str, Any]]) -> dict[str, Any]:
    stages: dict[str, dict[str, float]] = {}
    for process in runs[0]["stages_us"]:
        names = runs[0]["stages_us"][process]
        stages[process] = {
            name: round(statistics.median(r["stages_us"][process].get(name, 0.0) for r in runs), 1)
            for name in names
        }
    step_us = statistics.median(r["step_us"] for r in runs)
    return {
        "steps": runs[0]["steps"],
        "step_us": round(step_us, 1),
        "step_us_runs": [round(r["step_us"], 1) for r in runs],
        "stages_us": stages,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="local HF directory")
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--forward-ms", type=float, nargs="+", default=[0.0, 5.0])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--prompt-tokens", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128, help="generated per request")
    parser.add_argument("--num-blocks", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)

    results = []
    for batch in args.batch:
        for forward_ms in args.forward_ms:
            runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in args.modes}
            for repeat in range(args.repeats + 1):  # the first of each is the warm-up
                for mode in args.modes:
                    tag = f"{mode}-b{batch}-t{forward_ms}-r{repeat}"
                    run = run_once(args.model, mode, batch, forward_ms, args, tag)
                    if repeat:
                        runs[mode].append(run)
            for mode, mode_runs in runs.items():
                record = {"mode": mode, "batch": batch, "forward_ms": forward_ms}
                record |= median_record(mode_runs)
                # Beyond the device's time: with T = 0, all the CPU work of a step.
                record["us_beyond_forward"] = round(record["step_us"] - forward_ms * 1e3, 1)
                if forward_ms > 0:
                    record["step_over_forward"] = round(record["step_us"] / (forward_ms * 1e3), 3)
                results.append(record)
                print(format_record(record), flush=True)
    document = {
        "tool": "tools/bench_step_overhead.py",
        "argv": sys.argv[1:] if argv is None else argv,
        "model": str(args.model),
        "cpu_count": os.cpu_count(),
        "results": results,
    }
    if args.json:
        args.json.write_text(json.dumps(document, indent=1))
    return 0


def format_record(record: dict[str, Any]) -> str:
    lines = [
        f"{record['mode']}, batch {record['batch']}, stand-in forward {record['forward_ms']} ms: "
        f"{record['step_us']:.0f} us/step over {record['steps']} steps "
        f"({record['us_beyond_forward']:.0f} us beyond the forward)"
    ]
    for process, stages in record["stages_us"].items():
        parts = ", ".join(f"{name} {us:.0f}" for name, us in stages.items())
        lines.append(f"    {process}: {parts}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
