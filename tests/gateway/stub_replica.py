"""A stand-in replica on a real loopback port, for what a real engine will not do on demand:
answer every completion with an error, expose only vLLM's ``/metrics`` (no ``/load``), break a
stream off, answer ``/tokenize`` slowly, or report its engine dead (503 on ``/load`` and ``/health``)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from tests.helpers.servers import AppThread

STREAM_ENDS = ("done", "crash", "eof", "error", "usage_crash")


class ReplicaCrash(Exception):
    """Raised inside a streamed body: uvicorn then drops the connection mid-body, as a dying process does."""


class StubReplica(AppThread):
    """``with StubReplica(...) as stub: stub.url``. Attributes may be changed while it runs.

    * ``status``: a non-streamed completion's status after ``delay_s``: 200 answers a completion with
      ``usage`` (prompt tokens = words of the prompt), anything else an error body (400 when the
      prompt is ``"bad"``) with ``code`` = ``error_code``.
    * A streamed completion (``stream: true``) sends ``stream_events`` token chunks, ``event_delay_s``
      apart, then ends as ``stream_end`` says: ``done`` (the usage chunk, then ``[DONE]``), ``crash``
      (the connection drops mid-body: the replica died), ``eof`` (the body ends cleanly without
      ``[DONE]``), ``error`` (an error event then ``[DONE]``, as the engine ends a failed request) or
      ``usage_crash`` (the usage chunk, then the connection drops before ``[DONE]``).
    * ``plain_crash``: a non-streamed completion's body breaks off halfway (the connection drops).
    * ``tokenize_delay_s``: None serves no ``/tokenize`` (404); else it answers the word count after
      that delay.
    * ``health_status`` / ``load_status``: what ``/health`` and ``/load`` answer (503: the engine died);
      ``load_delay_s``: how long ``/load`` takes to answer (a replica too busy to answer in time).
    * ``vllm=True`` serves vLLM's gauges on /metrics and 404 on /load.
    * ``/detokenize`` answers ``w<id>`` per id (ids below 100, else 400); ``/version`` ``stub-1``.
    * ``last_body``: the last completions body it received.
    """

    def __init__(self, status: int = 503, vllm: bool = False, running: int = 0, waiting: int = 0,
                 delay_s: float = 0.0, *, stream_events: int = 3, stream_end: str = "done",
                 event_delay_s: float = 0.0, tokenize_delay_s: float | None = None):
        assert stream_end in STREAM_ENDS, stream_end
        self.status, self.vllm = status, vllm
        self.running, self.waiting = running, waiting
        self.delay_s = delay_s
        self.stream_events, self.stream_end, self.event_delay_s = stream_events, stream_end, event_delay_s
        self.tokenize_delay_s = tokenize_delay_s
        self.plain_crash = False
        self.error_code: str | None = None  # the code of its error answers
        self.health_status = self.load_status = 200
        self.load_delay_s = 0.0
        self.completions = 0
        self.tokenize_calls = 0
        self.last_body: dict | None = None
        app = FastAPI()

        @app.get("/health")
        async def health() -> JSONResponse:
            if self.health_status != 200:
                return _error(self.health_status, "the engine is not running", "engine_unavailable")
            return JSONResponse({"status": "ok"})

        @app.get("/load")
        async def load() -> JSONResponse:
            if self.vllm:
                return JSONResponse({"detail": "Not Found"}, status_code=404)
            await asyncio.sleep(self.load_delay_s)
            if self.load_status != 200:
                return _error(self.load_status, "the engine is not running", "engine_unavailable")
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

        @app.post("/tokenize")
        async def tokenize(request: Request) -> JSONResponse:
            self.tokenize_calls += 1
            body = await request.json()
            if self.tokenize_delay_s is None:
                return JSONResponse({"detail": "Not Found"}, status_code=404)
            await asyncio.sleep(self.tokenize_delay_s)
            return JSONResponse({"count": len(str(body.get("prompt", "")).split())})

        @app.post("/detokenize")
        async def detokenize(request: Request) -> JSONResponse:
            tokens = (await request.json()).get("tokens")
            if not isinstance(tokens, list) or any(not isinstance(t, int) or t >= 100 for t in tokens):
                return _error(400, "Token ids must be in [0, 100).", None)
            return JSONResponse({"prompt": " ".join(f"w{t}" for t in tokens)})

        @app.get("/version")
        async def version() -> JSONResponse:
            return JSONResponse({"version": "stub-1"})

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            self.completions += 1
            body = await request.json()
            self.last_body = body
            if body.get("stream"):
                return StreamingResponse(self._events(body), media_type="text/event-stream")
            await asyncio.sleep(self.delay_s)  # longer than the gateway's request timeout: sent, never answered
            if self.plain_crash:
                return StreamingResponse(_half_then_crash(), media_type="application/json")
            status = 400 if body.get("prompt") == "bad" else self.status
            if status == 200:
                return JSONResponse(_completion(body, [{"index": 0, "text": " ok", "finish_reason": "length"}],
                                                usage=True))
            return _error(status, f"stub answers {status}", self.error_code if status != 400 else None)

        super().__init__(app)

    async def _events(self, body: dict) -> AsyncIterator[str]:
        for i in range(self.stream_events):
            if self.event_delay_s:
                await asyncio.sleep(self.event_delay_s)
            yield _sse(_completion(body, [{"index": 0, "text": f" t{i}", "finish_reason": None}]))
        end = self.stream_end
        if end == "usage_crash":
            yield _sse(_completion(body, [], usage=True))
        if end in ("crash", "usage_crash"):
            raise ReplicaCrash("the stub replica dies mid-stream")
        if end == "error":
            yield _sse({"error": {"message": "stub failed the request", "type": "server_error", "param": None,
                                  "code": "internal_error"}})
        if end == "done":
            yield _sse(_completion(body, [], usage=True))
        if end in ("done", "error"):
            yield "data: [DONE]\n\n"


async def _half_then_crash() -> AsyncIterator[str]:
    yield '{"id": "cmpl-stub", "object": "text_completion", "choi'
    raise ReplicaCrash("the stub replica dies mid-response")


def _words(body: dict) -> int:
    return len(str(body.get("prompt", "")).split())


def _completion(body: dict, choices: list[dict], usage: bool = False) -> dict:
    out: dict = {"id": "cmpl-stub", "object": "text_completion", "created": 0, "model": "stub", "choices": choices}
    if usage:
        out["usage"] = {"prompt_tokens": _words(body), "completion_tokens": 3, "total_tokens": _words(body) + 3}
    return out


def _sse(event: dict) -> str:
    return f"data: {json.dumps(event)}\n\n"


def _error(status: int, message: str, code: str | None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "server_error", "param": None, "code": code}},
                        status_code=status)
