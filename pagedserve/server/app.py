"""The FastAPI app: routes, lifespan (EngineClient start / graceful stop), middleware, errors.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``POST /v1/messages`` and ``/v1/messages/count_tokens`` (Anthropic's, server/anthropic_messages.py),
``POST /v1/responses``, ``GET`` / ``DELETE /v1/responses/{id}`` (server/responses_api.py),
``POST /tokenize``, ``POST /detokenize``, ``GET /version``, ``GET /health``, ``GET /metrics``, ``GET /load``;
the dashboard at ``/`` and ``/dashboard`` with its feed ``GET /dashboard/events``; ``/docs``. See
docs/SERVER.md, docs/DASHBOARD.md.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

import pagedserve
from pagedserve.engine import EngineClient, LoadReport
from pagedserve.server import protocol as p
from pagedserve.server.anthropic_messages import install_anthropic_routes
from pagedserve.server.config import ServerConfig
from pagedserve.server.dashboard import DashboardFeed
from pagedserve.server.errors import error_response, install_error_handlers
from pagedserve.server.metrics import ServerMetrics
from pagedserve.server.middleware import API_SERVER_HEADER, GuardMiddleware, ResponseHeaderMiddleware
from pagedserve.server.responses_api import install_responses_routes
from pagedserve.server.serving import ClientDisconnected, OpenAIServing
from pagedserve.server.tokenization import TokenizerWorker
from pagedserve.streaming import ClosingStreamingResponse
from pagedserve.tokenizer import TokenizerPreload
from pagedserve.web import install_offline_docs, mount_dashboard

logger = logging.getLogger(__name__)

_ERRORS = {400: {"model": p.ErrorResponse}, 401: {"model": p.ErrorResponse}, 404: {"model": p.ErrorResponse},
           413: {"model": p.ErrorResponse}, 503: {"model": p.ErrorResponse}}


def build_app(client: EngineClient, config: ServerConfig,
              on_started: Callable[[], Awaitable[None]] | None = None,
              preload: TokenizerPreload | None = None) -> FastAPI:
    """An app serving through ``client`` (in-process or the engine core's process). The client
    starts with the app's lifespan and stops with it, after in-flight requests finished (up to
    ``config.shutdown_timeout_s``) or were aborted. The app knows the engine only through it.
    ``on_started`` is awaited at the end of the lifespan's start-up, before the server accepts
    connections (the API-server supervisor holds every front there until all are ready).
    ``preload``: where the tokenizer worker may take its tokenizer, loaded while the core started."""
    model_name = config.served_model_name or client.facts.model_name
    app = FastAPI(title="pagedserve", version=pagedserve.__version__,
                  lifespan=_lifespan(client, config, model_name, on_started, preload),
                  docs_url=None, redoc_url=None,  # /docs without a CDN: install_offline_docs below
                  description="OpenAI-compatible server of the pagedserve engine (docs/SERVER.md).")
    app.add_middleware(GuardMiddleware, max_body_bytes=config.max_body_bytes, api_key=config.api_key)
    if config.api_server_index is not None:  # outermost: refusals by the guard carry it too
        app.add_middleware(ResponseHeaderMiddleware, name=API_SERVER_HEADER, value=str(config.api_server_index))
    install_error_handlers(app)
    install_offline_docs(app, "pagedserve")
    mount_dashboard(app, "engine.html")
    _install_dashboard_feed(app, client, model_name)

    @app.exception_handler(ClientDisconnected)
    async def _gone(_: Request, __: ClientDisconnected) -> JSONResponse:
        # Nobody reads this: the client has gone. 499 is what nginx logs for it.
        return error_response(499, "client closed the connection", "invalid_request_error")

    # Registered in this order, which is also the order /docs lists them in.
    _install_openai_routes(app)
    install_anthropic_routes(app, _serving)
    install_responses_routes(app, _serving, config)
    _install_tokenizer_routes(app)
    _install_status_routes(app, client, config, model_name)
    return app


def _lifespan(client: EngineClient, config: ServerConfig, model_name: str,
              on_started: Callable[[], Awaitable[None]] | None,
              preload: TokenizerPreload | None) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """The app's lifespan: start the client and the serving objects; on shutdown drain and stop them."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        metrics = ServerMetrics(model_name, client.stats, client.facts, lambda: client.core_restarts)
        client.observer = metrics
        tokenizers = TokenizerWorker(client.facts.tokenizer, chat_template=config.chat_template, preload=preload)
        await client.start()
        app.state.engine = client
        app.state.metrics = metrics
        app.state.serving = OpenAIServing(client, config, tokenizers)
        try:
            if on_started is not None:
                await on_started()
            yield
        finally:
            await client.shutdown(drain_timeout_s=config.shutdown_timeout_s)
            await app.state.responses.store.close()
            tokenizers.close()
            stats = client.stats()
            logger.info("engine stopped: %d running, %d waiting, %d KV blocks in use",
                        stats.num_running, stats.num_waiting, stats.kv_blocks_used)

    return lifespan


