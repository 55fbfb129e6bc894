"""``EngineReplica``: one Ray Serve replica owning one engine, serving the project's own app.

The replica builds an in-process engine (:class:`~pagedserve.engine.frontend.async_engine.AsyncEngine`; Ray
already gives each replica its own process, and HTTP parsing happens in the front) and the
project's FastAPI app around it (:func:`pagedserve.server.app.build_app`), which ``serve.ingress``
runs: Ray starts its lifespan (the engine) when the replica starts and ends it (draining, then
aborting what is left) when the replica stops. Two ways in:

- ``forward(scope, body, routing=...)``: what the front calls through a handle. It runs one HTTP
  request through the app in-process and yields its ASGI messages one by one (a stream's events as
  the engine makes them). When the caller goes away (the client disconnected, the front's handle
  call was cancelled) the app sees ``http.disconnect`` and is cancelled, so the engine request is
  aborted and its KV blocks are freed.
- Ray's HTTP proxy straight to the app (a deployment used as the ingress itself); then the router
  has no prefix key and routes on load alone.

Every answer carries ``x-pagedserve-replica: <Ray replica id>``. ``record_routing_stats`` hands
Ray the engine's ``/load`` report, which the router reads; ``check_health`` fails once the engine
stopped, so Ray replaces the replica.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import AsyncIterator
from typing import Any

from ray import serve
from starlette.types import ASGIApp, Message

from pagedserve.config import EngineConfig
from pagedserve.server.config import ServerConfig
from pagedserve.server.middleware import ResponseHeaderMiddleware

REPLICA_HEADER = "x-pagedserve-replica"

_APP_DONE = object()  # put on forward's queue when the app's call returned


@serve.ingress()  # the app is built per replica, by __serve_build_asgi_app__, after __init__
class EngineReplica:
    """One engine and the OpenAI app over it (module docstring)."""

    def __init__(self, engine_config: EngineConfig, server_config: ServerConfig):
        from pagedserve.engine import in_process

        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.client = in_process(engine_config, log_requests=server_config.log_requests)
        self.server_config = server_config
        self._report_seq = itertools.count()

    def __serve_build_asgi_app__(self) -> ASGIApp:
        from pagedserve.server.app import build_app

        return ResponseHeaderMiddleware(build_app(self.client, self.server_config), REPLICA_HEADER, self.replica_id)

    async def forward(self, scope: dict[str, Any], body: bytes,
                      routing: dict[str, Any] | None = None) -> AsyncIterator[Message]:
        """Run one HTTP request through the app; yield its ASGI messages (``routing`` is for the
        router only: the prefix key and priority the front computed)."""
        queue: asyncio.Queue[Any] = asyncio.Queue()
        caller_gone = asyncio.Event()
        body_sent = False

        async def receive() -> Message:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await caller_gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            queue.put_nowait(message)

        task = asyncio.ensure_future(self.app(dict(scope), receive, send))
        task.add_done_callback(lambda _: queue.put_nowait(_APP_DONE))
        try:
            while (message := await queue.get()) is not _APP_DONE:
                yield message
            task.result()  # the app raised: the caller sees the error
        finally:
            caller_gone.set()
            if not task.done():
                task.cancel()

    async def record_routing_stats(self) -> dict[str, Any]:
        """The engine's load report (``GET /load``'s fields), numbered so the router can tell a new
        report from one it has used already."""
        report = dataclasses.asdict(self.client.load()) if self.client.is_running else {}
        return {**report, "seq": next(self._report_seq), "replica_id": self.replica_id}

    async def check_health(self) -> None:
        """Ray replaces a replica whose check fails: this one fails once the engine stopped."""
        if not self.client.is_running:
            raise RuntimeError(f"the engine of replica {self.replica_id} is not running")
