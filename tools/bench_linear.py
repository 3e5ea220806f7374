"""Microbenchmark of the linear layers on CPU (not a test): torch's F.linear (MKL in float32,
oneDNN / torch's own kernels in bfloat16) on the plain [out, in] weight against pagedserve's
kernel on the same weight packed into panels (csrc/ops.h ``linear_packed``), both measured in
this run, alternating trial by trial so a noisy neighbour slows both alike.

For each matrix of a decoder layer (qkv, o, gate_up, down) and the LM head, at row counts from
one decode token to a prefill chunk: milliseconds per call (the median of the trials), GFLOP/s
and the speedup. Then a whole decode step's matrix products (every layer's four matrices and
the LM head) at each row count. The weights of the step's matrices are distinct tensors, as in
the model, so the large ones come from memory as they do in a real step.

    cd tools && ../.venv/bin/python bench_linear.py [--shapes embedded|llama-7b]
        [--dtype float32|bfloat16|float16] [--threads N] [--rows 1,8,32,...] [--trials 7]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from machine import cpu_model

from pagedserve import _C_cpu
from pagedserve.gpu_worker import ops
from pagedserve.gpu_worker.layers.packed_weights import PanelWeight

# (hidden, intermediate, q heads x head size, kv heads x head size, vocab, layers)
MODELS = {
    # SmolLM2-135M, the embedded model: 9 query heads and 3 kv heads of 64, tied LM head.
    "embedded": (576, 1536, 576, 192, 49152, 30),
    "llama-7b": (4096, 11008, 4096, 4096, 32000, 32),
}
DEFAULT_ROWS = (1, 4, 8, 16, 32, 64, 128, 256, 2048)


def matrices(model: str) -> dict[str, tuple[int, int]]:
    """name -> (out_features, in_features) of one decoder layer's matrices and the LM head."""
    hidden, intermediate, q_size, kv_size, vocab, _ = MODELS[model]
    return {
        "qkv": (q_size + 2 * kv_size, hidden),
        "o": (hidden, q_size),
        "gate_up": (2 * intermediate, hidden),
        "down": (hidden, intermediate),
        "lm_head": (vocab, hidden),
    }


def timed(fn: Callable[[], object], min_seconds: float) -> float:
    """Seconds per call over at least ``min_seconds`` of calls."""
    fn()
    calls = 0
    start = time.perf_counter()
    while (elapsed := time.perf_counter() - start) < min_seconds or calls == 0:
        fn()
        calls += 1
    return elapsed / calls


