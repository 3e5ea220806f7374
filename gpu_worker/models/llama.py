"""The Llama family: Llama, Mistral, Qwen2 and Qwen3 (GQA, RoPE, RMSNorm, gated SiLU MLP;
Qwen3 adds an RMSNorm over each query and key head before RoPE), and their
mixture-of-experts members Mixtral, Qwen2-MoE and Qwen3-MoE, whose layers swap the MLP for
a sparse one (layers/moe.py). IBM's Granite is Llama with four scalars (µP's): the
embeddings times ``embedding_multiplier``, attention scores scaled by
``attention_multiplier`` instead of 1/sqrt(head size), each sublayer's output times
``residual_multiplier`` before it joins the residual, and the logits divided by
``logits_scaling``; Granite MoE adds experts (stacked tensors, split per expert on
loading), Granite MoE Shared a gated MLP beside them. Microsoft's Phi-3 (and Phi-4) is
Llama whose checkpoint stores q/k/v as one ``qkv_proj`` and gate/up as one
``gate_up_proj``, split here on loading so each tensor-parallel rank takes its heads and rows
as from separate tensors. Hugging Face's
SmolLM3 is Llama whose every fourth layer (``no_rope_layers``) attends without RoPE.
ByteDance's Seed-OSS is Llama with q/k/v biases and a separate switch for the output
projection's (``attention_out_bias``). Baidu's ERNIE 4.5 (the dense models) is Llama with
one switch for every projection's bias (``use_bias``) and RoPE on interleaved pairs, run as
the ops' rotate-half on query and key rows the loader reorders (``rotary.pairs_to_halves``;
``CausalLM.checkpoint_rows``); its MoE models add experts under a softmax router whose learned
bias per expert only chooses, and shared experts. Arcee's AFM is Llama with an ungated MLP,
``down(relu(up(x))^2)``. Zhipu's GLM-4.5 (``Glm4MoeForCausalLM``) is Llama with q/k/v biases,
RoPE over half of each head, optional per-head q/k norms (``use_qk_norm``), and, from layer
``first_k_dense_replace`` on, experts under DeepSeek-V3's grouped sigmoid router plus a shared
expert (layers/moe.py); its checkpoints' multi-token-prediction layer is not loaded.
rednote's dots.llm1 (``Dots1ForCausalLM``) is Qwen3 (per-head q/k norms) with DeepSeek-V3's
experts, its ``attention_bias`` on all four projections. Tencent's Hunyuan dense models
(``HunYuanDenseV1ForCausalLM``) are Llama with per-head q/k norms after RoPE and a fixed NTK
stretch of the RoPE base (``alpha``; the ``ntk_alpha`` rope type); its MoE models add experts
under a float32 softmax router beside a shared MLP. The Swiss AI Initiative's
Apertus is Llama with per-head q/k norms and an ungated MLP whose xIELU activation has learned
scalars per layer (``basic.XIELU``); its norms' names are its own. LG AI's EXAONE 3.0 / 3.5
(``ExaoneForCausalLM``) is Llama under GPT-2-style names (``transformer.h.N.attn.attention``,
``c_fc_0`` / ``c_fc_1``), renamed on loading as transformers renames them. AllenAI's OLMoE
is Llama with norms over the whole query and key projections (as OLMo 2's, Llama's
arithmetic), an optional ``clip_qkv``, and experts in every layer. MiniMax-M2
(``MiniMaxM2ForCausalLM``) has those norms, RoPE over the first ``rotary_dim`` values of each
head, and Mixtral's experts under a sigmoid router whose learned bias only chooses. Meta's
Llama 4 (``Llama4ForCausalLM``, the language model of Scout and Maverick) rotates interleaved
pairs (reordered on loading, as ERNIE's) and L2-normalises each query and key head after RoPE
on its chunked layers (each token attends within its chunk of ``attention_chunk_size``);
every fourth layer (``no_rope_layers``) attends to the whole context without RoPE, its
queries scaled by a temperature growing with the position; its experts (stacked in the
checkpoint, split on loading) take the top-1 expert's input scaled by its sigmoid score,
beside a shared expert."""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from pagedserve.gpu_worker.layers.attention import AttentionMetadata
from pagedserve.gpu_worker.layers.basic import (
    RMSNorm,
    ShardedRMSNorm,
    WeightlessRMSNorm,
    empty_parameter,
    norm_query_and_key_heads,
)
from pagedserve.gpu_worker.layers.mlp import GatedMLP, UngatedMLP
from pagedserve.gpu_worker.layers.moe import SparseMoE
from pagedserve.gpu_worker.layers.rotary import RotaryEmbedding, pairs_to_halves
from pagedserve.gpu_worker.layers.self_attention import SelfAttention
from pagedserve.gpu_worker.model_config import (
    HUNYUAN,
    ModelConfig,
    llama4_nope_temperature,
    llama4_query_scaling,
    rope_layers,
)
from pagedserve.gpu_worker.models.base import (
    StackedDecoderLM,
    load_fused_checkpoint,
    split_fused_projections,
    without_next_token_layers,
)
from pagedserve.gpu_worker.parallel import SINGLE, TensorParallel

