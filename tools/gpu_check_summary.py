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

# Whole-check limit (issue 37): a rerun must fit in a session's 15 minutes of GPU time.
TARGET_TOTAL_S = 7 * 60


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


def decode_row(bench: dict[str, Any] | None, shape: tuple[int, int, int, int]) -> dict | None:
    """bench_cuda.py's decode result for (batch, context, num_heads, num_kv_heads)."""
    for row in (bench or {}).get("decode", []):
        if (row["batch"], row["context"], row["num_heads"], row["num_kv_heads"]) == shape:
            return row
    return None


def prefill_row(bench: dict[str, Any] | None, shape: tuple[int, int, int, int]) -> dict | None:
    """bench_cuda.py's prefill result for (batch, prompt_len, num_heads, num_kv_heads)."""
    for row in (bench or {}).get("prefill", []):
        if (row["batch"], row["prompt_len"], row["num_heads"], row["num_kv_heads"]) == shape:
            return row
    return None


def target(name: str, value: float | None, bound: float, at_least: bool) -> dict[str, Any]:
    """One target: ``value`` against ``bound`` (a floor when ``at_least``, else a ceiling);
    ``met`` is None when the value was not measured."""
    met = None if value is None else (value >= bound if at_least else value <= bound)
    return {"name": name, "value": value, "bound": bound, "at_least": at_least, "met": met}


