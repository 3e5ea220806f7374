"""LG AI's EXAONE 3.0 / 3.5 (``ExaoneForCausalLM``): Llama under GPT-2-style names
(``transformer.h.N.attn.attention.q_proj``, ``ln_1``, ``mlp.c_fc_0`` / ``c_fc_1`` /
``c_proj``) and config fields (``num_layers``, ``layer_norm_epsilon``,
``activation_function``), as its checkpoints write them. Greedy tokens identical to HF
transformers (float32) across block sizes (the parity matrix), chunked prefill with prefix
hits and two tensor-parallel ranks, for the checkpoint's own config and for the one
transformers saves (``LlamaForCausalLM`` of ``model_type`` exaone, the same tensor names)."""

from __future__ import annotations

import json

import pytest

from helpers.family_configs import EXAONE
from helpers.parity import hf_greedy
from helpers.tiny_family import (
    GREEDY,
    check_chunked_prefix_hits_and_two_ranks,
    prompts,
    rewritten,
    token_ids,
)
from pagedserve.frontend import LLM
from pagedserve.gpu_worker.model_config import ModelConfig

# The config as EXAONE's checkpoints write it: their own names for three fields.
_OWN_NAMES = {
    "num_hidden_layers": "num_layers",
    "rms_norm_eps": "layer_norm_epsilon",
    "hidden_act": "activation_function",
}


@pytest.fixture(scope="module")
def model_dir(family_models):
    """EXAONE's class with the field names transformers saves (the parity matrix's model)."""
    return family_models.model_dir(EXAONE)


@pytest.fixture(scope="module")
def hf_reference(family_models):
    return family_models.reference(EXAONE)


@pytest.fixture(scope="module")
def saved_dir(model_dir, tmp_path_factory):
    """As transformers saves it: LlamaForCausalLM of model_type exaone, EXAONE's names."""
    return rewritten(
        model_dir, tmp_path_factory.mktemp("exaone") / "saved", architectures=["LlamaForCausalLM"]
    )


@pytest.fixture(scope="module")
def checkpoint_dir(model_dir, tmp_path_factory):
    """As EXAONE's checkpoints are: ExaoneForCausalLM and its own config field names."""
    path = tmp_path_factory.mktemp("exaone_checkpoint")
    for file in model_dir.iterdir():
        (path / file.name).write_bytes(file.read_bytes())
    config = json.loads((model_dir / "config.json").read_text())
    config = {_OWN_NAMES.get(name, name): value for name, value in config.items()}
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_the_checkpoint_s_names_and_fields_are_read(saved_dir, checkpoint_dir):
    config = ModelConfig.from_dir(checkpoint_dir)
    assert (config.architecture, config.spec.model_class, config.num_layers) == (
        "ExaoneForCausalLM",
        "LlamaForCausalLM",
        2,
    )
    assert ModelConfig.from_dir(saved_dir).architecture == "LlamaForCausalLM"


def test_the_checkpoint_s_own_names_match_hf(checkpoint_dir, hf_reference):
    # HF reads the checkpoint's names as its saved ones: the same tokens.
    assert hf_greedy(checkpoint_dir, prompts()) == hf_reference
    check_chunked_prefix_hits_and_two_ranks(checkpoint_dir, hf_reference)


def test_transformers_saved_form_matches_hf(saved_dir, hf_reference):
    llm = LLM(saved_dir, num_blocks=256)
    assert token_ids(llm.generate(prompts(), GREEDY)) == hf_reference