# Architectures that RMS-normalise each query and key head (``self_attn.q_norm`` /
# ``k_norm``, one weight of head_size shared by all heads) between projection and RoPE.
_PER_HEAD_QK_NORM = frozenset(
    {"Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Dots1ForCausalLM", "ApertusForCausalLM"}
)
# Llama's ungated-MLP members (``down(act(up(x)))``): Arcee's squared ReLU, Apertus's xIELU.
_UNGATED_MLP = frozenset({"ArceeForCausalLM", "ApertusForCausalLM"})


_GRANITE = frozenset({"GraniteForCausalLM", "GraniteMoeForCausalLM", "GraniteMoeSharedForCausalLM"})
_ERNIE = frozenset({"Ernie4_5ForCausalLM", "Ernie4_5_MoeForCausalLM"})


def _granite_scalar(config: ModelConfig, name: str) -> float | None:
    """One of Granite's scalars (the config class's default when the file leaves it out:
    ``model_config._CONFIG_DEFAULTS``); None on the other architectures."""
    return float(config.hf_config[name]) if config.architecture in _GRANITE else None


def _qkv_bias(config: ModelConfig) -> bool:
    """Qwen2 always has q/k/v biases, Qwen2-MoE unless ``qkv_bias`` is false; Llama,
    Mistral, Mixtral and Qwen3 when ``attention_bias`` says."""
    hf = config.hf_config
    if config.architecture == "Qwen2ForCausalLM":
        return True
    if config.architecture in _ERNIE:
        return bool(hf.get("use_bias"))
    if config.architecture == "Qwen2MoeForCausalLM":
        return bool(hf.get("qkv_bias", True))
    return bool(hf.get("attention_bias"))


# The config field that switches the attention's output-projection bias (and the MLP's, where
# it is not ``mlp_bias``), where it is not Llama's.
_OUTPUT_BIAS_FIELDS = {
    "SeedOssForCausalLM": "attention_out_bias",
    "Ernie4_5ForCausalLM": "use_bias",
    "Ernie4_5_MoeForCausalLM": "use_bias",
}
_MLP_BIAS_FIELDS = {"Ernie4_5ForCausalLM": "use_bias", "Ernie4_5_MoeForCausalLM": "use_bias"}


def _output_bias(config: ModelConfig) -> bool:
    """GLM-4.5's ``attention_bias`` gives q/k/v biases only; elsewhere its field says."""
    if config.architecture == "Glm4MoeForCausalLM":
        return False
    field = _OUTPUT_BIAS_FIELDS.get(config.architecture, "attention_bias")
    return bool(config.hf_config.get(field))