def targets(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 6's and issue 37's targets, each with what this run measured."""
    bench = summary["bench_cuda"]["results"]
    e2e = summary["e2e"]["results"] or {}
    counts = summary["tests"]["counts"]
    mha = decode_row(bench, (64, 4096, 32, 32)) or {}
    gqa = decode_row(bench, (64, 4096, 32, 8)) or {}
    long = decode_row(bench, (1, 32768, 32, 8)) or {}
    rows = [
        target(
            "GPU tests: failures and errors",
            None if counts is None else counts["failures"] + counts["errors"],
            0,
            at_least=False,
        ),
        target("decode 64 x 4096, 32 / 32 heads: of copy bandwidth",
               mha.get("fraction_of_copy_bandwidth"), 0.80, at_least=True),
        target("decode 64 x 4096, 32 / 32 heads: x SDPA's time",
               mha.get("paged_over_sdpa"), 1.10, at_least=False),
        target("decode 64 x 4096, 32 / 8 heads: of copy bandwidth",
               gqa.get("fraction_of_copy_bandwidth"), 0.80, at_least=True),
        target("decode 64 x 4096, 32 / 8 heads: x SDPA's time",
               gqa.get("paged_over_sdpa"), 1.10, at_least=False),
        target("decode 1 x 32768, 32 / 8 heads: of copy bandwidth",
               long.get("fraction_of_copy_bandwidth"), 0.60, at_least=True),
    ]  # fmt: skip
    for batch, prompt_len in ((8, 1024), (32, 161)):
        for heads in ((32, 8), (32, 32)):
            row = prefill_row(bench, (batch, prompt_len, *heads)) or {}
            rows.append(
                target(
                    f"prefill {batch} x {prompt_len}, {heads[0]} / {heads[1]} heads: x flash SDPA",
                    row.get("varlen_over_sdpa"),
                    1.30,
                    at_least=False,
                )
            )
    rows += [
        target("end to end: of the decode memory roofline",
               e2e.get("fraction_of_roofline"), 0.60, at_least=True),
        target("end to end: x HF generate_batch",
               e2e.get("speedup", {}).get("pagedserve_over_hf_generate_batch"), 3.0,
               at_least=True),
        target("whole check: seconds", summary["total_seconds"], TARGET_TOTAL_S, at_least=False),
    ]  # fmt: skip
    return rows


def main() -> int:
    out = Path(os.environ["OUT"])
    env = os.environ
    summary = {
        "build": {"rc": int(env["BUILD_RC"]), "seconds": int(env["BUILD_S"])},
        "tests": {"rc": int(env["TESTS_RC"]), "counts": test_counts(out / "pytest.xml")},
        "bench_cuda": {"rc": int(env["BENCH_RC"]), "results": load_json(out / "bench_cuda.json")},
        "e2e": {"rc": int(env["E2E_RC"]), "results": load_json(out / "e2e.json")},
        "total_seconds": int(env["TOTAL_S"]),
    }
    summary["targets"] = targets(summary)
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=2))
    (out / "gpu_check.md").write_text(markdown(summary))
    print((out / "gpu_check.md").read_text())
    return 0


def _figure(value: float | None) -> str:
    if value is None:
        return "not measured"
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.2f}"


def _ms(row: dict[str, Any], key: str) -> str:
    value = row.get(key)
    return "-" if value is None else f"{value:.3f}"


def markdown(summary: dict[str, Any]) -> str:
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
    lines += ["", "## Targets", "", "| target | measured | bound | met |", "|---|---|---|---|"]
    for row in summary["targets"]:
        bound = (">= " if row["at_least"] else "<= ") + _figure(row["bound"])
        met = {True: "yes", False: "NO", None: "-"}[row["met"]]
        lines.append(f"| {row['name']} | {_figure(row['value'])} | {bound} | {met} |")
    lines += ["", "## Paged decode", ""]
    if bench.get("decode"):
        lines.append(f"Device-to-device copy: {bench['copy_gb_s']:.0f} GB/s (read + write).")
        lines += [
            "",
            "| batch | context | heads / kv | paged ms | GB/s | of copy | SDPA ms | paged / SDPA |"
            " single ms | split 512 ms | split 256 ms | split 128 ms |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in bench["decode"]:
            lines.append(
                f"| {r['batch']} | {r['context']} | {r['num_heads']} / {r['num_kv_heads']} | "
                f"{r['paged_ms']:.3f} | {r['paged_gb_s']:.0f} | "
                f"{r['fraction_of_copy_bandwidth']:.0%} | {r['sdpa_contiguous_ms']:.3f} | "
                f"{r['paged_over_sdpa']:.2f} | {_ms(r, 'paged_single_pass_ms')} | "
                f"{_ms(r, 'paged_split_k_512_ms')} | {_ms(r, 'paged_split_k_256_ms')} | "
                f"{_ms(r, 'paged_split_k_128_ms')} |"
            )
    if bench.get("prefill"):
        lines += [
            "",
            "## Prefill over the paged cache",
            "",
            "| batch x prompt | heads / kv | varlen ms | padded SDPA ms | paged kernel ms |"
            " flash SDPA (contiguous) ms | varlen / SDPA |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in bench["prefill"]:
            ratio = r.get("varlen_over_sdpa")
            lines.append(
                f"| {r['batch']} x {r['prompt_len']} | {r['num_heads']} / {r['num_kv_heads']} | "
                f"{_ms(r, 'varlen_ms')} | {_ms(r, 'gathered_sdpa_ms')} | {_ms(r, 'paged_ms')} | "
                f"{_ms(r, 'sdpa_causal_ms')} | {'-' if ratio is None else f'{ratio:.2f}'} |"
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
    lines += ["", "## End to end (ShareGPT-like trace)", ""]
    if e2e:
        model = e2e.get("model", {})
        lines.append(
            f"Model: {model.get('num_hidden_layers')} layers, hidden {model.get('hidden_size')}, "
            f"{model.get('num_attention_heads')} / {model.get('num_key_value_heads')} heads, "
            f"{model.get('dtype')}, random weights."
        )
        lines += [
            "",
            "| run | requests | output tokens | s | output tok/s |",
            "|---|---|---|---|---|",
        ]
        for name, stage in e2e.get("stages", {}).items():
            if "output_tokens_per_s" in stage and "num_requests" in stage:
                lines.append(
                    f"| {name} | {stage['num_requests']} | {stage['output_tokens']} | "
                    f"{stage['seconds']:.1f} | {stage['output_tokens_per_s']:.0f} |"
                )
        roofline = e2e.get("stages", {}).get("roofline")
        if roofline:
            rate, bandwidth = roofline["output_tokens_per_s"], roofline["bandwidth_gb_s"]
            lines.append(
                f"\nDecode memory roofline of the whole trace: {rate:.0f} output tok/s "
                f"({roofline['steps']} steps at {bandwidth:.0f} GB/s); pagedserve reaches "
                f"{_figure(e2e.get('fraction_of_roofline'))} of it."
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
