"""Turns the logits of a step into one token per sampling request, batch-invariantly."""

from __future__ import annotations

import numpy as np
import torch

_GOLDEN_GAMMA = np.uint64(0x9E3779B97F4A7C15)


def _splitmix64(values: np.ndarray) -> np.ndarray:
    """A well-mixed 64-bit hash (uint64 arithmetic wraps, which the mixing relies on)."""
    z = values + _GOLDEN_GAMMA
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def request_uniforms(seeds: np.ndarray, output_positions: np.ndarray) -> np.ndarray:
    """One uniform in [0, 1) per row, a pure function of (seed, output position).

    Because a draw depends only on the request's own seed and how many tokens it has
    generated, the same seed yields the same tokens whatever else shares the batch and
    however often the request was preempted and recomputed.
    """
    mixed = _splitmix64(_splitmix64(seeds.astype(np.uint64)) ^ output_positions.astype(np.uint64))
    return (mixed >> np.uint64(11)).astype(np.float64) / float(1 << 53)


class Sampler:
    """Greedy rows take the argmax; other rows sample from softmax(logits / T) by
    inverse CDF with the row's own uniform. Vectorized over the batch."""

    def __call__(
        self,
        logits: torch.Tensor,
        temperatures: np.ndarray,
        seeds: np.ndarray,
        output_positions: np.ndarray,
    ) -> torch.Tensor:
        """``logits`` float32 [rows, vocab]; ``temperatures`` float32, ``seeds`` uint64 and
        ``output_positions`` int64, each [rows]. Returns int64 token ids [rows]."""
        tokens = logits.argmax(dim=-1)
        random_rows = np.flatnonzero(temperatures > 0)
        if random_rows.size == 0:
            return tokens
        rows = torch.from_numpy(random_rows)
        temperature = torch.from_numpy(temperatures[random_rows].astype(np.float32))
        probs = torch.softmax(logits[rows] / temperature[:, None], dim=-1)
        cdf = probs.cumsum(dim=-1)
        uniforms = request_uniforms(seeds[random_rows], output_positions[random_rows])
        # Scale by the row total so float32 rounding in the cumsum cannot push the
        # target past the last bucket.
        targets = torch.from_numpy(uniforms).to(cdf.dtype) * cdf[:, -1]
        sampled = torch.searchsorted(cdf, targets[:, None], right=True).squeeze(1)
        tokens[rows] = sampled.clamp_max(logits.shape[-1] - 1)
        return tokens
