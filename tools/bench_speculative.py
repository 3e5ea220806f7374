"""What speculative decoding gives: the same requests with and without it.

One engine per configuration, built once and kept for the whole run: plain decoding, and
prompt-lookup speculation (vLLM's "ngram" method), or with ``--draft-model`` speculation
with that draft model, or with ``--mtp`` the model's own multi-token-prediction layer
(DeepSeek-V3, GLM-4.5), with each ``--num-speculative-tokens`` K, otherwise the same
settings. Each serves the workloads, chat prompts on the chat
template, greedy, ``--max-tokens`` per request with ``ignore_eos=True`` so that every
configuration generates the same token counts:

    repetitive  prompts asking the model to repeat or edit text the prompt holds (a
                list, a table, a paragraph, code with one change, a text with typos):
                the output copies the prompt, so its last tokens occurred before and
                the lookup's drafts are often right. On the embedded model
                (SmolLM2-135M-Instruct) greedy outputs copy 12 to 24 lines faithfully,
                then continue with text of their own up to --max-tokens.
    free        open questions whose answers do not repeat the prompt: the control,
                where the drafts are few and mostly wrong and what speculation costs
                shows.
    random      8 prompts of 64 to 200 random token ids (seeded): for a model without a
                tokenizer (a random checkpoint), the only workload it takes.

For each (workload, batch size) cell, the first ``batch_size`` prompts of the workload
(cycled past its 8) run once untimed on every engine (plain first: its outputs are the
reference; this also puts the prompts in each engine's prefix cache, so every timed run
prefills alike), then ``--repeats`` times on every engine, interleaved, the order rotating
each repeat so that the machine's drift weighs on all alike. Reported per cell and K:
output tokens/s with and without speculation (medians), their ratio, the median of the
ratios of runs of one repeat (which sit next to each other in time), the acceptance rate
(accepted / drafted tokens, from ``LLM.stats()``), the tokens a speculating sequence
emitted per step ((accepted + speculating sequence-steps) / speculating sequence-steps,
the plans' ``spec_token_ids`` counted around ``Scheduler.schedule``), the engine steps
and mean step time each way (``EngineCore.step`` timed), and the load average before and
after the cell.

Checks: every output, timed or not, must equal the plain engine's reference tokens (the
engine promises speculation changes nothing in the output); a mismatch makes the run
invalid (exit status 1) and the record lists it.
Machines are shared and noisy: compare the ratios within one run, not figures across runs.

Examples (from the repository root):

    # The full benchmark (2 workloads x batch 1 and 8 x plain, K=2, K=4; 3 repeats).
    # With 2 repeats and one thread it took 17 minutes on 2 cores shared at load 3-6.
    .venv/bin/python tools/bench_speculative.py --json bench.json

    # One thread: on cores other jobs share, torch's 2 OpenMP threads make every
    # multi-row GEMM many times slower (docs/BENCHMARKS.md), speculation's verification most.
    .venv/bin/python tools/bench_speculative.py --threads 1 --json bench.json

    # The model's multi-token-prediction layer on a random DeepSeek-V3-shaped checkpoint
    # (no tokenizer: random prompts; docs/BENCHMARKS.md shows how the model is made).
    .venv/bin/python tools/bench_speculative.py --model /tmp/bench-mtp/predictable --mtp \
        --workloads random --num-speculative-tokens 1 2 3 --threads 1 --json bench.json

    # A smoke run, a couple of minutes.
    .venv/bin/python tools/bench_speculative.py --batch-sizes 1 --num-speculative-tokens 4 \\
        --repeats 1 --max-tokens 32
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shlex
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from machine import cpu_model

from pagedserve.frontend import LLM, SamplingParams
from pagedserve.gpu_worker import ops
from pagedserve.scheduler.engine_core import EngineCore

DTYPES = ("float32", "bfloat16")
PLAIN = "plain"

_GROCERIES = (
    "apples", "bread", "carrots", "dish soap", "eggs", "flour", "green tea", "honey",
    "ice cream", "jam", "kale", "lemons", "milk", "noodles", "olive oil", "peanut butter",
    "quinoa", "rice", "salt", "tomatoes", "vinegar", "walnuts", "yogurt", "zucchini",
)  # fmt: skip
_CITIES = (
    "Paris, France, 2.1 million", "Berlin, Germany, 3.6 million",
    "Madrid, Spain, 3.3 million", "Rome, Italy, 2.8 million", "Vienna, Austria, 1.9 million",
    "Warsaw, Poland, 1.8 million", "Lisbon, Portugal, 0.5 million",
    "Prague, Czechia, 1.3 million", "Dublin, Ireland, 0.6 million",
    "Oslo, Norway, 0.7 million", "Athens, Greece, 0.6 million",
    "Budapest, Hungary, 1.7 million",
)  # fmt: skip
# Chosen on the embedded model: its greedy outputs copy these (acceptance 0.46-0.90 each
# at K=4, batch 1, 128 tokens). Some edit while copying (a name, a function name, typos).
REPETITIVE = (
    "Repeat this list exactly, one item per line:\n"
    + "\n".join(f"{number}. {item}" for number, item in enumerate(_GROCERIES, 1)),
    "Copy this table of cities exactly, keeping the format:\n" + "\n".join(_CITIES),
    'Quote this paragraph back word for word:\n"The river runs through the old town, past '
    "the mill and under the stone bridge. In spring the water rises and the meadows flood; "
    "in summer children swim near the bank and fishermen sit in the shade of the willows. "
    "By autumn the leaves drift down the current toward the sea, and in winter the ice "
    "creaks along the banks while the town sleeps under snow. Every year the people of the "
    'town gather on the bridge to watch the first boat of spring pass beneath it."',
    "Rewrite this text with every name replaced by Alex:\nMaria opened the door and "
    "greeted Tom. Tom handed Maria a letter from Sarah. Sarah had written that she would "
    "visit Maria and Tom next Sunday, and that Peter would come too. Maria read the letter "
    "twice and smiled. Tom asked Maria whether Peter still lived in the city. Maria said "
    "that Peter had moved to the coast, and that Sarah would drive him.",
    "Copy this Python code exactly, changing only the function name add_numbers to "
    "sum_positive:\n\ndef add_numbers(values):\n    total = 0\n    for value in values:\n"
    "        if value > 0:\n            total += value\n    return total\n\n\n"
    "def mean(values):\n    if not values:\n        return 0.0\n"
    "    return add_numbers(values) / len(values)\n\n\ndef report(values):\n"
    "    print('count', len(values))\n    print('sum', add_numbers(values))\n"
    "    print('mean', mean(values))\n",
    "Repeat these instructions exactly:\nStep 1: Preheat the oven to 180 degrees.\n"
    "Step 2: Mix the flour, sugar and butter in a large bowl.\nStep 3: Add two eggs and "
    "stir until smooth.\nStep 4: Pour the batter into a greased tin.\nStep 5: Bake for 35 "
    "minutes until golden.\nStep 6: Let the cake cool for ten minutes.\nStep 7: Spread the "
    "icing over the top.\nStep 8: Cut into slices and serve.",
    "Repeat this CSV data exactly:\nname,age,city\nAnna,34,Boston\nBen,28,Denver\n"
    "Carla,45,Austin\nDavid,39,Seattle\nElena,23,Miami\nFrank,51,Chicago\nGrace,30,Portland\n"
    "Henry,42,Dallas\nIrene,27,Phoenix\nJack,36,Atlanta\nKaren,48,Detroit\nLeo,33,Houston",
    "Fix the spelling mistakes in this text and write it out in full:\nThe weathr was cold "
    "and windy when we left the house. We walkd to the station, bougt two tickets and "
    "waited for the train. It arived ten minuts late, but we still reachd the city before "
    "noon. We visted the museum, had lunch in a small cafe and walked along the river until "
    "the sun went down.",
)
FREE = (
    "Write a short story about a dragon who learns to cook.",
    "Explain how photosynthesis works.",
    "What are the benefits of regular exercise?",
    "Describe your ideal vacation.",
    "Give some advice for a first job interview.",
    "Why is the sky blue?",
    "What should I look for when buying a used car?",
    "How do airplanes stay in the air?",
)
WORKLOADS = {"repetitive": REPETITIVE, "free": FREE}
RANDOM = "random"  # token ids, not text


@dataclass(frozen=True)
class Run:
    """One timed generate call over one cell's batch on one engine."""

    config: str  # PLAIN or "K=<k>"
    repeat: int
    output_tokens: int
    seconds: float
    num_steps: int  # EngineCore.step calls
    step_seconds: float
    num_draft_tokens: int
    num_accepted_tokens: int
    num_speculating_steps: int  # sequence-steps that carried drafts

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def mean_step_ms(self) -> float:
        return 1e3 * self.step_seconds / self.num_steps

    def as_record(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "tokens_per_s": self.tokens_per_s,
            "mean_step_ms": self.mean_step_ms,
        }


