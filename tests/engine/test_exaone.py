"""LG AI's EXAONE 3.0 / 3.5 (``ExaoneForCausalLM``): Llama under GPT-2-style names
(``transformer.h.N.attn.attention.q_proj``, ``ln_1``, ``mlp.c_fc_0`` / ``c_fc_1`` /
``c_proj``) and config fields (``num_layers``, ``layer_norm_epsilon``,
``activation_function``), as its checkpoints write them. Greedy tokens identical to HF
transformers (float32) across block sizes, chunked prefill with prefix hits and two
tensor-parallel ranks, for the checkpoint's own config and for the one transformers saves
(``LlamaForCausalLM`` of ``model_type`` exaone, the same tensor names)."""

from __future__ import annotations

import json

import pytest

from helpers.parity import hf_greedy
from helpers.tiny_family import (
    GREEDY,
    TINY_SHAPE,
    check_chunked_prefix_hits_and_two_ranks,
    prompts,
    token_ids,
)
from helpers.tiny_models import random_hf_model
from pagedserve.frontend import LLM
from pagedserve.gpu_worker.model_config import ModelConfig

EXAONE = dict(
    architectures=["ExaoneForCausalLM"],
    **TINY_SHAPE,
    head_dim=64,
    pad_token_id=0,
    eos_token_id=2,
)
# The config as EXAONE's checkpoints write it: their own names for three fields.
_OWN_NAMES = {
    "num_hidden_layers": "num_layers",
    "rms_norm_eps": "layer_norm_epsilon",
    "hidden_act": "activation_function",
}


@pytest.fixture(scope="module")
def saved_dir(tmp_path_factory):
    """As transformers saves it: LlamaForCausalLM of model_type exaone, EXAONE's names."""
    return random_hf_model(EXAONE, tmp_path_factory.mktemp("exaone"))


@pytest.fixture(scope="module")
def checkpoint_dir(saved_dir, tmp_path_factory):
    """As EXAONE's checkpoints are: ExaoneForCausalLM and its own config field names."""
    path = tmp_path_factory.mktemp("exaone_checkpoint")
    for file in saved_dir.iterdir():
        (path / file.name).write_bytes(file.read_bytes())
    config = json.loads((saved_dir / "config.json").read_text())
    config = {_OWN_NAMES.get(name, name): value for name, value in config.items()}
    config["architectures"] = ["ExaoneForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def hf_reference(checkpoint_dir):
    return hf_greedy(checkpoint_dir, prompts())


def test_the_checkpoint_s_names_and_fields_are_read(saved_dir, checkpoint_dir):
    config = ModelConfig.from_dir(checkpoint_dir)
    assert (config.architecture, config.spec.model_class, config.num_layers) == (
        "ExaoneForCausalLM",
        "LlamaForCausalLM",
        2,
    )
    assert ModelConfig.from_dir(saved_dir).architecture == "LlamaForCausalLM"


@pytest.mark.parametrize("block_size", [8, 16])
def test_exaone_matches_hf(checkpoint_dir, hf_reference, block_size):
    llm = LLM(checkpoint_dir, block_size=block_size, num_blocks=256)
    assert token_ids(llm.generate(prompts(), GREEDY)) == hf_reference


def test_chunked_prefill_prefix_hits_and_two_ranks_match_hf(checkpoint_dir, hf_reference):
    check_chunked_prefix_hits_and_two_ranks(checkpoint_dir, hf_reference)


def test_transformers_saved_form_matches_hf(saved_dir, hf_reference):
    assert hf_greedy(saved_dir, prompts()) == hf_reference
    llm = LLM(saved_dir, num_blocks=256)
    assert token_ids(llm.generate(prompts(), GREEDY)) == hf_reference