class LlamaAttention(SelfAttention):
    """Over this rank's query and KV heads (all of them without tensor parallelism); Qwen3's
    per-head query and key norms, Granite's attention scale."""

    def __init__(
        self,
        config: ModelConfig,
        rotary: RotaryEmbedding | None,
        dtype: torch.dtype,
        parallel: TensorParallel,
        sliding_window: int = 0,
        attention_chunk_size: int = 0,
    ) -> None:
        """``rotary``: None for a layer without position embeddings (SmolLM3's and Llama 4's
        NoPE layers)."""
        hf = config.hf_config
        super().__init__(
            config,
            rotary,
            dtype,
            parallel,
            bias=_qkv_bias(config),
            output_bias=_output_bias(config),
            sliding_window=sliding_window,
            scale=_granite_scalar(config, "attention_multiplier"),
            clip_qkv=hf.get("clip_qkv") if config.architecture == "OlmoeForCausalLM" else None,
            query_scaling=llama4_query_scaling(config),
            nope_temperature=llama4_nope_temperature(config, rotary is not None),
            attention_chunk_size=attention_chunk_size,
        )
        # OLMoE and MiniMax-M2 norm the whole query and key projections (all heads at once;
        # each rank its rows, the sum of squares over the ranks), Llama's arithmetic.
        self.whole_projection_norms = config.architecture in (
            "OlmoeForCausalLM",
            "MiniMaxM2ForCausalLM",
        )
        if self.whole_projection_norms:
            eps = hf.get("rms_norm_eps", 1e-5)
            query_rows, kv_rows, _ = self.qkv_proj.component_rows
            kv_replicas = max(1, parallel.size // config.num_kv_heads)
            self.q_norm = ShardedRMSNorm(
                config.num_heads * config.head_size,
                query_rows,
                eps,
                dtype,
                parallel,
                scale_in_float32=False,
            )
            self.k_norm = ShardedRMSNorm(
                config.num_kv_heads * config.head_size,
                kv_rows,
                eps,
                dtype,
                parallel,
                kv_replicas,
                scale_in_float32=False,
            )
            self.query_layernorm = self.key_layernorm = None
            return
        # Each rank holds whole heads, so the per-head norm weights are replicated, not split.
        per_head_norm = config.architecture in _PER_HEAD_QK_NORM or (
            config.architecture == "Glm4MoeForCausalLM" and bool(hf.get("use_qk_norm"))
        )
        eps = hf.get("rms_norm_eps", 1e-6)
        self.q_norm = RMSNorm(config.head_size, eps, dtype) if per_head_norm else None
        self.k_norm = RMSNorm(config.head_size, eps, dtype) if per_head_norm else None
        # Hunyuan norms each query and key head after RoPE, not before; Llama 4 too, on its
        # layers with RoPE, without learned scales.
        rotated_norm = config.architecture in HUNYUAN
        self.query_layernorm = RMSNorm(config.head_size, eps, dtype) if rotated_norm else None
        self.key_layernorm = RMSNorm(config.head_size, eps, dtype) if rotated_norm else None
        if config.architecture == "Llama4ForCausalLM" and hf["use_qk_norm"] and rotary:
            self.query_layernorm = WeightlessRMSNorm(config.head_size, eps, dtype)
            self.key_layernorm = WeightlessRMSNorm(config.head_size, eps, dtype)

    def normalize_qk(
        self, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.q_norm is None or self.k_norm is None:
            return query, key
        if self.whole_projection_norms:
            return self.q_norm(query), self.k_norm(key)
        return norm_query_and_key_heads(self.q_norm, self.k_norm, query, key, self.head_size)

    def normalize_rotated_qk(
        self, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.query_layernorm is None or self.key_layernorm is None:
            return query, key
        return norm_query_and_key_heads(
            self.query_layernorm, self.key_layernorm, query, key, self.head_size
        )


def _mlp(
    config: ModelConfig, dtype: torch.dtype, parallel: TensorParallel, layer_index: int
) -> nn.Module:
    """The layer's feed-forward block: a gated MLP, or experts where the config puts them."""
    hf = config.hf_config
    act_name = hf.get("hidden_act", "silu")
    experts = config.layer_experts[layer_index]
    if experts is not None:
        return SparseMoE(config.hidden_size, experts, act_name, dtype, parallel)
    if config.architecture == "Llama4ForCausalLM":  # its dense layers' own width
        return GatedMLP(
            config.hidden_size, hf["intermediate_size_mlp"], False, act_name, dtype, parallel
        )
    if config.architecture in _UNGATED_MLP:
        return UngatedMLP(
            config.hidden_size,
            hf["intermediate_size"],
            bool(hf.get("mlp_bias")),
            act_name,
            dtype,
            parallel,
        )
    return GatedMLP(
        config.hidden_size,
        hf["intermediate_size"],
        bool(hf.get(_MLP_BIAS_FIELDS.get(config.architecture, "mlp_bias"))),
        act_name,
        dtype,
        parallel,
    )


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        rotary: RotaryEmbedding,
        dtype: torch.dtype,
        parallel: TensorParallel,
        layer_index: int,
        self_attn: nn.Module | None = None,
    ) -> None:
        """``self_attn``: a family's own attention over (positions, hidden, metadata)
        (DeepSeek's latent attention); None: Llama's."""
        super().__init__()
        eps = config.hf_config.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype)
        if self_attn is None:
            rotates = rope_layers(config.architecture, config.hf_config)[layer_index]
            self_attn = LlamaAttention(
                config,
                rotary if rotates else None,
                dtype,
                parallel,
                config.layer_sliding_windows[layer_index],
                config.layer_attention_chunks[layer_index],
            )
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype)
        self.mlp = _mlp(config, dtype, parallel, layer_index)
        self.residual_multiplier = _granite_scalar(config, "residual_multiplier")

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Takes the previous layer's output and the running residual sum (None before
        the first layer); returns this layer's. Each residual add is fused with the norm
        that follows it: ``residual += out; normed = norm(residual)``, HF's arithmetic."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            self.input_layernorm.add_and_norm(hidden, residual)
        hidden = self.self_attn(positions, hidden, metadata)
        if self.residual_multiplier is not None:
            hidden = hidden * self.residual_multiplier
        self.post_attention_layernorm.add_and_norm(hidden, residual)
        hidden = self.mlp(hidden)
        if self.residual_multiplier is not None:
            hidden = hidden * self.residual_multiplier
        return hidden, residual


