"""API key → tier lookup in constant time; the key itself is never stored or logged."""

from __future__ import annotations

import hmac
from collections.abc import Mapping

from pagedserve.gateway.config import KeyEntry, key_digest


class KeyRing:
    """Finds the entry for a presented key by comparing SHA-256 digests with every stored one.

    Every entry is compared (no early exit) with :func:`hmac.compare_digest`, so the time taken
    does not depend on which key matched or how much of it did.
    """

    def __init__(self, entries: list[KeyEntry]):
        self._entries = list(entries)

    def lookup(self, key: str | None) -> KeyEntry | None:
        """The entry for ``key``, or None for a missing or unknown key."""
        digest = key_digest(key or "")
        found: KeyEntry | None = None
        for entry in self._entries:
            if hmac.compare_digest(entry.digest, digest) and key:
                found = entry
        return found


def bearer_key(authorization: str | None) -> str | None:
    """The key from an ``Authorization: Bearer KEY`` header (None when absent or malformed)."""
    if not authorization:
        return None
    scheme, _, value = authorization.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return None
    return value.strip()


def presented_key(headers: Mapping[str, str]) -> str | None:
    """The key a request presents: ``Authorization: Bearer KEY``, else ``x-api-key: KEY`` (how
    Anthropic's clients send it)."""
    return bearer_key(headers.get("authorization")) or (headers.get("x-api-key") or "").strip() or None
