"""What structured output costs: the same requests constrained by a JSON schema and not.

The requests are chat prompts asking the embedded model (SmolLM2-135M-Instruct) for facts
about a subject as JSON, one subject per request (built deterministically from a fixed
list), greedy. In one run:

1. Throughput. The batch runs once constrained by ``SCHEMA`` (a topic, a summary and 3
   or 4 facts of bounded strings and a year) to learn each request's output length (the
   calibration run, untimed for the medians). Then the same batch runs ``--repeats`` times
   each way, alternating (constrained first in even repeats, unconstrained first in odd
   ones, so that the machine's drift weighs on both alike): constrained as calibrated, and
   unconstrained with each request's ``max_tokens`` set to the number of tokens its
   constrained output had and ``ignore_eos=True``, so both generate the same token counts
   in the same batch shape. Reported: output tokens/s per run, the medians, and the ratio
   constrained / unconstrained. With ``--multiprocess`` the same again through
   ``LLM(multiprocess=True)``, the server's shape, where the mask work sits in the
   scheduler process. Both engines get a warm-up first (one constrained request too, so
   the grammar tokenizer's one-off build is outside every timed run), and the calibration
   run puts every prompt in the prefix cache, so every timed run prefills alike.
2. Where the time goes. In process each ``EngineCore.step`` is timed, and so is the
   grammar work inside the steps as the engine does it (wrappers around the engine
   object's ``step``, ``GrammarMatcher.allowed_token_bitmask`` and ``accept``, and the
   sampler's ``apply_grammar_masks``; the multi-process client receives batches, not
   steps, and its scheduler runs elsewhere, so it has neither). In isolation, after the
   runs, the calibration outputs' token sequences are replayed through fresh matchers
   (``StructuredOutput(llm.grammar_vocabulary)``, as the scheduler builds them), timing
   ``allowed_token_bitmask`` and ``accept`` (with the ``is_finished`` check the scheduler
   makes after it) per token, the median of ``--replay-passes`` passes; the first
   matcher's build (llguidance's tokenizer, once per engine) and a matcher's build per
   request are timed too. The sampler's side: ``apply_grammar_masks`` on [64, vocab]
   float32 logits with 64 rows masked (the replay's real masks). Both, per step, against
   the engine's mean step time: the isolated timings run warm in the caches, the
   engine's between forward passes.
3. Checks. Every constrained output must be JSON with the schema's required keys (the
   fact objects' included); a failure with finish reason "stop" makes the benchmark
   invalid (exit status 1). Outputs cut short by ``--max-tokens`` ("length") are counted
   apart. Each constrained run must give the calibration's tokens, each unconstrained run
   exactly the calibrated counts, and the replay must accept every token.

``SCHEMA`` asks for compact JSON (``"x-guidance": {"whitespace_flexible": false}``): with
flexible whitespace this model loops on newlines and spaces inside the object until
``max_tokens`` in some requests (seen here: 1 of 10 subjects at 512 tokens).
Machines are shared and noisy: compare the ratio within one run, not figures across runs;
the record keeps the load average before and after.

Examples (from the repository root):

    # The full benchmark (32 requests, 3 repeats each way, in process and multi-process:
    # about 13 minutes on 2 cores, 7 without --multiprocess).
    .venv/bin/python tools/bench_structured_output.py --multiprocess --json bench.json

    # A smoke run, a couple of minutes.
    .venv/bin/python tools/bench_structured_output.py --num-requests 4 --repeats 1 \\
        --max-tokens 96
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch
from machine import cpu_model

from pagedserve.frontend import LLM, SamplingParams, StructuredOutputsParams
from pagedserve.gpu_worker import sampler as sampler_module
from pagedserve.gpu_worker.sampler import SamplingBatch, apply_grammar_masks
from pagedserve.scheduler.engine_core import EngineCore
from pagedserve.scheduler.structured_output import (
    GrammarMatcher,
    GrammarVocabulary,
    StructuredOutput,
)

DTYPES = ("float32", "bfloat16")
SUBJECTS = (
    "the Roman Empire", "volcanoes", "the printing press", "honeybees", "the Moon landing",
    "jazz music", "the Great Wall of China", "penicillin", "the Eiffel Tower", "chess",
    "the Amazon rainforest", "the steam engine", "Mount Everest", "the Olympic Games",
    "the telephone", "ancient Egypt", "the Internet", "coral reefs", "the French Revolution",
    "black holes", "the Silk Road", "electricity", "dinosaurs", "the Renaissance",
    "the Titanic", "photosynthesis", "the Vikings", "the bicycle", "the Sahara desert",
    "vaccines", "the Beatles", "the Panama Canal", "Albert Einstein", "the Moon",
    "the Industrial Revolution", "tea", "the Mayan civilization", "airplanes", "Antarctica",
    "the piano", "the human heart", "Shakespeare", "the Nile river", "railways",
    "the Cold War", "glaciers", "the compass", "Mars", "the Byzantine Empire", "coffee",
    "the camera", "tigers", "the Statue of Liberty", "radio", "the Ming dynasty",
    "earthquakes", "the microscope", "Leonardo da Vinci", "the Pacific Ocean", "paper",
    "the Apollo program", "whales", "the Aztecs", "the light bulb",
)  # fmt: skip
PROMPT = (
    "Give three or four key facts about {subject} as JSON: a topic, a one-sentence "
    "summary and a list of facts, each with a name, a detail and a year."
)
_FACT = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "detail": {"type": "string", "maxLength": 60},
        "year": {"type": "integer", "minimum": -3000, "maximum": 2100},
    },
    "required": ["name", "detail", "year"],
    "additionalProperties": False,
}
SCHEMA = {
    "type": "object",
    "properties": {
        "topic": {"type": "string", "maxLength": 40},
        "summary": {"type": "string", "maxLength": 100},
        "facts": {"type": "array", "minItems": 3, "maxItems": 4, "items": _FACT},
    },
    "required": ["topic", "summary", "facts"],
    "additionalProperties": False,
    # Compact JSON: with flexible whitespace this model loops on blank lines in some outputs.
    "x-guidance": {"whitespace_flexible": False},
}
# The sampler timing's batch: a full decode step of max_num_seqs=64 constrained rows.
SAMPLER_ROWS = 64
SAMPLER_CALLS = 30


@dataclass(frozen=True)
class Run:
    """One timed generate call over the whole batch."""

    kind: str  # "constrained" or "unconstrained"
    output_tokens: int
    seconds: float
    # In process only (None multi-process): EngineCore.step calls and their total time.
    num_steps: int | None
    step_seconds: float | None
    # In process, constrained: the grammar work inside those steps (``engine_timers``).
    grammar: dict[str, float] | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def mean_step_ms(self) -> float | None:
        if not self.num_steps or self.step_seconds is None:
            return None
        return 1e3 * self.step_seconds / self.num_steps

    def as_record(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "tokens_per_s": self.tokens_per_s,
            "mean_step_ms": self.mean_step_ms,
        }


@dataclass
class Checks:
    """What the outputs must satisfy; anything counted here is listed in the record."""

    invalid_json_stopped: int = 0  # finish "stop" but no JSON with the required keys
    invalid_json_length: int = 0  # cut short by max_tokens
    constrained_token_mismatches: int = 0  # a timed constrained output != calibration
    unconstrained_length_mismatches: int = 0
    replay_rejections: int = 0  # the replay's matcher refused a token the engine sampled
    replay_unfinished_stops: int = 0  # finish "stop", yet the replayed grammar not complete

    @property
    def valid(self) -> bool:
        return not (
            self.invalid_json_stopped
            or self.constrained_token_mismatches
            or self.unconstrained_length_mismatches
            or self.replay_rejections
            or self.replay_unfinished_stops
        )


# ---------------------------------------------------------------------------- requests


def build_prompts(llm: LLM, num_requests: int) -> list[list[int]]:
    """Each subject's chat prompt as token ids, as ``LLM.chat`` encodes it; encoded once so
    that no timed run tokenizes."""
    tokenizer = llm.tokenizer
    assert tokenizer is not None, "the embedded model has a tokenizer"
    prompts = []
    for subject in SUBJECTS[:num_requests]:
        conversation = [{"role": "user", "content": PROMPT.format(subject=subject)}]
        text = llm.render_chat(conversation)
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return prompts


def constrained_params(max_tokens: int) -> SamplingParams:
    return SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        structured_outputs=StructuredOutputsParams(json=SCHEMA),
    )


def unconstrained_params(lengths: list[int]) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]


def json_problem(text: str) -> str | None:
    """Why ``text`` is not an object with SCHEMA's required keys; None when it is."""
    try:
        value = json.loads(text)
    except ValueError as error:
        return f"not JSON: {error}"
    if not isinstance(value, dict):
        return f"not an object: {type(value).__name__}"
    missing = [key for key in SCHEMA["required"] if key not in value]
    if missing:
        return f"missing {missing}"
    facts = value["facts"]
    if not isinstance(facts, list):
        return "facts is not a list"
    for index, fact in enumerate(facts):
        if not isinstance(fact, dict) or any(key not in fact for key in _FACT["required"]):
            return f"facts[{index}] lacks a required key"
    return None