class LlamaForCausalLM(StackedDecoderLM):
    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, parallel: TensorParallel = SINGLE
    ) -> None:
        super().__init__(config, dtype, parallel)
        hf = config.hf_config
        rotary = self.model_rotary()
        self.stack_layers(lambda index: LlamaDecoderLayer(config, rotary, dtype, parallel, index))
        self.norm = RMSNorm(config.hidden_size, hf.get("rms_norm_eps", 1e-6), dtype)
        self.embedding_multiplier = _granite_scalar(config, "embedding_multiplier")
        self.logits_scaling = _granite_scalar(config, "logits_scaling")
        # ERNIE 4.5 MoE's LM head has a bias when ``use_bias`` says (the dense model's never).
        self.lm_head_bias = (
            empty_parameter(config.vocab_size, dtype=dtype)
            if config.architecture == "Ernie4_5_MoeForCausalLM" and hf.get("use_bias")
            else None
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """Each layer passes on its output and the running residual (fused adds)."""
        hidden = self.embed_tokens(input_ids)
        if self.embedding_multiplier is not None:
            hidden = hidden * self.embedding_multiplier
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, metadata)
        self.norm.add_and_norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.logits_table.logits(hidden_states)
        if self.lm_head_bias is not None:
            logits += self.lm_head_bias.float()
        if self.logits_scaling is not None:
            logits = logits / self.logits_scaling
        return logits

    def checkpoint_rows(self, projection: str, tensor: torch.Tensor) -> torch.Tensor:
        """ERNIE 4.5's and Llama 4's query and key rows from interleaved pairs to halves (on
        Llama 4's layers without RoPE too: a permutation of both, which leaves their dot
        products and norms as they are)."""
        interleaved = self.config.architecture in (*_ERNIE, "Llama4ForCausalLM")
        if interleaved and projection in ("q_proj", "k_proj"):
            return pairs_to_halves(tensor, self.config.head_size, self.config.head_size)
        return tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.config.architecture == "Phi3ForCausalLM":
            weights = split_fused_projections(self.config, weights)
        if self.config.architecture in ("GraniteMoeForCausalLM", "GraniteMoeSharedForCausalLM"):
            weights = _split_granite_experts(weights)
        if self.config.architecture == "Glm4MoeForCausalLM":
            weights = without_next_token_layers(self.config, weights)
        if self.config.architecture == "Ernie4_5_MoeForCausalLM":
            weights = _ernie_moe_tensors(weights)
        if self.config.hf_config.get("model_type") == "exaone":  # EXAONE 3.x's own names
            weights = ((_exaone_name(name), tensor) for name, tensor in weights)
        if self.config.architecture == "HunYuanMoEV1ForCausalLM":
            weights = ((_hunyuan_moe_name(name), tensor) for name, tensor in weights)
        if self.config.architecture == "ApertusForCausalLM":
            weights = ((_apertus_name(name), tensor) for name, tensor in weights)
        if self.config.architecture == "MiniMaxM2ForCausalLM":
            weights = ((_minimax_m2_name(name), tensor) for name, tensor in weights)
        if self.config.architecture == "Qwen3MoeForCausalLM":
            weights = _split_stacked_experts(self.config, weights)
        if self.config.architecture == "Llama4ForCausalLM":
            weights = ((_llama4_name(name), tensor) for name, tensor in weights)
            weights = _split_stacked_experts(self.config, weights, hidden_first=True)

        def rows(name: str, tensor: torch.Tensor) -> torch.Tensor:
            return self.checkpoint_rows(name.rpartition(".")[0].rpartition(".")[2], tensor)

        load_fused_checkpoint(self, weights, rename=_mixtral_names, convert=rows)


