"""Prompt token counts for the reservation: the engine's ``POST /tokenize``, or a byte bound.

The reservation only has to be an upper bound the gateway can afford to compute before
forwarding; the response's ``usage`` corrects it afterwards. ``tokenize`` asks a healthy replica of
the chosen pool (exact, one loopback round trip); ``bytes`` counts UTF-8 bytes of the
text (a byte-level BPE token covers at least one byte) plus a margin per chat message for the
template — no network call, but a reservation several times the real prompt.

The ``/tokenize`` call is part of the request's wait, so it is bounded by what is left of the
tier's queue allowance (the ``deadline``) and by :data:`TOKENIZE_TIMEOUT_S`, whichever comes
first, as a whole call (httpx's own timeouts apply per read, so a replica dripping bytes could
outlast them). A call cut short falls back to the byte bound; the caller's seat wait then sees
the spent budget (see ``app.handle``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import httpx

from pagedserve.gateway.pools import Replica

log = logging.getLogger("pagedserve.gateway.tokens")

# Chat templates add role markers and separators around each message, and a generation prompt.
MESSAGE_OVERHEAD = 8
TEMPLATE_OVERHEAD = 16

# The longest a /tokenize call may take even when the tier's budget would allow more: past it the
# byte bound is cheaper than waiting for a replica that is this slow to answer.
TOKENIZE_TIMEOUT_S = 2.0


def _text_bytes(value: Any) -> int:
    if isinstance(value, str):
        return len(value.encode())
    if isinstance(value, list):
        return sum(_text_bytes(v) for v in value)
    if isinstance(value, dict):
        return sum(_text_bytes(v) for v in value.values())
    return 0


def token_ids_count(prompt: Any) -> int | None:
    """The exact count when a completions prompt is already token ids, else None."""
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) and all(isinstance(t, int) for t in p)
                                                   for p in prompt):
        return sum(len(p) for p in prompt)
    return None


def byte_bound(body: dict[str, Any]) -> int:
    """An upper bound on the prompt's tokens from its UTF-8 size (see the module docstring)."""
    if isinstance(body.get("messages"), list):
        msgs = body["messages"]
        return _text_bytes(msgs) + MESSAGE_OVERHEAD * len(msgs) + TEMPLATE_OVERHEAD
    exact = token_ids_count(body.get("prompt"))
    return exact if exact is not None else _text_bytes(body.get("prompt")) + TEMPLATE_OVERHEAD


async def count_prompt_tokens(client: httpx.AsyncClient, replica: Replica, body: dict[str, Any], mode: str,
                              deadline: float | None = None, timeout_s: float = TOKENIZE_TIMEOUT_S) -> tuple[int, str]:
    """``(tokens, how)``; ``how`` is ``ids``, ``tokenize``, ``bytes`` (the fallback) or
    ``bytes_timeout`` (the byte bound, because the tier's budget ran out before ``/tokenize``
    answered: ``deadline`` is a ``time.monotonic()`` instant, None for no budget)."""
    exact = token_ids_count(body.get("prompt")) if "messages" not in body else None
    if exact is not None:
        return exact, "ids"
    if mode == "tokenize":
        query: dict[str, Any] = {}
        if body.get("model") is not None:
            query["model"] = body["model"]
        if isinstance(body.get("messages"), list):
            query["messages"] = body["messages"]
        elif isinstance(body.get("prompt"), str):
            query["prompt"] = body["prompt"]
        elif isinstance(body.get("prompt"), list) and len(body["prompt"]) == 1 and isinstance(body["prompt"][0], str):
            query["prompt"] = body["prompt"][0]
        if "prompt" in query or "messages" in query:
            left = timeout_s if deadline is None else deadline - time.monotonic()
            if left <= 0:  # the budget is already spent: no time to ask
                return byte_bound(body), "bytes_timeout"
            limit = min(timeout_s, left)
            try:
                async with asyncio.timeout(limit):
                    resp = await client.post(f"{replica.url}/tokenize", content=json.dumps(query), timeout=limit,
                                             headers={"content-type": "application/json", **replica.auth_headers()})
                count = resp.json()["count"] if resp.status_code == 200 else None
                # A count that is not a whole number >= 0 would make the reservation meaningless (a
                # negative one would fill the bucket): a broken answer, like none.
                if isinstance(count, int) and not isinstance(count, bool) and count >= 0:
                    return count, "tokenize"
                log.debug("tokenize answered %s (count %r); using the byte bound", resp.status_code, count)
            except (TimeoutError, httpx.TimeoutException):
                log.debug("tokenize took over %.3fs; using the byte bound", limit)
                return byte_bound(body), "bytes_timeout" if limit < timeout_s else "bytes"
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
                log.debug("tokenize failed (%s); using the byte bound", e)
    return byte_bound(body), "bytes"