@dataclass
class Mismatch:
    """An output that differs from the plain engine's reference tokens."""

    workload: str
    batch_size: int
    config: str
    repeat: int | None  # None: the untimed first run
    request: int
    first_difference: int  # index of the first differing token


# ---------------------------------------------------------------------------- engines


def config_name(num_speculative_tokens: int | None) -> str:
    return PLAIN if num_speculative_tokens is None else f"K={num_speculative_tokens}"


def build_engines(args: argparse.Namespace) -> dict[str, LLM]:
    """One in-process engine per configuration, plain first, the same settings otherwise."""
    engines = {}
    for k in [None, *args.num_speculative_tokens]:
        speculative_config = None
        if k is not None and args.draft_model is not None:
            speculative_config = {"model": args.draft_model, "num_speculative_tokens": k}
        elif k is not None and args.mtp:
            speculative_config = {"method": "mtp", "num_speculative_tokens": k}
        elif k is not None:
            speculative_config = {
                "method": "ngram",
                "num_speculative_tokens": k,
                "prompt_lookup_max": args.prompt_lookup_max,
                "prompt_lookup_min": args.prompt_lookup_min,
            }
        _log(f"loading {config_name(k)}")
        llm = LLM(
            model=args.model,
            dtype=args.dtype,
            max_num_seqs=max(args.batch_sizes),
            kv_cache_bytes=args.kv_cache_bytes,
            multiprocess=False,
            speculative_config=speculative_config,
        )
        assert isinstance(llm.engine, EngineCore), "in process, the timers need the engine"
        engines[config_name(k)] = llm
    return engines