# ---------------------------------------------------------------------------- engine runs


@dataclass
class EngineTimes:
    """What an in-process engine spent, gathered by ``engine_timers``."""

    steps: list[float] = field(default_factory=list)  # each EngineCore.step
    masks: list[float] = field(default_factory=list)  # GrammarMatcher.allowed_token_bitmask
    accepts: list[float] = field(default_factory=list)  # GrammarMatcher.accept
    applies: list[float] = field(default_factory=list)  # sampler's apply_grammar_masks
    applied_rows: int = 0  # rows those calls masked


@contextmanager
def engine_timers(llm: LLM) -> Iterator[EngineTimes]:
    """Time an in-process engine's steps and its grammar work as it runs: wrappers around
    the engine object's ``step``, ``GrammarMatcher``'s two methods and the sampler module's
    ``apply_grammar_masks`` (each adds two clock reads, ~0.1 us), removed on exit. A
    multi-process engine runs them elsewhere: the lists stay empty."""
    times = EngineTimes()
    engine = llm.engine
    if not isinstance(engine, EngineCore):
        yield times
        return

    def timed(function: Callable[..., Any], durations: list[float]) -> Callable[..., Any]:
        def wrapper(*args: Any) -> Any:
            start = time.perf_counter()
            result = function(*args)
            durations.append(time.perf_counter() - start)
            return result

        return wrapper

    def apply(logits: torch.Tensor, batch: SamplingBatch) -> None:
        times.applied_rows += batch.grammar_rows.size
        original_apply(logits, batch)

    original_mask = GrammarMatcher.allowed_token_bitmask
    original_accept = GrammarMatcher.accept
    original_apply = sampler_module.apply_grammar_masks
    engine.step = timed(engine.step, times.steps)  # type: ignore[method-assign]
    GrammarMatcher.allowed_token_bitmask = timed(original_mask, times.masks)  # type: ignore[method-assign]
    GrammarMatcher.accept = timed(original_accept, times.accepts)  # type: ignore[method-assign]
    sampler_module.apply_grammar_masks = timed(apply, times.applies)
    try:
        yield times
    finally:
        del engine.step  # the class's method again
        GrammarMatcher.allowed_token_bitmask = original_mask  # type: ignore[method-assign]
        GrammarMatcher.accept = original_accept  # type: ignore[method-assign]
        sampler_module.apply_grammar_masks = original_apply


