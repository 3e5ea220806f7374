"""The Figure-2 categories: stored, reserved, internal and external fragmentation."""

from __future__ import annotations

import pytest

from pagedserve.scheduler.memory_accounting import MemoryAccounting


def test_categories_are_attributed_when_the_final_length_is_known():
    accounting = MemoryAccounting()
    # A contiguous reservation of 16 slots; the sequence ends at 10 tokens.
    for stored in (4, 6, 8):
        accounting.record_sequence("a", 16, stored)
    accounting.record_step(table_slots=16, used_slots=16, external_slots=8)
    assert accounting.summary()["kv_utilization"] == 0.0  # nothing attributed yet
    accounting.finish_sequence("a", final_tokens=10)
    # stored 18; reservation (10 - 4) + (10 - 6) + (10 - 8) = 12; internal 6 x 3 = 18.
    assert (accounting.stored, accounting.reservation) == (18, 12)
    assert accounting.internal_fragmentation == 18
    assert accounting.external_fragmentation == 8
    summary = accounting.summary()
    assert summary["kv_utilization"] == pytest.approx(18 / 56)
    assert summary["kv_internal_fragmentation_fraction"] == pytest.approx(18 / 56)
    assert summary["kv_external_fragmentation_fraction"] == pytest.approx(8 / 56)


def test_sharing_savings_compare_table_slots_with_used_slots():
    accounting = MemoryAccounting()
    accounting.record_step(table_slots=64, used_slots=40, external_slots=0)
    accounting.record_step(table_slots=36, used_slots=30, external_slots=0)
    assert accounting.summary()["kv_sharing_savings"] == pytest.approx(30 / 100)
    accounting.finish_sequence("unknown", 5)  # never recorded: nothing to attribute
    assert accounting.stored == 0
