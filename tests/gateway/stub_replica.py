"""A stand-in replica on a real loopback port, for what a real engine will not do on demand:
answer every completion with an error, or expose only vLLM's ``/metrics`` (no ``/load``)."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from tests.helpers.servers import AppThread


class StubReplica(AppThread):
    """``with StubReplica(...) as stub: stub.url``. ``status`` answers every completion (a 400 when the
    prompt is ``"bad"``) after ``delay_s``; ``vllm=True`` serves vLLM's gauges on /metrics and 404 on /load."""

    def __init__(self, status: int = 503, vllm: bool = False, running: int = 0, waiting: int = 0,
                 delay_s: float = 0.0):
        self.status, self.vllm = status, vllm
        self.running, self.waiting = running, waiting
        self.completions = 0
        app = FastAPI()

        @app.get("/health")
        async def health() -> JSONResponse:
            return JSONResponse({"status": "ok"})

        @app.get("/load")
        async def load() -> JSONResponse:
            if self.vllm:
                return JSONResponse({"detail": "Not Found"}, status_code=404)
            return JSONResponse({"running": self.running, "waiting": self.waiting, "max_num_seqs": 4})

        @app.get("/metrics")
        async def metrics() -> PlainTextResponse:
            if not self.vllm:
                return PlainTextResponse("", status_code=404)
            return PlainTextResponse(
                "# TYPE vllm:num_requests_running gauge\n"
                f'vllm:num_requests_running{{model_name="stub"}} {self.running}.0\n'
                "# TYPE vllm:num_requests_waiting gauge\n"
                f'vllm:num_requests_waiting{{model_name="stub"}} {self.waiting}.0\n')

        @app.post("/v1/completions")
        async def completions(request: Request) -> JSONResponse:
            self.completions += 1
            body = await request.json()
            await asyncio.sleep(delay_s)  # longer than the gateway's request timeout: sent, never answered
            status = 400 if body.get("prompt") == "bad" else self.status
            return JSONResponse({"error": {"message": f"stub answers {status}", "type": "server_error",
                                           "param": None, "code": None}}, status_code=status)

        super().__init__(app)
