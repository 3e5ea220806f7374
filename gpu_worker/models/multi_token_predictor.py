"""DeepSeek-V3's multi-token-prediction (MTP) module, as its checkpoints and GLM-4.5's and
GLM-4.7-Flash's carry it (``model.layers.{N}``, the layer after the ``num_hidden_layers``
decoder layers; HF transformers skips it): a draft model for speculative decoding (method
``"mtp"``, ``gpu_worker/next_token_drafter.py``).

At position ``i`` it takes the target's final hidden state there, ``h_i``, and the embedding
of the token after it, ``t_{i+1}``, and predicts ``t_{i+2}``:
``x = eh_proj([enorm(embed(t_{i+1})), hnorm(h_i)])``, one decoder layer of the target's
kind (its attention over a paged cache of its own, its experts), then
``head(shared_head.norm(x))``. The embedding is zero at position 0, as vLLM and SGLang
feed it (the first token has no hidden state before it in training). A second guess runs the
same layer again on the first guess, with this module's own output in place of ``h``.

The checkpoint's copies of the embedding and the head (``embed_tokens``,
``shared_head.head``) are loaded as tables of its own unless they equal the target's (as
DeepSeek-V3's do: the paper shares them), which the module then reads instead, so a copy
takes no memory (DeepSeek-V3's head: 1.85 GB in bfloat16); a checkpoint without them
drafts with the target's.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedserve.gpu_worker.kv_cache import layer_caches
from pagedserve.gpu_worker.layers.attention import AttentionMetadata
from pagedserve.gpu_worker.layers.basic import Linear, RMSNorm
from pagedserve.gpu_worker.layers.packed_weights import pack_linear_weights
from pagedserve.gpu_worker.layers.vocab_embedding import VocabParallelEmbedding
from pagedserve.gpu_worker.model_config import ModelConfig
from pagedserve.gpu_worker.models.base import StackedDecoderLM, load_fused_checkpoint
from pagedserve.gpu_worker.models.deepseek import MultiHeadLatentAttention
from pagedserve.gpu_worker.models.llama import LlamaDecoderLayer
from pagedserve.gpu_worker.parallel import TensorParallel

# The module's own tensors, as the checkpoint names them under ``model.layers.{N}.``; the
# rest belong to its decoder layer.
_OWN_TENSORS = {
    "embed_tokens.weight": "embed_tokens.weight",
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "shared_head.norm.weight": "shared_head_norm.weight",
    "shared_head.head.weight": "head.weight",
}


def layer_prefix(target_config: ModelConfig) -> str:
    """The checkpoint names' prefix of the first multi-token-prediction layer."""
    return f"model.layers.{target_config.num_layers}."


class MultiTokenPredictor(nn.Module):
    """One MTP layer over the target's hidden states; ``config`` is
    ``model_config.next_token_layer_config``'s (a one-layer model: the layer's experts and
    cache)."""

    def __init__(
        self,
        target: StackedDecoderLM,
        config: ModelConfig,
        dtype: torch.dtype,
        parallel: TensorParallel,
    ) -> None:
        super().__init__()
        self.config = config
        hf = config.hf_config
        eps = hf.get("rms_norm_eps", 1e-6)
        hidden = config.hidden_size
        # The target's RoPE (its scaling, its rotated part of a head): the layer's positions
        # are the target's.
        rotary = target.layers[-1].self_attn.rotary
        attention = (
            MultiHeadLatentAttention(config, rotary, dtype, parallel)
            if config.latent_attention
            else None
        )
        self.layer = LlamaDecoderLayer(config, rotary, dtype, parallel, 0, attention)
        self.enorm = RMSNorm(hidden, eps, dtype)
        self.hnorm = RMSNorm(hidden, eps, dtype)
        self.eh_proj = Linear(2 * hidden, hidden, False, dtype)
        self.shared_head_norm = RMSNorm(hidden, eps, dtype)
        self.embed_tokens: VocabParallelEmbedding | None = VocabParallelEmbedding(
            config.vocab_size, hidden, dtype, parallel
        )
        self.head: VocabParallelEmbedding | None = VocabParallelEmbedding(
            config.vocab_size, hidden, dtype, parallel
        )
        # The target's tables, for a checkpoint without copies of its own (not submodules:
        # the target loads and packs them).
        self._target_tables = (target.embed_tokens, target.logits_table)
        self._checkpoint_rows = target.checkpoint_rows

    @property
    def layers(self) -> list[nn.Module]:
        return [self.layer]

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        self.layer.self_attn.key_cache, self.layer.self_attn.value_cache = layer_caches(kv_cache, 0)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        previous_hidden: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """``input_ids``: each position's next token; ``previous_hidden``: the target's final
        hidden state at each position (or this module's output, for a further guess) ->
        this module's output there (before ``shared_head.norm``)."""
        table = self.embed_tokens if self.embed_tokens is not None else self._target_tables[0]
        embedded = table(input_ids).masked_fill((positions == 0)[:, None], 0.0)
        hidden = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(previous_hidden)], -1))
        hidden, residual = self.layer(positions, hidden, None, metadata)
        return residual + hidden

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        head = self.head if self.head is not None else self._target_tables[1]
        return head.logits(self.shared_head_norm(hidden_states))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], prefix: str) -> None:
        """The tensors named ``prefix`` + ... (``layer_prefix``), every other one skipped;
        an absent embedding or head is the target's."""
        names: set[str] = set()

        def own(pairs: Iterable[tuple[str, torch.Tensor]]):
            for name, tensor in pairs:
                if not name.startswith(prefix):
                    continue
                rest = name.removeprefix(prefix)
                mapped = _OWN_TENSORS.get(rest, f"layer.{rest}")
                names.add(mapped)
                projection = mapped.rpartition(".")[0].rpartition(".")[2]
                yield mapped, self._checkpoint_rows(projection, tensor)

        pairs = list(own(weights))
        if "eh_proj.weight" not in names:
            raise ValueError(
                f"speculative_config.method 'mtp': the checkpoint of {str(self.config.path)!r} "
                f"has no multi-token-prediction layer ({prefix}eh_proj.weight is absent)"
            )
        if "embed_tokens.weight" not in names:
            self.embed_tokens = None
        if "head.weight" not in names:
            self.head = None
        load_fused_checkpoint(self, pairs)
        if isinstance(self.layer.self_attn, MultiHeadLatentAttention):
            self.layer.self_attn.absorb_kv_b_proj()
        target_embedding, target_head = self._target_tables
        if self.embed_tokens is not None and _same_table(self.embed_tokens, target_embedding):
            self.embed_tokens = None
        if self.head is not None and _same_table(self.head, target_head):
            self.head = None

    def pack_weights(self, quantization: str | None = None) -> int:
        packed = pack_linear_weights(self, quantization)
        if self.head is not None:
            packed += self.head.pack_for_logits()
        return packed


def _same_table(own: VocabParallelEmbedding, target: VocabParallelEmbedding) -> bool:
    """Whether this rank's rows of two tables are equal (a copy the module need not keep)."""
    return own.weight.shape == target.weight.shape and bool(torch.equal(own.weight, target.weight))
