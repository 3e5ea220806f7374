"""Where the KV cache's slots go, step by step: the paper's Figure 2 for this engine.

After every step each sequence on the device holds ``allocated`` slots (its block table
times the block size; under a contiguous policy, its whole reservation) of which
``stored`` hold a computed token's K/V. How the rest is wasted depends on the length
the sequence finally reaches, ``final`` (prompt plus output), known when it ends; so
each sequence's steps are tallied then::

    slots:  [ stored | reservation (filled later) | internal fragmentation (never) ]
             0       stored                       min(allocated, final)    allocated

External fragmentation is free memory that requests wait for but cannot use: the free
slots outside the longest free run, on steps when requests are waiting under a
contiguous policy (paged allocation can use any free block, so it has none).

All figures are slot-steps (a slot held for one step), summed over the run, so a long
request weighs more than a short one in proportion to the memory it held and for how
long. Sharing is measured separately: table slots (each sequence counting its own
blocks) against the device blocks actually in use.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class _SequenceTally:
    # allocated slots -> steps held at that size; and the stored slots summed over steps.
    steps_by_allocation: Counter[int] = field(default_factory=Counter)
    stored_slot_steps: int = 0


class MemoryAccounting:
    """Slot-step totals by category; ``summary()`` gives the fractions."""

    def __init__(self) -> None:
        self.stored = 0
        self.reservation = 0
        self.internal_fragmentation = 0
        self.external_fragmentation = 0
        # Sharing: slots as every sequence's table counts them, and as used on device.
        self.table_slot_steps = 0
        self.used_slot_steps = 0
        self.num_steps = 0
        self._live: dict[str, _SequenceTally] = {}

    def record_sequence(self, sequence_id: str, allocated_slots: int, stored_slots: int) -> None:
        tally = self._live.get(sequence_id)
        if tally is None:
            tally = self._live[sequence_id] = _SequenceTally()
        tally.steps_by_allocation[allocated_slots] += 1
        tally.stored_slot_steps += stored_slots

    def record_step(self, table_slots: int, used_slots: int, external_slots: int) -> None:
        self.num_steps += 1
        self.table_slot_steps += table_slots
        self.used_slot_steps += used_slots
        self.external_fragmentation += external_slots

    def finish_sequence(self, sequence_id: str, final_tokens: int) -> None:
        """Attribute a finished sequence's steps now that its final length is known."""
        tally = self._live.pop(sequence_id, None)
        if tally is None:
            return
        self.stored += tally.stored_slot_steps
        within_final = 0
        for allocated, steps in tally.steps_by_allocation.items():
            within_final += min(allocated, final_tokens) * steps
            self.internal_fragmentation += max(0, allocated - final_tokens) * steps
        self.reservation += max(0, within_final - tally.stored_slot_steps)

    def summary(self) -> dict[str, float]:
        """Fractions of the KV memory in use (plus what fragmentation withheld)."""
        total = self.stored + self.reservation + self.internal_fragmentation
        total += self.external_fragmentation
        saved = self.table_slot_steps - self.used_slot_steps
        return {
            "kv_utilization": self.stored / total if total else 0.0,
            "kv_reservation_fraction": self.reservation / total if total else 0.0,
            "kv_internal_fragmentation_fraction": (
                self.internal_fragmentation / total if total else 0.0
            ),
            "kv_external_fragmentation_fraction": (
                self.external_fragmentation / total if total else 0.0
            ),
            "kv_sharing_savings": saved / self.table_slot_steps if self.table_slot_steps else 0.0,
        }