def encode_workloads(llm: LLM, workloads: list[str]) -> dict[str, list[list[int]]]:
    """Each workload's chat prompts as token ids, encoded once so no timed run tokenizes."""
    encoded = {}
    if RANDOM in workloads:
        rng = random.Random(0)
        vocab_size = llm.model_config.vocab_size
        encoded[RANDOM] = [
            [rng.randrange(vocab_size) for _ in range(rng.randrange(64, 201))] for _ in range(8)
        ]
    texts_asked = [name for name in workloads if name != RANDOM]
    if not texts_asked:
        return encoded
    tokenizer = llm.tokenizer
    assert tokenizer is not None, "text workloads need a tokenizer: use --workloads random"
    for name in texts_asked:
        texts = WORKLOADS[name]
        encoded[name] = [
            tokenizer.encode(
                llm.render_chat([{"role": "user", "content": text}]), add_special_tokens=False
            )
            for text in texts
        ]
    return encoded


@dataclass
class StepCounts:
    """What ``step_counters`` gathers during one generate call."""

    step_seconds: list[float] = field(default_factory=list)
    num_speculating_steps: int = 0


@contextmanager
def step_counters(llm: LLM) -> Iterator[StepCounts]:
    """Time the engine's steps and count the sequences each plan speculates for: wrappers
    on the engine object's ``step`` and its scheduler's ``schedule`` (two clock reads and
    a dict length per step), removed on exit."""
    counts = StepCounts()
    engine = llm.engine
    original_step = engine.step
    original_schedule = engine.scheduler.schedule

    def step() -> Any:
        start = time.perf_counter()
        result = original_step()
        counts.step_seconds.append(time.perf_counter() - start)
        return result

    def schedule() -> Any:
        plan = original_schedule()
        counts.num_speculating_steps += len(plan.spec_token_ids)
        return plan

    engine.step = step  # type: ignore[method-assign]
    engine.scheduler.schedule = schedule  # type: ignore[method-assign]
    try:
        yield counts
    finally:
        del engine.step  # the class's methods again
        del engine.scheduler.schedule


