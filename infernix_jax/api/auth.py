"""API-key check: OpenAI clients send `Authorization: Bearer KEY`, Anthropic clients `x-api-key: KEY`."""

from __future__ import annotations

import hmac
from collections.abc import Mapping

# Routes that stay open without a key, so probes and scrapers need no secret.
PUBLIC_PATHS = frozenset({"/health", "/metrics"})


def presented_key(headers: Mapping[str, str]) -> str | None:
    """The key the client sent, from either header, or None."""
    auth = headers.get("Authorization") or headers.get("authorization")
    if auth:
        scheme, _, value = auth.partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    key = headers.get("x-api-key") or headers.get("X-Api-Key")
    return key.strip() if key else None


def is_authorized(headers: Mapping[str, str], path: str, api_key: str | None) -> bool:
    """True when no key is configured, the route is public, or the client sent the right key."""
    if not api_key or path in PUBLIC_PATHS:
        return True
    key = presented_key(headers)
    return key is not None and hmac.compare_digest(key.encode(), api_key.encode())