def timed_generate(
    llm: LLM, kind: str, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
) -> tuple[Run, list[Any]]:
    with engine_timers(llm) as times:
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        seconds = time.perf_counter() - start
    tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
    if not times.steps:
        return Run(kind, tokens, seconds, None, None), outputs
    grammar = None
    if times.masks:
        grammar = {
            "num_masks": len(times.masks),
            "mask_seconds": sum(times.masks),
            "accept_seconds": sum(times.accepts),
            "apply_seconds": sum(times.applies),
            "applied_rows": times.applied_rows,
        }
    return Run(kind, tokens, seconds, len(times.steps), sum(times.steps), grammar), outputs


def warm_up(llm: LLM, prompts: list[list[int]]) -> None:
    # First calls pay one-off costs (allocator growth, oneDNN kernels for new shapes, the
    # grammar tokenizer's build in the scheduler); keep them out of the timed runs.
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    llm.generate(prompts[:2], constrained_params(16))


def check_constrained(outputs: list[Any], checks: Checks) -> list[dict[str, Any]]:
    """Count JSON failures; returns one entry per failing output for the record."""
    failures = []
    for index, output in enumerate(outputs):
        completion = output.outputs[0]
        problem = json_problem(completion.text)
        if problem is None:
            continue
        if completion.finish_reason == "stop":
            checks.invalid_json_stopped += 1
        else:
            checks.invalid_json_length += 1
        failures.append(
            {
                "request": index,
                "subject": SUBJECTS[index],
                "finish_reason": completion.finish_reason,
                "problem": problem,
                "text_tail": completion.text[-120:],
            }
        )
    return failures


