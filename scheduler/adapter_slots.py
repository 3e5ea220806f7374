"""LoRA adapters as the scheduler sees them (a part of ``Scheduler``): loads and unloads
riding with the next step, and the cap on distinct adapters in a batch (``max_loras``)."""

from __future__ import annotations

from collections.abc import Iterable

from pagedserve.scheduler.messages import StepPlan
from pagedserve.scheduler.request import Request


class AdapterSlots:
    """``Scheduler``'s adapters (a mixin)."""

    def load_lora(self, lora_id: int, name: str, path: str) -> None:
        """Have the workers load adapter ``lora_id`` before the next step runs."""
        self._loras_to_load.append((lora_id, name, path))

    def unload_lora(self, lora_id: int) -> None:
        """Have the workers drop adapter ``lora_id`` once no request uses it."""
        self._loras_to_unload.add(lora_id)

    def _add_lora_updates(self, plan: StepPlan) -> None:
        """Pending adapter loads, and the unloads no live request holds back, ride with a
        step that runs (an idle engine keeps them until one does)."""
        if plan.is_empty:
            return
        plan.load_loras, self._loras_to_load = self._loras_to_load, []
        if self._loras_to_unload:
            in_use = {request.lora_id for request in self.requests.values()}
            ready = sorted(self._loras_to_unload - in_use)
            plan.unload_lora_ids = ready
            self._loras_to_unload.difference_update(ready)

    def _lora_slot_missing(self, head: Request, running: Iterable[Request]) -> bool:
        """Whether ``head``'s adapter would take a batch of ``running`` past ``max_loras``
        distinct adapters (never for the base model, nor an adapter already running)."""
        cap = self.config.max_loras
        if not cap or not head.lora_id:
            return False
        adapters = {sequence.lora_id for sequence in running if sequence.lora_id}
        return head.lora_id not in adapters and len(adapters) >= cap
