"""Turns the logits of a step into one token per sampling request, batch-invariantly.

Every operation works on whole tensors of rows; the only Python loops are over the
(few) rows that use penalties, to gather their token histories. It runs where the logits
are: the per-row settings (small host arrays) are copied there, so on a GPU the step's
tokens are drawn without the host waiting for the forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

_GOLDEN_GAMMA = np.uint64(0x9E3779B97F4A7C15)


def _splitmix64(values: np.ndarray) -> np.ndarray:
    """A well-mixed 64-bit hash (uint64 arithmetic wraps, which the mixing relies on)."""
    z = values + _GOLDEN_GAMMA
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _on(array: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    """A host array as a tensor on ``like``'s device."""
    return torch.from_numpy(array).to(like.device)


def request_uniforms(seeds: np.ndarray, output_positions: np.ndarray) -> np.ndarray:
    """One uniform in [0, 1) per row, a pure function of (seed, output position).

    Because a draw depends only on the request's own seed and how many tokens it has
    generated, the same seed yields the same tokens whatever else shares the batch and
    however often the request was preempted and recomputed.
    """
    mixed = _splitmix64(_splitmix64(seeds.astype(np.uint64)) ^ output_positions.astype(np.uint64))
    return (mixed >> np.uint64(11)).astype(np.float64) / float(1 << 53)


@dataclass
class SamplingBatch:
    """Per-row sampling settings, one entry per row of the logits."""

    temperatures: np.ndarray  # float32 [rows]; 0 = greedy
    top_k: np.ndarray  # int64 [rows]; 0 = off
    top_p: np.ndarray  # float32 [rows]; 1 = off
    min_p: np.ndarray  # float32 [rows]; 0 = off
    seeds: np.ndarray  # uint64 [rows]
    output_positions: np.ndarray  # int64 [rows]: tokens generated so far
    num_logprobs: np.ndarray  # int64 [rows]; -1 = none
    # Rows with penalties, and the token history each one needs.
    penalty_rows: np.ndarray  # int64 [p]
    repetition_penalties: np.ndarray  # float32 [p]
    presence_penalties: np.ndarray  # float32 [p]
    frequency_penalties: np.ndarray  # float32 [p]
    penalty_prompt_tokens: list[np.ndarray]  # p arrays of prompt token ids
    penalty_output_tokens: list[np.ndarray]  # p arrays of generated token ids
    # Rows with tokens they may not pick now, and those ids: stop tokens and EOS short of
    # min_tokens, and tokens that would complete a bad word.
    banned_rows: np.ndarray  # int64 [b]
    banned_token_ids: list[np.ndarray]  # b arrays
    # Rows with a logit_bias: the token ids and the bias added to each.
    bias_rows: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    bias_token_ids: list[np.ndarray] = field(default_factory=list)  # int64 arrays
    bias_values: list[np.ndarray] = field(default_factory=list)  # float32 arrays
    # Rows of beam-search requests: their candidates are ranked by log-probs the settings
    # above process (HF's beam search), not by the raw distribution's.
    beam_rows: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    # Rows with allowed_token_ids, and those ids.
    allowed_rows: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    allowed_token_ids: list[np.ndarray] = field(default_factory=list)  # int64 arrays
    # Rows under a grammar (structured output), and the tokens each may pick: bit t of
    # row i's little-endian bytes set when token t is allowed (StepPlan.token_bitmasks).
    grammar_rows: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    allowed_token_bits: np.ndarray = field(  # uint8 [g, ceil(vocab / 32) * 4]
        default_factory=lambda: np.empty((0, 0), dtype=np.uint8)
    )


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # int64 [rows]
    # [rows, 1 + max k]: the chosen token first, then the top-k, of the raw distribution (a
    # beam row's: of the processed log-probs, which its search ranks by);
    # None when no row asked for logprobs.
    logprob_token_ids: torch.Tensor | None
    logprobs: torch.Tensor | None


