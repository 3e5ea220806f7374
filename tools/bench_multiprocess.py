"""Per-step cost of the process split: the same decode batch in one process and in three.

``LLM(multiprocess=True)`` adds, per engine step, encoding the plan, the ring hand-off to
the worker, the result back over ZeroMQ, and an ``OutputBatch`` to the frontend. This
runs the same requests (equal prompts, EOS ignored, so every step decodes the whole
batch) through ``LLM(...)`` and ``LLM(..., multiprocess=True)``, alternating, and
reports microseconds per engine step for each and their difference. Steps are counted
in-process (calls to the worker) and are the same in both modes: scheduling is
deterministic. Start-up and a warm-up run are outside the timed region. Machines are
shared and noisy: read the difference within one run, medians over ``--repeats``.

Example (from the repository root), on the tests' tiny Llama:

    .venv/bin/python -c "import sys; sys.path.insert(0, 'tests'); \\
        from helpers.tiny_models import make_tiny_model; from pathlib import Path; \\
        make_tiny_model('llama', Path('/tmp/tiny-llama'))"
    .venv/bin/python tools/bench_multiprocess.py --model /tmp/tiny-llama --batch 64
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from pagedserve.frontend import LLM, SamplingParams


def count_steps(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> int:
    """Engine steps of one ``generate`` in-process (each is one call to the worker)."""
    worker = llm.worker
    execute = worker.execute
    steps = 0

    def counting_execute(plan):
        nonlocal steps
        steps += 1
        return execute(plan)

    worker.execute = counting_execute
    try:
        llm.generate(prompts, params)
    finally:
        del worker.execute
    return steps


def scheduling_us_per_step(
    llm: LLM, prompts: list[list[int]], params: SamplingParams, steps: int
) -> float:
    """In-process time per step in ``Scheduler.schedule`` plus ``update_from_output``:
    the scheduler's own share of a step, whatever process it runs in."""
    scheduler = llm.engine.scheduler
    schedule, update = scheduler.schedule, scheduler.update_from_output
    spent_s = 0.0

    def timed(function):
        def wrapper(*args):
            nonlocal spent_s
            started_s = time.perf_counter()
            try:
                return function(*args)
            finally:
                spent_s += time.perf_counter() - started_s

        return wrapper

    scheduler.schedule, scheduler.update_from_output = timed(schedule), timed(update)
    try:
        llm.generate(prompts, params)
    finally:
        del scheduler.schedule, scheduler.update_from_output
    return spent_s / steps * 1e6


def time_generate(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> float:
    started_s = time.perf_counter()
    llm.generate(prompts, params)
    return time.perf_counter() - started_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="local HF directory")
    parser.add_argument("--batch", type=int, default=64, help="requests decoded together")
    parser.add_argument("--prompt-tokens", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128, help="generated per request")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    prompts = [[1 + (i % 400)] * args.prompt_tokens for i in range(args.batch)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    settings = dict(num_blocks=4096, max_num_seqs=args.batch, enable_prefix_caching=False)
    in_process = LLM(args.model, **settings)
    multi_process = LLM(args.model, multiprocess=True, **settings)
    try:
        steps = count_steps(in_process, prompts, params)
        scheduling_us = scheduling_us_per_step(in_process, prompts, params, steps)
        time_generate(multi_process, prompts, params)  # warm-up
        seconds: dict[str, list[float]] = {"in-process": [], "multi-process": []}
        for _ in range(args.repeats):
            seconds["in-process"].append(time_generate(in_process, prompts, params))
            seconds["multi-process"].append(time_generate(multi_process, prompts, params))
    finally:
        multi_process.shutdown()
    print(f"batch {args.batch}, {steps} steps per run, {args.repeats} runs each, us/step:")
    print(f"  {'':15}{'median':>10}{'best':>10}")
    rows = {
        mode: [statistics.median(runs) / steps * 1e6, min(runs) / steps * 1e6]
        for mode, runs in seconds.items()
    }
    rows["split overhead"] = [
        multi - single for multi, single in zip(rows["multi-process"], rows["in-process"])
    ]
    for name, (median_us, best_us) in rows.items():
        print(f"  {name:15}{median_us:10.1f}{best_us:10.1f}")
    print(f"  scheduler (schedule + update_from_output, in-process): {scheduling_us:.1f} us/step")


if __name__ == "__main__":
    main()
