"""Linear weights packed for oneDNN (bfloat16 / float16 on CPU): every layer kind computes
what F.linear computes over the plain weight, float32 is never packed, and a bfloat16
engine packs every matrix and runs the same greedy tokens as one left unpacked."""

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
from pagedserve.gpu_worker.layers.packed_weights import pack_linear_weights, packing_available
from pagedserve.gpu_worker.layers.vocab_embedding import VocabParallelEmbedding
from pagedserve.gpu_worker.models.base import CausalLM


def _needs_packing(dtype: torch.dtype) -> pytest.MarkDecorator:
    return pytest.mark.skipif(
        not packing_available(torch.empty(1, 1, dtype=dtype)),
        reason=f"no oneDNN packed linear in {dtype} here (this torch build or this CPU's ISA)",
    )


needs_bfloat16_packing = _needs_packing(torch.bfloat16)


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
        torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=2e-2)


@needs_bfloat16_packing
def test_packed_lm_head_keeps_the_lookup_table():
    table = VocabParallelEmbedding(100, 32, dtype=torch.bfloat16)
    _filled(table, 7)
    hidden = torch.randn(5, 32).to(torch.bfloat16)
    expected = F.linear(hidden, table.weight).float()
    ids = torch.tensor([0, 5, 99])
    looked_up = table(ids)
    assert table.pack_for_logits()
    torch.testing.assert_close(table.logits(hidden), expected, atol=2e-2, rtol=2e-2)
    assert torch.equal(table(ids), looked_up)
    assert table.logits(hidden).dtype == torch.float32


def test_float32_is_never_packed():
    layers = _layers(torch.float32)
    model = torch.nn.ModuleList(layers)
    assert pack_linear_weights(model) == 0
    assert all(isinstance(layer.weight, torch.nn.Parameter) for layer in layers)


@needs_bfloat16_packing
def test_bfloat16_engine_packs_every_matrix_and_matches_unpacked(tiny_model_dirs, monkeypatch):
    prompts = [[(7 * i + 3 * j) % 200 + 1 for j in range(5 + 9 * i)] for i in range(4)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    packed_counts: list[int] = []
    real_pack = CausalLM.pack_weights

    def counting_pack(model):
        packed_counts.append(real_pack(model))
        return packed_counts[-1]

    monkeypatch.setattr(CausalLM, "pack_weights", counting_pack)
    packed = LLM(tiny_model_dirs["llama"], dtype="bfloat16", num_blocks=64).generate(
        prompts, params
    )
    monkeypatch.setattr(CausalLM, "pack_weights", lambda model: 0)
    plain = LLM(tiny_model_dirs["llama"], dtype="bfloat16", num_blocks=64).generate(prompts, params)
    num_layers = json.loads((tiny_model_dirs["llama"] / "config.json").read_text())[
        "num_hidden_layers"
    ]
    # Every decoder layer's qkv, o, gate_up and down, plus the LM head (untied here: the
    # input embedding, never read as a matrix, stays unpacked).
    assert packed_counts == [4 * num_layers + 1]
    same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(packed, plain))
    # Both round in bfloat16, through different kernels; a near-tie may flip one prompt.
    assert same >= len(prompts) - 1
