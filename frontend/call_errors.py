"""How a server call ends when it does not succeed, whichever API it came by.

The codes are gRPC's status names; the gRPC API sends them as they are, the HTTP API
maps them to HTTP statuses (``http_server.py``), and the metrics count calls by them."""

from __future__ import annotations

# code -> HTTP status
HTTP_STATUS = {
    "INVALID_ARGUMENT": 400,
    "UNAUTHENTICATED": 401,
    "PERMISSION_DENIED": 403,
    "NOT_FOUND": 404,
    "RESOURCE_EXHAUSTED": 429,
    "DEADLINE_EXCEEDED": 408,  # the client was too slow to send its request
    "UNAVAILABLE": 503,
    "INTERNAL": 500,
}


class CallError(Exception):
    """A call refused or ended early: ``code`` says how (a key of ``HTTP_STATUS``),
    ``message`` says why, naming the field, the value and the limit for bad input;
    ``param`` is the request field at fault, where one is."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        if code not in HTTP_STATUS:
            raise ValueError(f"unknown call error code {code!r}")
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param


class ServerDrainingError(RuntimeError):
    """The server stopped before the request finished."""
