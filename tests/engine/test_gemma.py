"""Gemma, Gemma 2 and Gemma 3 text: greedy tokens identical to HF transformers (float32)
across block sizes (the parity matrix), chunked prefill, prefix caching, the gathered
prefill and two tensor-parallel ranks; Gemma 2's attention logit soft-cap (which changes
HF's tokens here); Gemma 2's and Gemma 3's layer kinds and RoPE settings read from either
config style as HF reads them; the final logit soft-cap in the reported logprobs; the (1 +
w) norm in HF's bits; and what stays unsupported (bidirectional attention, bad caps) refused
by name.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from helpers.family_configs import GEMMA_CONFIGS
from helpers.parity import check_bfloat16_first_tokens_agree_with_hf, hf_greedy
from helpers.tiny_family import GREEDY, prompts, token_ids
from helpers.tiny_models import random_hf_model
from pagedserve.frontend import LLM, SamplingParams
from pagedserve.gpu_worker.layers.basic import GemmaRMSNorm
from pagedserve.gpu_worker.layers.gathered_prefill import PREFILL_ATTENTION_ENV
from pagedserve.gpu_worker.layers.rope_config import layer_type_rope_parameters
from pagedserve.gpu_worker.model_config import ModelConfig, check_tensor_parallel_size


def _rewrite_config(model_dir: Path, **changes) -> None:
    """Edit ``model_dir``'s config.json: a value of None removes the field."""
    config_file = model_dir / "config.json"
    config = json.loads(config_file.read_text())
    for name, value in changes.items():
        if value is None:
            config.pop(name, None)
        else:
            config[name] = value
    config_file.write_text(json.dumps(config))


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gemma_models")
    dirs = {family: random_hf_model(c, root / family) for family, c in GEMMA_CONFIGS.items()}
    # As the Hub's Gemma configs are written: the legacy "gelu" (HF runs the tanh
    # approximation) and no tie_word_embeddings (tied by default).
    _rewrite_config(dirs["gemma"], hidden_act="gelu", tie_word_embeddings=None)
    # As transformers 4 wrote Gemma 2 configs: no layer_types (both HF and the engine derive
    # them).
    _rewrite_config(dirs["gemma2"], layer_types=None)
    return dirs


@pytest.fixture(scope="module")
def hf_references(model_dirs) -> dict[str, list[list[int]]]:
    return {family: hf_greedy(path, prompts()) for family, path in model_dirs.items()}


@pytest.mark.parametrize("family", ["gemma", "gemma2", "gemma3"])
def test_the_hub_s_config_forms_match_hf(model_dirs, hf_references, family):
    # The forms transformers saves, at each block size: the parity matrix.
    llm = LLM(model_dirs[family], block_size=16, num_blocks=256)
    assert token_ids(llm.generate(prompts(), GREEDY)) == hf_references[family]


def test_gemma2_attention_soft_cap_changes_hf_s_tokens(model_dirs, hf_references, tmp_path):
    # Without its cap of 50 HF's own tokens differ: the parity tests above can tell an engine
    # that ignores the cap from one that applies it.
    uncapped_dir = tmp_path / "gemma2_uncapped"
    shutil.copytree(model_dirs["gemma2"], uncapped_dir)
    config_file = uncapped_dir / "config.json"
    config_file.write_text(
        json.dumps({**json.loads(config_file.read_text()), "attn_logit_softcapping": None})
    )
    assert hf_greedy(uncapped_dir, prompts()) != hf_references["gemma2"]


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_chunked_prefill_matches_hf(model_dirs, hf_references, family):
    # 24-token steps: long prompts prefill in chunks whose windows reach into cached context.
    llm = LLM(
        model_dirs[family],
        block_size=8,
        num_blocks=256,
        enable_chunked_prefill=True,
        max_num_batched_tokens=24,
    )
    assert token_ids(llm.generate(prompts(), GREEDY)) == hf_references[family]