def _serving(request: Request) -> OpenAIServing:
    """The app's OpenAI serving object (made by the lifespan)."""
    return request.app.state.serving


def _install_dashboard_feed(app: FastAPI, client: EngineClient, model_name: str) -> None:
    """``GET /dashboard/events``, the dashboard's live feed; its :class:`DashboardFeed` is ``app.state.dashboard``."""
    feed = app.state.dashboard = DashboardFeed(client, model_name)

    @app.get("/dashboard/events", include_in_schema=False)
    async def dashboard_events() -> Response:
        """The dashboard's live feed (server-sent events; docs/DASHBOARD.md). Needs the API key when
        one is set, as a bearer token like /v1/*."""
        if not client.is_running:
            return _engine_unavailable()
        if feed.full:
            return error_response(503, f"the dashboard already has {feed.max_viewers} viewers; close one",
                                  "server_error", code="too_many_viewers")
        events = feed.events()
        return ClosingStreamingResponse(events, events.aclose, media_type="text/event-stream",
                                        headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})


def _install_openai_routes(app: FastAPI) -> None:
    """OpenAI's ``POST /v1/completions`` and ``POST /v1/chat/completions``."""

    @app.post("/v1/completions", responses={200: {"model": p.CompletionResponse}, **_ERRORS})
    async def completions(body: p.CompletionRequest, request: Request) -> Response:
        """Text completion (OpenAI). ``stream: true`` answers server-sent events ending in ``[DONE]``."""
        return await _serving(request).completions(body, request)

    @app.post("/v1/chat/completions", responses={200: {"model": p.ChatCompletionResponse}, **_ERRORS})
    async def chat_completions(body: p.ChatCompletionRequest, request: Request) -> Response:
        """Chat completion (OpenAI), prompt built with the tokenizer's chat template."""
        return await _serving(request).chat(body, request)


def _install_tokenizer_routes(app: FastAPI) -> None:
    """``POST /tokenize`` and ``POST /detokenize`` (vLLM's)."""

    @app.post("/tokenize", response_model=p.TokenizeResponse, responses=_ERRORS)
    async def tokenize(body: p.TokenizeRequest, request: Request) -> Response:
        """Token ids and count of a prompt or conversation, and the model's max_model_len."""
        return await _serving(request).tokenize(body)

    @app.post("/detokenize", response_model=p.DetokenizeResponse, responses=_ERRORS)
    async def detokenize(body: p.DetokenizeRequest, request: Request) -> Response:
        """The text of a list of token ids (vLLM's /detokenize)."""
        return await _serving(request).detokenize(body)


def _install_status_routes(app: FastAPI, client: EngineClient, config: ServerConfig, model_name: str) -> None:
    """What the server is and how it fares: ``/version``, ``/v1/models``, ``/health``, ``/metrics``, ``/load``."""

    @app.get("/version")
    async def version() -> p.VersionResponse:
        """The pagedserve version serving this API."""
        return p.VersionResponse(version=pagedserve.__version__)

    @app.get("/v1/models")
    async def models(request: Request) -> p.ModelList:
        """The one model this server serves."""
        s = _serving(request)
        description = config.model_description
        if config.random_weights and description is None:
            description = ("RANDOM WEIGHTS: this is pagedserve's built-in test model and its output is noise. "
                           "Serve a real model with: pagedserve serve --model <hf-dir-or-hub-id>")
        return p.ModelList(data=[p.ModelCard(id=s.model_name, root=client.facts.model_name, max_model_len=s.max_model_len,
                                             random_weights=config.random_weights, description=description)])

    @app.get("/health")
    async def health(request: Request) -> Response:
        """200 while the engine serves, 503 once it died or is shutting down."""
        if client.is_running:
            return JSONResponse({"status": "ok"})
        return _engine_unavailable()

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        """Prometheus exposition text: the ``pagedserve_*`` names and vLLM's ``vllm:*`` names (docs/SERVER.md);
        read from the latest stats snapshot, never waiting for a step."""
        return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/load", response_model=LoadReport, responses={503: {"model": p.ErrorResponse}})
    async def load(request: Request) -> Response:
        """Running/waiting requests, KV blocks, tokens/s and the estimated queue wait (for the gateway);
        503 when the engine is not running, so a gateway stops routing here at once."""
        if not client.is_running:
            return _engine_unavailable()
        report = client.load()
        return dataclasses.replace(report, model=model_name, tokens_per_s=round(report.tokens_per_s, 3),
                                   est_queue_wait_s=round(report.est_queue_wait_s, 3))


def _engine_unavailable() -> JSONResponse:
    return error_response(503, "the engine is not running", "server_error", code="engine_unavailable")
