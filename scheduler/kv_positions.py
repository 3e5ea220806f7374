"""What a sequence's position does to its KV (a part of ``Scheduler``): blocks a sliding
window has left behind go back to the pool, and a sequence that grows past LongRoPE's
original context enters a new rotation epoch (its K/V rotated otherwise), computed again
from its first token, its cached prefixes kept apart."""

from __future__ import annotations

from pagedserve.scheduler.messages import StepPlan
from pagedserve.scheduler.prefix_cache import PrefixKey
from pagedserve.scheduler.request import Request


class KvPositions:
    """``Scheduler``'s windows and rotation epochs (a mixin)."""

    def _enters_new_rotation(self, request: Request) -> bool:
        """Whether a sequence has grown into a rotation epoch its K/V were not computed in
        (``SchedulerConfig.rotation_epoch``: a LongRoPE sequence past the original
        context): HF's Phi-3 then drops its cache and computes the whole sequence again."""
        return self.config.rotation_epoch(request.num_tokens) > request.rotation_epoch

    def _recompute_in_new_rotation(self, request: Request, plan: StepPlan) -> None:
        """Take the sequence (its group's, all of them) out of the batch to compute again
        from its first token, as HF does at this point: it resumes ahead of newer requests,
        in its new rotation, and takes prefix hits among such sequences only."""
        group = request.group
        sequences = (
            [request]
            if group is None
            else [sequence for sequence in self.running if sequence.group is group]
        )
        ids = {sequence.request_id for sequence in sequences}
        self.running = [sequence for sequence in self.running if sequence.request_id not in ids]
        self._preempt(
            sequences, plan, "a new rotation epoch (LongRoPE past the original context)",
            mode="recompute", counted=False,
        )  # fmt: skip

    @staticmethod
    def _prefix_key(request: Request) -> PrefixKey:
        """Whose cached prefixes the request's K/V may share: those of the same adapter,
        cache salt and rotation epoch (the same tokens give other K/V otherwise)."""
        return PrefixKey(request.lora_id, request.cache_namespace, request.rotation_epoch)

    def _free_blocks_before_window(self, plan: StepPlan, request: Request) -> None:
        """Give back the sequence's blocks that its window has left behind (a windowed model
        only), before it asks for new ones; the workers mark them in their tables."""
        block_manager = self.block_manager
        before = block_manager.num_window_freed(request.request_id)
        num_freed = block_manager.free_blocks_before_window(
            request.request_id, request.num_computed_tokens
        )
        if not num_freed:
            return
        self.num_window_freed_blocks += num_freed - before
        if request.request_id in self._known_to_workers:
            plan.window_freed_blocks[request.request_id] = num_freed