def test_prefix_caching_matches_hf(model_dirs, hf_references):
    # The second pass finds each prompt's full blocks of 16 cached and prefills only the
    # rest over them.
    llm = LLM(model_dirs["gemma3"], block_size=16, num_blocks=256, enable_prefix_caching=True)
    first = llm.generate(prompts(), GREEDY)
    second = llm.generate(prompts(), GREEDY)
    assert [o.num_cached_tokens for o in second] == [0, 16, 32, 96, 144]
    assert token_ids(first) == token_ids(second) == hf_references["gemma3"]


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_gathered_prefill_matches_hf(model_dirs, hf_references, monkeypatch, family):
    # Prefill over gathered K/V (a GPU's default), with the model's scale and each layer's
    # window: one SDPA call for Gemma 3, explicit soft-capped scores for Gemma 2.
    monkeypatch.setenv(PREFILL_ATTENTION_ENV, "sdpa")
    llm = LLM(model_dirs[family], block_size=8, num_blocks=256, max_num_batched_tokens=64)
    assert llm.worker.runner.gathered_prefill
    assert token_ids(llm.generate(prompts(), GREEDY)) == hf_references[family]


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_two_tensor_parallel_ranks_match_hf(model_dirs, hf_references, family):
    # Each rank holds half the heads (and all of Gemma 3's per-head norms) of every layer.
    llm = LLM(model_dirs[family], num_blocks=256, tensor_parallel_size=2)
    try:
        assert token_ids(llm.generate(prompts(), GREEDY)) == hf_references[family]
    finally:
        llm.shutdown()


