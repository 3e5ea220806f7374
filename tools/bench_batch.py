"""What ``pagedserve run-batch`` costs: a batch file of the trace against the offline API.

Writes the synthetic trace (tools/traces.py: random prompt token ids, fixed output lengths
with EOS ignored, greedy) as a batch file of ``/v1/completions`` lines (prompts as token
ids, ``return_token_ids`` so the outputs can be compared), runs ``python -m
pagedserve.frontend.cli run-batch`` on it in a child process, and reads the batch's own
time from its log (``batch done: N lines in X s``: the lines read, run and written, the
model's loading left out). Every answer must be a 200 whose usage holds exactly the
request's output length, and the command must end 0 (its last check: every KV block
free, the block accounting consistent).

The peer, in the same run on the same trace and engine settings (the batch's block count
included, read from its log): ``LLM(model, multiprocess=True).generate`` on the same
prompts, the same scheduler and worker processes with no batch file, no JSON and no
asyncio. The ratio of output tokens/s, batch over offline, is what the batch path costs:
reading and checking each line, the OpenAI request's parsing, the whole answer's JSON, the
engine thread's hand-off. The outputs must equal the offline ones, token for token.

Batch and offline runs alternate ``--repeats`` times after a warm-up of the offline engine;
medians are reported. Machines are shared and noisy: read the ratio within one run.

    .venv/bin/python tools/bench_batch.py --num-requests 64 --length-scale 0.25 \\
        --max-len 256 --json docs/bench/batch_embedded_f32.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench_server import (
    FIRST_ORDINARY_TOKEN_ID,
    EngineSettings,
    OfflineRun,
    add_engine_arguments,
    machine_info,
    run_offline,
)
from traces import TRACE_SHAPES, Request, make_trace, trace_stats

BATCH_DONE = re.compile(r"batch done: (\d+) lines in ([0-9.]+) s")
BLOCKS_FREE = re.compile(r"KV cache: all (\d+) blocks free, block accounting consistent")
READY = re.compile(r"KV cache: (\d+) blocks of")


@dataclass
class BatchRun:
    lines: int
    output_tokens: int
    seconds: float  # the batch's own time, from its log
    wall_seconds: float  # the command's, model loading and shutdown included
    exit_code: int
    num_blocks: int | None
    problems: dict[str, int]

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.problems


def batch_lines(requests: list[Request]) -> str:
    lines = []
    for index, request in enumerate(requests):
        body = {
            "prompt": request.prompt_token_ids,
            "max_tokens": request.output_len,
            "ignore_eos": True,
            "temperature": 0.0,
            "return_token_ids": True,
        }
        line = {"custom_id": f"r{index}", "method": "POST", "url": "/v1/completions", "body": body}
        lines.append(json.dumps(line) + "\n")
    return "".join(lines)


def run_batch(
    engine: EngineSettings, requests: list[Request], directory: Path, timeout_s: float
) -> tuple[BatchRun, list[list[int]]]:
    """One run of the command on the trace; its figures and each request's output ids."""
    input_path = directory / "batch.jsonl"
    output_path = directory / "answers.jsonl"
    input_path.write_text(batch_lines(requests))
    command = [
        sys.executable, "-m", "pagedserve.frontend.cli", "run-batch", *engine.server_flags(),
        "-i", str(input_path), "-o", str(output_path),
    ]  # fmt: skip
    started_s = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    wall_seconds = time.perf_counter() - started_s
    done = BATCH_DONE.search(result.stderr)
    blocks = READY.search(result.stderr)
    problems: dict[str, int] = {}
    outputs: list[list[int]] = []
    output_tokens = 0
    records = [json.loads(line) for line in output_path.read_text().splitlines()]
    if [r["custom_id"] for r in records] != [f"r{i}" for i in range(len(requests))]:
        problems["answers missing or out of order"] = 1
    for record, request in zip(records, requests):
        response = record["response"] or {}
        if response.get("status_code") != 200:
            problems[f"status {response.get('status_code')}"] = (
                problems.get(f"status {response.get('status_code')}", 0) + 1
            )
            outputs.append([])
            continue
        body = response["body"]
        tokens = body["usage"]["completion_tokens"]
        if tokens != request.output_len:
            problems["wrong token count"] = problems.get("wrong token count", 0) + 1
        output_tokens += tokens
        outputs.append(body["choices"][0]["token_ids"])
    if done is None or BLOCKS_FREE.search(result.stderr) is None:
        problems["no summary or block check in the log"] = 1
        sys.stderr.write(result.stderr[-3000:])
    run = BatchRun(
        lines=int(done.group(1)) if done else 0,
        output_tokens=output_tokens,
        seconds=float(done.group(2)) if done else 0.0,
        wall_seconds=wall_seconds,
        exit_code=result.returncode,
        num_blocks=int(blocks.group(1)) if blocks else None,
        problems=problems,
    )
    return run, outputs


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded model")
    add_engine_arguments(parser)
    parser.add_argument("--trace", default="sharegpt", choices=sorted(TRACE_SHAPES))
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--length-scale", type=float, default=0.25)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--vocab-size", type=int, default=49152, help="the prompts' ids' range")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--timeout-s", type=float, default=900.0)
    parser.add_argument("--json", type=Path, default=None)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_before = os.getloadavg()[0]
    engine = EngineSettings.from_args(args)
    requests = make_trace(
        args.trace, args.num_requests, args.seed, args.max_len, args.vocab_size,
        FIRST_ORDINARY_TOKEN_ID, length_scale=args.length_scale,
    )  # fmt: skip
    batch_runs: list[BatchRun] = []
    offline_runs: list[OfflineRun] = []
    mismatches: list[int] = []
    llm = None
    try:
        with tempfile.TemporaryDirectory(prefix="bench-batch-") as directory:
            for repeat in range(args.repeats):
                run, outputs = run_batch(engine, requests, Path(directory), args.timeout_s)
                batch_runs.append(run)
                _log(f"batch run {repeat}: {run.tokens_per_s:.1f} tok/s, {run.seconds:.2f} s")
                if not run.ok or run.num_blocks is None:
                    _log(f"batch run {repeat} failed: {run.problems}, exit {run.exit_code}")
                    break
                if llm is None:
                    llm = engine.offline_llm(run.num_blocks)
                    _log("offline warm-up")
                    run_offline(llm, requests[:8], "warmup", args.timeout_s)
                offline = run_offline(llm, requests, f"repeat-{repeat}", args.timeout_s)
                offline_runs.append(offline)
                _log(f"offline run {repeat}: {offline.tokens_per_s:.1f} tok/s")
                mismatches = [
                    index
                    for index, (got, want) in enumerate(zip(outputs, offline.output_token_ids))
                    if got != want
                ]
                if mismatches or not offline.ok:
                    break
    finally:
        if llm is not None:
            llm.shutdown()
    batch_tok_s = statistics.median(r.tokens_per_s for r in batch_runs) if batch_runs else None
    offline_tok_s = (
        statistics.median(r.tokens_per_s for r in offline_runs) if offline_runs else None
    )
    ok = (
        len(batch_runs) == args.repeats
        and len(offline_runs) == args.repeats
        and all(r.ok for r in batch_runs)
        and all(r.ok for r in offline_runs)
        and not mismatches
    )
    record: dict[str, Any] = {
        "tool": "bench_batch",
        "ok": ok,
        "settings": vars(args) | {"json": None if args.json is None else str(args.json)},
        "trace": asdict(trace_stats(requests)),
        "machine": machine_info() | {"load_average_1m_before": load_before},
        "batch_runs": [asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in batch_runs],
        "offline_runs": [
            {"seconds": r.seconds, "tokens_per_s": r.tokens_per_s, "problems": r.problems}
            for r in offline_runs
        ],
        "output_mismatches": mismatches[:8],
        "batch_tok_s_median": batch_tok_s,
        "offline_tok_s_median": offline_tok_s,
        "batch_over_offline": (
            batch_tok_s / offline_tok_s if batch_tok_s and offline_tok_s else None
        ),
    }
    print(
        f"batch {batch_tok_s and round(batch_tok_s, 1)} tok/s, offline "
        f"{offline_tok_s and round(offline_tok_s, 1)} tok/s, batch / offline "
        f"{record['batch_over_offline'] and round(record['batch_over_offline'], 3)}"
        + ("" if ok else f"; NOT OK: mismatches {mismatches[:8]}")
    )
    if args.json is not None:
        args.json.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0 if ok else 1


def _log(message: str) -> None:
    print(f"[bench_batch {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
