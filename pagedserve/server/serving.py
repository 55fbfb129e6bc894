"""The completions and chat completions handlers: request → prompt + SamplingParams → engine →
OpenAI response, either one JSON body or server-sent events ending in ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import dataclasses
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
from pagedserve.engine.sampling_params import SamplingParams, StructuredOutputsParams
from pagedserve.server import protocol as p
from pagedserve.server.config import ServerConfig
from pagedserve.server.errors import APIError, error_body
from pagedserve.server.best_of import select_best
from pagedserve.server.fanout import RequestGroup
from pagedserve.server.prompt_logprobs import concat, echo_logprobs, vllm_prompt_logprobs
from pagedserve.server.structured import requested_spec, tool_call_spec
from pagedserve.server.tokenization import TokenizerWorker, encode
from pagedserve.server.tool_parsers import PARSERS, ParsedCall, StreamingToolCalls, ToolParser
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

    def __init__(self, events: AsyncIterator[str], stream: RequestStream | RequestGroup):
        async def abort() -> None:
            stream.abort()
        super().__init__(events, abort, media_type="text/event-stream", headers=SSE_HEADERS)


@dataclass(frozen=True)
class _CompletionView:
    """How a completions request's engine outputs become its choices."""

    logprobs: int | None  # the request's logprobs (None: no logprobs in the answer)
    echo: list[str] | None  # each prompt's text, when echo is on
    prompt_only: bool  # max_tokens 0 with echo: the generated token is left out
    stride: int  # completions per engine request (n, or best_of)
    prompt_logprobs: int | None  # the request's prompt_logprobs (vLLM's field)


@dataclass
class _Choice:
    """What is known of one of the ``n`` completions so far."""

    latest: CompletionOutput | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_sent: bool = False
    request_id: str = ""  # the engine request it belongs to (several prompts: one per prompt)
    prompt_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    cached_tokens: int = 0
    echo_sent: bool = False
    tools: StreamingToolCalls | None = None  # streamed with tool parsing


