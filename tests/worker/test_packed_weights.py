"""Linear weights packed once on CPU (oneDNN's layout in bfloat16 / float16, panels for
pagedserve's kernel in float32): every layer kind computes what F.linear computes over the
plain weight, ``PAGEDSERVE_CPU_LINEAR=torch`` keeps the plain weights, and an engine packs
every matrix and runs the same greedy tokens as one left unpacked."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from pagedserve.frontend import LLM, SamplingParams
from pagedserve.gpu_worker.layers.basic import Linear
from pagedserve.gpu_worker.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagedserve.gpu_worker.layers.packed_weights import (
    CPU_LINEAR_ENV,
    PanelWeight,
    pack_linear_weights,
    pack_weight,
    packing_available,
)
from pagedserve.gpu_worker.layers.vocab_embedding import VocabParallelEmbedding
from pagedserve.gpu_worker.models.base import CausalLM


def _needs_packing(dtype: torch.dtype) -> pytest.MarkDecorator:
    return pytest.mark.skipif(
        not packing_available(torch.empty(1, 1, dtype=dtype)),
        reason=f"no packed linear in {dtype} here (this torch build or this CPU's ISA)",
    )


needs_bfloat16_packing = _needs_packing(torch.bfloat16)
needs_float32_packing = _needs_packing(torch.float32)
# float32 panels sum in another order than MKL: a few ulp; 16-bit types round the output.
_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2}


def _filled(layer: torch.nn.Module, seed: int) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(seed)
    for parameter in layer.parameters():
        parameter.data.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    return layer


def _layers(dtype: torch.dtype) -> list[torch.nn.Module]:
    return [
        _filled(Linear(64, 48, bias=True, dtype=dtype), 1),
        _filled(Linear(64, 48, bias=False, dtype=dtype), 2),
        _filled(ColumnParallelLinear(64, [32, 32], bias=False, dtype=dtype), 3),
        _filled(QKVParallelLinear(64, 16, 4, 2, bias=True, dtype=dtype), 4),
        _filled(RowParallelLinear(96, 64, bias=True, dtype=dtype), 5),
    ]


@pytest.mark.parametrize(
    "dtype",
    [
        pytest.param(torch.float32, marks=needs_float32_packing),
        pytest.param(torch.bfloat16, marks=needs_bfloat16_packing),
        pytest.param(torch.float16, marks=_needs_packing(torch.float16)),
    ],
)
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_packed_layers_compute_what_f_linear_computes(dtype, rows):
    for layer in _layers(dtype):
        plain_weight = layer.weight.detach().clone()
        bias = None if layer.bias is None else layer.bias.detach().clone()
        x = torch.randn(rows, plain_weight.shape[1], generator=torch.Generator().manual_seed(rows))
        x = x.to(dtype)
        expected = F.linear(x.float(), plain_weight.float(), None if bias is None else bias.float())
        assert layer.pack()
        assert layer.weight_packed and not layer.pack()  # packing twice is a no-op
        assert "weight" not in dict(layer.named_parameters())  # the plain copy is released
        got = layer(x)
        assert got.dtype == dtype and got.shape == (rows, plain_weight.shape[0])
        tolerance = _TOLERANCE[dtype]
        torch.testing.assert_close(got.float(), expected, atol=tolerance, rtol=tolerance)
        if dtype == torch.float32:  # what a LoRA adapter reads of a packed layer
            assert isinstance(layer.weight, PanelWeight)
            assert layer.weight.shape == plain_weight.shape


@pytest.mark.parametrize(
    "dtype",
    [
        pytest.param(torch.float32, marks=needs_float32_packing),
        pytest.param(torch.bfloat16, marks=needs_bfloat16_packing),
    ],
)
def test_packed_lm_head_keeps_the_lookup_table(dtype):
    table = VocabParallelEmbedding(100, 32, dtype=dtype)
    _filled(table, 7)
    hidden = torch.randn(5, 32).to(dtype)
    expected = F.linear(hidden, table.weight).float()
    ids = torch.tensor([0, 5, 99])
    looked_up = table(ids)
    assert table.pack_for_logits()
    tolerance = _TOLERANCE[dtype]
    torch.testing.assert_close(table.logits(hidden), expected, atol=tolerance, rtol=tolerance)
    assert torch.equal(table(ids), looked_up)
    assert table.logits(hidden).dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_linear_torch_keeps_plain_weights(monkeypatch, dtype):
    monkeypatch.setenv(CPU_LINEAR_ENV, "torch")
    layers = _layers(dtype)
    assert pack_linear_weights(torch.nn.ModuleList(layers)) == 0
    assert all(isinstance(layer.weight, torch.nn.Parameter) for layer in layers)


def test_cpu_linear_names_a_bad_value(monkeypatch):
    monkeypatch.setenv(CPU_LINEAR_ENV, "mkl")
    with pytest.raises(ValueError, match="PAGEDSERVE_CPU_LINEAR='mkl' is not one of packed, torch"):
        packing_available(torch.empty(4, 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpus_with_avx2_pack_every_dtype(dtype):
    from pagedserve import _C_cpu

    weight = torch.randn(20, 8).to(dtype)
    if _C_cpu.isa() in ("avx2", "avx512"):
        assert packing_available(weight)
        packed = pack_weight(weight)
        # Panels unless oneDNN packs the dtype itself (float32: always panels).
        assert isinstance(packed, PanelWeight) or dtype != torch.float32
    assert not packing_available(torch.empty(4, 4, dtype=torch.float64))
    assert not packing_available(torch.empty(4, dtype=dtype))


@pytest.mark.parametrize(
    "dtype",
    [
        pytest.param(torch.float32, marks=needs_float32_packing),
        pytest.param(torch.bfloat16, marks=needs_bfloat16_packing),
    ],
)
def test_engine_packs_every_matrix_and_matches_unpacked(tiny_model_dirs, monkeypatch, dtype):
    prompts = [[(7 * i + 3 * j) % 200 + 1 for j in range(5 + 9 * i)] for i in range(4)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    packed_counts: list[int] = []
    real_pack = CausalLM.pack_weights

    def counting_pack(model, quantization=None):
        packed_counts.append(real_pack(model, quantization))
        return packed_counts[-1]

    monkeypatch.setattr(CausalLM, "pack_weights", counting_pack)
    packed = LLM(
        tiny_model_dirs["llama"], dtype=str(dtype).removeprefix("torch."), num_blocks=64
    ).generate(prompts, params)
    monkeypatch.setattr(CausalLM, "pack_weights", lambda model, quantization=None: 0)
    plain = LLM(
        tiny_model_dirs["llama"], dtype=str(dtype).removeprefix("torch."), num_blocks=64
    ).generate(prompts, params)
    num_layers = json.loads((tiny_model_dirs["llama"] / "config.json").read_text())[
        "num_hidden_layers"
    ]
    # Every decoder layer's qkv, o, gate_up and down, plus the LM head (untied here: the
    # input embedding, never read as a matrix, stays unpacked).
    assert packed_counts == [4 * num_layers + 1]
    same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(packed, plain))
    if dtype == torch.float32:
        assert same == len(prompts)
    else:  # both round in bfloat16, through different kernels; a near-tie may flip one prompt
        assert same >= len(prompts) - 1
