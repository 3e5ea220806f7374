"""Every registered architecture against HF transformers, token for token (float32 greedy):
a tiny random model of its config (``PARITY_CONFIGS``), prompts of one token, part of a
block, past a window and several blocks, at two block sizes. What one architecture does
differently (windows, experts, RoPE layouts, checkpoint names, tensor parallelism, chunked
prefill, LoRA) is checked in its family's module, on the same model."""

from __future__ import annotations

import pytest

from helpers.family_configs import PARITY_CONFIGS
from helpers.tiny_family import GREEDY, prompts, token_ids
from pagedserve.frontend import LLM
from pagedserve.gpu_worker.models.registry import SUPPORTED_ARCHITECTURES


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("architecture", sorted(PARITY_CONFIGS))
def test_architecture_matches_hf(family_models, architecture, block_size):
    config = PARITY_CONFIGS[architecture]
    llm = LLM(family_models.model_dir(config), block_size=block_size, num_blocks=256)
    assert llm.model_config.architecture == architecture
    assert token_ids(llm.generate(prompts(), GREEDY)) == family_models.reference(config)


def test_every_registered_architecture_is_in_the_matrix():
    missing = sorted(set(SUPPORTED_ARCHITECTURES) - set(PARITY_CONFIGS))
    assert not missing, f"add a tiny config to PARITY_CONFIGS for {missing}"
    unknown = sorted(set(PARITY_CONFIGS) - set(SUPPORTED_ARCHITECTURES))
    assert not unknown, f"PARITY_CONFIGS names architectures the registry lacks: {unknown}"
