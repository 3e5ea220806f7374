"""What every model family provides to the model runner."""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable

import torch
from torch import nn

from pagedserve.gpu_worker.kv_cache import layer_caches
from pagedserve.gpu_worker.layers.attention import AttentionMetadata
from pagedserve.gpu_worker.layers.linear import ShardedWeights
from pagedserve.gpu_worker.layers.packed_weights import pack_linear_weights
from pagedserve.gpu_worker.layers.rotary import RotaryEmbedding, rope_parameters
from pagedserve.gpu_worker.layers.vocab_embedding import VocabParallelEmbedding
from pagedserve.gpu_worker.model_config import ModelConfig
from pagedserve.gpu_worker.parallel import TensorParallel


class CausalLM(nn.Module, abc.ABC):
    """A decoder-only model over a flattened batch of tokens and a paged KV cache.

    Families keep their decoder layers in ``self.layers``, each with ``self_attn``.
    """

    @abc.abstractmethod
    def forward(  # type: ignore[override]
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """``input_ids``/``positions`` int64 [num_tokens] -> hidden states [num_tokens,
        hidden_size] (before the LM head)."""

    @abc.abstractmethod
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Hidden states of the rows to sample -> float32 logits [rows, vocab_size]."""

    @abc.abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (HF names) into the parameters; every parameter must
        be covered."""

    @property
    @abc.abstractmethod
    def logits_table(self) -> VocabParallelEmbedding:
        """The vocabulary table the LM head reads (the embedding itself when tied)."""

    def pack_weights(self, quantization: str | None = None) -> int:
        """Once loading is over: packs every matrix that has a faster packed form on this
        device and dtype (``layers/packed_weights.py``), the linear layers quantized as
        ``quantization`` says (the LM head, a classifier head and embeddings never are);
        returns how many it packed."""
        packed = pack_linear_weights(self, quantization)
        if self.classifier is None:  # a classifier computes no logits over the vocabulary
            packed += self.logits_table.pack_for_logits()
        return packed

    def attach_classifier(self, config: ModelConfig, dtype: torch.dtype) -> None:
        """Make this a sequence classification model (HF's ``*ForSequenceClassification``):
        a ``score`` head maps the final hidden state to one logit per label, in place of
        the LM head (an untied one is dropped: the checkpoint has none). Every rank holds
        the whole head: it is small, and every rank has the whole hidden state."""
        if getattr(self, "lm_head", None) is not None:
            self.lm_head = None
        self.score = nn.Linear(config.embedding_size, len(config.labels), bias=False, dtype=dtype)
        self.score.weight.requires_grad_(False)

    @property
    def classifier(self) -> nn.Linear | None:
        """The classifier head (``attach_classifier``); None for a causal LM."""
        return self._modules.get("score")

    def classify(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Final hidden states [rows, hidden] -> float32 logits [rows, num_labels]."""
        if self.classifier is None:
            raise ValueError("this model has no classifier head (it is a causal LM)")
        return self.classifier(hidden_states).float()

    def checkpoint_rows(self, projection: str, tensor: torch.Tensor) -> torch.Tensor:
        """A checkpoint tensor whose rows are ``projection``'s outputs (its weight, bias, or a
        LoRA adapter's B), in the order this model keeps them: as stored, unless a family
        reorders them on loading (Cohere's and GLM-4's query and key rows)."""
        return tensor

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        """Point each layer's attention at its key/value views of ``kv_cache``."""
        for index, layer in enumerate(self.layers):
            layer.self_attn.key_cache, layer.self_attn.value_cache = layer_caches(kv_cache, index)


class PreNormDecoderLayer(nn.Module):
    """A decoder layer that norms each sublayer's input and adds its output to the residual:
    ``h += self_attn(input_layernorm(h))``, then ``h += mlp(post_attention_layernorm(h))``
    (StarCoder2's, gpt-oss's). A family sets the four modules."""

    input_layernorm: nn.Module
    self_attn: nn.Module
    post_attention_layernorm: nn.Module
    mlp: nn.Module

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden), metadata)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class StackedDecoderLM(CausalLM):
    """The shape the Llama family, OLMo 2, StarCoder2, Cohere and GLM-4 share: the token
    embedding, ``self.layers`` each mapping (positions, hidden, metadata) to hidden, a final
    ``self.norm``, and an LM head tied to the embedding or a table of its own
    (``tie_word_embeddings``, default ``tie_default``), split over the ranks alike. A family
    sets ``layers`` and ``norm`` after this ``__init__`` (Llama overrides ``forward``: its
    layers pass the residual on too)."""

    layers: nn.ModuleList
    norm: nn.Module

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        parallel: TensorParallel,
        tie_default: bool = False,
    ) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, dtype, parallel
        )
        tied = bool(config.hf_config.get("tie_word_embeddings", tie_default))
        self.tie_word_embeddings = tied
        self.lm_head = (
            None
            if tied
            else VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype, parallel)
        )

    def model_rotary(self) -> RotaryEmbedding:
        """The RoPE of a family with one for every layer: the config's scaling, over the
        model's context."""
        config = self.config
        return RotaryEmbedding(
            config.head_size, config.max_position_embeddings, rope_parameters(config.hf_config)
        )

    def stack_layers(self, make_layer: Callable[[int], nn.Module]) -> None:
        """``self.layers``: ``make_layer(index)`` for each of the config's layers."""
        self.layers = nn.ModuleList(make_layer(index) for index in range(self.config.num_layers))

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden = layer(positions, hidden, metadata)
        return self.norm(hidden)

    @property
    def logits_table(self) -> VocabParallelEmbedding:
        return self.embed_tokens if self.lm_head is None else self.lm_head

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.logits_table.logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_fused_checkpoint(self, weights)


