"""Sampler inputs for the tests: a batch of per-row settings with defaults that turn every
feature off, and fixed random logits."""

from __future__ import annotations

import numpy as np
import torch

from pagedserve.gpu_worker.sampler import SamplingBatch

VOCAB = 64


def make_batch(rows: int, **overrides) -> SamplingBatch:
    fields = dict(
        temperatures=np.zeros(rows, np.float32),
        top_k=np.zeros(rows, np.int64),
        top_p=np.ones(rows, np.float32),
        min_p=np.zeros(rows, np.float32),
        seeds=np.arange(rows, dtype=np.uint64) + 11,
        output_positions=np.zeros(rows, np.int64),
        num_logprobs=np.full(rows, -1, np.int64),
        penalty_rows=np.zeros(0, np.int64),
        repetition_penalties=np.zeros(0, np.float32),
        presence_penalties=np.zeros(0, np.float32),
        frequency_penalties=np.zeros(0, np.float32),
        penalty_prompt_tokens=[],
        penalty_output_tokens=[],
        banned_rows=np.zeros(0, np.int64),
        banned_token_ids=[],
        bias_rows=np.zeros(0, np.int64),
        bias_token_ids=[],
        bias_values=[],
        allowed_rows=np.zeros(0, np.int64),
        allowed_token_ids=[],
        grammar_rows=np.zeros(0, np.int64),
        allowed_token_bits=np.zeros((0, 0), np.uint8),
    )
    for name, value in overrides.items():
        fields[name] = (
            np.asarray(value, dtype=fields[name].dtype)
            if name in fields and isinstance(fields[name], np.ndarray)
            else value
        )
    return SamplingBatch(**fields)


def fixed_logits(rows: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=generator) * 3
