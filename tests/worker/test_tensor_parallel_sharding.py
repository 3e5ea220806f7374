"""Weight sharding for tensor parallelism, in one process (no collectives run): every
rank's shard, put back together, is the full checkpoint tensor; sizes that cannot split
a model are refused with the field, its value and the limit; ranks share the cores."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from pagedserve import _C_cpu
from pagedserve.gpu_worker import ops
from pagedserve.gpu_worker.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagedserve.gpu_worker.layers.vocab_embedding import VocabParallelEmbedding
from pagedserve.gpu_worker.model_config import ModelConfig
from pagedserve.gpu_worker.models.registry import build_model
from pagedserve.gpu_worker.parallel import (
    TensorParallel,
    check_tensor_parallel_size,
    set_threads_per_rank,
)
from pagedserve.gpu_worker.weights import iterate_weights

HEAD_SIZE = 4
HIDDEN = 16


def ranks(size: int) -> list[TensorParallel]:
    return [TensorParallel(rank, size) for rank in range(size)]


def load(layer, attribute: str, tensor: torch.Tensor, part: int | None = None) -> None:
    """What WeightLoader does for one tensor."""
    row_offset, rows = layer.shard_of(attribute, tensor, part)
    getattr(layer, attribute).data.narrow(0, row_offset, rows.shape[0]).copy_(rows)


def load_qkv(layers, q, k, v, attribute="weight"):
    for layer in layers:
        for part, tensor in enumerate((q, k, v)):
            load(layer, attribute, tensor, part)


def split_qkv(layer: QKVParallelLinear, tensor: torch.Tensor):
    return tensor.split([layer.q_size, layer.kv_size, layer.kv_size])


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "size"),
    [(4, 2, 2), (8, 4, 4), (4, 4, 2), (6, 3, 3)],
    ids=["gqa", "gqa-4-ranks", "mha", "three-ranks"],
)
def test_qkv_shards_put_together_are_the_full_projections(num_heads, num_kv_heads, size):
    q = torch.randn(num_heads * HEAD_SIZE, HIDDEN)
    k = torch.randn(num_kv_heads * HEAD_SIZE, HIDDEN)
    v = torch.randn(num_kv_heads * HEAD_SIZE, HIDDEN)
    q_bias, k_bias, v_bias = (torch.randn(t.shape[0]) for t in (q, k, v))
    layers = [
        QKVParallelLinear(HIDDEN, HEAD_SIZE, num_heads, num_kv_heads, True, torch.float32, tp)
        for tp in ranks(size)
    ]
    load_qkv(layers, q, k, v)
    load_qkv(layers, q_bias, k_bias, v_bias, attribute="bias")
    for layer in layers:
        assert (layer.num_heads, layer.num_kv_heads) == (
            num_heads // size,
            num_kv_heads // size,
        )
    for full, index in ((q, 0), (k, 1), (v, 2)):
        shards = [split_qkv(layer, layer.weight)[index] for layer in layers]
        assert torch.equal(torch.cat(shards), full)
    for full, index in ((q_bias, 0), (k_bias, 1), (v_bias, 2)):
        shards = [split_qkv(layer, layer.bias)[index] for layer in layers]
        assert torch.equal(torch.cat(shards), full)


def test_fewer_kv_heads_than_ranks_are_replicated_where_the_query_heads_read_them():
    # 8 query heads over 2 KV heads (groups of 4), 4 ranks: ranks 0-1 hold query heads
    # 0-3 and KV head 0, ranks 2-3 query heads 4-7 and KV head 1, as without splitting.
    q = torch.randn(8 * HEAD_SIZE, HIDDEN)
    k = torch.randn(2 * HEAD_SIZE, HIDDEN)
    v = torch.randn(2 * HEAD_SIZE, HIDDEN)
    layers = [
        QKVParallelLinear(HIDDEN, HEAD_SIZE, 8, 2, False, torch.float32, tp) for tp in ranks(4)
    ]
    load_qkv(layers, q, k, v)
    k_heads, v_heads = k.view(2, HEAD_SIZE, HIDDEN), v.view(2, HEAD_SIZE, HIDDEN)
    for rank, layer in enumerate(layers):
        q_shard, k_shard, v_shard = split_qkv(layer, layer.weight)
        assert (layer.num_heads, layer.num_kv_heads) == (2, 1)
        assert torch.equal(q_shard, q[rank * 2 * HEAD_SIZE : (rank + 1) * 2 * HEAD_SIZE])
        assert torch.equal(k_shard, k_heads[rank // 2]) and torch.equal(v_shard, v_heads[rank // 2])


def test_fused_gate_up_is_split_per_component_not_as_one_tensor():
    gate, up = torch.randn(12, HIDDEN), torch.randn(12, HIDDEN)
    layers = [ColumnParallelLinear(HIDDEN, [12, 12], False, torch.float32, tp) for tp in ranks(2)]
    for layer in layers:
        load(layer, "weight", gate, 0)
        load(layer, "weight", up, 1)
    # Each rank holds [gate_r | up_r], so SiLU(gate) * up pairs the right rows.
    for rank, layer in enumerate(layers):
        gate_shard, up_shard = layer.weight.chunk(2)
        assert torch.equal(gate_shard, gate[rank * 6 : (rank + 1) * 6])
        assert torch.equal(up_shard, up[rank * 6 : (rank + 1) * 6])
    with pytest.raises(ValueError, match="part is missing"):
        layers[0].shard_of("weight", torch.cat([gate, up]), None)


def test_row_parallel_shards_are_column_blocks_and_the_bias_is_whole():
    weight, bias = torch.randn(HIDDEN, 12), torch.randn(HIDDEN)
    layers = [RowParallelLinear(12, HIDDEN, True, torch.float32, tp) for tp in ranks(3)]
    for layer in layers:
        load(layer, "weight", weight)
        load(layer, "bias", bias)
    assert torch.equal(torch.cat([layer.weight for layer in layers], dim=1), weight)
    assert all(torch.equal(layer.bias, bias) for layer in layers)
    # The partial products sum to the full product (all_reduce's job), bias added once.
    x = torch.randn(5, 12)
    partials = sum(
        torch.nn.functional.linear(x[:, layer.columns.start : layer.columns.stop], layer.weight)
        for layer in layers
    )
    torch.testing.assert_close(partials + bias, torch.nn.functional.linear(x, weight, bias))


def test_vocab_shards_cover_every_id_once_and_pad_the_last():
    table = torch.randn(10, HIDDEN)
    layers = [VocabParallelEmbedding(10, HIDDEN, torch.float32, tp) for tp in ranks(4)]
    for layer in layers:
        load(layer, "weight", table)
    assert [(layer.start, layer.end) for layer in layers] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert all(layer.weight.shape == (3, HIDDEN) for layer in layers)
    assert torch.equal(torch.cat([layer.weight for layer in layers])[:10], table)
    assert not layers[-1].weight[1:].any()  # padding rows
    with pytest.raises(ValueError, match=r"has shape \(9, 16\), expected \(10, 16\)"):
        layers[0].shard_of("weight", table[:9], None)


@pytest.mark.parametrize("family", ["qwen2", "llama", "opt", "qwen3", "qwen3_tied_bias"])
def test_model_ranks_load_shards_of_the_checkpoint(tiny_model_dirs, family):
    """Through the model's own loader: q/k/v (with their biases where the checkpoint has
    them) and gate/up of every layer, put back together from the two ranks, are the
    checkpoint's tensors; Qwen3's per-head q/k norms are whole on every rank."""
    path = tiny_model_dirs[family]
    config = ModelConfig.from_dir(path)
    checkpoint = load_file(path / "model.safetensors")
    models = []
    for tp in ranks(2):
        model = build_model(config, torch.float32, tp)
        model.load_weights(iterate_weights(path))
        models.append(model)
    prefix = "model.decoder." if family == "opt" else "model."
    for index in range(config.num_layers):
        attentions = [model.layers[index].self_attn for model in models]
        has_bias = f"{prefix}layers.{index}.self_attn.q_proj.bias" in checkpoint
        for suffix in ("weight", "bias") if has_bias else ("weight",):
            pieces = [split_qkv(a.qkv_proj, getattr(a.qkv_proj, suffix)) for a in attentions]
            for part, name in enumerate(("q_proj", "k_proj", "v_proj")):
                full = checkpoint[f"{prefix}layers.{index}.self_attn.{name}.{suffix}"]
                shards = [piece[part] for piece in pieces]
                if config.num_kv_heads < 2 and part > 0:
                    assert all(torch.equal(shard, full) for shard in shards)  # replicated
                else:
                    assert torch.equal(torch.cat(shards), full)
        if config.architecture == "Qwen3ForCausalLM":
            for name in ("q_norm", "k_norm"):
                full = checkpoint[f"{prefix}layers.{index}.self_attn.{name}.weight"]
                assert all(torch.equal(getattr(a, name).weight, full) for a in attentions)
        if family != "opt":
            gate_ups = [model.layers[index].mlp.gate_up_proj.weight.chunk(2) for model in models]
            for part, name in enumerate(("gate_proj", "up_proj")):
                full = checkpoint[f"{prefix}layers.{index}.mlp.{name}.weight"]
                assert torch.equal(torch.cat([pieces[part] for pieces in gate_ups]), full)
    embeddings = torch.cat([model.embed_tokens.weight for model in models])
    assert torch.equal(embeddings, checkpoint[f"{prefix}embed_tokens.weight"])


def write_config(tmp_path, **overrides) -> ModelConfig:
    config = dict(
        architectures=["LlamaForCausalLM"],
        hidden_size=96,
        intermediate_size=192,
        num_hidden_layers=1,
        num_attention_heads=6,
        num_key_value_heads=3,
        vocab_size=100,
    )
    config.update(overrides)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return ModelConfig.from_dir(tmp_path)


def test_sizes_that_split_the_model_are_accepted(tmp_path):
    config = write_config(tmp_path, num_key_value_heads=2, num_attention_heads=12)
    for size in (1, 2, 4, 12):  # 4 and 12 ranks replicate the 2 KV heads
        check_tensor_parallel_size(config, size)


@pytest.mark.parametrize(
    ("overrides", "size", "message"),
    [
        (
            {"num_attention_heads": 9, "num_key_value_heads": 3},
            2,
            r"tensor_parallel_size=2 does not divide the model's num_attention_heads=9 .*"
            r"sizes that do: 1, 3, 9",
        ),
        ({}, 2, r"does not divide the model's num_key_value_heads=3"),
        (
            {"num_attention_heads": 12},
            4,
            r"tensor_parallel_size=4: the model's num_key_value_heads=3 is below it",
        ),
        ({"intermediate_size": 190}, 3, r"does not divide the model's intermediate_size=190"),
        ({}, 0, r"tensor_parallel_size must be a positive integer, got 0"),
    ],
    ids=["heads", "kv-heads", "kv-replicas", "intermediate", "zero"],
)
def test_sizes_that_cannot_split_the_model_are_refused_naming_the_field(
    tmp_path, overrides, size, message
):
    with pytest.raises(ValueError, match=message):
        check_tensor_parallel_size(write_config(tmp_path, **overrides), size)


def test_opt_checks_its_ffn_dim(tmp_path):
    config = write_config(
        tmp_path,
        architectures=["OPTForCausalLM"],
        num_attention_heads=4,
        num_key_value_heads=None,
        ffn_dim=150,
    )
    with pytest.raises(ValueError, match=r"does not divide the model's ffn_dim=150"):
        check_tensor_parallel_size(config, 4)


def test_each_rank_takes_its_share_of_the_cores(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    before = torch.get_num_threads()
    try:
        set_threads_per_rank(2)
        assert torch.get_num_threads() == max(1, cores // 2)
        assert _C_cpu.get_num_threads() == max(1, cores // 2)
        set_threads_per_rank(cores + 1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
        ops.set_num_threads(before)


@pytest.mark.parametrize(
    ("omp_num_threads", "size", "expected"),
    [("1", 1, 1), ("1,1", 1, 1), ("0", 1, None), ("many", 1, None), ("64", 1, None)],
)
def test_omp_num_threads_caps_each_rank(monkeypatch, omp_num_threads, size, expected):
    """A positive OMP_NUM_THREADS caps a rank's threads below its share of the cores; a
    value OpenMP would ignore (zero, not a number) leaves the share."""
    share = max(1, len(os.sched_getaffinity(0)) // size)
    monkeypatch.setenv("OMP_NUM_THREADS", omp_num_threads)
    before = torch.get_num_threads()
    try:
        set_threads_per_rank(size)
        assert torch.get_num_threads() == (expected or share)
        assert _C_cpu.get_num_threads() == (expected or share)
    finally:
        torch.set_num_threads(before)
        ops.set_num_threads(before)
