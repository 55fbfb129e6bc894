"""The endpoints the gateway passes to a replica as they are: ``GET /v1/models``, ``POST /tokenize``,
``POST /detokenize``, ``GET /version``.

They generate nothing, so they take no tokens and no seat; the key still decides who may call
them (401 otherwise) and which replicas answer: those of its tier's pools, in the tier's order.
Each is read-only, so a replica that cannot be reached is taken out of routing and the next one
is asked; the first answer — an error included (a 400 for a token id outside the vocabulary) —
goes back to the client unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable

import httpx
from fastapi.responses import Response

from pagedserve.gateway.pools import LoadPoller, Replica

# The answer's own content type is kept; length and transport headers are the gateway's.
_KEEP_HEADERS = ("content-type",)


async def relay(client: httpx.AsyncClient, replicas: Iterable[Replica], method: str, path: str,
                content: bytes | None = None, content_type: str | None = None) -> Response | None:
    """The first answer of ``replicas`` to ``method path`` (with ``content``), or None when none of
    them could be reached."""
    headers = {"content-type": content_type or "application/json"} if content is not None else {}
    for r in replicas:
        try:
            resp = await client.request(method, r.url + path, content=content, headers=headers | r.auth_headers())
        except httpx.HTTPError as e:
            LoadPoller.mark_down(r, f"{type(e).__name__}: {e}")
            continue
        kept = {k: v for k, v in resp.headers.items() if k.lower() in _KEEP_HEADERS}
        return Response(resp.content, resp.status_code, headers=kept)
    return None