def test_logprobs_carry_the_final_logit_softcap(model_dirs):
    model_dir = model_dirs["gemma3"]
    prompt = prompts()[2]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=5)
    completion = LLM(model_dir, num_blocks=64).generate([prompt], params)[0].outputs[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    sequence = torch.tensor([prompt + completion.token_ids])
    with torch.no_grad():
        capped = torch.log_softmax(model(sequence).logits[0], dim=-1)
        model.config.final_logit_softcapping = None
        uncapped = torch.log_softmax(model(sequence).logits[0], dim=-1)
    rows = slice(len(prompt) - 1, len(prompt) - 1 + len(completion.token_ids))
    # Without the cap the numbers would be these; the check below tells them apart.
    assert (capped[rows] - uncapped[rows]).abs().max() > 0.1
    for entry, row in zip(completion.logprobs, capped[rows]):
        top = row.topk(5)
        assert set(entry) >= set(top.indices.tolist())
        for token, value in zip(top.indices.tolist(), top.values.tolist()):
            assert entry[token] == pytest.approx(value, abs=1e-4)


# Not Gemma 2's tiny model: its attention logits of tens are rounded to bfloat16 in HF's
# scores, which the ops keep in float32, and that flips its near-tied first tokens.
@pytest.mark.parametrize("family", ["gemma", "gemma3"])
def test_bfloat16_first_tokens_agree_with_hf_bfloat16(model_dirs, family):
    # Off float32 the norms run HF's own expression (GemmaRMSNorm) and the cap runs in bfloat16.
    check_bfloat16_first_tokens_agree_with_hf(model_dirs[family])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_norm_has_hf_s_bits(dtype):
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm as HFGemmaRMSNorm

    torch.manual_seed(0)
    offset = torch.empty(128).uniform_(-0.5, 0.5).to(dtype)
    reference = HFGemmaRMSNorm(128, eps=1e-6).to(dtype)
    reference.weight.data.copy_(offset)
    norm = GemmaRMSNorm(128, 1e-6)
    norm.weight.data.copy_(GemmaRMSNorm.scale_from_checkpoint(offset, dtype))
    x = (torch.randn(9, 128) * 3).to(dtype)
    residual = torch.randn(9, 128).to(dtype)
    with torch.no_grad():
        assert torch.equal(norm(x), reference(x))
        expected_residual = residual + x
        expected = reference(expected_residual)
        norm.add_and_norm(x, residual)
    assert torch.equal(residual, expected_residual)
    assert torch.equal(x, expected)


def test_legacy_gelu_runs_the_tanh_approximation_as_hf_does(model_dirs):
    from pagedserve.gpu_worker.models.registry import build_model

    config = ModelConfig.from_dir(model_dirs["gemma"])
    assert config.hf_config["hidden_act"] == "gelu"
    model = build_model(config, torch.float32)
    hf_config = transformers.AutoConfig.from_pretrained(model_dirs["gemma"])
    x = torch.linspace(-6, 6, 1001)
    ours = model.layers[0].mlp.act(x)
    assert torch.equal(ours, transformers.activations.ACT2FN[hf_config.hidden_act](x))
    assert not torch.equal(ours, torch.nn.functional.gelu(x))


# A Gemma 3 config as transformers 4 wrote them (the Hub's gemma-3-1b, shrunk): no
# layer_types (every 3rd layer global here), the RoPE bases and scaling as top-level fields,
# no head_dim (256) and no tie_word_embeddings (tied).
HUB_STYLE_GEMMA3 = dict(
    architectures=["Gemma3ForCausalLM"],
    model_type="gemma3_text",
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=1,
    vocab_size=512,
    max_position_embeddings=1024,
    query_pre_attn_scalar=64,
    rope_theta=1_000_000,
    rope_local_base_freq=10_000,
    rope_scaling={"rope_type": "linear", "factor": 8.0},
    sliding_window=32,
    sliding_window_pattern=3,
    attn_logit_softcapping=None,
    final_logit_softcapping=None,
)


def _write_config(directory: Path, config: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize("style", ["transformers_4", "transformers_5"])
def test_gemma3_config_reads_layers_and_rope_as_hf_does(model_dirs, tmp_path, style):
    if style == "transformers_4":
        model_dir = _write_config(tmp_path, HUB_STYLE_GEMMA3)
        expected_windows = (32, 32, 0, 32, 32, 0)
        expected_theta = {"sliding_attention": 10_000, "full_attention": 1_000_000}
    else:
        model_dir = model_dirs["gemma3"]
        expected_windows = (16, 0, 16)
        expected_theta = {"sliding_attention": 10_000.0, "full_attention": 1_000_000.0}
    config = ModelConfig.from_dir(model_dir)
    hf = transformers.AutoConfig.from_pretrained(model_dir)
    assert config.layer_sliding_windows == expected_windows
    assert config.layer_sliding_windows == tuple(
        hf.sliding_window if kind == "sliding_attention" else 0 for kind in hf.layer_types
    )
    assert (config.head_size, config.num_kv_heads) == (hf.head_dim, hf.num_key_value_heads)
    assert config.max_position_embeddings == hf.max_position_embeddings
    assert config.hf_config["tie_word_embeddings"] == hf.tie_word_embeddings
    for layer_type, theta in expected_theta.items():
        ours = layer_type_rope_parameters(config.hf_config, layer_type)
        assert ours["rope_theta"] == theta
        assert {key: ours[key] for key in hf.rope_parameters[layer_type]} == (
            hf.rope_parameters[layer_type]
        )
    # Only the global layers scale.
    assert layer_type_rope_parameters(config.hf_config, "full_attention")["factor"] == (
        8.0 if style == "transformers_4" else 4.0
    )
    assert "factor" not in layer_type_rope_parameters(config.hf_config, "sliding_attention")


def test_gemma2_config_takes_hf_s_layer_kinds_and_caps(tmp_path):
    # A transformers 4 style Gemma 2 config (the Hub's gemma-2-2b, shrunk): no layer_types,
    # no head_dim, no caps and no window, which Gemma2Config fills in (4096 tokens, 50, 30).
    fields = dict(
        architectures=["Gemma2ForCausalLM"],
        model_type="gemma2",
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
    )
    config = ModelConfig.from_dir(_write_config(tmp_path, fields))
    hf = transformers.AutoConfig.from_pretrained(tmp_path)
    assert config.layer_sliding_windows == (4096, 0, 4096, 0, 4096)
    assert config.layer_sliding_windows == tuple(
        hf.sliding_window if kind == "sliding_attention" else 0 for kind in hf.layer_types
    )
    assert (config.head_size, config.num_kv_heads) == (hf.head_dim, hf.num_key_value_heads)
    assert config.max_position_embeddings == hf.max_position_embeddings
    for name in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"):
        assert config.hf_config[name] == getattr(hf, name), name
    assert config.hf_config["attn_logit_softcapping"] == 50.0


def test_hub_style_gemma_config_takes_hf_s_defaults(tmp_path):
    # Gemma 7B's shape: head_dim 256 is not hidden_size / num_attention_heads (192).
    fields = dict(
        architectures=["GemmaForCausalLM"],
        model_type="gemma",
        hidden_size=3072,
        intermediate_size=24576,
        num_hidden_layers=2,
        num_attention_heads=16,
        num_key_value_heads=16,
        vocab_size=512,
        hidden_act="gelu",
    )
    model_dir = _write_config(tmp_path, fields)
    config = ModelConfig.from_dir(model_dir)
    hf = transformers.AutoConfig.from_pretrained(model_dir)
    assert config.head_size == hf.head_dim == 256
    assert config.hf_config["tie_word_embeddings"] is hf.tie_word_embeddings is True
    assert config.max_position_embeddings == hf.max_position_embeddings == 8192
    assert config.layer_sliding_windows == (0, 0)


@pytest.mark.parametrize(
    ("fields", "message_parts"),
    [
        # HF divides by a cap: 0 would make every logit NaN.
        (
            dict(attn_logit_softcapping=0),
            ["attn_logit_softcapping must be a positive finite number or null, got 0"],
        ),
        (
            dict(architectures=["Gemma2ForCausalLM"], attn_logit_softcapping=-50.0),
            ["attn_logit_softcapping must be a positive finite number or null, got -50.0"],
        ),
        (
            dict(use_bidirectional_attention=True),
            ["use_bidirectional_attention=True is not supported: the attention ops are causal"],
        ),
        (
            dict(final_logit_softcapping=-1.0),
            ["final_logit_softcapping must be a positive finite number or null, got -1.0"],
        ),
        (
            dict(layer_types=["sliding_attention", "chunked_attention"] * 3),
            [
                "layer_types holds 'chunked_attention', which Gemma 3 does not have; supported: "
                "sliding_attention, full_attention"
            ],
        ),
        (
            dict(sliding_window=None),
            [
                "Gemma 3's sliding_attention layers need a sliding_window of at least 1 token, "
                "got None"
            ],
        ),
        (
            dict(architectures=["Gemma2ForCausalLM"], sliding_window=None),
            [
                "Gemma 2's sliding_attention layers need a sliding_window of at least 1 token, "
                "got None"
            ],
        ),
        (
            dict(architectures=["Gemma2ForCausalLM"], use_bidirectional_attention=True),
            ["use_bidirectional_attention=True is not supported: the attention ops are causal"],
        ),
    ],
)
def test_what_the_ops_cannot_do_is_refused_naming_the_field(tmp_path, fields, message_parts):
    model_dir = _write_config(tmp_path, {**HUB_STYLE_GEMMA3, **fields})
    with pytest.raises(ValueError) as refusal:
        LLM(model_dir, num_blocks=16)
    assert all(part in str(refusal.value) for part in message_parts), refusal.value


def test_tensor_parallel_sizes_are_checked_naming_gemma_s_fields(tmp_path):
    config = ModelConfig.from_dir(
        _write_config(tmp_path, {**HUB_STYLE_GEMMA3, "intermediate_size": 254})
    )
    with pytest.raises(ValueError, match="does not divide the model's num_attention_heads=4"):
        check_tensor_parallel_size(config, 3)
    with pytest.raises(ValueError, match="does not divide the model's intermediate_size=254"):
        check_tensor_parallel_size(config, 4)
    check_tensor_parallel_size(config, 2)