def compare(
    plain: Callable[[], object], packed: Callable[[], object], trials: int, min_seconds: float
) -> tuple[float, float]:
    """Median seconds per call of each, the two measured in alternating trials."""
    plain_times, packed_times = [], []
    for _ in range(trials):
        plain_times.append(timed(plain, min_seconds))
        packed_times.append(timed(packed, min_seconds))
    plain_times.sort()
    packed_times.sort()
    return plain_times[trials // 2], packed_times[trials // 2]


def bench_matrices(
    model: str, rows: list[int], trials: int, dtype: torch.dtype
) -> list[dict[str, object]]:
    records = []
    for name, (out_features, in_features) in matrices(model).items():
        weight = torch.randn(out_features, in_features).to(dtype)
        packed = PanelWeight(weight)
        for num_rows in rows:
            x = torch.randn(num_rows, in_features).to(dtype)
            plain_s, packed_s = compare(
                functools.partial(torch.nn.functional.linear, x, weight),
                functools.partial(packed.linear, x, None),
                trials,
                0.05,
            )
            flop = 2 * num_rows * in_features * out_features
            records.append(
                {
                    "matrix": name,
                    "out_features": out_features,
                    "in_features": in_features,
                    "rows": num_rows,
                    "f_linear_ms": plain_s * 1e3,
                    "packed_ms": packed_s * 1e3,
                    "f_linear_gflop_s": flop / plain_s / 1e9,
                    "packed_gflop_s": flop / packed_s / 1e9,
                    "speedup": plain_s / packed_s,
                }
            )
            print(
                f"  {name:8s} [{out_features:5d} x {in_features:5d}] rows {num_rows:5d}: "
                f"F.linear {plain_s * 1e3:8.3f} ms {flop / plain_s / 1e9:6.1f} GFLOP/s | "
                f"packed {packed_s * 1e3:8.3f} ms {flop / packed_s / 1e9:6.1f} GFLOP/s "
                f"({plain_s / packed_s:4.2f}x)",
                flush=True,
            )
    return records


def _plain_step(weights: list[torch.Tensor], inputs: dict[int, torch.Tensor]) -> None:
    for weight in weights:
        torch.nn.functional.linear(inputs[weight.shape[1]], weight)


def _packed_step(packed: list[PanelWeight], inputs: dict[int, torch.Tensor]) -> None:
    for matrix in packed:
        matrix.linear(inputs[matrix.shape[1]], None)


def bench_decode_steps(
    model: str, rows: list[int], trials: int, dtype: torch.dtype
) -> list[dict[str, object]]:
    """Every layer's four matrices, then the LM head: the products of one model step."""
    num_layers = MODELS[model][-1]
    shapes = matrices(model)
    weights = [
        torch.randn(*shapes[name]).to(dtype)
        for _ in range(num_layers)
        for name in ("qkv", "o", "gate_up", "down")
    ]
    weights.append(torch.randn(*shapes["lm_head"]).to(dtype))
    packed = [PanelWeight(weight) for weight in weights]
    records = []
    for num_rows in rows:
        inputs = {
            in_features: torch.randn(num_rows, in_features).to(dtype)
            for _, in_features in shapes.values()
        }

        plain_s, packed_s = compare(
            functools.partial(_plain_step, weights, inputs),
            functools.partial(_packed_step, packed, inputs),
            trials,
            0.0,
        )
        records.append(
            {
                "rows": num_rows,
                "f_linear_ms": plain_s * 1e3,
                "packed_ms": packed_s * 1e3,
                "speedup": plain_s / packed_s,
            }
        )
        print(
            f"  step rows {num_rows:5d}: F.linear {plain_s * 1e3:9.2f} ms | packed "
            f"{packed_s * 1e3:9.2f} ms ({plain_s / packed_s:4.2f}x)",
            flush=True,
        )
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", choices=sorted(MODELS), default="embedded")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument(
        "--rows",
        default=",".join(map(str, DEFAULT_ROWS)),
        help="comma-separated row counts (tokens per call)",
    )
    parser.add_argument("--trials", type=int, default=7, help="alternating trials per figure")
    parser.add_argument(
        "--step-rows", default="1,16,64,256", help="row counts of the whole-step figures ('' none)"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the records here")
    args = parser.parse_args(argv)
    rows = [int(value) for value in args.rows.split(",") if value]
    step_rows = [int(value) for value in args.step_rows.split(",") if value]
    if args.threads < 1 or args.trials < 1 or any(value < 1 for value in rows + step_rows):
        parser.error("--threads, --trials and every row count must be >= 1")
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    ops.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(
        f"{cpu_model()}: {args.threads} threads, kernels {_C_cpu.isa()}, shapes {args.shapes}, "
        f"{args.dtype}"
    )
    results = {
        "command": shlex.join(sys.orig_argv),
        "cpu_model": cpu_model(),
        "machine": platform.machine(),
        "threads": args.threads,
        "isa": _C_cpu.isa(),
        "shapes": args.shapes,
        "dtype": args.dtype,
        "torch": torch.__version__,
        "matrices": bench_matrices(args.shapes, rows, args.trials, dtype),
        "decode_steps": bench_decode_steps(args.shapes, step_rows, max(3, args.trials // 2), dtype),
    }
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