class Sampler:
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """``logits`` float32 [rows, vocab] (raw model output; modified in place)."""
        raw_logprobs = None
        if (batch.num_logprobs >= 0).any():
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        beam_rows = _on(batch.beam_rows, logits) if batch.beam_rows.size else None
        if beam_rows is not None:
            # As HF's beam search: penalties, biases and bans act on the log-probs, and the
            # beams rank (and score) their candidates by what those make of them.
            logits[beam_rows] = raw_logprobs[beam_rows]
        # vLLM's order (HF's too, where it has the processor): what may be picked at all,
        # then logit_bias, then the penalties (a bias moves a token the penalty then scales).
        if batch.allowed_rows.size:
            keep_only_allowed_tokens(logits, batch)
        if batch.grammar_rows.size:
            apply_grammar_masks(logits, batch)
        if batch.banned_rows.size:
            ban_tokens(logits, batch)
        if batch.bias_rows.size:
            rows, columns = _flatten_rows(batch.bias_rows, batch.bias_token_ids, logits)
            logits[rows, columns] += _on(np.concatenate(batch.bias_values), logits)
        if batch.penalty_rows.size:
            apply_penalties(logits, batch)
        if beam_rows is not None:
            raw_logprobs[beam_rows] = logits[beam_rows]

        # NOTE: max(dim).indices, not argmax: the same first-maximum index (NaN included),
        # measured 1.75x faster on CPU for [64, 49152] float32 (~1 ms a decode step).
        token_ids = logits.max(dim=-1).indices
        random_rows = np.flatnonzero(batch.temperatures > 0)
        if random_rows.size:
            token_ids[_on(random_rows, logits)] = sample_rows(logits, batch, random_rows)

        if raw_logprobs is None:
            return SamplerOutput(token_ids, None, None)
        top_k = min(int(batch.num_logprobs.max()), logits.shape[-1])
        chosen = raw_logprobs.gather(1, token_ids[:, None])
        top_values, top_ids = raw_logprobs.topk(top_k, dim=-1)
        return SamplerOutput(
            token_ids,
            torch.cat((token_ids[:, None], top_ids), dim=1),
            torch.cat((chosen, top_values), dim=1),
        )


def _flatten_rows(
    rows: np.ndarray, token_ids: list[np.ndarray], like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) index pairs of per-row token lists, for one advanced-indexing op, on
    ``like``'s device."""
    repeated = np.repeat(rows, [ids.size for ids in token_ids])
    return _on(repeated, like), _on(np.concatenate(token_ids), like)


