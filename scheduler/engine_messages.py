"""Plain messages between the frontend process and the scheduler process.

The frontend sends ``AddRequest`` / ``AbortRequest`` (and ``Shutdown``) to the scheduler;
the scheduler answers with ``RequestOutputDelta`` (in ``messages.py``) and, for a request
it could not take or an engine-wide failure, ``EngineError``. Every process announces
itself with ``Ready`` once it can serve. Like ``messages.py``, only ints, floats, strings,
lists, dicts and nested dataclasses of those live here, so ``serialization.py`` can encode
them explicitly, field by field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedserve.scheduler.sampling_params import SamplingParams


@dataclass
class AddRequest:
    """A new request, already tokenized and validated by the frontend.

    ``arrival_time_s`` is the frontend's ``time.monotonic()`` when the request arrived;
    processes on one host share that clock, so the scheduler can order by it and measure
    queueing time without a second clock reading.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time_s: float


@dataclass
class AbortRequest:
    """Stop a request (client cancelled, deadline passed); the scheduler frees its blocks
    and answers with the request's final ``RequestOutputDelta``."""

    request_id: str


@dataclass
class EngineError:
    """A failure to report to the frontend: about one request (``request_id`` set; that
    request has ended with this error) or about the whole engine (``request_id`` None)."""

    request_id: str | None
    message: str


@dataclass
class Shutdown:
    """Ask the receiving process to finish what it is doing and exit."""


@dataclass
class Ready:
    """A process's handshake once it can serve: ``component`` names its role
    (``"scheduler"``, ``"worker"``...), ``info`` carries plain facts about it (e.g.
    ``{"rank": 0, "num_blocks": 4096}``): strings, numbers, booleans, None, bytes, and
    lists / string-keyed dicts of those. Tuples inside ``info`` arrive as lists."""

    component: str
    pid: int
    info: dict[str, Any] = field(default_factory=dict)
