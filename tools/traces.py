"""Synthetic offline request traces with the length statistics of the vLLM paper's datasets.

Each request is a prompt of random token ids and a fixed output length (generated with EOS
ignored). Lengths are drawn lognormal, then capped so that prompt + output <= max_len:

    trace      mean input   mean output   (tokens)
    sharegpt     161.31       337.99
    alpaca        19.31        58.45

Capping trims the long tail, so the lognormal's location is calibrated (on a large fixed
sample) for the capped lengths to keep the paper's means; a trace of a few hundred requests
still differs from them by sampling noise, which `TraceStats` shows.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

# Spread of ln(length); the paper gives means only. 0.8 keeps a long ShareGPT tail while
# under a tenth of its requests reach the 1024-token cap.
LOGNORMAL_SIGMA = 0.8
# Size and seed of the sample the lognormal locations are calibrated on; fixed so that the
# location depends only on the trace and the cap, never on the trace's own seed.
CALIBRATION_SAMPLES = 20_000
CALIBRATION_SEED = 20_231_016


@dataclass(frozen=True)
class TraceShape:
    """The paper's mean input and output lengths (tokens) for one dataset."""

    mean_input_len: float
    mean_output_len: float


TRACE_SHAPES: dict[str, TraceShape] = {
    "sharegpt": TraceShape(mean_input_len=161.31, mean_output_len=337.99),
    "alpaca": TraceShape(mean_input_len=19.31, mean_output_len=58.45),
}


@dataclass(frozen=True)
class Request:
    """One offline request: its prompt and how many tokens it must generate."""

    prompt_token_ids: list[int]
    output_len: int


@dataclass(frozen=True)
class TraceStats:
    """Realised lengths of a trace, after capping."""

    num_requests: int
    mean_input_len: float
    mean_output_len: float
    max_total_len: int
    total_output_tokens: int


def make_trace(
    name: str,
    num_requests: int,
    seed: int,
    max_len: int,
    vocab_size: int,
    first_token_id: int = 3,
    length_scale: float = 1.0,
) -> list[Request]:
    """Draw `num_requests` requests of the `name` trace; the same arguments give the same trace.

    `length_scale` multiplies both mean lengths (with `max_len` scaled alike, the trace keeps
    its shape at a fraction of the cost: reproduce_paper.py's latency sweep uses 1/4).

    Every length is >= 1 and every prompt + output <= `max_len`: the prompt keeps at most
    `max_len - 1` tokens and the output is cut to what is left. Token ids are uniform in
    [`first_token_id`, `vocab_size`), so special tokens below `first_token_id` never appear.
    """
    if name not in TRACE_SHAPES:
        raise ValueError(f"trace={name!r} is unknown; allowed: {sorted(TRACE_SHAPES)}")
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if max_len < 2:
        raise ValueError(f"max_len must be >= 2 (one prompt and one output token), got {max_len}")
    if not 0 <= first_token_id < vocab_size:
        raise ValueError(f"first_token_id={first_token_id} is outside [0, {vocab_size})")
    if not length_scale > 0:
        raise ValueError(f"length_scale must be > 0, got {length_scale}")
    shape = TRACE_SHAPES[name]
    if length_scale != 1.0:
        shape = TraceShape(
            shape.mean_input_len * length_scale, shape.mean_output_len * length_scale
        )
    input_mu, output_mu = _calibrated_locations(shape, max_len)
    rng = np.random.default_rng(seed)
    input_lens = _lengths(input_mu, rng.standard_normal(num_requests), max_len - 1)
    output_lens = _lengths(output_mu, rng.standard_normal(num_requests), max_len - input_lens)
    requests = []
    for input_len, output_len in zip(input_lens.tolist(), output_lens.tolist()):
        prompt = rng.integers(first_token_id, vocab_size, size=input_len).tolist()
        requests.append(Request(prompt_token_ids=prompt, output_len=output_len))
    return requests


def trace_stats(requests: list[Request]) -> TraceStats:
    input_lens = [len(request.prompt_token_ids) for request in requests]
    output_lens = [request.output_len for request in requests]
    return TraceStats(
        num_requests=len(requests),
        mean_input_len=sum(input_lens) / len(requests),
        mean_output_len=sum(output_lens) / len(requests),
        max_total_len=max(i + o for i, o in zip(input_lens, output_lens)),
        total_output_tokens=sum(output_lens),
    )


def _lengths(mu: float, normals: np.ndarray, cap: int | np.ndarray) -> np.ndarray:
    lengths = np.rint(np.exp(mu + LOGNORMAL_SIGMA * normals)).astype(np.int64)
    return np.minimum(np.maximum(lengths, 1), cap)


@functools.cache
def _calibrated_locations(shape: TraceShape, max_len: int) -> tuple[float, float]:
    """The mu of ln(input length) and ln(output length) whose capped lengths have the shape's
    means; the output cap is what its prompt leaves of max_len, as in make_trace."""
    rng = np.random.default_rng(CALIBRATION_SEED)
    input_normals = rng.standard_normal(CALIBRATION_SAMPLES)
    output_normals = rng.standard_normal(CALIBRATION_SAMPLES)
    input_mu = _solve_location(shape.mean_input_len, input_normals, max_len - 1)
    input_lens = _lengths(input_mu, input_normals, max_len - 1)
    output_mu = _solve_location(shape.mean_output_len, output_normals, max_len - input_lens)
    return input_mu, output_mu


def _solve_location(mean: float, normals: np.ndarray, cap: int | np.ndarray) -> float:
    # The capped mean grows with mu, so bisect; start around the uncapped answer,
    # E[exp(N(mu, sigma^2))] = exp(mu + sigma^2 / 2). A mean above the cap ends at the top.
    low = math.log(mean) - LOGNORMAL_SIGMA**2 / 2 - 1.0
    high = low + 4.0
    for _ in range(50):
        middle = (low + high) / 2
        if _lengths(middle, normals, cap).mean() < mean:
            low = middle
        else:
            high = middle
    return (low + high) / 2
