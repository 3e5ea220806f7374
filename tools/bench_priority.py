"""What priority scheduling gives interactive requests on an engine busy with batch work.

One trace, replayed against the engine once per scheduling policy (the peer, first come
first served, in the same run): ``--background-requests`` long "batch" requests arrive at
once and fill the batch (``--max-num-seqs``), then ``--interactive-requests`` short ones
arrive every ``--interactive-every-s`` seconds. Under ``fcfs`` every request has priority
0; under ``priority`` the batch requests have priority 10 and the interactive ones 0, so an
interactive request preempts a batch request (by recompute) when it does not fit.

The trace is replayed in real time on the in-process engine: before each engine step the
requests whose arrival time has passed are added; each request's first token and end are
stamped when the step that made them returns. Reported per policy: the interactive
requests' time to first token and end-to-end latency (median and p90), the batch
requests' mean latency and the time until the last one ended, output tokens per second
over the whole trace, and the preemptions. Greedy with ``ignore_eos``: every policy makes
the same tokens, and the run checks that it does (preemption must change no output);
a mismatch makes it invalid (exit status 1).
Machines are shared and noisy: compare the policies within one run, not across runs.

Examples (from the repository root):

    .venv/bin/python tools/bench_priority.py --threads 1 --json priority.json

    # A smoke run, under a minute.
    .venv/bin/python tools/bench_priority.py --background-requests 4 --interactive-requests 2 \\
        --background-max-tokens 32
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from machine import cpu_model

from pagedserve.frontend import LLM, SamplingParams
from pagedserve.gpu_worker import ops

POLICIES = ("fcfs", "priority")
BATCH_PRIORITY = 10
_BACKGROUND_TOPICS = (
    "the history of bridges", "how bees make honey", "a journey across the desert",
    "the life of a lighthouse keeper", "the invention of the printing press",
    "a city under the sea", "the migration of birds", "a day in a bakery",
)  # fmt: skip
_QUESTIONS = (
    "What is the capital of France?", "How many legs does a spider have?",
    "What colour is the sky on a clear day?", "Name a planet of the solar system.",
    "What is two plus two?", "Which ocean is the largest?",
)  # fmt: skip


@dataclass
class TraceRequest:
    request_id: str
    arrival_s: float
    prompt_token_ids: list[int]
    max_tokens: int
    interactive: bool
    first_token_s: float | None = None
    end_s: float | None = None
    token_ids: list[int] = field(default_factory=list)


def make_trace(llm: LLM, args: argparse.Namespace) -> list[TraceRequest]:
    tokenizer = llm.tokenizer
    trace = []
    for index in range(args.background_requests):
        topic = _BACKGROUND_TOPICS[index % len(_BACKGROUND_TOPICS)]
        text = f"Write a long, detailed essay about {topic}. Essay {index + 1}:"
        trace.append(
            TraceRequest(
                f"batch-{index}", 0.0, tokenizer.encode(text), args.background_max_tokens, False
            )
        )
    for index in range(args.interactive_requests):
        text = _QUESTIONS[index % len(_QUESTIONS)]
        arrival_s = (index + 1) * args.interactive_every_s
        trace.append(
            TraceRequest(
                f"chat-{index}",
                arrival_s,
                tokenizer.encode(text),
                args.interactive_max_tokens,
                True,
            )
        )
    return trace


def replay(llm: LLM, trace: list[TraceRequest], policy: str) -> dict:
    """Run ``trace`` in real time on ``llm``'s engine; fills each request's stamps."""
    engine = llm.engine
    pending = sorted(trace, key=lambda r: r.arrival_s)
    by_id = {r.request_id: r for r in trace}
    before = llm.stats()
    start_s = time.monotonic()
    num_steps = 0
    while pending or engine.has_unfinished_requests():
        now_s = time.monotonic() - start_s
        while pending and pending[0].arrival_s <= now_s:
            request = pending.pop(0)
            priority = BATCH_PRIORITY if policy == "priority" and not request.interactive else 0
            params = SamplingParams(max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True)
            engine.add_request(
                request.request_id,
                request.prompt_token_ids,
                params,
                llm.eos_token_ids,
                arrival_time_s=start_s + request.arrival_s,
                priority=priority,
            )
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, pending[0].arrival_s - (time.monotonic() - start_s)))
            continue
        deltas = engine.step()
        num_steps += 1
        stamp_s = time.monotonic() - start_s
        for delta in deltas:
            request = by_id[delta.request_id]
            if delta.new_token_ids and request.first_token_s is None:
                request.first_token_s = stamp_s
            request.token_ids.extend(delta.new_token_ids)
            if delta.finished:
                request.end_s = stamp_s
    makespan_s = time.monotonic() - start_s
    after = llm.stats()
    interactive = [r for r in trace if r.interactive]
    background = [r for r in trace if not r.interactive]
    return {
        "policy": policy,
        "interactive_ttft_s": _summary([r.first_token_s - r.arrival_s for r in interactive]),
        "interactive_latency_s": _summary([r.end_s - r.arrival_s for r in interactive]),
        "batch_latency_s": _summary([r.end_s - r.arrival_s for r in background]),
        "batch_last_end_s": round(max((r.end_s for r in background), default=0.0), 3),
        "makespan_s": round(makespan_s, 3),
        "output_tokens_per_s": round(sum(len(r.token_ids) for r in trace) / makespan_s, 2),
        "num_steps": num_steps,
        "num_preemptions": after["num_preemptions"] - before["num_preemptions"],
    }


def _summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]
    return {
        "median": round(statistics.median(ordered), 3),
        "p90": round(p90, 3),
        "mean": round(statistics.fmean(ordered), 3),
        "max": round(ordered[-1], 3),
    }


def format_report(record: dict) -> str:
    lines = [
        f"{'policy':>8}  {'chat TTFT p50/p90 s':>20}  {'chat latency p50/p90 s':>22}  "
        f"{'batch mean s':>12}  {'batch last s':>12}  {'tok/s':>7}  {'preempt':>7}"
    ]
    for result in record["results"]:
        ttft, latency = result["interactive_ttft_s"], result["interactive_latency_s"]
        lines.append(
            f"{result['policy']:>8}  {ttft['median']:>9.2f} / {ttft['p90']:<8.2f}  "
            f"{latency['median']:>10.2f} / {latency['p90']:<9.2f}  "
            f"{result['batch_latency_s']['mean']:>12.2f}  {result['batch_last_end_s']:>12.2f}  "
            f"{result['output_tokens_per_s']:>7.1f}  {result['num_preemptions']:>7}"
        )
    lines.append(f"outputs equal across policies: {record['checks']['outputs_equal']}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="model directory (default: embedded)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--max-num-seqs", type=int, default=8, help="sequences in the batch")
    parser.add_argument("--background-requests", type=int, default=16)
    parser.add_argument("--background-max-tokens", type=int, default=128)
    parser.add_argument("--interactive-requests", type=int, default=8)
    parser.add_argument("--interactive-every-s", type=float, default=1.0)
    parser.add_argument("--interactive-max-tokens", type=int, default=16)
    parser.add_argument("--kv-cache-bytes", type=int, default=256 << 20)
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    parser.add_argument(
        "--threads", type=int, default=None, help="torch and kernel threads (default: torch's)"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the record here")
    args = parser.parse_args(argv)
    for name in (
        "max_num_seqs",
        "background_requests",
        "background_max_tokens",
        "interactive_max_tokens",
        "kv_cache_bytes",
    ):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.interactive_requests < 0 or args.interactive_every_s <= 0:
        parser.error("--interactive-requests must be >= 0 and --interactive-every-s > 0")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
        ops.set_num_threads(args.threads)
    load_before = list(os.getloadavg())
    results, outputs = [], {}
    for policy in args.policies:
        llm = LLM(
            args.model,
            dtype=args.dtype,
            kv_cache_bytes=args.kv_cache_bytes,
            max_num_seqs=args.max_num_seqs,
            scheduling_policy=policy,
            multiprocess=False,
        )
        llm.generate(["Warm up."], SamplingParams(max_tokens=4, temperature=0.0))
        trace = make_trace(llm, args)
        results.append(replay(llm, trace, policy))
        outputs[policy] = {r.request_id: r.token_ids for r in trace}
        llm.check_integrity()
        print(f"{policy}: {results[-1]}", flush=True)
        del llm
    reference = next(iter(outputs.values()))
    outputs_equal = all(output == reference for output in outputs.values())
    record = {
        "command": shlex.join(sys.orig_argv),
        "settings": {
            key: value if not isinstance(value, Path) else str(value)
            for key, value in vars(args).items()
        }
        | {"model": args.model or "embedded", "batch_priority": BATCH_PRIORITY},
        "results": results,
        "checks": {"outputs_equal": outputs_equal},
        "machine": {
            "cpu": cpu_model(),
            "cores": os.cpu_count(),
            "threads": torch.get_num_threads(),
            "load_average_before": load_before,
            "load_average_after": list(os.getloadavg()),
        },
    }
    print(format_report(record))
    if args.json is not None:
        args.json.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.json}")
    if not outputs_equal:
        print("INVALID: the policies' outputs differ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
