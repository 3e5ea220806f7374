"""``openai_responses.prepare`` on its own (the server tests run the API end to end): what
background mode needs of the request and of the server's store."""

from __future__ import annotations

import pytest

from pagedserve.frontend.call_errors import CallError
from pagedserve.frontend.openai_responses import prepare
from pagedserve.frontend.responses_store import ResponseStore, StoredResponse


def test_background_needs_store_and_a_store_that_keeps_responses():
    call = prepare({"input": "hi", "background": True}, ResponseStore(4))
    assert call.background and call.store
    cases = [
        ({"input": "hi", "background": True, "store": False}, 4, "needs store=true"),
        ({"input": "hi", "background": True}, 0, "--responses-store-size 0"),
        ({"input": "hi", "background": "yes"}, 4, "background must be a boolean"),
    ]
    for body, capacity, message in cases:
        with pytest.raises(CallError) as refused:
            prepare(body, ResponseStore(capacity))
        assert refused.value.param == "background" and message in refused.value.message
    assert not prepare({"input": "hi"}, ResponseStore(0)).background


def test_a_running_background_response_is_never_evicted():
    store = ResponseStore(2)
    store.running["resp_running"] = object()  # its task, as start_background records it

    def put(response_id: str) -> None:
        store.put(StoredResponse({"id": response_id, "status": "completed"}, []))

    put("resp_running")
    for index in range(3):
        put(f"resp_{index}")
    assert store.get("resp_running").response["id"] == "resp_running"
    assert store.get("resp_2") is not None
    for gone in ("resp_0", "resp_1"):
        with pytest.raises(CallError):
            store.get(gone)
    del store.running["resp_running"]  # ended: the oldest again, evicted by the next put
    put("resp_3")
    with pytest.raises(CallError):
        store.get("resp_running")
