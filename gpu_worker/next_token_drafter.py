"""Speculative decoding with the target's own multi-token-prediction layer (method ``"mtp"``,
DeepSeek-V3's and GLM-4.5's ``num_nextn_predict_layers``; the module is
``models/multi_token_predictor.py``): it guesses from the target's final hidden states, so it
runs after each step over the hidden states the step just computed.

Like a draft model (``draft_model.py``) it keeps a one-layer KV cache pool beside the
target's, under the same block tables: its K/V at position ``i`` is computed from the
target's hidden state at ``i`` and the token at ``i + 1``, so after each step it runs over
the positions the target kept whose next token is known (all of them once the step's sample
is in), with the step's hidden-state rows. The last of those rows of a sequence that sampled
and may speculate gives the first guess; each further guess runs the layer once more at the
next position, on the guess before it and the layer's own output, writing K/V in a slot past
the sequence's computed tokens that the target's next step rewrites. The scheduler verifies
the guesses as it does a draft model's (rejection sampling: the output is the target's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.gpu_worker.draft_model import DraftRow
from pagedserve.gpu_worker.layers.attention import AttentionMetadata
from pagedserve.gpu_worker.models.multi_token_predictor import MultiTokenPredictor


@dataclass
class _PassRow:
    row: DraftRow
    start: int  # position of its first row in this pass
    token_ids: list[int]  # each position's next token
    guesses: bool  # the pass's last row of this sequence predicts a guess


class NextTokenDrafter:
    """The multi-token-prediction layer, bound to its own KV cache pool, and how it guesses
    (the interface of ``DraftModel``, with the step's hidden states)."""

    def __init__(
        self,
        model: MultiTokenPredictor,
        num_speculative_tokens: int,
        vocab_size: int,
        max_positions: int,
        block_size: int,
        device: torch.device,
        gathered_prefill: bool,
        latent_attention: bool,
    ) -> None:
        self.model = model
        self.num_speculative_tokens = num_speculative_tokens
        self.vocab_size = vocab_size
        self.max_positions = max_positions
        self.block_size = block_size
        self.device = device
        self.gathered_prefill = gathered_prefill
        self.latent_attention = latent_attention

    def propose(self, rows: list[DraftRow], hidden: torch.Tensor | None) -> dict[str, list[int]]:
        """Bring the layer's cache up to the target's for every row from the step's final
        hidden states ``hidden`` (each row's position ``start`` at its ``hidden_row``), and
        return the guesses of each proposing row (one at least)."""
        if hidden is None:
            return {}
        batch: list[_PassRow] = []
        for row in rows:
            # Positions whose next token is known: all the target kept once it sampled.
            end = min(row.end, len(row.token_ids) - 1)
            if end > row.start:
                guesses = row.proposes and end == row.end
                tokens = row.token_ids[row.start + 1 : end + 1]
                batch.append(_PassRow(row, row.start, tokens, guesses))
        if not batch:
            return {}
        # Decodes first: the attention layer runs the decode kernel on that prefix (the
        # further passes are decodes only, in this order).
        batch.sort(key=lambda pass_row: len(pass_row.token_ids) != 1)
        hidden_rows = [
            pass_row.row.hidden_row + offset
            for pass_row in batch
            for offset in range(len(pass_row.token_ids))
        ]
        previous = hidden[torch.tensor(hidden_rows, dtype=torch.int64, device=hidden.device)]
        drafts: dict[str, list[int]] = {}
        for count in range(self.num_speculative_tokens):
            guesses, outputs = self._forward(batch, previous)
            batch_next = []
            next_rows = []
            for index, (pass_row, token_id) in enumerate(
                zip((r for r in batch if r.guesses), guesses)
            ):
                row = pass_row.row
                drafts.setdefault(row.request_id, []).append(token_id)
                position = row.end + count  # where the guess's pass writes its K/V
                if count + 1 < self.num_speculative_tokens and self._has_slot(row, position):
                    batch_next.append(_PassRow(row, position, [token_id], True))
                    next_rows.append(index)
            if not batch_next:
                break
            batch = batch_next
            previous = outputs[torch.tensor(next_rows, dtype=torch.int64, device=outputs.device)]
        return drafts

    def _has_slot(self, row: DraftRow, position: int) -> bool:
        return position < min(len(row.block_ids) * self.block_size, self.max_positions)

    def _forward(
        self, batch: list[_PassRow], previous: torch.Tensor
    ) -> tuple[list[int], torch.Tensor]:
        """One pass over ``batch`` (decodes first; ``previous``: each of its rows' hidden
        state in, in order); returns the guess of each row that guesses, in batch order, and
        the layer's outputs at those rows."""
        input_ids: list[int] = []
        guess_rows = []
        for pass_row in batch:
            input_ids.extend(pass_row.token_ids)
            if pass_row.guesses:
                guess_rows.append(len(input_ids) - 1)
        device = self.device
        metadata, positions = AttentionMetadata.for_sequences(
            [(r.row.block_ids, r.start, len(r.token_ids)) for r in batch],
            self.block_size,
            device,
            self.gathered_prefill,
            0,
            self.latent_attention,
        )
        with torch.inference_mode():
            outputs = self.model(
                torch.tensor(input_ids, dtype=torch.int64, device=device),
                positions,
                previous,
                metadata,
            )
            if not guess_rows:
                return [], outputs[:0]
            rows = torch.tensor(guess_rows, dtype=torch.int64, device=device)
            chosen = outputs[rows]
            logits = self.model.compute_logits(chosen)[:, : self.vocab_size]
            # NOTE: on a GPU, one synchronization per pass (the guesses feed the next pass).
            return logits.argmax(dim=-1).tolist(), chosen
