"""The sampler where the logits are: on a GPU it draws the tokens the host draws from the same
logits, for every setting it takes (the model runner keeps plain batches on the device since
issue 36; the others it still samples on the host). Skipped without a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers.sampler_batches import fixed_logits, make_batch
from pagedserve.gpu_worker.sampler import Sampler

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no CUDA GPU (torch.cuda.is_available() is False)"
    ),
]

ROWS = 6
BATCHES = {
    "greedy": {},
    "temperature": {"temperatures": [0.7] * ROWS},
    "top_k_top_p_min_p": {
        "temperatures": [1.0] * ROWS,
        "top_k": [0, 5, 0, 3, 10, 0],
        "top_p": [1.0, 1.0, 0.8, 0.9, 1.0, 0.5],
        "min_p": [0.0, 0.0, 0.0, 0.1, 0.05, 0.0],
        "output_positions": [0, 3, 7, 1, 2, 9],
    },
    "logprobs": {"temperatures": [0.0, 1.0] * 3, "num_logprobs": [2, -1, 0, 3, -1, 1]},
    "penalties_bans_bias_allowed": {
        "temperatures": [0.0, 0.8] * 3,
        "penalty_rows": [0, 3],
        "repetition_penalties": [1.3, 1.1],
        "presence_penalties": [0.5, 0.0],
        "frequency_penalties": [0.2, 0.4],
        "penalty_prompt_tokens": [np.array([1, 2, 3]), np.array([4])],
        "penalty_output_tokens": [np.array([5, 5]), np.array([6, 7])],
        "banned_rows": [1],
        "banned_token_ids": [np.array([0, 1, 2])],
        "bias_rows": [2],
        "bias_token_ids": [np.array([9])],
        "bias_values": [np.array([5.0], dtype=np.float32)],
        "allowed_rows": [4],
        "allowed_token_ids": [np.array([10, 20, 30])],
    },
}


@pytest.mark.parametrize("name", sorted(BATCHES))
def test_the_gpu_draws_the_hosts_tokens(name):
    logits = fixed_logits(ROWS, seed=3)
    host = Sampler()(logits.clone(), make_batch(ROWS, **BATCHES[name]))
    device = Sampler()(logits.clone().cuda(), make_batch(ROWS, **BATCHES[name]))
    assert device.token_ids.device.type == "cuda"
    assert device.token_ids.cpu().tolist() == host.token_ids.tolist()
    if host.logprobs is not None:
        assert device.logprob_token_ids.cpu().tolist() == host.logprob_token_ids.tolist()
        torch.testing.assert_close(device.logprobs.cpu(), host.logprobs, rtol=1e-5, atol=1e-5)
