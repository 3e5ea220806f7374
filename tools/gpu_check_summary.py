"""Summarises one tools/gpu_check.sh run: $OUT/gpu_check.json (everything measured) and
$OUT/gpu_check.md (the figures and the targets, for a person). Reads the step results the
script leaves in $OUT and its exit codes from the environment."""

from __future__ import annotations

import json
import os
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any

# Targets (issue 6): paged decode at batch 64 x 4096-token contexts with Llama-7B heads.
TARGET_FRACTION_OF_COPY = 0.80
TARGET_SLOWDOWN_VS_SDPA = 1.10


def load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def test_counts(path: Path) -> dict[str, int] | None:
    try:
        root = ElementTree.parse(path).getroot()
    except (OSError, ElementTree.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for suite in suites:
        for key in counts:
            counts[key] += int(suite.get(key, 0))
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts


def target_row(bench: dict[str, Any] | None) -> dict[str, Any] | None:
    for row in (bench or {}).get("decode", []):
        if (row["batch"], row["context"], row["num_heads"], row["num_kv_heads"]) == (
            64,
            4096,
            32,
            32,
        ):
            return row
    return None


def main() -> int:
    out = Path(os.environ["OUT"])
    env = os.environ
    bench = load_json(out / "bench_cuda.json")
    e2e = load_json(out / "e2e.json")
    tests = test_counts(out / "pytest.xml")
    row = target_row(bench)
    targets = None
    if row is not None:
        targets = {
            "fraction_of_copy_bandwidth": row["fraction_of_copy_bandwidth"],
            "fraction_target": TARGET_FRACTION_OF_COPY,
            "fraction_met": row["fraction_of_copy_bandwidth"] >= TARGET_FRACTION_OF_COPY,
            "paged_over_sdpa": row["paged_over_sdpa"],
            "slowdown_target": TARGET_SLOWDOWN_VS_SDPA,
            "slowdown_met": row["paged_over_sdpa"] <= TARGET_SLOWDOWN_VS_SDPA,
        }
    summary = {
        "build": {"rc": int(env["BUILD_RC"]), "seconds": int(env["BUILD_S"])},
        "tests": {"rc": int(env["TESTS_RC"]), "counts": tests},
        "bench_cuda": {"rc": int(env["BENCH_RC"]), "results": bench},
        "e2e": {"rc": int(env["E2E_RC"]), "results": e2e},
        "targets": targets,
        "total_seconds": int(env["TOTAL_S"]),
    }
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=2))
    (out / "gpu_check.md").write_text(markdown(summary, row))
    print((out / "gpu_check.md").read_text())
    return 0


def markdown(summary: dict[str, Any], row: dict[str, Any] | None) -> str:
    lines = ["# GPU check", ""]
    bench = summary["bench_cuda"]["results"] or {}
    if bench:
        lines.append(f"Device: {bench.get('device')}, torch {bench.get('torch')}, CUDA "
                     f"{bench.get('cuda')}.")  # fmt: skip
    lines.append(
        f"Build: rc {summary['build']['rc']} in {summary['build']['seconds']} s. "
        f"Whole check: {summary['total_seconds']} s."
    )
    counts = summary["tests"]["counts"]
    if counts:
        lines.append(
            f"Tests (pytest -m cuda tests/cuda): {counts['passed']} passed, "
            f"{counts['failures']} failed, {counts['errors']} errors, {counts['skipped']} skipped."
        )
    else:
        lines.append(f"Tests: no report (rc {summary['tests']['rc']}).")
    lines += ["", "## Paged decode", ""]
    if bench.get("decode"):
        lines.append(f"Device-to-device copy: {bench['copy_gb_s']:.0f} GB/s (read + write).")
        lines += [
            "",
            "| batch | context | heads / kv | paged ms | GB/s | of copy | SDPA ms | paged / SDPA |"
            " single ms | split-K ms |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in bench["decode"]:
            lines.append(
                f"| {r['batch']} | {r['context']} | {r['num_heads']} / {r['num_kv_heads']} | "
                f"{r['paged_ms']:.3f} | {r['paged_gb_s']:.0f} | "
                f"{r['fraction_of_copy_bandwidth']:.0%} | {r['sdpa_contiguous_ms']:.3f} | "
                f"{r['paged_over_sdpa']:.2f} | {r['paged_single_pass_ms']:.3f} | "
                f"{r['paged_split_k_512_ms']:.3f} |"
            )
    targets = summary["targets"]
    if targets and row:
        lines += [
            "",
            f"Target (batch 64 x 4096, Llama-7B heads, float16): "
            f"{targets['fraction_of_copy_bandwidth']:.0%} of copy bandwidth (target >= "
            f"{TARGET_FRACTION_OF_COPY:.0%}: {'met' if targets['fraction_met'] else 'NOT met'}); "
            f"{targets['paged_over_sdpa']:.2f}x SDPA's time (target <= "
            f"{TARGET_SLOWDOWN_VS_SDPA:.2f}x: {'met' if targets['slowdown_met'] else 'NOT met'}).",
        ]
    if bench.get("prefill"):
        lines += ["", "## Prefill", "", "| batch x prompt | paged ms | TFLOP/s | SDPA causal ms |",
                  "|---|---|---|---|"]  # fmt: skip
        for r in bench["prefill"]:
            lines.append(
                f"| {r['batch']} x {r['prompt_len']} | {r['paged_ms']:.2f} | "
                f"{r['paged_tflop_s']:.1f} | {r['sdpa_causal_ms']:.2f} |"
            )
    if bench.get("cache"):
        c = bench["cache"]
        lines += [
            "",
            "## Cache ops",
            "",
            f"reshape_and_cache of {c['reshape_and_cache_tokens']} tokens: "
            f"{c['reshape_and_cache_us']:.1f} us; copy_blocks {c['copy_blocks_gb_s']:.0f} GB/s; "
            f"swap out {c['swap_out_gb_s']:.1f} GB/s, in {c['swap_in_gb_s']:.1f} GB/s "
            f"(pinned host, {c['block_bytes'] >> 20} MiB blocks).",
        ]
    e2e = summary["e2e"]["results"]
    lines += ["", "## End to end (Llama-7B-shaped, float16, ShareGPT-like)", ""]
    if e2e:
        lines += ["| run | requests | output tokens | s | output tok/s |", "|---|---|---|---|---|"]
        for name, stage in e2e.get("stages", {}).items():
            if "output_tokens_per_s" in stage:
                lines.append(
                    f"| {name} | {stage['num_requests']} | {stage['output_tokens']} | "
                    f"{stage['seconds']:.1f} | {stage['output_tokens_per_s']:.0f} |"
                )
        for name, value in e2e.get("speedup", {}).items():
            lines.append(f"\n{name}: {value:.2f}x")
        for name, reason in {**e2e.get("skipped", {}), **e2e.get("errors", {})}.items():
            lines.append(f"\n{name}: {reason}")
    else:
        lines.append(f"No results (rc {summary['e2e']['rc']}).")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