@dataclass
class ToolMode:
    """How a chat request's output becomes tool calls: ``kind`` none | auto | required | named."""

    kind: str
    parser: ToolParser | None = None
    function: str | None = None  # named

    def calls(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """(content, calls) of a finished output."""
        if self.kind == "auto" and self.parser is not None:
            return self.parser.parse(text)
        if self.kind in ("required", "named"):
            try:  # the grammar made it JSON, unless max_tokens cut it short
                value = json.loads(text)
            except ValueError:
                return text, []
            if self.kind == "named":
                return None, [ParsedCall(self.function or "", json.dumps(value, ensure_ascii=False))]
            return None, [ParsedCall(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in value]
        return text, []


class OpenAIServing:
    """Turns validated OpenAI requests into engine requests and engine outputs into responses."""

    def __init__(self, engine: EngineClient, config: ServerConfig, tokenizers: TokenizerWorker):
        self.engine = engine
        self.config = config
        self.tokenizers = tokenizers  # prompts and chat templates: on the worker thread
        # The event loop's instance, for the per-token text of logprobs (never used from another
        # thread): the engine client's own, which detokenizes on this loop too.
        self.tokenizer = engine.tokenizer
        self.has_chat_template = (config.chat_template is not None
                                  or getattr(self.tokenizer, "chat_template", None) is not None)
        self.model_name = config.served_model_name or engine.facts.model_name
        self.max_model_len: int = engine.facts.max_model_len
        self.tokenizer_size = len(self.tokenizer)  # what /detokenize can decode
        self.special_ids = frozenset(self.tokenizer.all_special_ids)
        self.tool_parser = PARSERS[config.tool_call_parser]()

    # ---- validation ------------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        """Refuse a model name this server does not serve (null/absent means the one it does)."""
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model '{model}' does not exist on this server; it serves "
                                f"'{self.model_name}' (see GET /v1/models).",
                           error_type="invalid_request_error", param="model", code="model_not_found")

    async def completion_prompts(self, req: p.CompletionRequest) -> list[list[int]]:
        """Token ids of each of a completions request's prompts (text is tokenized the way the model
        expects). One text or one token list is one prompt; a list of either is several."""
        prompts: list[Any] = [req.prompt]
        if isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], (str, list)):
            prompts = list(req.prompt)
        out: list[list[int]] = []
        for k, prompt in enumerate(prompts):
            param = "prompt" if len(prompts) == 1 else f"prompt[{k}]"
            if isinstance(prompt, str):
                if not prompt:
                    raise errors.InvalidRequest("prompt must not be empty.", param=param)
                self.tokenizers.check_fits(prompt, self.max_model_len, param)
                ids: list[int] = await self.tokenizers.run(encode, prompt)
            else:
                ids = list(prompt)  # their range is the client's request check (the model's vocabulary)
                if not ids:
                    raise errors.InvalidRequest("prompt must not be empty.", param=param)
            if not ids:
                raise errors.InvalidRequest("prompt must not be empty (it tokenized to no tokens).", param=param)
            out.append(ids)
        return out

    async def chat_prompt(self, messages: list[p.ChatMessage], add_generation_prompt: bool = True,
                          template_kwargs: dict[str, Any] | None = None,
                          tools: list[p.Tool] | None = None) -> list[int]:
        """Token ids of a conversation rendered with the tokenizer's chat template."""
        if not messages:
            raise errors.InvalidRequest("messages must not be empty: send at least one message.", param="messages")
        reserved = RESERVED_TEMPLATE_KWARGS.intersection(template_kwargs or {})
        if reserved:
            raise errors.InvalidRequest(f"chat_template_kwargs may not set {sorted(reserved)}: the server controls them.",
                                        param="chat_template_kwargs")
        rendered: list[dict[str, Any]] = []
        for i, m in enumerate(messages):
            if m.function_call:
                raise errors.InvalidRequest("function_call (the deprecated form) is not supported; use tool_calls.",
                                            param=f"messages[{i}].function_call")
            if m.tool_calls and m.role != "assistant":
                raise errors.InvalidRequest("only assistant messages may carry tool_calls.",
                                            param=f"messages[{i}].tool_calls")
            if isinstance(m.content, list):
                content = "".join(part.text for part in m.content)
            else:
                content = m.content or ""
            if not content and m.role != "assistant":
                raise errors.InvalidRequest(f"messages[{i}].content must not be empty.",
                                            param=f"messages[{i}].content")
            message: dict[str, Any] = {"role": m.role, "content": content}
            if m.tool_calls:
                message["tool_calls"] = [_template_tool_call(c) for c in m.tool_calls]
            if m.role == "tool" and m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                message["name"] = m.name
            rendered.append(message)
        if not self.has_chat_template:
            raise errors.InvalidRequest(
                "This model's tokenizer has no chat template; use /v1/completions with a plain prompt.",
                param="messages")
        self.tokenizers.check_fits("".join(m["content"] for m in rendered), self.max_model_len, "messages")
        kwargs = dict(template_kwargs or {})
        if tools:  # templates that take tools (HF's tools=...) render them; others ignore them
            kwargs["tools"] = [t.model_dump(exclude_none=True) for t in tools]
        ids = await self.tokenizers.run(_render_chat, rendered, add_generation_prompt, kwargs)
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
        if isinstance(req, p.CompletionRequest):
            if req.max_tokens == 0 and not req.echo:
                raise errors.InvalidRequest("max_tokens must be at least 1 (0 is only for echo=true: the prompt "
                                            "and its logprobs, nothing generated).", param="max_tokens")
            if req.best_of is not None and req.best_of < req.n:
                raise errors.InvalidRequest(f"best_of ({req.best_of}) must be at least n ({req.n}).", param="best_of")
            if req.best_of is not None and req.best_of > req.n and req.stream:
                raise errors.InvalidRequest("best_of > n cannot be streamed (the best are known only at the end); "
                                            "set stream=false or best_of=n.", param="best_of")
            if req.suffix:
                raise errors.InvalidRequest("suffix (fill-in-the-middle) is not supported by this server; remove it "
                                            "and put the text before the gap in prompt.", param="suffix")
        if isinstance(req, p.ChatCompletionRequest):
            if req.top_logprobs and not req.logprobs:
                raise errors.InvalidRequest("top_logprobs requires logprobs=true.", param="top_logprobs")
        if req.prompt_logprobs is not None and req.stream:
            raise errors.InvalidRequest("prompt_logprobs is not available with stream=true (use echo with logprobs "
                                        "on /v1/completions to stream the prompt's logprobs).", param="prompt_logprobs")
        if req.stream_options is not None and not req.stream:
            raise errors.InvalidRequest("stream_options is only allowed with stream=true.", param="stream_options")

    @staticmethod
    def sampling_params(req: p.SamplingFields, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Map the request's fields onto the engine's SamplingParams (the schema bounded them; the
        client's request check validates the result once, engine/request_check.py)."""
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
            logit_bias={int(k): v for k, v in req.logit_bias.items()} if req.logit_bias else None,
            prompt_logprobs=req.prompt_logprobs,
            stream_interval=req.stream_interval or 1,
        )

    async def structured_spec(self, req: p.SamplingFields,
                              tool_mode: ToolMode | None = None) -> StructuredOutputsParams | None:
        """The request's output constraint (a forced tool call's, or what its fields ask for),
        checked on the tokenizer thread: one that cannot compile is a 400 naming the problem."""
        spec, param = requested_spec(req)
        if tool_mode is not None and tool_mode.kind in ("required", "named"):
            assert isinstance(req, p.ChatCompletionRequest) and req.tools and req.tool_choice is not None
            if spec is not None:
                raise errors.InvalidRequest(f"{param} cannot be combined with tool_choice {tool_mode.kind!r}, "
                                            "which constrains the output to a tool call.", param=param)
            spec, param = tool_call_spec(req.tools, req.tool_choice, req.parallel_tool_calls), "tools"
        if spec is not None:
            await self.tokenizers.run(_check_spec, spec, param)
        return spec

    def tool_mode(self, req: p.ChatCompletionRequest) -> ToolMode:
        """Validate ``tools`` / ``tool_choice`` and say how the output is read."""
        choice = req.tool_choice
        if not req.tools:
            if choice not in (None, "none"):
                raise errors.InvalidRequest("tool_choice needs tools: give the functions in tools.", param="tool_choice")
            return ToolMode("none")
        names = [t.function.name for t in req.tools]
        if len(set(names)) != len(names):
            raise errors.InvalidRequest("tools must have distinct function names.", param="tools")
        if choice is None:
            choice = "auto" if self.config.enable_auto_tool_choice else "none"
        if isinstance(choice, p.NamedToolChoice):
            if choice.function.name not in names:
                raise errors.InvalidRequest(f"tool_choice names function {choice.function.name!r}, which is not "
                                            f"in tools ({', '.join(names)}).", param="tool_choice")
            return ToolMode("named", function=choice.function.name)
        if choice == "auto" and not self.config.enable_auto_tool_choice:
            raise errors.InvalidRequest(
                'tool_choice "auto" needs the server started with --enable-auto-tool-choice (and '
                '--tool-call-parser for the model\'s format); use "required" or a named function, which '
                "work on any model.", param="tool_choice")
        return ToolMode(choice, parser=self.tool_parser if choice == "auto" else None)

    # ---- endpoints -------------------------------------------------------------------------

    async def completions(self, req: p.CompletionRequest, http: Request) -> Response:
        """``POST /v1/completions``."""
        self.check_model(req.model)
        self.check_unsupported(req)
        prompts = await self.completion_prompts(req)
        for k, ids in enumerate(prompts):
            self.check_length(len(ids), req.max_tokens, "prompt" if len(prompts) == 1 else f"prompt[{k}]", "max_tokens")
        # max_tokens 0 (echo only): the engine generates one token, which the answer leaves out.
        prompt_only = req.max_tokens == 0
        params = self.sampling_params(req, 1 if prompt_only else req.max_tokens, req.logprobs)
        best_of = req.best_of or req.n
        if best_of > max(req.n, self.engine.facts.max_num_seqs):  # (n's own bound is the engine's, named n)
            raise errors.InvalidRequest(f"best_of={best_of} needs {best_of} seats, but this server runs at most "
                                        f"max_num_seqs={self.engine.facts.max_num_seqs} sequences; lower best_of.",
                                        param="best_of")
        changes: dict[str, Any] = {}
        if req.echo and req.logprobs is not None:  # echo's logprobs start with the prompt's
            changes["prompt_logprobs"] = max(req.prompt_logprobs or 0, req.logprobs)
        if best_of > req.n:  # best_of sequences, ranked by their chosen tokens' logprobs
            changes.update(n=best_of, logprobs=req.logprobs or 0)
        if changes:
            params = dataclasses.replace(params, **changes)
        params.structured_outputs = await self.structured_spec(req)
        echo = await self.tokenizers.run(_echo_texts, req.prompt, prompts, req.skip_special_tokens) if req.echo else None
        request_id = req.request_id or f"cmpl-{uuid.uuid4().hex}"
        # One engine request per prompt; choice j of prompt i is index i * n + j (OpenAI's numbering).
        stream = await RequestGroup.add(
            lambda rid, i: self.engine.add_request(rid, prompts[i], params, req.priority, req.cache_salt),
            request_id, len(prompts), params.n)
        view = _CompletionView(req.logprobs, echo, prompt_only, params.n, req.prompt_logprobs)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return SSEResponse(self._completion_events(stream, request_id, req.logprobs is not None, include_usage,
                                                       view), stream)
        choices, final = await self._collect(stream, http)
        usage = self._usage(final, choices)  # every sampled token counts, the best_of not answered too
        if prompt_only:
            usage = p.Usage(prompt_tokens=usage.prompt_tokens, completion_tokens=0, total_tokens=usage.prompt_tokens,
                            prompt_tokens_details=usage.prompt_tokens_details)
        if best_of > req.n:
            choices = select_best(choices, len(prompts), best_of, req.n)
        resp = p.CompletionResponse(
            id=request_id, model=self.model_name,
            choices=[self._completion_choice(i, c, view, i // req.n) for i, c in sorted(choices.items())],
            usage=usage)
        return JSONResponse(resp.model_dump())

    def _completion_choice(self, index: int, c: _Choice, view: _CompletionView, prompt_index: int) -> p.CompletionChoice:
        """One non-streamed completions choice: echo, generated text, logprobs, prompt_logprobs."""
        text = "" if view.prompt_only or c.latest is None else c.latest.text
        logprobs = None
        if view.logprobs is not None:
            logprobs = self._completion_logprobs([] if view.prompt_only else c.logprobs)
        if view.echo is not None:
            echo_text = view.echo[prompt_index]
            if logprobs is not None:
                head = echo_logprobs(c.prompt_token_ids, c.prompt_logprobs, self._token_text, view.logprobs or 0,
                                     self.special_ids)
                logprobs = concat(head, self._completion_logprobs([] if view.prompt_only else c.logprobs,
                                                                  len(echo_text)))
            text = echo_text + text
        prompt_lps = None
        if view.prompt_logprobs is not None:
            prompt_lps = vllm_prompt_logprobs(c.prompt_token_ids, c.prompt_logprobs, self._token_text,
                                              view.prompt_logprobs)
        return p.CompletionChoice(index=index, text=text, logprobs=logprobs,
                                  finish_reason=c.latest.finish_reason if c.latest else "abort",
                                  stop_reason=c.latest.stop_reason if c.latest else None, prompt_logprobs=prompt_lps)

    async def chat(self, req: p.ChatCompletionRequest, http: Request) -> Response:
        """``POST /v1/chat/completions``."""
        self.check_model(req.model)
        self.check_unsupported(req)
        tools = self.tool_mode(req)
        prompt_ids = await self.chat_prompt(req.messages, req.add_generation_prompt, req.chat_template_kwargs,
                                            req.tools)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        self.check_length(len(prompt_ids), max_tokens, "messages", param)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling_params(req, max_tokens, logprobs)
        params.structured_outputs = await self.structured_spec(req, tools)
        request_id = req.request_id or f"chatcmpl-{uuid.uuid4().hex}"
        stream = await self.engine.add_request(request_id, prompt_ids, params, req.priority, req.cache_salt)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return SSEResponse(self._chat_events(stream, request_id, req.n, req.logprobs, include_usage, tools),
                               stream)
        choices, final = await self._collect(stream, http)
        prompt_lps = None
        if req.prompt_logprobs is not None and choices:
            first = choices[min(choices)]
            prompt_lps = vllm_prompt_logprobs(first.prompt_token_ids, first.prompt_logprobs, self._token_text,
                                              req.prompt_logprobs)
        resp = p.ChatCompletionResponse(
            id=request_id, model=self.model_name, prompt_logprobs=prompt_lps,
            choices=[self._chat_choice(i, c, tools, req.logprobs) for i, c in sorted(choices.items())],
            usage=self._usage(final, choices))
        return JSONResponse(resp.model_dump())

    def _chat_choice(self, index: int, c: _Choice, tools: ToolMode, want_logprobs: bool) -> p.ChatChoice:
        text = c.latest.text if c.latest else ""
        finish = c.latest.finish_reason if c.latest else "abort"
        content, calls = tools.calls(text) if finish != "abort" else (text, [])
        message = p.ChatResponseMessage(content=content, tool_calls=[_tool_call(call) for call in calls])
        return p.ChatChoice(index=index, message=message,
                            logprobs=self._chat_logprobs(c.logprobs) if want_logprobs else None,
                            finish_reason="tool_calls" if calls else finish,
                            stop_reason=c.latest.stop_reason if c.latest else None)

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

    async def detokenize(self, req: p.DetokenizeRequest) -> Response:
        """``POST /detokenize``: the text of token ids (special tokens kept, as vLLM does), on the
        tokenizer worker's thread."""
        self.check_model(req.model)
        bad = next((t for t in req.tokens if t >= self.tokenizer_size), None)
        if bad is not None:
            raise errors.InvalidRequest(f"Token id {bad} is out of range: ids must be in [0, {self.tokenizer_size}).",
                                        param="tokens")
        text = await self.tokenizers.run(_decode, req.tokens)
        return Response(msgspec.json.encode({"prompt": text}), media_type="application/json")

    # ---- non-streamed ----------------------------------------------------------------------

    async def _collect(self, stream: RequestStream | RequestGroup, http: Request) -> tuple[dict[int, _Choice], RequestOutput | None]:
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
            choice.request_id, choice.prompt_token_ids = out.request_id, out.prompt_token_ids
            choice.cached_tokens = out.num_cached_tokens
            if out.prompt_logprobs is not None:
                choice.prompt_logprobs = out.prompt_logprobs
            if c.delta_logprobs:
                choice.logprobs.extend(c.delta_logprobs)

    @staticmethod
    def _usage(final: RequestOutput | None, choices: dict[int, _Choice]) -> p.Usage:
        # The prompts' tokens once per engine request (its n choices share the prompt).
        requests = {c.request_id: c for c in choices.values() if c.latest is not None}
        if requests:
            prompt_tokens = sum(len(c.prompt_token_ids) for c in requests.values())
            cached = sum(c.cached_tokens for c in requests.values())
        else:
            prompt_tokens = len(final.prompt_token_ids) if final is not None else 0
            cached = final.num_cached_tokens if final is not None else 0
        completion_tokens = sum(len(c.latest.token_ids) for c in choices.values() if c.latest is not None)
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

    async def _completion_events(self, stream: RequestStream | RequestGroup, request_id: str, want_logprobs: bool,
                                 include_usage: bool, view: _CompletionView) -> AsyncIterator[str]:
        choices: dict[int, _Choice] = {}
        offsets: dict[int, int] = {}
        final: RequestOutput | None = None

        def chunk(index: int, text: str, lp: p.CompletionLogprobs | None, finish: str | None, stop: Any) -> str:
            body = {"id": request_id, "object": "text_completion", "created": _now(), "model": self.model_name,
                    "choices": [{"index": index, "text": text, "logprobs": lp.model_dump() if lp else None,
                                 "finish_reason": finish, "stop_reason": stop}]}
            if include_usage:
                body["usage"] = None
            return _sse(body)

        try:
            async for out in stream:
                final = out
                self._update(choices, out)
                for c in out.outputs:
                    choice = choices[c.index]
                    if view.echo is not None and not choice.echo_sent:  # the prompt first, once per choice
                        choice.echo_sent = True
                        echo_text = view.echo[c.index // view.stride]
                        lp = None
                        if want_logprobs:
                            lp = echo_logprobs(out.prompt_token_ids, out.prompt_logprobs, self._token_text,
                                               view.logprobs or 0, self.special_ids)
                        offsets[c.index] = len(echo_text)
                        yield chunk(c.index, echo_text, lp, None, None)
                    delta_text = "" if view.prompt_only else c.delta_text
                    if not delta_text and not (c.finished and not choice.finish_sent):
                        continue
                    choice.finish_sent = choice.finish_sent or c.finished
                    lp = None
                    if want_logprobs and c.delta_logprobs and not view.prompt_only:
                        lp = self._completion_logprobs(c.delta_logprobs, offsets.get(c.index, 0))
                    offsets[c.index] = offsets.get(c.index, 0) + len(delta_text)
                    yield chunk(c.index, delta_text, lp, c.finish_reason, c.stop_reason)
            if include_usage:
                usage = self._usage(final, choices)
                if view.prompt_only:
                    usage.completion_tokens, usage.total_tokens = 0, usage.prompt_tokens
                yield _sse({"id": request_id, "object": "text_completion", "created": _now(),
                            "model": self.model_name, "choices": [], "usage": usage.model_dump()})
        except errors.PagedServeError as exc:
            yield _sse(error_body(exc.message, exc.error_type, exc.param, exc.code))
        finally:
            stream.abort()
        yield "data: [DONE]\n\n"

    def _tool_deltas(self, choice: _Choice, c: CompletionOutput, tools: ToolMode) -> tuple[str, list[p.DeltaToolCall]]:
        """A tool-reading choice's content delta and its completed calls as deltas (each call goes
        out whole in one delta: name, id and all of its arguments)."""
        if choice.tools is None:
            # required / named: the whole output is the call(s), read at the end.
            parser = tools.parser or _ForcedCalls(tools)
            choice.tools = StreamingToolCalls(parser)
        content, calls = choice.tools.feed(c.text, c.finished and c.finish_reason != "abort")
        first = len(choice.tools.calls) - len(calls)
        deltas = []
        for k, call in enumerate(calls):
            full = _tool_call(call)
            deltas.append(p.DeltaToolCall(index=first + k, id=full.id, type="function",
                                          function=p.DeltaFunctionCall(name=call.name, arguments=call.arguments)))
        return content, deltas

    async def _chat_events(self, stream: RequestStream, request_id: str, n: int, want_logprobs: bool,
                           include_usage: bool, tools: ToolMode) -> AsyncIterator[str]:
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
                    finish = c.finish_reason
                    if tools.kind == "none":
                        if c.delta_text or lp is not None:
                            yield chunk(c.index, p.ChatDelta(content=c.delta_text), logprobs=lp)
                    else:
                        content, calls = self._tool_deltas(choice, c, tools)
                        if content or lp is not None:
                            yield chunk(c.index, p.ChatDelta(content=content), logprobs=lp)
                        if choice.tools is not None and choice.tools.calls and c.finished and finish != "abort":
                            finish = "tool_calls"
                        if calls:
                            yield chunk(c.index, p.ChatDelta(tool_calls=calls))
                    if c.finished and not choice.finish_sent:
                        choice.finish_sent = True
                        yield chunk(c.index, p.ChatDelta(), finish=finish, stop_reason=c.stop_reason)
            if include_usage:
                body = p.ChatCompletionChunk(id=request_id, model=self.model_name, choices=[],
                                             usage=self._usage(final, choices))
                yield _sse(body.model_dump())
        except errors.PagedServeError as exc:
            yield _sse(error_body(exc.message, exc.error_type, exc.param, exc.code))
        finally:
            stream.abort()
        yield "data: [DONE]\n\n"


def _tool_call(call: ParsedCall) -> p.ToolCall:
    return p.ToolCall(id=f"call_{uuid.uuid4().hex[:24]}",
                      function=p.FunctionCall(name=call.name, arguments=call.arguments))


def _template_tool_call(call: p.ToolCall) -> dict[str, Any]:
    """A tool call as chat templates expect it: arguments as an object (JSON text if not one)."""
    try:
        arguments: Any = json.loads(call.function.arguments)
    except ValueError:
        arguments = call.function.arguments
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}


def _check_spec(tokenizer: Any, spec: StructuredOutputsParams, param: str) -> None:
    """On the tokenizer worker's thread (the tokenizer is not needed: parsing is tokenizer-free)."""
    spec.check_grammar(param)


def _render_chat(tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool,
                 template_kwargs: dict[str, Any]) -> list[int]:
    """Render and tokenize a conversation (on the tokenizer worker's thread)."""
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             **template_kwargs)
    except Exception as exc:  # a template's own raise_exception("roles must alternate ...")
        raise errors.InvalidRequest(f"The chat template refused these messages: {exc}", param="messages") from exc
    return encode(tokenizer, text, add_special_tokens=False)


def _decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids)


def _echo_texts(tokenizer, prompt: Any, prompts: list[list[int]], skip_special_tokens: bool) -> list[str]:
    """What echo prepends for each prompt: the text as sent, or the decoded token ids."""
    sent = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]
    return [s if isinstance(s, str) else tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
            for s, ids in zip(sent, prompts)]


class _ForcedCalls(ToolParser):
    """``required`` / named outputs as a parser: nothing is content, the calls are read at the end."""

    def __init__(self, mode: ToolMode):
        self.mode = mode

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        return self.mode.calls(text)

    def content_safe_len(self, text: str) -> int:
        return 0


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
