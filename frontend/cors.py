"""Cross-origin access to the HTTP API, for a browser page served from another origin
(vLLM's ``--allowed-origins`` and ``--allow-credentials``).

Off unless origins are given: a browser then may call the API only from a page of this
server's own origin, which it has none of. With origins allowed, two parts:

- a preflight (``OPTIONS`` with ``Access-Control-Request-Method``) from an allowed origin
  is answered here, before the API key is asked for (browsers send no credentials with
  one): 204, the methods the path serves, the headers asked for, how long to cache it;
  from another origin: 403 naming the origin;
- every response to an allowed origin, streamed ones too, gets
  ``Access-Control-Allow-Origin`` as its headers go out (``on_response_prepare``).

``*`` allows any origin; with credentials the origin is echoed instead (browsers refuse a
wildcard with credentials), as Starlette's middleware, which vLLM uses, does.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from aiohttp import web

from pagedserve.frontend.call_errors import CallError

# How long a browser may reuse a preflight's answer.
PREFLIGHT_MAX_AGE_S = 600
_ORIGIN = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://[^/?#\s]+$")


def parse_origins(text: str) -> tuple[str, ...]:
    """``--allowed-origins``: a comma-separated list (``*`` for any origin), or vLLM's JSON
    list; ``ValueError`` naming an entry that is not an origin (scheme://host[:port])."""
    text = text.strip()
    if text.startswith("["):
        try:
            origins = json.loads(text)
        except ValueError as error:
            raise ValueError(f"allowed_origins: not a JSON list: {error}") from None
        if not isinstance(origins, list) or not all(isinstance(o, str) for o in origins):
            raise ValueError(f"allowed_origins: expected a list of strings, got {text!r}")
    else:
        origins = [origin.strip() for origin in text.split(",") if origin.strip()]
    for origin in origins:
        if origin != "*" and not _ORIGIN.match(origin):
            raise ValueError(
                f"allowed_origins: {origin!r} is not an origin (scheme://host[:port], no "
                "path; or * for any)"
            )
    return tuple(origin.rstrip("/") for origin in origins)


@dataclass(frozen=True)
class CorsPolicy:
    allowed_origins: tuple[str, ...]
    allow_credentials: bool = False

    def allows(self, origin: str) -> bool:
        return "*" in self.allowed_origins or origin in self.allowed_origins

    def _allow_origin_value(self, origin: str) -> str:
        if "*" in self.allowed_origins and not self.allow_credentials:
            return "*"
        return origin

    def install(self, app: web.Application) -> None:
        """Answer preflights (right after the error middleware, which gives a refusal
        OpenAI's shape; before the API key's) and mark every response to an allowed
        origin."""
        app.middlewares.insert(1, self._preflight)
        app.on_response_prepare.append(self._mark)

    @web.middleware
    async def _preflight(self, request: web.Request, handler) -> web.StreamResponse:
        origin = request.headers.get("Origin")
        asked_method = request.headers.get("Access-Control-Request-Method")
        if request.method != "OPTIONS" or origin is None or asked_method is None:
            return await handler(request)
        if not self.allows(origin):
            raise CallError(
                "PERMISSION_DENIED",
                f"origin {origin!r} may not call this API (the server's --allowed-origins)",
            )
        # Routing has run: a path served without OPTIONS matched as 405, which names the
        # methods it serves; an unknown path answers as any other (404).
        refusal = getattr(request.match_info, "http_exception", None)
        if not isinstance(refusal, web.HTTPMethodNotAllowed):
            return await handler(request)
        methods = sorted({*refusal.allowed_methods, "OPTIONS"})
        headers = {
            "Access-Control-Allow-Methods": ", ".join(methods),
            "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE_S),
        }
        asked_headers = request.headers.get("Access-Control-Request-Headers")
        if asked_headers:
            headers["Access-Control-Allow-Headers"] = asked_headers
        return web.Response(status=204, headers=headers)

    async def _mark(self, request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get("Origin")
        if origin is None or not self.allows(origin):
            return
        response.headers["Access-Control-Allow-Origin"] = self._allow_origin_value(origin)
        if self.allow_credentials:
            response.headers["Access-Control-Allow-Credentials"] = "true"
        response.headers.add("Vary", "Origin")
