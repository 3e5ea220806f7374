"""Mixture-of-experts models (Mixtral, Qwen2-MoE with its shared expert and dense layers,
Qwen3-MoE with renormalised top-k and sparse every other layer): greedy tokens identical to
HF transformers (float32) on the same weights, across block sizes (the parity matrix),
chunked prefill, prefix caching, preemption by swap, and two tensor-parallel ranks (each
holding half of every expert); the config fields as checkpoints write them; what is refused,
by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers

from helpers.family_configs import MOE_CONFIGS
from helpers.parity import GREEDY, hf_greedy, random_prompts
from pagedserve.frontend import LLM
from pagedserve.gpu_worker.model_config import ExpertsSpec, ModelConfig


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def moe_dirs(family_models) -> dict[str, Path]:
    return {family: family_models.model_dir(config) for family, config in MOE_CONFIGS.items()}


@pytest.fixture(scope="module")
def hf_references(moe_dirs) -> dict[str, list[list[int]]]:
    return {family: hf_greedy(path, random_prompts(1, 512)) for family, path in moe_dirs.items()}


def test_layers_get_the_experts_their_config_describes(moe_dirs):
    mixtral = ModelConfig.from_dir(moe_dirs["mixtral"]).layer_experts
    assert mixtral == (ExpertsSpec(4, 2, 192, "intermediate_size", True, True),) * 2
    qwen2 = ModelConfig.from_dir(moe_dirs["qwen2_moe"]).layer_experts
    sparse = ExpertsSpec(6, 2, 96, "moe_intermediate_size", False, False, 160)
    assert qwen2 == (sparse, None, sparse)
    qwen3 = ModelConfig.from_dir(moe_dirs["qwen3_moe"])
    assert qwen3.layer_experts == (
        None,
        ExpertsSpec(8, 3, 96, "moe_intermediate_size", True, False),
    )
    assert qwen3.has_experts


def test_chunked_prefill_and_prefix_caching_keep_the_tokens(moe_dirs, hf_references):
    llm = LLM(
        moe_dirs["qwen2_moe"],
        num_blocks=128,
        enable_chunked_prefill=True,
        max_num_batched_tokens=40,
        enable_prefix_caching=True,
    )
    prompts = random_prompts(1, 512)
    assert token_ids(llm.generate(prompts, GREEDY)) == hf_references["qwen2_moe"]
    # Again: every full block of each prompt now comes from the cache.
    assert token_ids(llm.generate(prompts, GREEDY)) == hf_references["qwen2_moe"]
    assert llm.stats()["prefix_cache_hits"] > 0


def test_preemption_by_swap_keeps_the_tokens(moe_dirs, hf_references):
    # The eight requests need 52 blocks of 16 together: with 16, running ones are swapped out.
    llm = LLM(
        moe_dirs["mixtral"],
        num_blocks=16,
        max_num_batched_tokens=64,
        preemption_mode="swap",
        swap_space_bytes=64 << 20,
    )
    assert token_ids(llm.generate(random_prompts(1, 512), GREEDY)) == hf_references["mixtral"]
    assert llm.stats()["num_swap_preemptions"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe"])
def test_two_ranks_split_every_expert_and_keep_the_tokens(moe_dirs, hf_references, family):
    llm = LLM(moe_dirs[family], num_blocks=128, tensor_parallel_size=2)
    try:
        assert token_ids(llm.generate(random_prompts(1, 512), GREEDY)) == hf_references[family]
    finally:
        llm.shutdown()


def test_a_size_that_does_not_divide_the_experts_fails_naming_the_field(moe_dirs, tmp_path):
    # 4 ranks divide the heads and the dense layer's 256 rows, not each expert's 90.
    path = _config_with(tmp_path, moe_dirs["qwen3_moe"], moe_intermediate_size=90)
    with pytest.raises(
        ValueError,
        match="tensor_parallel_size=4 does not divide the model's moe_intermediate_size=90",
    ):
        LLM(path, tensor_parallel_size=4)


def test_cuda_graphs_are_refused_by_name(moe_dirs):
    # (LoRA on these models: tests/engine/test_lora.py.)
    with pytest.raises(ValueError, match="cuda_graphs: MixtralForCausalLM routes tokens"):
        LLM(moe_dirs["mixtral"], device="cuda", cuda_graphs=True, multiprocess=True)


def _config_with(tmp_path: Path, source: Path, **changes) -> Path:
    """A copy of ``source``'s config.json (no weights) with ``changes`` applied."""
    config = json.loads((source / "config.json").read_text())
    config.update(changes)
    for name in [k for k, v in changes.items() if v is None]:
        del config[name]
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_expert_count_is_read_under_either_name(moe_dirs, tmp_path):
    # Hub checkpoints of Qwen MoE write num_experts; transformers 5 saves num_local_experts.
    path = _config_with(tmp_path, moe_dirs["qwen3_moe"], num_local_experts=None, num_experts=16)
    assert ModelConfig.from_dir(path).layer_experts[1].num_experts == 16


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"num_experts_per_tok": 9}, "num_experts_per_tok=9 exceeds num_local_experts=8"),
        ({"num_experts_per_tok": 0}, "num_experts_per_tok must be an integer >= 1, got 0"),
        ({"moe_intermediate_size": "96"}, "moe_intermediate_size must be an integer >= 1"),
        ({"decoder_sparse_step": 0}, "decoder_sparse_step must be a positive integer, got 0"),
    ],
)
def test_bad_expert_fields_are_refused_naming_them(moe_dirs, tmp_path, changes, message):
    path = _config_with(tmp_path, moe_dirs["qwen3_moe"], **changes)
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dir(path)


def test_qwen2_moe_windows_the_layers_hf_does(moe_dirs, tmp_path):
    # Without layer_types, HF 5's Qwen2MoeConfig windows layer i when i is even and below
    # max_window_layers (unlike Qwen2, which windows the layers from it on).
    changes = dict(use_sliding_window=True, sliding_window=32, max_window_layers=2)
    path = _config_with(tmp_path, moe_dirs["qwen2_moe"], layer_types=None, **changes)
    hf_config = {**MOE_CONFIGS["qwen2_moe"], **changes}
    del hf_config["architectures"]
    hf_types = transformers.Qwen2MoeConfig(**hf_config).layer_types
    windows = ModelConfig.from_dir(path).layer_sliding_windows
    assert windows == tuple(32 if kind == "sliding_attention" else 0 for kind in hf_types)
    assert windows == (32, 0, 0)
    # Qwen3-MoE windows every layer.
    path = _config_with(tmp_path, moe_dirs["qwen3_moe"], **changes)
    assert ModelConfig.from_dir(path).layer_sliding_windows == (32, 32)
