"""Weight-only int8 quantization (``LLM(quantization="int8")``, ``--quantization int8``): the
engine quantizes every decoder layer's linear weights as it loads and then runs HF
transformers' greedy tokens for the same model with those weights dequantized (float32), so
the quantized engine computes what the dequantized model computes; the LM head, embeddings and
a MoE router stay unquantized; bad values and devices are refused by name."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
import torch

from helpers.dequantized_models import save_dequantized
from helpers.parity import NEW_TOKENS, hf_greedy
from pagedserve.frontend import LLM, SamplingParams
from pagedserve.gpu_worker.layers.moe import SparseMoE
from pagedserve.gpu_worker.layers.packed_weights import (
    Int8PanelWeight,
    PanelWeight,
    pack_linear_weights,
)
from pagedserve.gpu_worker.model_config import ExpertsSpec

GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def _prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(4)
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in (1, 7, 30, 90)]


@pytest.mark.parametrize("family", ["llama", "qwen2", "opt"])
def test_quantized_engine_runs_the_dequantized_models_greedy_tokens(
    tiny_model_dirs, tmp_path, family
):
    prompts = _prompts(512)
    llm = LLM(tiny_model_dirs[family], num_blocks=128, quantization="int8")
    outputs = llm.generate(prompts, GREEDY)
    dequantized = save_dequantized(tiny_model_dirs[family], tmp_path / family)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(dequantized, prompts)
    model = llm.worker.model
    quantized = [
        m for m in model.modules() if isinstance(getattr(m, "weight", None), Int8PanelWeight)
    ]
    assert quantized and all(m.weight.panels.dtype == torch.int8 for m in quantized)
    # The LM head reads the (unquantized) table: float32 panels, or plain.
    assert not isinstance(model.logits_table.packed_weight, Int8PanelWeight)
    assert model.logits_table.weight.dtype == torch.float32


def test_multiprocess_engine_quantizes_too(tiny_model_dirs):
    prompts = _prompts(512)[:2]
    in_process = LLM(tiny_model_dirs["llama"], num_blocks=64, quantization="int8")
    want = [o.outputs[0].token_ids for o in in_process.generate(prompts, GREEDY)]
    llm = LLM(tiny_model_dirs["llama"], num_blocks=64, quantization="int8", multiprocess=True)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == want
    finally:
        llm.shutdown()


def test_two_ranks_quantize_as_one(tiny_model_dirs):
    """A row-parallel layer's ranks share each row's scale (its max over all columns), so two
    ranks run the quantized model one rank runs (the sums split, on a config without
    near-ties: the same tokens)."""
    prompts = _prompts(512)
    one = LLM(tiny_model_dirs["llama"], num_blocks=128, quantization="int8")
    want = [o.outputs[0].token_ids for o in one.generate(prompts, GREEDY)]
    two = LLM(tiny_model_dirs["llama"], num_blocks=128, quantization="int8", tensor_parallel_size=2)
    try:
        assert [o.outputs[0].token_ids for o in two.generate(prompts, GREEDY)] == want
    finally:
        two.shutdown()


def test_moe_router_stays_unquantized():
    spec = ExpertsSpec(6, 3, 48, "moe_intermediate_size", False, False, 80)
    layer = SparseMoE(64, spec, "silu", torch.float32)
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.normal_(0.0, 0.2)
    num_matrices = len(list(layer.parameters()))  # no biases
    assert pack_linear_weights(layer, "int8") == num_matrices
    assert isinstance(layer.experts[0].gate_up_proj.weight, Int8PanelWeight)
    assert isinstance(layer.shared_expert.down_proj.weight, Int8PanelWeight)
    for router in (layer.gate, layer.shared_expert_gate):
        assert not isinstance(router.weight, Int8PanelWeight)
        assert isinstance(router.weight, (PanelWeight, torch.Tensor))


def test_bad_quantization_is_refused_by_name(tiny_model_dirs):
    with pytest.raises(ValueError, match=r"quantization must be one of int8 or None, got 'fp4'"):
        LLM(tiny_model_dirs["llama"], num_blocks=64, quantization="fp4")
    with pytest.raises(
        ValueError, match=r"quantization='int8' runs on CPU only, got device='cuda'"
    ):
        LLM(tiny_model_dirs["llama"], num_blocks=64, quantization="int8", device="cuda")
    result = subprocess.run(
        [sys.executable, "-m", "pagedserve.frontend.cli", "generate", "--quantization", "fp4"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "--quantization: invalid choice: 'fp4'" in result.stderr