def alternate_runs(
    llm: LLM,
    prompts: list[list[int]],
    calibration: list[Any],
    args: argparse.Namespace,
    checks: Checks,
    label: str,
) -> list[Run]:
    """``args.repeats`` constrained and unconstrained runs, interleaved, order alternating."""
    expected = [list(output.outputs[0].token_ids) for output in calibration]
    lengths = [len(tokens) for tokens in expected]
    kinds = {
        "constrained": constrained_params(args.max_tokens),
        "unconstrained": unconstrained_params(lengths),
    }
    runs = []
    for repeat in range(args.repeats):
        order = ["constrained", "unconstrained"]
        if repeat % 2:
            order.reverse()
        for kind in order:
            run, outputs = timed_generate(llm, kind, prompts, kinds[kind])
            produced = [list(output.outputs[0].token_ids) for output in outputs]
            # Same tokens as the calibration: so the same JSON, checked once there.
            if kind == "constrained":
                checks.constrained_token_mismatches += sum(
                    p != e for p, e in zip(produced, expected)
                )
            else:
                checks.unconstrained_length_mismatches += sum(
                    len(p) != n for p, n in zip(produced, lengths)
                )
            _log(f"[{label}] repeat {repeat} {kind}: {run.tokens_per_s:.1f} tok/s")
            runs.append(run)
    return runs


def summarize(runs: list[Run]) -> dict[str, Any]:
    by_kind = {
        kind: [run for run in runs if run.kind == kind] for kind in ("constrained", "unconstrained")
    }
    medians = {
        kind: statistics.median(run.tokens_per_s for run in kind_runs)
        for kind, kind_runs in by_kind.items()
    }
    # Runs of one repeat sit next to each other in time: their ratio drifts least.
    paired = [
        c.tokens_per_s / u.tokens_per_s
        for c, u in zip(by_kind["constrained"], by_kind["unconstrained"])
    ]
    summary: dict[str, Any] = {
        "runs": [run.as_record() for run in runs],
        "median_constrained_tok_s": medians["constrained"],
        "median_unconstrained_tok_s": medians["unconstrained"],
        "ratio_constrained_over_unconstrained": medians["constrained"] / medians["unconstrained"],
        "paired_ratios": paired,
        "median_paired_ratio": statistics.median(paired),
    }
    for kind, kind_runs in by_kind.items():
        steps = [run.mean_step_ms for run in kind_runs if run.mean_step_ms is not None]
        summary[f"median_{kind}_step_ms"] = statistics.median(steps) if steps else None
        summary[f"{kind}_num_steps"] = sorted({run.num_steps for run in kind_runs})
    return summary


