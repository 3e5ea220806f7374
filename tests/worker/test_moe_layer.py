"""The sparse MLP layer against a per-token reference written from the definition: each
token's output is the sum over its top-k experts of weight x expert(token), with the
weights as each architecture rounds them (Mixtral in float32, Qwen in the model dtype)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.gpu_worker.layers.moe import SparseMoE
from pagedserve.gpu_worker.model_config import ExpertsSpec

HIDDEN = 64


def make_layer(spec: ExpertsSpec, dtype: torch.dtype, seed: int = 0) -> SparseMoE:
    torch.manual_seed(seed)
    layer = SparseMoE(HIDDEN, spec, "silu", dtype)
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.normal_(0.0, 0.2)
    return layer


def expert_reference(layer: SparseMoE, expert: int, row: torch.Tensor) -> torch.Tensor:
    mlp = layer.experts[expert] if expert >= 0 else layer.shared_expert
    gate, up = F.linear(row, mlp.gate_up_proj.weight).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, mlp.down_proj.weight)


def reference(
    layer: SparseMoE, hidden: torch.Tensor, weights_in_float32: bool | None = None
) -> torch.Tensor:
    spec = layer.spec
    if weights_in_float32 is None:
        weights_in_float32 = spec.weights_in_float32
    outputs = []
    for row in hidden[:, None]:
        probabilities = torch.softmax(F.linear(row, layer.gate.weight)[0].float(), dim=-1)
        weights, experts = torch.topk(probabilities, spec.top_k)
        if spec.renormalize:
            weights = weights / weights.sum()
        if not weights_in_float32:
            weights = weights.to(hidden.dtype)
        total = torch.zeros(1, HIDDEN, dtype=hidden.dtype)
        # Ascending expert order: the order the layer (and HF) adds contributions in.
        for weight, expert in sorted(zip(weights, experts.tolist()), key=lambda p: p[1]):
            total += (expert_reference(layer, expert, row) * weight).to(hidden.dtype)
        if layer.shared_expert_gate is not None:
            gate = torch.sigmoid(row @ layer.shared_expert_gate.weight.T)
            total += gate * expert_reference(layer, -1, row)
        outputs.append(total)
    return torch.cat(outputs)


MIXTRAL = ExpertsSpec(8, 2, 96, "intermediate_size", True, True)
QWEN2_MOE = ExpertsSpec(6, 3, 48, "moe_intermediate_size", False, False, 80)
QWEN3_MOE = ExpertsSpec(16, 4, 32, "moe_intermediate_size", True, False)


@pytest.mark.parametrize("spec", [MIXTRAL, QWEN2_MOE, QWEN3_MOE], ids=["mixtral", "qwen2", "qwen3"])
@pytest.mark.parametrize("num_tokens", [1, 5, 64])
def test_matches_the_per_token_definition_in_float32(spec, num_tokens):
    layer = make_layer(spec, torch.float32)
    hidden = torch.randn(num_tokens, HIDDEN)
    with torch.no_grad():
        torch.testing.assert_close(layer(hidden), reference(layer, hidden), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spec", [MIXTRAL, QWEN2_MOE], ids=["mixtral", "qwen2"])
def test_weights_are_rounded_as_each_architecture_rounds_them_in_bfloat16(spec):
    layer = make_layer(spec, torch.bfloat16)
    hidden = torch.randn(32, HIDDEN).to(torch.bfloat16)
    with torch.no_grad():
        # One token per call, as the reference computes: the same GEMM shapes, so bit for bit.
        outputs = torch.cat([layer(row) for row in hidden[:, None]])
        assert torch.equal(outputs, reference(layer, hidden))
        # The other architecture's rounding gives other bits: the check above can fail.
        other = reference(layer, hidden, weights_in_float32=not spec.weights_in_float32)
        assert not torch.equal(outputs, other)


def test_every_expert_is_used_and_routing_is_per_token():
    layer = make_layer(QWEN3_MOE, torch.float32)
    hidden = torch.randn(200, HIDDEN)
    with torch.no_grad():
        experts, weights = layer.route(hidden)
        batched = layer(hidden)
        one_by_one = torch.cat([layer(hidden[i : i + 1]) for i in range(len(hidden))])
    assert experts.shape == weights.shape == (200, QWEN3_MOE.top_k)
    assert set(experts.flatten().tolist()) == set(range(QWEN3_MOE.num_experts))
    torch.testing.assert_close(weights.sum(dim=-1), torch.ones(200))
    # A token's output does not depend on which tokens share its batch.
    torch.testing.assert_close(batched, one_by_one, rtol=1e-5, atol=1e-5)


def test_an_empty_batch_gives_an_empty_output():
    layer = make_layer(MIXTRAL, torch.float32)
    with torch.no_grad():
        assert layer(torch.empty(0, HIDDEN)).shape == (0, HIDDEN)