class WeightLoader:
    """Copies named checkpoint tensors into parameters and checks that every parameter
    received all of its rows. A tensor-parallel layer (``ShardedWeights``) picks this
    rank's rows of each full tensor, and where they go in its parameter: a fused layer
    takes one component (``part``) at a time."""

    def __init__(self, model: nn.Module) -> None:
        self.parameters = dict(model.named_parameters())
        self.modules = dict(model.named_modules())
        self._rows_loaded: dict[str, int] = dict.fromkeys(self.parameters, 0)

    def load(self, name: str, tensor: torch.Tensor, part: int | None = None) -> None:
        if name not in self.parameters:
            raise ValueError(f"checkpoint tensor maps to unknown parameter {name!r}")
        module_name, _, attribute = name.rpartition(".")
        module = self.modules[module_name]
        target = self.parameters[name].data
        if isinstance(module, ShardedWeights):
            row_offset, tensor = module.shard_of(attribute, tensor, part)
            # Narrowed to what fits, so a tensor of the wrong shape meets the check below.
            length = max(0, min(tensor.shape[0], target.shape[0] - row_offset))
            target = target.narrow(0, row_offset, length)
        elif part is not None:
            raise ValueError(f"{name!r} is not a fused parameter, yet got part {part}")
        if target.shape != tensor.shape:
            raise ValueError(
                f"checkpoint tensor for {name!r} has shape {tuple(tensor.shape)}, "
                f"expected {tuple(target.shape)}"
            )
        target.copy_(tensor)
        self._rows_loaded[name] += tensor.shape[0] if tensor.dim() else 1

    def check_complete(self, except_names: Iterable[str] = ()) -> None:
        skipped = set(except_names)
        missing = [
            name
            for name, parameter in self.parameters.items()
            if name not in skipped
            and self._rows_loaded[name] < (parameter.shape[0] if parameter.dim() else 1)
        ]
        if missing:
            raise ValueError(f"checkpoint is missing weights for: {', '.join(missing[:8])}")


# A checkpoint's separate projections -> (the fused parameter that holds them, which part).
FUSED_PROJECTIONS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def load_fused_checkpoint(
    model: CausalLM,
    weights: Iterable[tuple[str, torch.Tensor]],
    rename: Callable[[str], str] | None = None,
    convert: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """Loads an HF checkpoint (``model.``-prefixed decoder names, separate q/k/v and
    gate/up projections) into a model that fuses them (``FUSED_PROJECTIONS``): ``rename``
    maps a family's own names onto these, ``convert`` changes a tensor before it is copied.
    A tied model skips a stored ``lm_head.weight`` (a copy of the embedding)."""
    loader = WeightLoader(model)
    tied = getattr(model, "lm_head", None) is None
    for name, tensor in weights:
        if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and tied):
            continue
        name = name.removeprefix("model.")
        if rename is not None:
            name = rename(name)
        if convert is not None:
            tensor = convert(name, tensor)
        module, _, attribute = name.rpartition(".")
        parent, _, projection = module.rpartition(".")
        # Fused where the model fuses it (an ungated MLP keeps its up_proj as it is).
        if projection in FUSED_PROJECTIONS and name not in loader.parameters:
            target, part = FUSED_PROJECTIONS[projection]
            loader.load(f"{parent}.{target}.{attribute}", tensor, part)
        else:
            loader.load(name, tensor)
    loader.check_complete()


def without_next_token_layers(
    config: ModelConfig, weights: Iterable[tuple[str, torch.Tensor]]
) -> Iterable[tuple[str, torch.Tensor]]:
    """A checkpoint without its multi-token-prediction layers (DeepSeek-V3's and GLM-4.5's
    ``model.layers.{N}``, the ``num_nextn_predict_layers`` (default 1) after the
    ``num_hidden_layers``), which HF does not load either (``_keys_to_ignore_on_load_unexpected``):
    they only draft tokens, and speculative decoding's method "mtp" loads the first on its own
    (``models/multi_token_predictor.py``)."""
    extra = config.hf_config.get("num_nextn_predict_layers", 1)
    next_token_layers = range(config.num_layers, config.num_layers + extra)
    for name, tensor in weights:
        parts = name.split(".", 3)
        if (
            parts[:2] == ["model", "layers"]
            and len(parts) > 2
            and parts[2].isdigit()
            and int(parts[2]) in next_token_layers
        ):
            continue
        yield name, tensor


def split_fused_projections(
    config: ModelConfig, weights: Iterable[tuple[str, torch.Tensor]]
) -> Iterable[tuple[str, torch.Tensor]]:
    """A checkpoint's fused tensors (Phi-3's ``qkv_proj`` rows [q | k | v], Phi-3's and
    GLM-4's ``gate_up_proj`` rows [gate | up], HF's ``chunk(2)``: gate first) as separate
    ones, which ``load_fused_checkpoint`` gives each tensor-parallel rank its share of."""
    q_rows = config.num_heads * config.head_size
    kv_rows = config.num_kv_heads * config.head_size
    for name, tensor in weights:
        parent, _, attribute = name.rpartition(".")
        if parent.endswith(".qkv_proj"):
            stem = parent.removesuffix("qkv_proj")
            query, key, value = tensor.split([q_rows, kv_rows, kv_rows], dim=0)
            yield f"{stem}q_proj.{attribute}", query
            yield f"{stem}k_proj.{attribute}", key
            yield f"{stem}v_proj.{attribute}", value
        elif parent.endswith(".gate_up_proj"):
            stem = parent.removesuffix("gate_up_proj")
            gate, up = tensor.chunk(2, dim=0)
            yield f"{stem}gate_proj.{attribute}", gate
            yield f"{stem}up_proj.{attribute}", up
        else:
            yield name, tensor
