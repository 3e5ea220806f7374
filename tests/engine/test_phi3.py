"""Microsoft's Phi-3 and Phi-4 (``Phi3ForCausalLM``): Llama with fused ``qkv_proj`` and
``gate_up_proj`` checkpoint tensors and a sliding window on every layer when the config
sets one. Greedy tokens identical to HF transformers (float32) across block sizes, with a
window the longer prompts pass, chunked prefill with prefix hits, and two tensor-parallel
ranks (each takes its heads and rows out of the fused tensors); what the ops cannot run
yet (Phi-3's longrope scaling, RoPE over part of each head) is refused by name at load.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from engine.test_parity import NEW_TOKENS, hf_greedy
from tiny_models import random_hf_model

from pagedserve.frontend import LLM, SamplingParams
from pagedserve.gpu_worker.model_config import ModelConfig

PROMPT_LENGTHS = [1, 17, 40, 100, 150]
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
# GQA (Phi-3-medium's and Phi-4's), an untied LM head, and a 32-token window (Phi-3-mini-4k's
# is 2047) that the longer prompts run past.
PHI3 = dict(
    architectures=["Phi3ForCausalLM"],
    hidden_size=256,
    intermediate_size=384,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=512,
    original_max_position_embeddings=512,
    rope_theta=10000.0,
    sliding_window=32,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def prompts(seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(512) for _ in range(n)] for n in PROMPT_LENGTHS]


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def rewritten(model_dir: Path, path: Path, **changes) -> Path:
    """A copy of ``model_dir`` whose config.json has ``changes`` (None: the field removed)."""
    shutil.copytree(model_dir, path)
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    for name, value in changes.items():
        if value is None:
            config.pop(name, None)
        else:
            config[name] = value
    config_file.write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return random_hf_model(PHI3, tmp_path_factory.mktemp("phi3"))


@pytest.fixture(scope="module")
def hf_reference(model_dir) -> list[list[int]]:
    return hf_greedy(model_dir, prompts())


@pytest.mark.parametrize("block_size", [8, 16])
def test_phi3_matches_hf(model_dir, hf_reference, block_size):
    llm = LLM(model_dir, block_size=block_size, num_blocks=256)
    assert llm.model_config.layer_sliding_windows == (32, 32)
    assert token_ids(llm.generate(prompts(), GREEDY)) == hf_reference


def test_the_window_changes_hf_s_tokens(model_dir, hf_reference, tmp_path):
    # Without it HF's own tokens differ: the parity test above tells an engine that
    # ignores the window from one that applies it.
    unwindowed = rewritten(model_dir, tmp_path / "unwindowed", sliding_window=None)
    assert hf_greedy(unwindowed, prompts()) != hf_reference
    llm = LLM(unwindowed, num_blocks=256)
    assert token_ids(llm.generate(prompts(), GREEDY)) == hf_greedy(unwindowed, prompts())


def test_chunked_prefill_and_prefix_caching_match_hf(model_dir, hf_reference):
    llm = LLM(
        model_dir,
        block_size=16,
        num_blocks=256,
        enable_chunked_prefill=True,
        max_num_batched_tokens=24,
        enable_prefix_caching=True,
    )
    first = llm.generate(prompts(), GREEDY)
    second = llm.generate(prompts(), GREEDY)
    assert token_ids(first) == token_ids(second) == hf_reference


def test_two_tensor_parallel_ranks_match_hf(model_dir, hf_reference):
    llm = LLM(model_dir, num_blocks=256, tensor_parallel_size=2)
    try:
        assert token_ids(llm.generate(prompts(), GREEDY)) == hf_reference
    finally:
        llm.shutdown()


# As transformers 5 saves Phi-3-mini-128k's (Phi-3.5-mini's, Phi-4-mini's) RoPE.
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "short_factor": [1.0] * 32,
    "long_factor": [2.0] * 32,
}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(rope_parameters=LONGROPE), "rope_type 'longrope' is not supported yet"),
        (
            dict(rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.75}),
            "partial_rotary_factor=0.75 is not supported yet",
        ),
        # As Phi-4-mini's config (transformers 4's style) says it.
        (
            dict(partial_rotary_factor=0.75, rope_parameters=None),
            "partial_rotary_factor=0.75 is not supported yet",
        ),
    ],
)
def test_what_the_ops_cannot_run_is_refused_by_name(model_dir, tmp_path, changes, message):
    changed = rewritten(model_dir, tmp_path / "changed", **changes)
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dir(changed)
    with pytest.raises(ValueError, match=message):
        LLM(changed, num_blocks=16)
