"""Raw HTTP calls to a test server: POST and GET, streamed (SSE) answers read to their end,
and the metrics page as samples."""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def post(server, path: str, body, timeout_s: float = 60) -> tuple[int, dict]:
    """A raw POST (bytes go as they are); the status and the decoded JSON answer."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(
        server.http_url + path, data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def get(server, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(server.http_url + path, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def sse_events(server, path: str, body: dict) -> list:
    """A streamed call read to its end: each event's decoded data ("[DONE]" as is)."""
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    try:
        connection.request(
            "POST", path, json.dumps(body), headers={"Content-Type": "application/json"}
        )
        response = connection.getresponse()
        assert response.status == 200, response.read()
        assert response.getheader("Content-Type").startswith("text/event-stream")
        events = []
        for raw in response.read().decode().split("\n\n"):
            if raw.strip():
                assert raw.startswith("data: "), raw
                data = raw[len("data: ") :]
                events.append(data if data == "[DONE]" else json.loads(data))
        return events
    finally:
        connection.close()


def typed_events(server, body: dict) -> list[dict]:
    """A streamed Responses API call (``/v1/responses``) read to its end: each event's data,
    checked against its ``event:`` line."""
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    try:
        connection.request("POST", "/v1/responses", json.dumps({**body, "stream": True}))
        response = connection.getresponse()
        assert response.status == 200, response.read()
        assert response.getheader("Content-Type").startswith("text/event-stream")
        events = []
        for raw in response.read().decode().split("\n\n"):
            if not raw.strip():
                continue
            event_line, data_line = raw.split("\n")
            event = json.loads(data_line.removeprefix("data: "))
            assert event_line == f"event: {event['type']}"
            events.append(event)
        return events
    finally:
        connection.close()


def metric_samples(server) -> dict[tuple[str, tuple], float]:
    """The ``/metrics`` page: each sample's value by its name and sorted labels."""
    status, body = get(server, "/metrics")
    assert status == 200
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(body.decode())
        for sample in family.samples
    }
