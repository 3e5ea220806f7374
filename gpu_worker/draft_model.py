"""Speculative decoding with a draft model: a small model of the target's vocabulary
guesses each decoding sequence's next tokens, and the target checks them in one pass.

The draft model keeps a KV cache pool of its own, with as many blocks as the target's,
and shares the target's block tables: block ``b`` of a sequence holds the target's K/V for
those positions in the target's pool and the draft's in the draft's pool. So the
scheduler's block manager serves both: the worker copies (copy-on-write) and swaps each
block in both pools, and a cached prefix carries the draft's K/V along with the target's.

After each step the draft runs over what the target kept of the step's tokens (a prompt
chunk, or a sequence's last token and its accepted drafts), so its cache follows the
target's. For each sequence that sampled and may speculate (one sample, no beams) it then
also takes the token just sampled, and guesses greedily, one token a pass, up to
``num_speculative_tokens`` guesses, writing their K/V in slots past the sequence's
computed tokens. Those slots are rewritten when the target computes those positions, so a
wrong guess costs only its share of a pass. A sequence guesses only as far as its table
has slots: the scheduler reserves blocks for the guesses when they are free
(``Scheduler._reserve_draft_slots``), and never preempts for them.

The guesses go back in the step's result; the scheduler schedules them after the
sequence's last token in its next step, and the target's sampling keeps the longest prefix
it agrees with (``model_runner._emitted_rows``). A guess made with certainty is accepted
with the target's probability for it, and on a rejection the target's own sample comes
from the rest of its distribution: rejection sampling for a one-hot draft distribution,
exact, so the output is the target's, the same tokens for the same seed. A poor draft
model only makes fewer tokens per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.gpu_worker.layers.attention import AttentionMetadata
from pagedserve.gpu_worker.models.base import CausalLM


@dataclass
class DraftRow:
    """One sequence of the step, as the draft model sees it after the target sampled."""

    request_id: str
    token_ids: list[int]  # its known tokens, this step's samples included
    block_ids: list[int]  # its block table
    start: int  # the first position the target computed in this step
    end: int  # one past the last position whose K/V the target kept
    # The sequence sampled and may speculate: its token at ``end`` (the one just sampled)
    # joins the pass, and the draft guesses after it.
    proposes: bool
    # The row of the step's target hidden states at position ``start`` (the rows up to
    # ``end`` follow it): what a multi-token-prediction layer drafts from.
    hidden_row: int = 0


@dataclass
class _PassRow:
    row: DraftRow
    start: int  # position of its first token in this pass
    token_ids: list[int]
    guesses: bool  # the pass's last token of this row predicts a guess


class DraftModel:
    """The draft model, bound to its own KV cache pool, and how it guesses."""

    def __init__(
        self,
        model: CausalLM,
        num_speculative_tokens: int,
        vocab_size: int,
        max_positions: int,
        block_size: int,
        device: torch.device,
        gathered_prefill: bool,
        attention_chunk_size: int = 0,
        latent_attention: bool = False,
    ) -> None:
        """``vocab_size``: the target's; a guess is one of its tokens even where the draft
        model's vocabulary is padded further. ``max_positions``: the draft model's context
        window; past it the draft neither follows a sequence nor guesses for it (the
        target's window may be longer). ``attention_chunk_size``, ``latent_attention``: the
        draft model's (``ModelConfig``'s)."""
        self.model = model
        self.attention_chunk_size = attention_chunk_size
        self.latent_attention = latent_attention
        self.max_positions = max_positions
        self.num_speculative_tokens = num_speculative_tokens
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.device = device
        self.gathered_prefill = gathered_prefill

    def propose(
        self, rows: list[DraftRow], hidden: torch.Tensor | None = None
    ) -> dict[str, list[int]]:
        """Bring the draft's cache up to the target's for every row, and return the
        guesses of each proposing row that has a slot for them (one at least). A draft model
        reads tokens alone: the target's ``hidden`` states are not used."""
        first_pass = []
        for row in rows:
            end = min(row.end, self.max_positions)
            guesses = row.proposes and end == row.end and self._has_slot(row, end)
            if guesses:
                end += 1  # the token just sampled, at position row.end
            if end > row.start:
                first_pass.append(_PassRow(row, row.start, row.token_ids[row.start : end], guesses))
        if not first_pass:
            return {}
        drafts: dict[str, list[int]] = {}
        batch = first_pass
        for count in range(self.num_speculative_tokens):
            guesses = self._forward(batch)
            batch_next = []
            for pass_row, token_id in zip((r for r in batch if r.guesses), guesses):
                row = pass_row.row
                drafts.setdefault(row.request_id, []).append(token_id)
                position = row.end + count + 1  # where this guess's own K/V goes
                if count + 1 < self.num_speculative_tokens and self._has_slot(row, position):
                    batch_next.append(_PassRow(row, position, [token_id], True))
            if not batch_next:
                break
            batch = batch_next
        return drafts

    def _has_slot(self, row: DraftRow, position: int) -> bool:
        return position < min(len(row.block_ids) * self.block_size, self.max_positions)

    def _forward(self, batch: list[_PassRow]) -> list[int]:
        """One pass of the draft model over ``batch``; returns the guess of each row that
        guesses, in batch order."""
        # Decodes first: the attention layer runs the decode kernel on that prefix.
        batch.sort(key=lambda pass_row: len(pass_row.token_ids) != 1)
        input_ids: list[int] = []
        logits_indices = []
        for pass_row in batch:
            input_ids.extend(pass_row.token_ids)
            if pass_row.guesses:
                logits_indices.append(len(input_ids) - 1)
        device = self.device
        metadata, positions = AttentionMetadata.for_sequences(
            [(r.row.block_ids, r.start, len(r.token_ids)) for r in batch],
            self.block_size,
            device,
            self.gathered_prefill,
            self.attention_chunk_size,
            self.latent_attention,
        )
        with torch.inference_mode():
            hidden = self.model(
                torch.tensor(input_ids, dtype=torch.int64, device=device), positions, metadata
            )
            if not logits_indices:
                return []
            rows = torch.tensor(logits_indices, dtype=torch.int64, device=device)
            logits = self.model.compute_logits(hidden[rows])[:, : self.vocab_size]
            # NOTE: on a GPU, one synchronization per pass (the guesses feed the next pass).
            return logits.argmax(dim=-1).tolist()
