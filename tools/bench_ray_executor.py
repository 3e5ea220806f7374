"""Offline throughput through Ray's executor against the local one, on one node: the same
engine, model and ShareGPT-like trace (tools/traces.py, as bench_offline.py draws it), its
workers once as processes of this host (``distributed_executor_backend="mp"``) and once as
Ray actors on the running Ray cluster (``"ray"``), one engine at a time, runs alternating,
each cold (the prefix cache emptied first) after a warm-up. What it measures is what the
executor costs: plans, results and the actors' placement; the model's work is the same.

Start Ray on this host first, then::

    ray start --head --disable-usage-stats --include-dashboard=false
    python tools/bench_ray_executor.py --json ray_executor.json
    ray stop
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench_offline import EngineRun, embedded_model_path, run_pagedserve
from traces import make_trace, trace_stats

from pagedserve.frontend import LLM


def load(args: argparse.Namespace, backend: str) -> LLM:
    return LLM(
        model=args.model or embedded_model_path(),
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        kv_cache_bytes=args.kv_cache_bytes,
        tensor_parallel_size=args.tensor_parallel_size,
        multiprocess=True,
        distributed_executor_backend=backend,
        ray_address=args.ray_address,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="an HF directory (default: embedded)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--trace", default="sharegpt")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--kv-cache-bytes", type=int, default=2 << 30)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each executor")
    parser.add_argument("--ray-address", default="auto")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    model_path = Path(args.model) if args.model else embedded_model_path()
    vocab_size = json.loads((model_path / "config.json").read_text())["vocab_size"]
    requests = make_trace(args.trace, args.num_requests, 0, args.max_len, vocab_size)
    warmup = make_trace(args.trace, 4, 1, args.max_len // 2, vocab_size)
    runs: dict[str, list[EngineRun]] = {"mp": [], "ray": []}
    for repeat in range(args.repeats):
        # Alternating, so that the machine's drift touches both alike; one engine at a time
        # (on two cores a second one's workers would take the first's).
        for backend in ("mp", "ray") if repeat % 2 == 0 else ("ray", "mp"):
            llm = load(args, backend)
            try:
                run_pagedserve(llm, warmup)
                run = run_pagedserve(llm, requests)
            finally:
                llm.shutdown()
            runs[backend].append(run)
            print(f"{backend}: {run.tokens_per_s:.1f} output tok/s", file=sys.stderr)
    rates = {backend: [run.tokens_per_s for run in backend_runs] for backend, backend_runs in
             runs.items()}  # fmt: skip
    report: dict[str, Any] = {
        "command": " ".join(sys.argv),
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "model": str(model_path),
        "dtype": args.dtype,
        "tensor_parallel_size": args.tensor_parallel_size,
        "trace": {"name": args.trace, **trace_stats(requests).__dict__},
        "output_tok_s": rates,
        "median_output_tok_s": {backend: statistics.median(r) for backend, r in rates.items()},
    }
    report["ray_over_mp"] = (
        report["median_output_tok_s"]["ray"] / report["median_output_tok_s"]["mp"]
    )
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