def benchmark_engine(
    args: argparse.Namespace, multiprocess: bool, calibration: list[Any] | None, checks: Checks
) -> tuple[LLM, list[list[int]], list[Any], Run | None, dict[str, Any]]:
    """Load, warm up, calibrate (unless given the calibration), then the alternating runs."""
    label = "multi-process" if multiprocess else "in-process"
    _log(f"[{label}] loading {args.dtype}")
    llm = LLM(
        dtype=args.dtype,
        max_num_seqs=max(SAMPLER_ROWS, args.num_requests),
        kv_cache_bytes=args.kv_cache_bytes,
        multiprocess=multiprocess,
    )
    prompts = build_prompts(llm, args.num_requests)
    warm_up(llm, prompts)
    calibration_run = None
    if calibration is None:
        calibration_run, calibration = timed_generate(
            llm, "constrained", prompts, constrained_params(args.max_tokens)
        )
        _log(
            f"[{label}] calibration: {calibration_run.output_tokens} tokens, "
            f"{calibration_run.tokens_per_s:.1f} tok/s"
        )
    else:
        # The multi-process engine's prefix cache gets the prompts the same way.
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1))
    runs = alternate_runs(llm, prompts, calibration, args, checks, label)
    summary = summarize(runs)
    stats = llm.stats()
    summary["num_preemptions"] = stats["num_preemptions"]
    return llm, prompts, calibration, calibration_run, summary


# ---------------------------------------------------------------------------- the breakdown


