"""The completions and chat completions handlers: request → prompt + SamplingParams → engine →
OpenAI response, either one JSON body or server-sent events ending in ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagedserve import errors
from pagedserve.engine.client import EngineClient, EngineDeadError, RequestStream
from pagedserve.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.server import protocol as p
from pagedserve.server.config import ServerConfig
from pagedserve.server.errors import APIError, error_body
from pagedserve.server.tokenization import TokenizerWorker, encode
from pagedserve.streaming import ClosingStreamingResponse

logger = logging.getLogger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# apply_chat_template arguments a client must not override through chat_template_kwargs.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "tokenize", "return_dict", "return_tensors", "add_generation_prompt", "chat_template",
    "continue_final_message", "padding", "truncation", "max_length", "tools", "documents",
    "return_assistant_tokens_mask", "tokenizer_kwargs"})


class ClientDisconnected(Exception):
    """The client hung up before the answer was ready."""


class SSEResponse(ClosingStreamingResponse):
    """Server-sent events of one engine request; the request is aborted however the response ends
    (also when the client left before the first event: see :mod:`pagedserve.streaming`)."""

    def __init__(self, events: AsyncIterator[str], stream: RequestStream):
        async def abort() -> None:
            stream.abort()
        super().__init__(events, abort, media_type="text/event-stream", headers=SSE_HEADERS)


@dataclass
class _Choice:
    """What is known of one of the ``n`` completions so far."""

    latest: CompletionOutput | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_sent: bool = False


class OpenAIServing:
    """Turns validated OpenAI requests into engine requests and engine outputs into responses."""

    def __init__(self, engine: EngineClient, config: ServerConfig, tokenizers: TokenizerWorker):
        from transformers import AutoTokenizer

        self.engine = engine
        self.config = config
        self.tokenizers = tokenizers  # prompts and chat templates: on the worker thread
        # The event loop's own instance, for the per-token text of logprobs (never shared across threads).
        self.tokenizer = AutoTokenizer.from_pretrained(engine.facts.tokenizer)
        self.model_name = config.served_model_name or engine.facts.model_name
        self.max_model_len: int = engine.facts.max_model_len
        self.vocab_size = len(self.tokenizer)

    # ---- validation ------------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        """Refuse a model name this server does not serve (null/absent means the one it does)."""
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model '{model}' does not exist on this server; it serves "
                                f"'{self.model_name}' (see GET /v1/models).",
                           error_type="invalid_request_error", param="model", code="model_not_found")

    async def completion_prompt(self, req: p.CompletionRequest) -> list[int]:
        """Token ids of a completions prompt (text is tokenized the way the model expects)."""
        prompt: Any = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise errors.InvalidRequest(
                    f"Only one prompt per request is supported, got {len(prompt)}; send one request per prompt.",
                    param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise errors.InvalidRequest("prompt must not be empty.", param="prompt")
            self.tokenizers.check_fits(prompt, self.max_model_len, "prompt")
            ids: list[int] = await self.tokenizers.run(encode, prompt)
        else:
            ids = list(prompt)
            if not ids:
                raise errors.InvalidRequest("prompt must not be empty.", param="prompt")
            bad = next((t for t in ids if t >= self.vocab_size), None)
            if bad is not None:
                raise errors.InvalidRequest(
                    f"Token id {bad} in prompt is out of range: ids must be in [0, {self.vocab_size}).",
                    param="prompt")
        if not ids:
            raise errors.InvalidRequest("prompt must not be empty (it tokenized to no tokens).", param="prompt")
        return ids

    async def chat_prompt(self, messages: list[p.ChatMessage], add_generation_prompt: bool = True,
                          template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Token ids of a conversation rendered with the tokenizer's chat template."""
        if not messages:
            raise errors.InvalidRequest("messages must not be empty: send at least one message.", param="messages")
        reserved = RESERVED_TEMPLATE_KWARGS.intersection(template_kwargs or {})
        if reserved:
            raise errors.InvalidRequest(f"chat_template_kwargs may not set {sorted(reserved)}: the server controls them.",
                                        param="chat_template_kwargs")
        rendered: list[dict[str, str]] = []
        for i, m in enumerate(messages):
            if m.tool_calls or m.function_call:
                raise errors.InvalidRequest("tool calls are not supported by this server; remove them.",
                                            param=f"messages[{i}].tool_calls")
            if isinstance(m.content, list):
                content = "".join(part.text for part in m.content)
            else:
                content = m.content or ""
            if not content and m.role != "assistant":
                raise errors.InvalidRequest(f"messages[{i}].content must not be empty.",
                                            param=f"messages[{i}].content")
            rendered.append({"role": m.role, "content": content})
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise errors.InvalidRequest(
                "This model's tokenizer has no chat template; use /v1/completions with a plain prompt.",
                param="messages")
        self.tokenizers.check_fits("".join(m["content"] for m in rendered), self.max_model_len, "messages")
        ids = await self.tokenizers.run(_render_chat, rendered, add_generation_prompt, template_kwargs or {})
        if not ids:
            raise errors.InvalidRequest("messages rendered to an empty prompt.", param="messages")
        return ids

    def check_length(self, prompt_len: int, max_tokens: int | None, prompt_param: str,
                     max_tokens_param: str) -> None:
        """Refuse prompts over max_model_len and max_tokens past the context, naming the fix."""
        if prompt_len >= self.max_model_len:
            raise errors.RequestTooLong(
                f"The prompt is {prompt_len} tokens, but this model's maximum context length is "
                f"{self.max_model_len} tokens (prompt plus at least one generated token); shorten the prompt.",
                param=prompt_param)
        if max_tokens is not None and prompt_len + max_tokens > self.max_model_len:
            raise errors.RequestTooLong(
                f"{max_tokens_param}={max_tokens} plus the prompt's {prompt_len} tokens is "
                f"{prompt_len + max_tokens}, over the maximum context length of {self.max_model_len}; "
                f"set {max_tokens_param} to at most {self.max_model_len - prompt_len}.",
                param=max_tokens_param)

    @staticmethod
    def check_unsupported(req: p.SamplingFields) -> None:
        """Refuse OpenAI options this server accepts in the schema but cannot honour."""
        if req.logit_bias:
            raise errors.InvalidRequest("logit_bias is not supported; remove it.", param="logit_bias")
        if isinstance(req, p.CompletionRequest):
            if req.echo:
                raise errors.InvalidRequest("echo=true is not supported; remove it.", param="echo")
            if req.best_of is not None and req.best_of != req.n:
                raise errors.InvalidRequest("best_of is not supported (only best_of == n); use n.", param="best_of")
            if req.suffix:
                raise errors.InvalidRequest("suffix is not supported; remove it.", param="suffix")
        if isinstance(req, p.ChatCompletionRequest):
            if req.tools:
                raise errors.InvalidRequest("tools are not supported by this server; remove them.", param="tools")
            if req.top_logprobs and not req.logprobs:
                raise errors.InvalidRequest("top_logprobs requires logprobs=true.", param="top_logprobs")
        if req.stream_options is not None and not req.stream:
            raise errors.InvalidRequest("stream_options is only allowed with stream=true.", param="stream_options")

    @staticmethod
    def sampling_params(req: p.SamplingFields, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Map the request's fields onto the engine's SamplingParams (which validates them again)."""
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        return SamplingParams(
            n=req.n,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            seed=req.seed,
            stop=stop,
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos,
            include_stop_str_in_output=req.include_stop_str_in_output,
            logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens,
        )

    # ---- endpoints -------------------------------------------------------------------------

    async def completions(self, req: p.CompletionRequest, http: Request) -> Response:
        """``POST /v1/completions``."""
        self.check_model(req.model)
        self.check_unsupported(req)
        prompt_ids = await self.completion_prompt(req)
        self.check_length(len(prompt_ids), req.max_tokens, "prompt", "max_tokens")
        params = self.sampling_params(req, req.max_tokens, req.logprobs)
        request_id = req.request_id or f"cmpl-{uuid.uuid4().hex}"
        stream = await self.engine.add_request(request_id, prompt_ids, params, req.priority, req.cache_salt)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return SSEResponse(self._completion_events(stream, request_id, req.logprobs is not None, include_usage),
                               stream)
        choices, final = await self._collect(stream, http)
        resp = p.CompletionResponse(
            id=request_id, model=self.model_name,
            choices=[p.CompletionChoice(index=i, text=c.latest.text if c.latest else "",
                                        logprobs=self._completion_logprobs(c.logprobs) if req.logprobs is not None else None,
                                        finish_reason=c.latest.finish_reason if c.latest else "abort",
                                        stop_reason=c.latest.stop_reason if c.latest else None)
                     for i, c in sorted(choices.items())],
            usage=self._usage(final, choices))
        return JSONResponse(resp.model_dump())

    async def chat(self, req: p.ChatCompletionRequest, http: Request) -> Response:
        """``POST /v1/chat/completions``."""
        self.check_model(req.model)
        self.check_unsupported(req)
        prompt_ids = await self.chat_prompt(req.messages, req.add_generation_prompt, req.chat_template_kwargs)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        self.check_length(len(prompt_ids), max_tokens, "messages", param)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling_params(req, max_tokens, logprobs)
        request_id = req.request_id or f"chatcmpl-{uuid.uuid4().hex}"
        stream = await self.engine.add_request(request_id, prompt_ids, params, req.priority, req.cache_salt)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return SSEResponse(self._chat_events(stream, request_id, req.n, req.logprobs, include_usage), stream)
        choices, final = await self._collect(stream, http)
        resp = p.ChatCompletionResponse(
            id=request_id, model=self.model_name,
            choices=[p.ChatChoice(index=i, message=p.ChatResponseMessage(content=c.latest.text if c.latest else ""),
                                  logprobs=self._chat_logprobs(c.logprobs) if req.logprobs else None,
                                  finish_reason=c.latest.finish_reason if c.latest else "abort",
                                  stop_reason=c.latest.stop_reason if c.latest else None)
                     for i, c in sorted(choices.items())],
            usage=self._usage(final, choices))
        return JSONResponse(resp.model_dump())

    async def tokenize(self, req: p.TokenizeRequest) -> Response:
        """``POST /tokenize``: the prompt's token ids as the engine would see them (a
        :class:`~pagedserve.server.protocol.TokenizeResponse` body, encoded with msgspec: a
        million ids through pydantic would hold the event loop for a tenth of a second)."""
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise errors.InvalidRequest("send exactly one of prompt or messages.", param="prompt")
        if req.messages is not None:
            ids = await self.chat_prompt(req.messages, req.add_generation_prompt)
        else:
            ids = await self.tokenizers.run(encode, req.prompt, req.add_special_tokens)
        body = msgspec.json.encode({"count": len(ids), "tokens": ids, "max_model_len": self.max_model_len})
        return Response(body, media_type="application/json")

    # ---- non-streamed ----------------------------------------------------------------------

    async def _collect(self, stream: RequestStream, http: Request) -> tuple[dict[int, _Choice], RequestOutput | None]:
        """Run the request to the end; abort it if the client hangs up first."""
        choices: dict[int, _Choice] = {}

        async def consume() -> RequestOutput | None:
            final = None
            async for out in stream:
                self._update(choices, out)
                final = out
            return final

        consumer = asyncio.ensure_future(consume())
        watcher = asyncio.ensure_future(_wait_for_disconnect(http))
        try:
            done, _ = await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if consumer not in done:
                stream.abort()
                raise ClientDisconnected()
            final = consumer.result()
        finally:
            for task in (consumer, watcher):
                task.cancel()
            stream.abort()
        if final is None or not final.finished:
            raise EngineDeadError("the request was aborted before it finished: the server is shutting down")
        return choices, final

    @staticmethod
    def _update(choices: dict[int, _Choice], out: RequestOutput) -> None:
        for c in out.outputs:
            choice = choices.setdefault(c.index, _Choice())
            choice.latest = c
            if c.delta_logprobs:
                choice.logprobs.extend(c.delta_logprobs)

    @staticmethod
    def _usage(final: RequestOutput | None, choices: dict[int, _Choice]) -> p.Usage:
        prompt_tokens = len(final.prompt_token_ids) if final is not None else 0
        completion_tokens = sum(len(c.latest.token_ids) for c in choices.values() if c.latest is not None)
        cached = final.num_cached_tokens if final is not None else 0
        return p.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                       total_tokens=prompt_tokens + completion_tokens,
                       prompt_tokens_details=p.PromptTokensDetails(cached_tokens=cached))

    # ---- logprobs --------------------------------------------------------------------------

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _completion_logprobs(self, lps: list[TokenLogprob], offset: int = 0) -> p.CompletionLogprobs:
        out = p.CompletionLogprobs()
        for lp in lps:
            text = self._token_text(lp.token_id)
            out.tokens.append(text)
            out.token_logprobs.append(lp.logprob)
            out.top_logprobs.append({self._token_text(t): v for t, v in lp.top} if lp.top else None)
            out.text_offset.append(offset)
            offset += len(text)
        return out

    def _chat_logprobs(self, lps: list[TokenLogprob]) -> p.ChatLogprobs:
        content = []
        for lp in lps:
            text = self._token_text(lp.token_id)
            content.append(p.ChatTokenLogprob(
                token=text, logprob=lp.logprob, bytes=list(text.encode("utf-8", "replace")),
                top_logprobs=[p.TopLogprob(token=(t_text := self._token_text(t)), logprob=v,
                                           bytes=list(t_text.encode("utf-8", "replace"))) for t, v in lp.top]))
        return p.ChatLogprobs(content=content)

    # ---- streamed --------------------------------------------------------------------------

    async def _completion_events(self, stream: RequestStream, request_id: str, want_logprobs: bool,
                                 include_usage: bool) -> AsyncIterator[str]:
        choices: dict[int, _Choice] = {}
        offsets: dict[int, int] = {}
        final: RequestOutput | None = None
        try:
            async for out in stream:
                final = out
                self._update(choices, out)
                for c in out.outputs:
                    choice = choices[c.index]
                    if not c.delta_text and not (c.finished and not choice.finish_sent):
                        continue
                    choice.finish_sent = choice.finish_sent or c.finished
                    lp = None
                    if want_logprobs and c.delta_logprobs:
                        lp = self._completion_logprobs(c.delta_logprobs, offsets.get(c.index, 0))
                    offsets[c.index] = offsets.get(c.index, 0) + len(c.delta_text)
                    chunk = {"id": request_id, "object": "text_completion", "created": _now(), "model": self.model_name,
                             "choices": [{"index": c.index, "text": c.delta_text,
                                          "logprobs": lp.model_dump() if lp else None,
                                          "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]}
                    if include_usage:
                        chunk["usage"] = None
                    yield _sse(chunk)
            if include_usage:
                usage = self._usage(final, choices)
                yield _sse({"id": request_id, "object": "text_completion", "created": _now(),
                            "model": self.model_name, "choices": [], "usage": usage.model_dump()})
        except errors.PagedServeError as exc:
            yield _sse(error_body(exc.message, exc.error_type, exc.param, exc.code))
        finally:
            stream.abort()
        yield "data: [DONE]\n\n"

    async def _chat_events(self, stream: RequestStream, request_id: str, n: int, want_logprobs: bool,
                           include_usage: bool) -> AsyncIterator[str]:
        choices: dict[int, _Choice] = {}
        final: RequestOutput | None = None

        def chunk(index: int, delta: p.ChatDelta, finish: str | None = None, stop_reason: Any = None,
                  logprobs: p.ChatLogprobs | None = None) -> str:
            body = p.ChatCompletionChunk(id=request_id, model=self.model_name, choices=[
                p.ChatStreamChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish,
                                   stop_reason=stop_reason)]).model_dump(exclude={"usage"} if not include_usage else None)
            return _sse(body)

        try:
            # The role comes first, once per choice, as OpenAI sends it.
            for i in range(n):
                yield chunk(i, p.ChatDelta(role="assistant", content=""))
            async for out in stream:
                final = out
                self._update(choices, out)
                for c in out.outputs:
                    choice = choices[c.index]
                    lp = self._chat_logprobs(c.delta_logprobs) if want_logprobs and c.delta_logprobs else None
                    if c.delta_text or lp is not None:
                        yield chunk(c.index, p.ChatDelta(content=c.delta_text), logprobs=lp)
                    if c.finished and not choice.finish_sent:
                        choice.finish_sent = True
                        yield chunk(c.index, p.ChatDelta(), finish=c.finish_reason, stop_reason=c.stop_reason)
            if include_usage:
                body = p.ChatCompletionChunk(id=request_id, model=self.model_name, choices=[],
                                             usage=self._usage(final, choices))
                yield _sse(body.model_dump())
        except errors.PagedServeError as exc:
            yield _sse(error_body(exc.message, exc.error_type, exc.param, exc.code))
        finally:
            stream.abort()
        yield "data: [DONE]\n\n"


def _render_chat(tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool,
                 template_kwargs: dict[str, Any]) -> list[int]:
    """Render and tokenize a conversation (on the tokenizer worker's thread)."""
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             **template_kwargs)
    except Exception as exc:  # a template's own raise_exception("roles must alternate ...")
        raise errors.InvalidRequest(f"The chat template refused these messages: {exc}", param="messages") from exc
    return encode(tokenizer, text, add_special_tokens=False)


async def _wait_for_disconnect(http: Request) -> None:
    """Return when the client closes the connection (the body has already been read)."""
    while True:
        message = await http.receive()
        if message["type"] == "http.disconnect":
            return


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _now() -> int:
    return int(time.time())
