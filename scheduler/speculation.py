"""Speculative decoding in the scheduler (a part of ``Scheduler``): a decoding sequence's
draft tokens within the budget and its room (prompt lookup, or a worker drafter's
guesses), and the slots a drafter's next guesses need, only in blocks nobody else needs."""

from __future__ import annotations

from pagedserve.scheduler import ngram_proposer
from pagedserve.scheduler.request import Request
from pagedserve.scheduler.speculative_config import WORKER_DRAFTED_METHODS


class Speculation:
    """``Scheduler``'s drafts (a mixin)."""

    def _draft_tokens(self, request: Request, num_new: int, budget: int) -> list[int]:
        """Draft tokens for a decoding sequence that may speculate: within the token
        budget and the sequence's room, so every emitted token fits max_tokens."""
        config = self.config
        if (
            not config.num_speculative_tokens
            or not self._speculating
            or num_new != 1
            or request.num_computed_tokens + 1 != request.num_tokens
            or request.group is not None  # n > 1, best_of, beams: one token a step
        ):
            return []
        room = min(
            config.num_speculative_tokens,
            budget - 1,
            request.max_total_tokens - request.num_tokens - 1,
        )
        epoch_end = config.rotation_epoch_end(request.rotation_epoch)
        if epoch_end is not None:
            # A draft past its rotation epoch's end would be computed in the old rotation
            # where HF computes the sequence again in the new one.
            room = min(room, epoch_end - request.num_tokens)
        if room < 1:
            return []
        grammar = request.grammar
        # Under a grammar, the tokens it forces come first (jump-forward, checked like
        # any draft); then the draft model's guesses or prompt lookup, cut where the
        # grammar would refuse a draft.
        drafts = grammar.forced_tokens()[:room] if grammar is not None else []
        if not drafts and config.speculative_method in WORKER_DRAFTED_METHODS:
            drafts = request.draft_token_ids[:room]
        elif not drafts:
            drafts = ngram_proposer.propose(
                request.token_ids,
                room,
                config.prompt_lookup_min,
                config.prompt_lookup_max,
            )
        if grammar is not None and drafts:
            drafts = drafts[: grammar.usable_drafts(drafts)]
        return drafts

    def _drafts_fit(self, request: Request, target: int, num_drafts: int, num_left: int) -> bool:
        """Whether a sequence's drafts fit: in the slots its table already has, or in new
        blocks that still leave one for each of the ``num_left - 1`` running sequences
        after it. A guess never takes a block another sequence needs (never causes a
        preemption)."""
        block_manager = self.block_manager
        request_id = request.request_id
        needed = block_manager.num_new_blocks(request_id, target + num_drafts)
        extra = needed - block_manager.num_new_blocks(request_id, target)
        if extra == 0:
            return True
        if block_manager.needs_copy_on_write(request_id, request.num_computed_tokens):
            needed += 1
        return needed + num_left - 1 <= block_manager.num_free_blocks

    def _reserve_draft_slots(self, request: Request, target: int, num_left: int) -> list[int]:
        """Blocks for the draft model's guesses (speculative decoding with a draft model):
        after this step the workers' draft model writes K/V for the sequence's next token
        and its guesses past the ``target`` tokens scheduled, up to ``num_speculative_tokens``
        positions, wherever its table has slots (``gpu_worker/draft_model.py``). Reserved
        only from blocks that leave one for each of the ``num_left - 1`` running sequences
        after it, as ``_drafts_fit`` does: fewer slots only mean fewer guesses, and a guess
        never preempts. Returns the blocks added to the table."""
        config = self.config
        if (
            config.speculative_method not in WORKER_DRAFTED_METHODS
            or not config.num_speculative_tokens
            or not self._speculating
            or request.group is not None
            or request.pooling_params is not None
            or target < request.num_tokens  # a prefill chunk: nothing sampled after it
        ):
            return []
        block_manager = self.block_manager
        end = min(target + config.num_speculative_tokens, request.max_total_tokens)
        needed = block_manager.num_new_blocks(request.request_id, end)
        if needed == 0 or needed + num_left - 1 > block_manager.num_free_blocks:
            return []
        return block_manager.append(request.request_id, end) or []