def replay_masks(
    vocabulary: GrammarVocabulary, calibration: list[Any], passes: int, checks: Checks
) -> tuple[dict[str, Any], list[bytes]]:
    """Time the scheduler's grammar work per sampled token by replaying the calibration
    outputs through fresh matchers. Returns the figures and one mask per request (taken
    halfway through its output) for the sampler timing."""
    params = StructuredOutputsParams(json=SCHEMA)
    structured = StructuredOutput(vocabulary)
    start = time.perf_counter()
    structured.new_matcher(params)
    first_matcher_s = time.perf_counter() - start
    token_lists = [list(output.outputs[0].token_ids) for output in calibration]
    pass_figures = []
    sample_masks: list[bytes] = []
    for replay in range(passes):
        mask_seconds: list[float] = []
        accept_seconds: list[float] = []
        build_seconds: list[float] = []
        for tokens, output in zip(token_lists, calibration):
            start = time.perf_counter()
            matcher = structured.new_matcher(params)
            build_seconds.append(time.perf_counter() - start)
            complete = False
            for position, token_id in enumerate(tokens):
                start = time.perf_counter()
                mask = matcher.allowed_token_bitmask()
                middle = time.perf_counter()
                accepted = matcher.accept(token_id)
                complete = matcher.is_finished  # the scheduler checks it after each accept
                end = time.perf_counter()
                mask_seconds.append(middle - start)
                accept_seconds.append(end - middle)
                if replay == 0 and position == len(tokens) // 2:
                    sample_masks.append(mask)
                if not accepted:
                    if replay == 0:
                        checks.replay_rejections += 1
                    break
            finished = output.outputs[0].finish_reason == "stop"
            if replay == 0 and finished and not complete:
                checks.replay_unfinished_stops += 1
        pass_figures.append(
            {
                "num_tokens": len(mask_seconds),
                "mask_us_mean": 1e6 * statistics.fmean(mask_seconds),
                "mask_us_median": 1e6 * statistics.median(mask_seconds),
                "mask_us_p99": 1e6 * float(np.percentile(mask_seconds, 99)),
                "mask_us_max": 1e6 * max(mask_seconds),
                "accept_us_mean": 1e6 * statistics.fmean(accept_seconds),
                "matcher_build_ms_median": 1e3 * statistics.median(build_seconds),
            }
        )
    # The pass of median total cost: one pass is ~1 s, easily hit by a neighbour's burst.
    totals = [p["mask_us_mean"] + p["accept_us_mean"] for p in pass_figures]
    median_pass = pass_figures[sorted(range(passes), key=totals.__getitem__)[passes // 2]]
    return {
        "first_matcher_s": first_matcher_s,
        "passes": pass_figures,
        **median_pass,
        "grammar_us_per_token": median_pass["mask_us_mean"] + median_pass["accept_us_mean"],
    }, sample_masks


def time_sampler_masks(masks: list[bytes], vocab_size: int) -> dict[str, Any]:
    """``apply_grammar_masks`` on [SAMPLER_ROWS, vocab] float32 logits, every row masked."""
    rows = [masks[index % len(masks)] for index in range(SAMPLER_ROWS)]
    bits = np.frombuffer(b"".join(rows), dtype=np.uint8).reshape(SAMPLER_ROWS, -1)
    empty_ids: list[np.ndarray] = []
    batch = SamplingBatch(
        temperatures=np.zeros(SAMPLER_ROWS, dtype=np.float32),
        top_k=np.zeros(SAMPLER_ROWS, dtype=np.int64),
        top_p=np.ones(SAMPLER_ROWS, dtype=np.float32),
        min_p=np.zeros(SAMPLER_ROWS, dtype=np.float32),
        seeds=np.zeros(SAMPLER_ROWS, dtype=np.uint64),
        output_positions=np.zeros(SAMPLER_ROWS, dtype=np.int64),
        num_logprobs=np.full(SAMPLER_ROWS, -1, dtype=np.int64),
        penalty_rows=np.empty(0, dtype=np.int64),
        repetition_penalties=np.empty(0, dtype=np.float32),
        presence_penalties=np.empty(0, dtype=np.float32),
        frequency_penalties=np.empty(0, dtype=np.float32),
        penalty_prompt_tokens=empty_ids,
        penalty_output_tokens=empty_ids,
        banned_rows=np.empty(0, dtype=np.int64),
        banned_token_ids=empty_ids,
        grammar_rows=np.arange(SAMPLER_ROWS, dtype=np.int64),
        allowed_token_bits=bits,
    )
    logits = torch.randn(SAMPLER_ROWS, vocab_size, dtype=torch.float32)
    seconds = _median_call_seconds(lambda: apply_grammar_masks(logits, batch))
    greedy_seconds = _median_call_seconds(lambda: logits.max(dim=-1).indices)
    return {
        "rows": SAMPLER_ROWS,
        "vocab_size": vocab_size,
        "apply_grammar_masks_ms": 1e3 * seconds,
        "apply_grammar_masks_us_per_row": 1e6 * seconds / SAMPLER_ROWS,
        # For scale: the greedy pick the sampler makes on the same logits afterwards.
        "greedy_max_ms": 1e3 * greedy_seconds,
    }


def _median_call_seconds(call: Callable[[], object]) -> float:
    for _ in range(3):
        call()
    durations = []
    for _ in range(SAMPLER_CALLS):
        start = time.perf_counter()
        call()
        durations.append(time.perf_counter() - start)
    return statistics.median(durations)


def breakdown(
    replay: dict[str, Any], sampler: dict[str, Any], in_process: dict[str, Any]
) -> dict[str, Any]:
    """The grammar's cost per step, against the engine's mean step in this run: as the
    isolated timings (replay, sampler call on 64 rows) predict it, and as the in-process
    engine spent it (``engine_timers``, the median over the constrained runs)."""
    constrained_runs = [run for run in in_process["runs"] if run["kind"] == "constrained"]
    tokens = constrained_runs[0]["output_tokens"]
    steps = statistics.median(run["num_steps"] for run in constrained_runs)
    tokens_per_step = tokens / steps
    constrained_ms = in_process["median_constrained_step_ms"]
    unconstrained_ms = in_process["median_unconstrained_step_ms"]

    def parts(scheduler_ms: float, sampler_ms: float) -> dict[str, float]:
        return {
            "scheduler_grammar_ms_per_step": scheduler_ms,
            "sampler_masks_ms_per_step": sampler_ms,
            "fraction_of_constrained_step": (scheduler_ms + sampler_ms) / constrained_ms,
            # The throughput ratio these predict if they were all a constrained step adds.
            "predicted_ratio": unconstrained_ms / (unconstrained_ms + scheduler_ms + sampler_ms),
        }

    def in_engine(figure: Callable[[dict[str, float], int], float]) -> float:
        return statistics.median(
            figure(run["grammar"], run["num_steps"]) for run in constrained_runs
        )

    return {
        "sampled_tokens_per_step": tokens_per_step,
        "median_constrained_step_ms": constrained_ms,
        "median_unconstrained_step_ms": unconstrained_ms,
        "measured_step_difference_ms": constrained_ms - unconstrained_ms,
        "isolated": parts(
            tokens_per_step * replay["grammar_us_per_token"] / 1e3,
            tokens_per_step * sampler["apply_grammar_masks_us_per_row"] / 1e3,
        ),
        "in_engine": {
            **parts(
                in_engine(lambda g, n: 1e3 * (g["mask_seconds"] + g["accept_seconds"]) / n),
                in_engine(lambda g, n: 1e3 * g["apply_seconds"] / n),
            ),
            "mask_us_mean": in_engine(lambda g, n: 1e6 * g["mask_seconds"] / g["num_masks"]),
            "accept_us_mean": in_engine(lambda g, n: 1e6 * g["accept_seconds"] / g["num_masks"]),
            "apply_us_per_row": in_engine(
                lambda g, n: 1e6 * g["apply_seconds"] / g["applied_rows"]
            ),
        },
    }


# ---------------------------------------------------------------------------- the run


def machine_info() -> dict[str, Any]:
    return {
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "llguidance_version": metadata.version("llguidance"),
        "python_version": platform.python_version(),
        # Other processes on the cores slow both kinds of run; a 1-minute load above
        # cpu_count means the figures are low, the ratio less so.
        "load_average": list(os.getloadavg()),
    }


def format_report(record: dict[str, Any]) -> str:
    lines = []
    for label in ("in_process", "multiprocess"):
        summary = record[label]
        if summary is None:
            continue
        lines.append(f"{label}:")
        lines.append(f"  {'run':>3}  {'kind':<13}  {'tokens':>6}  {'s':>7}  {'tok/s':>7}  step ms")
        for index, run in enumerate(summary["runs"]):
            step = "-" if run["mean_step_ms"] is None else f"{run['mean_step_ms']:.1f}"
            lines.append(
                f"  {index:>3}  {run['kind']:<13}  {run['output_tokens']:>6}  "
                f"{run['seconds']:>7.2f}  {run['tokens_per_s']:>7.1f}  {step}"
            )
        lines.append(
            f"  median tok/s: constrained {summary['median_constrained_tok_s']:.1f}, "
            f"unconstrained {summary['median_unconstrained_tok_s']:.1f}, ratio "
            f"{summary['ratio_constrained_over_unconstrained']:.3f} (paired median "
            f"{summary['median_paired_ratio']:.3f})"
        )
    replay, sampler, parts = record["replay"], record["sampler"], record["breakdown"]
    lines += [
        f"grammar tokenizer + first matcher: {replay['first_matcher_s']:.2f} s; a matcher per "
        f"request: {replay['matcher_build_ms_median']:.2f} ms",
        f"per sampled token: mask {replay['mask_us_mean']:.1f} us mean "
        f"({replay['mask_us_median']:.1f} median, {replay['mask_us_p99']:.0f} p99), accept "
        f"{replay['accept_us_mean']:.1f} us",
        f"sampler apply_grammar_masks [{sampler['rows']}, {sampler['vocab_size']}]: "
        f"{sampler['apply_grammar_masks_ms']:.2f} ms "
        f"({sampler['apply_grammar_masks_us_per_row']:.1f} us/row; greedy max "
        f"{sampler['greedy_max_ms']:.2f} ms)",
        f"per step ({parts['sampled_tokens_per_step']:.1f} sampled tokens; step "
        f"{parts['median_constrained_step_ms']:.1f} ms constrained vs "
        f"{parts['median_unconstrained_step_ms']:.1f} ms unconstrained):",
    ]
    engine = parts["in_engine"]
    lines.append(
        f"  in the engine: mask {engine['mask_us_mean']:.1f} us/token, accept "
        f"{engine['accept_us_mean']:.1f} us/token, sampler {engine['apply_us_per_row']:.1f} us/row"
    )
    for label in ("isolated", "in_engine"):
        part = parts[label]
        lines.append(
            f"  {label}: scheduler grammar {part['scheduler_grammar_ms_per_step']:.2f} ms, "
            f"sampler masks {part['sampler_masks_ms_per_step']:.2f} ms, "
            f"{part['fraction_of_constrained_step']:.1%} of a step, ratio they predict "
            f"{part['predicted_ratio']:.3f}"
        )
    counts = {key: value for key, value in record["checks"].items() if key != "json_failures"}
    lines.append(f"checks: {counts}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="weights and KV cache")
    parser.add_argument(
        "--num-requests", type=int, default=32, help=f"requests (at most {len(SUBJECTS)})"
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each kind")
    parser.add_argument(
        "--max-tokens", type=int, default=256, help="cap on each constrained output"
    )
    parser.add_argument(
        "--multiprocess",
        action="store_true",
        help="also run everything through LLM(multiprocess=True), the server's shape",
    )
    parser.add_argument("--replay-passes", type=int, default=3, help="mask replays (median)")
    parser.add_argument("--kv-cache-bytes", type=int, default=4 << 30, help="KV cache cap")
    parser.add_argument("--json", type=Path, default=None, help="write the record here")
    args = parser.parse_args(argv)
    if not 1 <= args.num_requests <= len(SUBJECTS):
        parser.error(f"--num-requests must be in [1, {len(SUBJECTS)}], got {args.num_requests}")
    for name in ("repeats", "max_tokens", "replay_passes", "kv_cache_bytes"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_before = list(os.getloadavg())
    checks = Checks()
    llm, _, calibration, calibration_run, in_process = benchmark_engine(args, False, None, checks)
    assert calibration_run is not None
    failures = check_constrained(calibration, checks)
    vocabulary = llm.grammar_vocabulary
    assert vocabulary is not None, "the embedded model has a tokenizer"
    _log("replaying the calibration outputs' masks")
    replay, masks = replay_masks(vocabulary, calibration, args.replay_passes, checks)
    sampler = time_sampler_masks(masks, vocabulary.vocab_size)
    finish_reasons = [output.outputs[0].finish_reason for output in calibration]
    lengths = [len(output.outputs[0].token_ids) for output in calibration]
    del llm
    gc.collect()
    multiprocess = None
    if args.multiprocess:
        split, _, _, _, multiprocess = benchmark_engine(args, True, calibration, checks)
        split.shutdown()
    record = {
        "command": shlex.join(sys.orig_argv),
        "settings": {
            "dtype": args.dtype,
            "num_requests": args.num_requests,
            "repeats": args.repeats,
            "max_tokens": args.max_tokens,
            "replay_passes": args.replay_passes,
            "kv_cache_bytes": args.kv_cache_bytes,
            "max_num_seqs": max(SAMPLER_ROWS, args.num_requests),
            "sampling": "greedy",
            "prompt": PROMPT,
            "schema": SCHEMA,
        },
        "outputs": {
            "total_tokens": sum(lengths),
            "mean_tokens": statistics.fmean(lengths),
            "min_tokens": min(lengths),
            "max_tokens": max(lengths),
            "finish_reasons": {r: finish_reasons.count(r) for r in sorted(set(finish_reasons))},
            "per_request_tokens": lengths,
            "calibration_run": calibration_run.as_record(),
            "example": calibration[0].outputs[0].text,
        },
        "in_process": in_process,
        "multiprocess": multiprocess,
        "replay": replay,
        "sampler": sampler,
        "breakdown": breakdown(replay, sampler, in_process),
        "checks": {**asdict(checks), "valid": checks.valid, "json_failures": failures},
        "machine": {**machine_info(), "load_average_before": load_before},
    }
    print(format_report(record))
    if record["machine"]["load_average"][0] > (os.cpu_count() or 1):
        print("NOTE: other processes compete for the cores: absolute figures are low")
    if args.json is not None:
        args.json.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.json}")
    if not checks.valid:
        print("INVALID: see checks", file=sys.stderr)
        return 1
    return 0


def _log(message: str) -> None:
    print(f"bench_structured_output: {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