def timed_generate(
    llm: LLM, config: str, repeat: int, prompts: list[list[int]], params: SamplingParams
) -> tuple[Run, list[list[int]]]:
    before = llm.stats()
    with step_counters(llm) as counts:
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        seconds = time.perf_counter() - start
    after = llm.stats()
    tokens = [list(output.outputs[0].token_ids) for output in outputs]
    run = Run(
        config=config,
        repeat=repeat,
        output_tokens=sum(len(t) for t in tokens),
        seconds=seconds,
        num_steps=len(counts.step_seconds),
        step_seconds=sum(counts.step_seconds),
        num_draft_tokens=int(after["num_draft_tokens"] - before["num_draft_tokens"]),
        num_accepted_tokens=int(after["num_accepted_tokens"] - before["num_accepted_tokens"]),
        num_speculating_steps=counts.num_speculating_steps,
    )
    return run, tokens


def warm_up(engines: dict[str, LLM], prompts: list[list[int]]) -> None:
    # First calls pay one-off costs (allocator growth, kernels for new shapes); keep
    # them out of the timed runs.
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for llm in engines.values():
        llm.generate(prompts[:2], params)


# ---------------------------------------------------------------------------- one cell


def cell_prompts(prompts: list[list[int]], batch_size: int) -> list[list[int]]:
    return [prompts[index % len(prompts)] for index in range(batch_size)]


def compare(
    produced: list[list[int]], reference: list[list[int]], where: dict[str, Any]
) -> list[Mismatch]:
    mismatches = []
    for request, (tokens, expected) in enumerate(zip(produced, reference)):
        if tokens == expected:
            continue
        first = next(
            (i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b),
            min(len(tokens), len(expected)),
        )
        mismatches.append(Mismatch(**where, request=request, first_difference=first))
    return mismatches


def run_cell(
    engines: dict[str, LLM],
    workload: str,
    prompts: list[list[int]],
    batch_size: int,
    args: argparse.Namespace,
    mismatches: list[Mismatch],
) -> dict[str, Any]:
    """The untimed reference run on every engine, then the interleaved timed repeats."""
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    batch = cell_prompts(prompts, batch_size)
    load_before = list(os.getloadavg())
    configs = list(engines)
    reference: list[list[int]] = []
    for config in configs:
        _, tokens = timed_generate(engines[config], config, -1, batch, params)
        if config == PLAIN:
            reference = tokens
        where = {"workload": workload, "batch_size": batch_size, "config": config}
        mismatches += compare(tokens, reference, {**where, "repeat": None})
    runs = []
    for repeat in range(args.repeats):
        shift = repeat % len(configs)
        for config in configs[shift:] + configs[:shift]:
            run, tokens = timed_generate(engines[config], config, repeat, batch, params)
            where = {"workload": workload, "batch_size": batch_size, "config": config}
            mismatches += compare(tokens, reference, {**where, "repeat": repeat})
            _log(
                f"{workload} batch {batch_size} repeat {repeat} {config}: "
                f"{run.tokens_per_s:.1f} tok/s, {run.num_steps} steps, "
                f"{run.mean_step_ms:.1f} ms/step"
            )
            runs.append(run)
    return {
        "workload": workload,
        "batch_size": batch_size,
        "runs": [run.as_record() for run in runs],
        "speculation": [summarize(runs, config) for config in configs if config != PLAIN],
        "plain_tok_s": statistics.median(r.tokens_per_s for r in runs if r.config == PLAIN),
        "load_average_before": load_before,
        "load_average_after": list(os.getloadavg()),
    }


