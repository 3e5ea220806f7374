"""``pagedserve serve --api-key``: a shared secret that generation calls must present, as
``Authorization: Bearer <key>`` (an HTTP header, or gRPC metadata ``authorization``).

Health checks, metrics, version and load stay open (load balancers and scrapers hold no key),
as in vLLM's server. The key is compared in constant time; TLS (``--tls-*``) keeps it
secret on the wire.
"""

from __future__ import annotations

import hmac

ENVIRONMENT_VARIABLE = "PAGEDSERVE_API_KEY"  # keeps the key out of `ps` and unit files
UNAUTHENTICATED_MESSAGE = "missing or wrong API key: send the header 'Authorization: Bearer <key>'"


def bearer_matches(authorization: str | None, api_key: str) -> bool:
    """Whether an ``Authorization`` value carries ``api_key`` as a bearer token."""
    if authorization is None:
        return False
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(token.strip().encode(), api_key.encode())