# Granite MoE's stacked tensors (the checkpoint's names, and transformers 5's) -> per expert.
_GRANITE_MOE_TENSORS = {
    "block_sparse_moe.input_linear.weight": "gate_up",
    "block_sparse_moe.experts.gate_up_proj": "gate_up",
    "block_sparse_moe.output_linear.weight": "down",
    "block_sparse_moe.experts.down_proj": "down",
    "block_sparse_moe.router.layer.weight": "router",
    "block_sparse_moe.router.weight": "router",
    # Granite MoE Shared's MLP beside the experts: rows [gate | up], then down.
    "shared_mlp.input_linear.weight": "shared_gate_up",
    "shared_mlp.output_linear.weight": "shared_down",
}


def _split_granite_experts(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterable[tuple[str, torch.Tensor]]:
    """Granite MoE's experts as Mixtral-style per-expert projections: the stacked
    [experts, 2 * intermediate, hidden] input tensor split into each expert's gate (its first
    half of rows, HF's ``chunk(2)``) and up, the [experts, hidden, intermediate] output
    tensor into each down projection; the router is the MoE's gate."""
    for name, tensor in weights:
        prefix, kind = next(
            (
                (name.removesuffix(suffix), kind)
                for suffix, kind in _GRANITE_MOE_TENSORS.items()
                if name.endswith(suffix)
            ),
            (name, None),
        )
        if kind == "router":
            yield f"{prefix}mlp.gate.weight", tensor
        elif kind == "gate_up":
            for expert, stacked in enumerate(tensor):
                gate, up = stacked.chunk(2, dim=0)
                yield f"{prefix}mlp.experts.{expert}.gate_proj.weight", gate
                yield f"{prefix}mlp.experts.{expert}.up_proj.weight", up
        elif kind == "down":
            for expert, down in enumerate(tensor):
                yield f"{prefix}mlp.experts.{expert}.down_proj.weight", down
        elif kind == "shared_gate_up":
            gate, up = tensor.chunk(2, dim=0)
            yield f"{prefix}mlp.shared_experts.gate_proj.weight", gate
            yield f"{prefix}mlp.shared_experts.up_proj.weight", up
        elif kind == "shared_down":
            yield f"{prefix}mlp.shared_experts.down_proj.weight", tensor
        else:
            yield name, tensor


def _split_stacked_experts(
    config: ModelConfig,
    weights: Iterable[tuple[str, torch.Tensor]],
    hidden_first: bool = False,
) -> Iterable[tuple[str, torch.Tensor]]:
    """A layer's experts stacked in two tensors (Qwen3-VL-MoE's checkpoints:
    ``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``) as each expert's projections.
    Either orientation, as transformers reads both: its own ([experts, 2 * intermediate,
    hidden] and [experts, hidden, intermediate]) or the published checkpoints' transposed one
    ([experts, hidden, 2 * intermediate], [experts, intermediate, hidden]), told apart by the
    hidden size (where the two sizes are equal, transformers' own, as it reads them), or
    always the transposed one with ``hidden_first`` (Llama 4's, which its HF model holds).
    Gate rows first, HF's ``chunk(2)``."""
    hidden = config.hidden_size
    for name, tensor in weights:
        if name.endswith(".mlp.experts.gate_up_proj"):
            if hidden_first or tensor.shape[-1] != hidden:
                tensor = tensor.transpose(1, 2)
            prefix = name.removesuffix("gate_up_proj")
            for expert, stacked in enumerate(tensor):
                gate, up = stacked.chunk(2, dim=0)
                yield f"{prefix}{expert}.gate_proj.weight", gate
                yield f"{prefix}{expert}.up_proj.weight", up
        elif name.endswith(".mlp.experts.down_proj"):
            if hidden_first or tensor.shape[1] != hidden:
                tensor = tensor.transpose(1, 2)
            prefix = name.removesuffix("down_proj")
            for expert, down in enumerate(tensor):
                yield f"{prefix}{expert}.down_proj.weight", down
        else:
            yield name, tensor


# Apertus's names for Llama's layer norms and the MLP's activation.
_APERTUS_NAMES = {
    ".attention_layernorm.": ".input_layernorm.",
    ".feedforward_layernorm.": ".post_attention_layernorm.",
    ".mlp.act_fn.": ".mlp.act.",
}


# EXAONE 3.0 / 3.5's checkpoint names -> Llama's (transformers' own renaming, in order).
_EXAONE_NAMES = (
    (re.compile(r"^transformer\.wte\."), "model.embed_tokens."),
    (re.compile(r"^transformer\.h\."), "model.layers."),
    (re.compile(r"^transformer\.ln_f\."), "model.norm."),
    (re.compile(r"\.attn\.attention\."), ".self_attn."),
    (re.compile(r"\.self_attn\.out_proj\."), ".self_attn.o_proj."),
    (re.compile(r"\.ln_1\."), ".input_layernorm."),
    (re.compile(r"\.ln_2\."), ".post_attention_layernorm."),
    (re.compile(r"\.mlp\.c_fc_0\."), ".mlp.gate_proj."),
    (re.compile(r"\.mlp\.c_fc_1\."), ".mlp.up_proj."),
    (re.compile(r"\.mlp\.c_proj\."), ".mlp.down_proj."),
)


def _exaone_name(name: str) -> str:
    for pattern, llama in _EXAONE_NAMES:
        name = pattern.sub(llama, name)
    return name


def _hunyuan_moe_name(name: str) -> str:
    """Hunyuan MoE's router (``mlp.gate.wg``) and shared MLP (``mlp.shared_mlp``) as
    ``SparseMoE`` names them."""
    return name.replace(".mlp.gate.wg.", ".mlp.gate.").replace(
        ".mlp.shared_mlp.", ".mlp.shared_experts."
    )


def _apertus_name(name: str) -> str:
    for apertus, llama in _APERTUS_NAMES.items():
        name = name.replace(apertus, llama)
    return name


def _ernie_moe_tensors(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterable[tuple[str, torch.Tensor]]:
    """ERNIE 4.5 MoE's checkpoint as the router holds it: the bias [1, experts] of
    ``mlp.moe_statics`` (Baidu's name; transformers' ``mlp.gate.moe_statics``) as
    ``mlp.gate.e_score_correction_bias`` [experts], the LM head's bias as ``lm_head_bias``;
    without the multi-token-prediction tensors (``mtp_*``), which HF does not load either."""
    for name, tensor in weights:
        if any(part.startswith("mtp") for part in name.split(".")):
            continue
        if name == "lm_head.bias":
            name = "lm_head_bias"
        for stem in (".mlp.gate.moe_statics.", ".mlp.moe_statics."):
            if stem in name:
                name = name.replace(stem, ".mlp.gate.")
                tensor = tensor.reshape(-1)
        yield name, tensor


def _llama4_name(name: str) -> str:
    """Llama 4's feed-forward names (``feed_forward``, its ``router``, its ungated
    ``shared_expert``) as ``SparseMoE`` and ``GatedMLP`` hold them."""
    return (
        name.replace(".feed_forward.router.", ".mlp.gate.")
        .replace(".feed_forward.shared_expert.", ".mlp.shared_experts.")
        .replace(".feed_forward.", ".mlp.")
    )


def _minimax_m2_name(name: str) -> str:
    """MiniMax-M2's router bias (``block_sparse_moe.e_score_correction_bias``, transformers 5's
    ``mlp.e_score_correction_bias``) beside its router, as this engine keeps it."""
    for prefix in (".block_sparse_moe.", ".mlp."):
        if name.endswith(prefix + "e_score_correction_bias"):
            return name.replace(
                prefix + "e_score_correction_bias", ".mlp.gate.e_score_correction_bias"
            )
    return name


# Mixtral's sparse block and its experts' gate, down and up projections, by their own names.
_MIXTRAL_PROJECTIONS = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


def _mixtral_names(name: str) -> str:
    """``layers.L.block_sparse_moe.experts.E.w1.weight`` -> ``layers.L.mlp.experts.E.
    gate_proj.weight`` (and w2 -> down_proj, w3 -> up_proj); other names unchanged."""
    name = name.replace(".block_sparse_moe.", ".mlp.")
    module, _, attribute = name.rpartition(".")
    parent, _, projection = module.rpartition(".")
    if projection in _MIXTRAL_PROJECTIONS:
        return f"{parent}.{_MIXTRAL_PROJECTIONS[projection]}.{attribute}"
    return name
