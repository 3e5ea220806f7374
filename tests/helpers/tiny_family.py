"""What the tests of one model family share (tests/engine/test_<family>.py): the prompts
(one token, part of a block, past a small window, past a 24-token chunking budget, several
blocks), greedy sampling of ``NEW_TOKENS``, a config rewritten in a copy of the model, and
the engine checked against HF's greedy tokens with chunked prefill and prefix hits, and on
two tensor-parallel ranks."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from helpers.parity import NEW_TOKENS
from pagedserve.frontend import LLM, SamplingParams

PROMPT_LENGTHS = [1, 17, 40, 100, 150]
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
# A tiny decoder's shape: GQA (4 query heads of 64, 2 KV heads), a 512-token vocabulary.
TINY_SHAPE = dict(
    hidden_size=256,
    intermediate_size=384,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=512,
)


def family_fixtures(config: dict):
    """A family test module's ``model_dir`` (a random HF model of ``config``) and
    ``hf_reference`` (HF's greedy tokens for ``prompts()`` on it) fixtures, built once a
    session and shared with the parity matrix (``family_models``):
    ``model_dir, hf_reference = family_fixtures(CONFIG)``."""

    @pytest.fixture(scope="module", name="model_dir")
    def model_dir_fixture(family_models) -> Path:
        return family_models.model_dir(config)

    @pytest.fixture(scope="module", name="hf_reference")
    def hf_reference_fixture(family_models) -> list[list[int]]:
        return family_models.reference(config)

    return model_dir_fixture, hf_reference_fixture


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


def check_chunked_prefix_hits_and_two_ranks(
    model_dir: Path, expected: list[list[int]], **engine_args
) -> None:
    """HF's greedy tokens (``expected``) from 24-token chunks whose second pass hits the
    prefix cache, and from two tensor-parallel ranks (``engine_args``: both engines')."""
    llm = LLM(
        model_dir,
        block_size=16,
        num_blocks=256,
        enable_chunked_prefill=True,
        max_num_batched_tokens=24,
        enable_prefix_caching=True,
        **engine_args,
    )
    first = llm.generate(prompts(), GREEDY)
    second = llm.generate(prompts(), GREEDY)
    assert [o.num_cached_tokens for o in second] == [0, 16, 32, 96, 144]
    assert token_ids(first) == token_ids(second) == expected
    parallel = LLM(model_dir, num_blocks=256, tensor_parallel_size=2, **engine_args)
    try:
        assert token_ids(parallel.generate(prompts(), GREEDY)) == expected
    finally:
        parallel.shutdown()


def check_preemption_by_swap_keeps_the_tokens(model_dir: Path, expected: list[list[int]]) -> None:
    """HF's greedy tokens (``expected``) from a cache of 20 blocks, too few for the prompts
    together: running requests are swapped out and back."""
    llm = LLM(
        model_dir,
        num_blocks=20,
        max_num_batched_tokens=160,
        preemption_mode="swap",
        swap_space_bytes=64 << 20,
    )
    assert token_ids(llm.generate(prompts(), GREEDY)) == expected
    assert llm.stats()["num_swap_preemptions"] > 0


def with_next_token_layer(model_dir: Path, path: Path) -> Path:
    """A copy of ``model_dir`` whose checkpoint carries a multi-token-prediction layer after
    its decoder layers (a copy of the last, plus an ``eh_proj``), as DeepSeek-V3's and
    GLM-4.5's checkpoints do (``num_nextn_predict_layers`` 1)."""
    import torch
    from safetensors.torch import load_file, save_file

    copy = rewritten(model_dir, path, num_nextn_predict_layers=1)
    config = json.loads((copy / "config.json").read_text())
    last, extra = config["num_hidden_layers"] - 1, config["num_hidden_layers"]
    tensors = load_file(copy / "model.safetensors")
    for name in [n for n in tensors if n.startswith(f"model.layers.{last}.")]:
        tensors[name.replace(f"model.layers.{last}.", f"model.layers.{extra}.")] = tensors[name]
    hidden = config["hidden_size"]
    tensors[f"model.layers.{extra}.eh_proj.weight"] = torch.zeros(hidden, 2 * hidden)
    save_file(
        {name: tensor.clone() for name, tensor in tensors.items()},
        copy / "model.safetensors",
        metadata={"format": "pt"},
    )
    return copy
