"""The browser side of the server and the gateway: their dashboards and the API docs, served offline.

Plain HTML, CSS and JavaScript files in ``static/`` (package data: they ship in the wheel), no build
step and nothing fetched from a CDN, so the pages work on a machine without network. ``/docs`` is
FastAPI's Swagger UI with its assets served from the ``swagger-ui-bundle-v2`` package instead of
a CDN; ReDoc (which FastAPI would also load from a CDN) is not offered.

This package knows nothing of the engine or the gateway: each app mounts it and feeds its own page.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse
from fastapi.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).parent / "static"
STATIC_URL = "/dashboard/static"
DOCS_STATIC_URL = "/docs/static"


def mount_dashboard(app: FastAPI, page: str) -> None:
    """Serve ``static/<page>`` at ``/`` and ``/dashboard``, and the shared assets under /dashboard/static."""
    app.mount(STATIC_URL, StaticFiles(directory=STATIC_DIR), name="dashboard-static")
    path = STATIC_DIR / page

    async def dashboard() -> FileResponse:
        # no-cache: a browser revalidates, so an upgraded server's page is never mixed with old scripts
        return FileResponse(path, media_type="text/html", headers={"Cache-Control": "no-cache"})

    for url in ("/", "/dashboard"):
        app.add_api_route(url, dashboard, methods=["GET"], include_in_schema=False)


def install_offline_docs(app: FastAPI, title: str) -> None:
    """``/docs`` with Swagger UI's files from the local ``swagger_ui_bundle`` package.

    Build the app with ``docs_url=None, redoc_url=None`` first (FastAPI's own /docs uses a CDN).
    """
    from swagger_ui_bundle import swagger_ui_path

    app.mount(DOCS_STATIC_URL, StaticFiles(directory=str(swagger_ui_path)), name="docs-static")
    openapi_url = app.openapi_url or "/openapi.json"

    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url=openapi_url, title=f"{title} - API docs",
                                   swagger_js_url=f"{DOCS_STATIC_URL}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{DOCS_STATIC_URL}/swagger-ui.css",
                                   swagger_favicon_url=f"{DOCS_STATIC_URL}/favicon-32x32.png")

    app.add_api_route("/docs", docs, methods=["GET"], include_in_schema=False)


def sse_event(name: str, data: str) -> bytes:
    """One server-sent event (``data`` is one line of JSON)."""
    return f"event: {name}\ndata: {data}\n\n".encode()


# Sent first on every feed: how long the browser waits before reconnecting (milliseconds).
SSE_PREAMBLE = b"retry: 1000\n\n"
SSE_PING = b": ping\n\n"  # a comment line: keeps proxies from closing an idle feed, finds dead clients

StopCheck = Callable[[], bool]
