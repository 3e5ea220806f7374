"""The step's host arrays, built by array operations over the batch
(``attention._step_arrays``), equal a plain loop over its sequences."""

from __future__ import annotations

import random

import numpy as np

from pagedserve.gpu_worker.layers.attention import _step_arrays


def _by_loop(sequences, block_size):
    width = max(len(block_ids) for block_ids, _, _ in sequences)
    tables = np.zeros((len(sequences), width), dtype=np.int32)
    positions, slots, seq_lens, query_lens = [], [], [], []
    for row, (block_ids, start, num_tokens) in enumerate(sequences):
        tables[row, : len(block_ids)] = block_ids
        for position in range(start, start + num_tokens):
            positions.append(position)
            slots.append(block_ids[position // block_size] * block_size + position % block_size)
        seq_lens.append(start + num_tokens)
        query_lens.append(num_tokens)
    return tables, seq_lens, query_lens, positions, slots


def test_arrays_match_a_loop_over_random_batches():
    rng = random.Random(0)
    for block_size in (8, 16):
        for _ in range(50):
            sequences = []
            for _ in range(rng.randint(1, 40)):
                start = rng.randint(0, 300)
                num_tokens = 1 if rng.random() < 0.6 else rng.randint(1, 70)
                num_blocks = -(-(start + num_tokens) // block_size) + rng.randint(0, 2)
                block_ids = [rng.randint(0, 100_000) for _ in range(num_blocks)]
                sequences.append((block_ids, start, num_tokens))
            sequences.sort(key=lambda sequence: sequence[2] != 1)  # decodes first
            got = _step_arrays(sequences, block_size)
            expected = _by_loop(sequences, block_size)
            for name, array, values in zip(
                ("tables", "seq_lens", "query_lens", "positions", "slots"), got, expected
            ):
                np.testing.assert_array_equal(array, np.asarray(values), err_msg=name)
            assert got[0].dtype == got[1].dtype == got[2].dtype == np.int32
            assert got[3].dtype == got[4].dtype == np.int64