def summarize(runs: list[Run], config: str) -> dict[str, Any]:
    """One speculative configuration against plain decoding, over one cell's repeats."""
    plain = [run for run in runs if run.config == PLAIN]
    spec = [run for run in runs if run.config == config]
    plain_tok_s = statistics.median(run.tokens_per_s for run in plain)
    spec_tok_s = statistics.median(run.tokens_per_s for run in spec)
    drafted = sum(run.num_draft_tokens for run in spec)
    accepted = sum(run.num_accepted_tokens for run in spec)
    speculating_steps = sum(run.num_speculating_steps for run in spec)
    return {
        "config": config,
        "plain_tok_s": plain_tok_s,
        "spec_tok_s": spec_tok_s,
        "ratio": spec_tok_s / plain_tok_s,
        # Runs of one repeat sit next to each other in time: their ratio drifts least.
        "median_paired_ratio": statistics.median(
            s.tokens_per_s / p.tokens_per_s for s, p in zip(spec, plain)
        ),
        "acceptance_rate": accepted / drafted if drafted else None,
        "draft_tokens_per_run": drafted / len(spec),
        "accepted_tokens_per_run": accepted / len(spec),
        # A speculating sequence's step emits its accepted drafts plus one token.
        "tokens_per_speculating_step": (
            (accepted + speculating_steps) / speculating_steps if speculating_steps else None
        ),
        "speculating_sequence_steps_per_run": speculating_steps / len(spec),
        "plain_steps": statistics.median(run.num_steps for run in plain),
        "spec_steps": statistics.median(run.num_steps for run in spec),
        "plain_step_ms": statistics.median(run.mean_step_ms for run in plain),
        "spec_step_ms": statistics.median(run.mean_step_ms for run in spec),
    }


# ---------------------------------------------------------------------------- the run


def machine_info() -> dict[str, Any]:
    return {
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        # Other processes on the cores slow every run; a 1-minute load above cpu_count
        # means the figures are low, the ratios less so (but see docs/BENCHMARKS.md: a
        # multi-row GEMM suffers more from a busy core than a one-row one).
        "load_average": list(os.getloadavg()),
    }


