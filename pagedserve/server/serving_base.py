"""What the OpenAI handlers share (serving_completions.py, serving_chat.py, serving_tokenize.py): the
request checks, the sampling parameters, the output constraint, collecting a stream into choices,
the SSE response and the per-token logprob text.
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

from fastapi import Request

from pagedserve import errors
from pagedserve.engine import EngineClient, EngineDeadError, RequestStream
from pagedserve.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from pagedserve.engine.sampling_params import SamplingParams, StructuredOutputsParams
from pagedserve.server import protocol as p
from pagedserve.server.config import ServerConfig
from pagedserve.server.errors import APIError
from pagedserve.server.fanout import RequestGroup
from pagedserve.server.structured import compact_json_spec, requested_spec, tool_call_spec
from pagedserve.server.tokenization import TokenizerWorker, encode
from pagedserve.server.tool_parsers import PARSERS, ParsedCall, ToolParser
from pagedserve.server.tool_stream import completed_calls
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
    tools: Any = None  # streamed with tool parsing: StreamingToolCalls, or tool_stream.ForcedCallStream


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
                # A call array cut short still holds the calls it completed (tool_stream.py).
                done = completed_calls(text) if self.kind == "required" else []
                return (None, done) if done else (text, [])
            if self.kind == "named":
                return None, [ParsedCall(self.function or "", json.dumps(value, ensure_ascii=False))]
            return None, [ParsedCall(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in value]
        return text, []


class ServingBase:
    """What every OpenAI handler shares: the engine client, the checks of a request, its sampling
    parameters and output constraint, collecting a stream into choices, usage and logprob text."""

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
        self.tool_parser = PARSERS[config.tool_call_parser or "hermes"]()

    # ---- validation ------------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        """Refuse a model name this server does not serve (null/absent means the one it does)."""
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model '{model}' does not exist on this server; it serves "
                                f"'{self.model_name}' (see GET /v1/models).",
                           error_type="invalid_request_error", param="model", code="model_not_found")

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
        client's request check validates the result once, engine/frontend/request_check.py)."""
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
            # The call's own JSON: checked as the schema, generated without free whitespace.
            return await self.tokenizers.run(_compact_call_spec, spec, param)
        if spec is not None:
            await self.tokenizers.run(_check_spec, spec, param)
        return spec

    # ---- endpoints -------------------------------------------------------------------------

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

    # ---- streamed --------------------------------------------------------------------------



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


def _compact_call_spec(tokenizer: Any, spec: StructuredOutputsParams, param: str) -> StructuredOutputsParams:
    """On the tokenizer worker's thread: a forced tool call's schema, checked, as its compact grammar."""
    spec.check_grammar(param)
    return compact_json_spec(spec)


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
