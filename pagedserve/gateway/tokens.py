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
from pagedserve.gateway.shape import prompt_list

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
    """The exact count when a completions prompt is already token ids (one list, or several), else None."""
    prompts = prompt_list(prompt)
    if all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompts):
        return sum(len(p) for p in prompts)
    return None


def _prompt_bound(prompt: Any) -> int:
    """The byte bound of one completions prompt (token ids count exactly)."""
    exact = token_ids_count(prompt) if isinstance(prompt, list) else None
    return exact if exact is not None else _text_bytes(prompt) + TEMPLATE_OVERHEAD


def byte_bound(body: dict[str, Any]) -> int:
    """An upper bound on the prompt's tokens from its UTF-8 size (see the module docstring); several
    completions prompts each get their own margin (each is tokenized, and templated, on its own)."""
    if isinstance(body.get("messages"), list):
        msgs = body["messages"]
        return _text_bytes(msgs) + MESSAGE_OVERHEAD * len(msgs) + TEMPLATE_OVERHEAD
    return sum(_prompt_bound(p) for p in prompt_list(body.get("prompt")))


def _queries(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The ``/tokenize`` bodies that count this request's prompt: one per prompt (the replica makes
    each prompt its own engine request, and usage sums them), None when there is nothing to ask."""
    base: dict[str, Any] = {}
    if body.get("model") is not None:
        base["model"] = body["model"]
    if isinstance(body.get("messages"), list):
        return [base | {"messages": body["messages"]}]
    prompts = prompt_list(body.get("prompt"))
    if all(isinstance(p, str) for p in prompts):
        return [base | {"prompt": p} for p in prompts]
    return None


async def _ask(client: httpx.AsyncClient, replica: Replica, query: dict[str, Any], limit: float) -> int | None:
    """One ``/tokenize`` count, or None when the replica cannot give a sensible one."""
    try:
        resp = await client.post(f"{replica.url}/tokenize", content=json.dumps(query), timeout=limit,
                                 headers={"content-type": "application/json", **replica.auth_headers()})
        count = resp.json()["count"] if resp.status_code == 200 else None
    except httpx.TimeoutException:
        raise  # out of time: the caller falls back for the whole request
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
        log.debug("tokenize failed (%s); using the byte bound", e)
        return None
    # A count that is not a whole number >= 0 would make the reservation meaningless (a negative
    # one would fill the bucket): a broken answer, like none.
    if isinstance(count, int) and not isinstance(count, bool) and count >= 0:
        return count
    log.debug("tokenize answered %s (count %r); using the byte bound", resp.status_code, count)
    return None


async def count_prompt_tokens(client: httpx.AsyncClient, replica: Replica, body: dict[str, Any], mode: str,
                              deadline: float | None = None, timeout_s: float = TOKENIZE_TIMEOUT_S) -> tuple[int, str]:
    """``(tokens, how)``; ``how`` is ``ids``, ``tokenize``, ``bytes`` (the fallback) or
    ``bytes_timeout`` (the byte bound, because the tier's budget ran out before ``/tokenize``
    answered: ``deadline`` is a ``time.monotonic()`` instant, None for no budget). Several text
    prompts are counted by one ``/tokenize`` call each, all at once, within the same time limit."""
    exact = token_ids_count(body.get("prompt")) if "messages" not in body else None
    if exact is not None:
        return exact, "ids"
    queries = _queries(body) if mode == "tokenize" else None
    if not queries:
        return byte_bound(body), "bytes"
    left = timeout_s if deadline is None else deadline - time.monotonic()
    if left <= 0:  # the budget is already spent: no time to ask
        return byte_bound(body), "bytes_timeout"
    limit = min(timeout_s, left)
    tasks = [asyncio.ensure_future(_ask(client, replica, q, limit)) for q in queries]
    try:
        async with asyncio.timeout(limit):
            counts = await asyncio.gather(*tasks)
    except (TimeoutError, httpx.TimeoutException):
        log.debug("tokenize took over %.3fs; using the byte bound", limit)
        return byte_bound(body), "bytes_timeout" if limit < timeout_s else "bytes"
    finally:
        for t in tasks:  # one call's failure ends the count: the others are not left running
            t.cancel()
    if all(c is not None for c in counts):
        return sum(c for c in counts if c is not None), "tokenize"
    return byte_bound(body), "bytes"
