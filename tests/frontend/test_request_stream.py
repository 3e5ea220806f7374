"""``RequestStream``: what a gRPC handler reads of one request while the engine runs on."""

from __future__ import annotations

import asyncio

import pytest

from pagedserve.frontend.async_engine import RequestStream
from pagedserve.frontend.engine_client import EngineDeadError
from pagedserve.frontend.request_tracker import RequestTracker
from pagedserve.scheduler.messages import RequestOutputDelta
from pagedserve.scheduler.sampling_params import SamplingParams


def make_stream() -> tuple[RequestTracker, RequestStream]:
    tracker = RequestTracker("r", None, [1, 2], SamplingParams(max_tokens=3), None, frozenset({0}))
    return tracker, RequestStream(tracker)


def test_the_last_delta_arriving_while_the_reader_sends_is_still_read():
    """The output changes in place: a reader busy with one message when the final delta
    lands must get one more turn, or it would end without the last tokens."""

    async def read() -> list[tuple[list[int], bool]]:
        tracker, stream = make_stream()
        tracker.apply(RequestOutputDelta("r", [7], False))
        stream.notify()
        seen = []
        async for output in stream:
            seen.append((list(output.outputs[0].token_ids), output.finished))
            if len(seen) == 1:  # "sending" the first message: the rest arrives meanwhile
                tracker.apply(RequestOutputDelta("r", [8, 9], True, finish_reason="length"))
                stream.notify()
        return seen

    seen = asyncio.run(read())
    assert seen == [([7], False), ([7, 8, 9], True)]


def test_several_deltas_before_a_read_come_as_one_and_a_failure_raises():
    async def read() -> list[list[int]]:
        tracker, stream = make_stream()
        for token in (4, 5):
            tracker.apply(RequestOutputDelta("r", [token], False))
            stream.notify()
        seen = []
        async for output in stream:
            seen.append(list(output.outputs[0].token_ids))
            stream.fail(EngineDeadError("worker rank 0 died"))
        return seen

    with pytest.raises(EngineDeadError, match="worker rank 0 died"):
        asyncio.run(read())
