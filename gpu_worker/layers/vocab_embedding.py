"""The token embedding table split by vocabulary over tensor-parallel ranks, read both
ways: ids -> hidden states (the input embedding) and hidden states -> logits (the LM
head, tied to the embedding or a table of its own).

Rank r holds the rows of ids ``[r * rows_per_rank, (r + 1) * rows_per_rank)``;
``rows_per_rank`` is the vocabulary divided by the ranks, rounded up, so the last shard
may end in padding rows that no id reads and whose logits are dropped::

    vocab 10, 4 ranks:  rank 0: ids 0-2 | rank 1: 3-5 | rank 2: 6-8 | rank 3: 9, pad, pad
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.gpu_worker.layers.basic import empty_parameter
from pagedserve.gpu_worker.layers.packed_weights import (
    pack_weight,
    packed_linear,
    packing_available,
)
from pagedserve.gpu_worker.parallel import SINGLE, TensorParallel


class VocabParallelEmbedding(nn.Module):
    """``weight`` [rows_per_rank, embedding_dim]: this rank's rows of the table."""

    def __init__(
        self,
        vocab_size: int,
        embedding_dim: int,
        dtype: torch.dtype,
        parallel: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.parallel = parallel
        self.vocab_size = vocab_size
        self.rows_per_rank = -(-vocab_size // parallel.size)
        self.start = min(vocab_size, parallel.rank * self.rows_per_rank)
        self.end = min(vocab_size, self.start + self.rows_per_rank)
        self.weight = empty_parameter(self.rows_per_rank, embedding_dim, dtype=dtype)
        # The LM head's copy of the table in oneDNN's layout (see packed_weights.py); the
        # lookup keeps the plain table.
        self.packed_weight: torch.Tensor | None = None

    def pack_for_logits(self) -> bool:
        """Adds a packed copy for the LM head (the model asks only the table it reads logits
        from); True if this device and dtype have a packed path."""
        if self.packed_weight is not None or not packing_available(self.weight):
            return False
        self.packed_weight = pack_weight(self.weight)
        return True

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """int64 [num_tokens] -> [num_tokens, embedding_dim], the same on every rank:
        each rank looks up the ids it holds, zeros the others, and the sum over ranks
        (one non-zero term per row) is exact."""
        if self.parallel.size == 1:
            return F.embedding(input_ids, self.weight)
        in_shard = (input_ids >= self.start) & (input_ids < self.end)
        local_ids = torch.where(in_shard, input_ids - self.start, 0)
        embeddings = F.embedding(local_ids, self.weight)
        embeddings.masked_fill_(~in_shard[:, None], 0)
        return self.parallel.all_reduce(embeddings)

    def logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[rows, embedding_dim] -> float32 logits [rows, vocab_size], on every rank:
        each rank scores its ids, the scores are gathered side by side (every rank then
        samples the same tokens from the same bits, as vLLM v1 does, so each rank's
        cached tokens stay the ones rank 0 reports) and the padding is dropped."""
        if self.packed_weight is not None:
            logits = packed_linear(hidden_states, self.packed_weight, None)
        else:
            logits = F.linear(hidden_states, self.weight)
        if self.parallel.size > 1:
            # NOTE: an all_gather of [rows, vocab_size] per step.
            logits = self.parallel.all_gather(logits)[:, : self.vocab_size].contiguous()
        return logits.float()

    def shard_of(
        self, attribute: str, tensor: torch.Tensor, part: int | None
    ) -> tuple[int, torch.Tensor]:
        expected = (self.vocab_size, self.weight.shape[1])
        if tuple(tensor.shape) != expected:
            raise ValueError(
                f"checkpoint tensor for the {attribute!r} of a vocabulary table has shape "
                f"{tuple(tensor.shape)}, expected {expected}"
            )
        rows = tensor.new_zeros((self.rows_per_rank, *tensor.shape[1:]))
        rows[: self.end - self.start] = tensor[self.start : self.end]
        return 0, rows
