"""Faults forced on purpose, to prove that a request's failure stays the request's.

An operator (or the fault-injection tests) sets ``PAGEDSERVE_FAULT_INJECTION`` to
``<stage>:<seed>[,<stage>:<seed>...]`` before starting the server: the requests whose
sampling ``seed`` is ``<seed>`` then fail at ``<stage>``, in whichever process runs it,
while every other request runs on. Unset (always, in production), each check is one
comparison with None.

Stages, in a request's order through the pipeline:

- ``encoding``: the frontend's engine thread encodes its ``AddRequest``;
- ``admission``: the scheduler process queues it;
- ``scheduling``: the scheduler records a step's result for it (where beam scores and stop
  checks are computed);
- ``sampling_setup``: a worker takes it into its batch;
- ``output_processing``: the frontend turns its deltas into text.
"""

from __future__ import annotations

import os

ENVIRONMENT_VARIABLE = "PAGEDSERVE_FAULT_INJECTION"
STAGES = ("encoding", "admission", "scheduling", "sampling_setup", "output_processing")


class InjectedFault(RuntimeError):
    """The failure ``PAGEDSERVE_FAULT_INJECTION`` asked for."""


def _parse(value: str | None) -> frozenset[tuple[str, int]] | None:
    if not value:
        return None
    faults = set()
    for entry in value.split(","):
        stage, _, seed = entry.strip().partition(":")
        if stage not in STAGES or not seed.isdigit():
            raise ValueError(
                f"{ENVIRONMENT_VARIABLE} must be '<stage>:<seed>[,...]' with stages among "
                f"{', '.join(STAGES)}, got {value!r}"
            )
        faults.add((stage, int(seed)))
    return frozenset(faults)


_FAULTS = _parse(os.environ.get(ENVIRONMENT_VARIABLE))


def check(stage: str, seed: int | None) -> None:
    """Raise ``InjectedFault`` when a configured fault is at ``stage`` for this seed."""
    if _FAULTS is not None and (stage, seed) in _FAULTS:
        raise InjectedFault(f"fault injected at {stage} ({ENVIRONMENT_VARIABLE})")