def keep_only_allowed_tokens(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """Every token outside a row's allowed_token_ids gets -inf. In place."""
    local_rows, columns = _flatten_rows(
        np.arange(batch.allowed_rows.size), batch.allowed_token_ids, logits
    )
    allowed = torch.zeros(
        batch.allowed_rows.size, logits.shape[1], dtype=torch.bool, device=logits.device
    )
    allowed[local_rows, columns] = True
    rows = _on(batch.allowed_rows, logits)
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def apply_grammar_masks(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """Every token a row's grammar does not allow gets -inf. In place."""
    vocab_size = logits.shape[1]
    bits = np.unpackbits(batch.allowed_token_bits, axis=1, bitorder="little")[:, :vocab_size]
    disallowed = _on(bits, logits) == 0
    if batch.grammar_rows.size == logits.shape[0]:  # rows are unique: every row, in order
        logits.masked_fill_(disallowed, float("-inf"))
        return
    # NOTE: a Python loop per constrained row (not per token): in place on each row's view,
    # about twice as fast as gathering the rows, masking a copy and scattering it back.
    for index, row in enumerate(batch.grammar_rows.tolist()):
        logits[row].masked_fill_(disallowed[index], float("-inf"))


def ban_tokens(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """Each banned row's banned tokens (EOS and stop tokens short of min_tokens, bad words'
    last tokens) get -inf. In place.

    Where a grammar (or allowed_token_ids) allows nothing but those tokens, the grammar
    wins: that row keeps them, since a row with no token left could only pick one outside
    what it allows."""
    rows, columns = _flatten_rows(batch.banned_rows, batch.banned_token_ids, logits)
    kept = logits[rows, columns]
    logits[rows, columns] = float("-inf")
    if batch.grammar_rows.size or batch.allowed_rows.size:
        banned_rows = _on(batch.banned_rows, logits)
        emptied = torch.isneginf(logits[banned_rows]).all(dim=-1)
        if emptied.any():
            restore = emptied[torch.searchsorted(banned_rows, rows)]
            logits[rows[restore], columns[restore]] = kept[restore]


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """HF-style repetition penalty over prompt and output tokens; OpenAI-style presence
    and frequency penalties over output tokens. In place on the penalty rows."""
    vocab_size = logits.shape[1]
    num_rows = batch.penalty_rows.size
    rows = _on(batch.penalty_rows, logits)
    output_counts = torch.zeros(num_rows, vocab_size, dtype=torch.float32, device=logits.device)
    _scatter_rows(output_counts, batch.penalty_output_tokens, 1.0, accumulate=True)
    seen = torch.zeros_like(output_counts)
    _scatter_rows(seen, batch.penalty_prompt_tokens, 1.0, accumulate=False)
    seen = (seen > 0) | (output_counts > 0)

    selected = logits[rows]
    repetition = _on(batch.repetition_penalties, logits)[:, None]
    penalized = torch.where(selected > 0, selected / repetition, selected * repetition)
    selected = torch.where(seen, penalized, selected)
    frequency = _on(batch.frequency_penalties, logits)[:, None]
    presence = _on(batch.presence_penalties, logits)[:, None]
    selected = selected - frequency * output_counts - presence * (output_counts > 0).float()
    logits[rows] = selected


def _scatter_rows(
    target: torch.Tensor, token_lists: list[np.ndarray], value: float, accumulate: bool
) -> None:
    lengths = [tokens.size for tokens in token_lists]
    if not sum(lengths):
        return
    rows = _on(np.repeat(np.arange(len(token_lists)), lengths), target)
    columns = _on(np.concatenate(token_lists).astype(np.int64), target)
    values = torch.full((rows.numel(),), value, dtype=target.dtype, device=target.device)
    target.index_put_((rows, columns), values, accumulate=accumulate)


def sample_rows(logits: torch.Tensor, batch: SamplingBatch, rows: np.ndarray) -> torch.Tensor:
    """Draw one token for each of ``rows`` from softmax(logits / T) after top-k, top-p and
    min-p, by inverse CDF with the row's own uniform.

    Rows with top-k or top-p work in descending-probability order (one sort); others in
    vocabulary order. Which path a row takes depends only on its own settings.
    """
    result = torch.empty(rows.size, dtype=torch.int64, device=logits.device)
    needs_sort = (batch.top_k[rows] > 0) | (batch.top_p[rows] < 1.0)
    for sorted_path in (False, True):
        subset = np.flatnonzero(needs_sort == sorted_path)
        if subset.size:
            picked = rows[subset]
            draw = _sample_sorted if sorted_path else _sample_unsorted
            result[_on(subset, logits)] = draw(logits, batch, picked)
    return result


def _scaled(logits: torch.Tensor, batch: SamplingBatch, rows: np.ndarray) -> torch.Tensor:
    temperature = _on(batch.temperatures[rows].astype(np.float32), logits)
    return logits[_on(rows, logits)] / temperature[:, None]


def _draw(probs: torch.Tensor, batch: SamplingBatch, rows: np.ndarray) -> torch.Tensor:
    """Inverse-CDF draw per row; ``probs`` need not be normalized."""
    cdf = probs.cumsum(dim=-1)
    uniforms = request_uniforms(batch.seeds[rows], batch.output_positions[rows])
    # Scaled by the row total, so float32 rounding in the cumsum cannot push the target
    # past the last bucket, and masked (zero) buckets can never be hit.
    targets = _on(uniforms, cdf).to(cdf.dtype) * cdf[:, -1]
    picked = torch.searchsorted(cdf, targets[:, None], right=True).squeeze(1)
    return picked.clamp_max(probs.shape[-1] - 1)


def _min_p_mask(probs: torch.Tensor, batch: SamplingBatch, rows: np.ndarray) -> torch.Tensor:
    min_p = _on(batch.min_p[rows].astype(np.float32), probs)[:, None]
    return probs < min_p * probs.max(dim=-1, keepdim=True).values


def _sample_unsorted(logits: torch.Tensor, batch: SamplingBatch, rows: np.ndarray) -> torch.Tensor:
    probs = torch.softmax(_scaled(logits, batch, rows), dim=-1)
    if (batch.min_p[rows] > 0).any():
        probs = probs.masked_fill(_min_p_mask(probs, batch, rows), 0.0)
    return _draw(probs, batch, rows)


def _sample_sorted(logits: torch.Tensor, batch: SamplingBatch, rows: np.ndarray) -> torch.Tensor:
    values, order = _scaled(logits, batch, rows).sort(dim=-1, descending=True)
    vocab_size = values.shape[-1]
    top_k = _on(batch.top_k[rows], values)
    top_k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab_size))
    ranks = torch.arange(vocab_size, device=values.device)[None, :]
    values = values.masked_fill(ranks >= top_k[:, None], float("-inf"))
    probs = torch.softmax(values, dim=-1)
    # Nucleus: keep a token while the probability mass before it is below top_p, so
    # the most likely token always stays.
    top_p = _on(batch.top_p[rows].astype(np.float32), probs)[:, None]
    mass_before = probs.cumsum(dim=-1) - probs
    probs = probs.masked_fill(mass_before >= top_p, 0.0)
    if (batch.min_p[rows] > 0).any():
        probs = probs.masked_fill(_min_p_mask(probs, batch, rows), 0.0)
    picked = _draw(probs, batch, rows)
    return order.gather(1, picked[:, None]).squeeze(1)