def format_report(record: dict[str, Any]) -> str:
    header = (
        f"{'workload':<10}  {'batch':>5}  {'K':>3}  {'plain tok/s':>11}  {'spec tok/s':>10}  "
        f"{'spec/plain':>10}  {'paired':>6}  {'accept':>6}  {'tok/spec step':>13}  "
        f"{'steps plain/spec':>16}  {'ms/step plain/spec':>18}  load before->after"
    )
    lines = [header]
    for cell in record["cells"]:
        load = f"{cell['load_average_before'][0]:.2f}->{cell['load_average_after'][0]:.2f}"
        for spec in cell["speculation"]:
            accept = "-" if spec["acceptance_rate"] is None else f"{spec['acceptance_rate']:.2f}"
            per_step = spec["tokens_per_speculating_step"]
            per_step_text = "-" if per_step is None else f"{per_step:.2f}"
            steps = f"{spec['plain_steps']:.0f}/{spec['spec_steps']:.0f}"
            step_ms = f"{spec['plain_step_ms']:.1f}/{spec['spec_step_ms']:.1f}"
            lines.append(
                f"{cell['workload']:<10}  {cell['batch_size']:>5}  {spec['config'][2:]:>3}  "
                f"{spec['plain_tok_s']:>11.1f}  {spec['spec_tok_s']:>10.1f}  "
                f"{spec['ratio']:>10.3f}  {spec['median_paired_ratio']:>6.3f}  {accept:>6}  "
                f"{per_step_text:>13}  {steps:>16}  {step_ms:>18}  {load}"
            )
    checks = record["checks"]
    lines.append(
        f"checks: {checks['num_mismatches']} outputs differ from plain decoding "
        f"({'valid' if checks['valid'] else 'INVALID'})"
    )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="model directory (default: embedded)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="weights and KV cache")
    parser.add_argument(
        "--draft-model",
        default=None,
        help="speculate with this draft model (a directory or GGUF file of the model's "
        "tokenizer) instead of by prompt lookup",
    )
    parser.add_argument(
        "--mtp",
        action="store_true",
        help="speculate with the model's multi-token-prediction layer (method 'mtp')",
    )
    parser.add_argument(
        "--batch-sizes", type=int, nargs="+", default=[1, 8], help="requests per generate call"
    )
    parser.add_argument(
        "--num-speculative-tokens",
        type=int,
        nargs="+",
        default=[2, 4],
        help="K: draft tokens per sequence per step, one engine each",
    )
    parser.add_argument("--prompt-lookup-max", type=int, default=4, help="longest suffix looked up")
    parser.add_argument("--prompt-lookup-min", type=int, default=2, help="shortest suffix")
    parser.add_argument(
        "--workloads", nargs="+", choices=(*WORKLOADS, RANDOM), default=list(WORKLOADS)
    )
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each engine")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch and kernel threads (default: torch's)"
    )
    parser.add_argument(
        "--kv-cache-bytes", type=int, default=512 << 20, help="KV cache of each engine"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the record here")
    args = parser.parse_args(argv)
    for name in ("max_tokens", "repeats", "kv_cache_bytes"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("batch_sizes", "num_speculative_tokens"):
        bad = [value for value in getattr(args, name) if value < 1]
        if bad:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {bad}")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    if args.mtp and args.draft_model is not None:
        parser.error("--mtp and --draft-model are two methods: give one")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
        ops.set_num_threads(args.threads)
    load_before = list(os.getloadavg())
    engines = build_engines(args)
    prompts = encode_workloads(engines[PLAIN], args.workloads)
    warm_up(engines, prompts[args.workloads[0]])
    mismatches: list[Mismatch] = []
    cells = [
        run_cell(engines, workload, prompts[workload], batch_size, args, mismatches)
        for workload in args.workloads
        for batch_size in args.batch_sizes
    ]
    valid = not mismatches
    record = {
        "command": shlex.join(sys.orig_argv),
        "settings": {
            "model": args.model or "embedded",
            "method": "mtp"
            if args.mtp
            else ("ngram" if args.draft_model is None else "draft_model"),
            "draft_model": args.draft_model,
            "dtype": args.dtype,
            "batch_sizes": args.batch_sizes,
            "num_speculative_tokens": args.num_speculative_tokens,
            "prompt_lookup_max": args.prompt_lookup_max,
            "prompt_lookup_min": args.prompt_lookup_min,
            "max_tokens": args.max_tokens,
            "repeats": args.repeats,
            "kv_cache_bytes": args.kv_cache_bytes,
            "sampling": "greedy, ignore_eos",
            "prompt_tokens": {
                name: [len(ids) for ids in encoded] for name, encoded in prompts.items()
            },
        },
        "cells": cells,
        "checks": {
            "num_mismatches": len(mismatches),
            "valid": valid,
            "mismatches": [asdict(mismatch) for mismatch in mismatches],
        },
        "machine": {**machine_info(), "load_average_before": load_before},
    }
    print(format_report(record))
    if record["machine"]["load_average"][0] > (os.cpu_count() or 1):
        print("NOTE: other processes compete for the cores: absolute figures are low")
    if args.json is not None:
        args.json.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.json}")
    if not valid:
        print("INVALID: outputs with speculation differ from plain decoding", file=sys.stderr)
        return 1
    return 0


def _log(message: str) -> None:
    print(f"bench_speculative: {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
