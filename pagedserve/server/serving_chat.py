"""``POST /v1/chat/completions``: messages through the chat template, tools and their calls, → one body or SSE."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagedserve import errors
from pagedserve.engine import RequestStream
from pagedserve.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from pagedserve.server import protocol as p
from pagedserve.server.errors import error_body
from pagedserve.server.prompt_logprobs import vllm_prompt_logprobs
from pagedserve.server.serving_base import SSEResponse, ServingBase, ToolMode, _Choice, _sse, _tool_call
from pagedserve.server.tool_format import auto_tool_parser
from pagedserve.server.tool_stream import ForcedCallStream
from pagedserve.server.tool_parsers import PARSERS, StreamingToolCalls


class ChatServing(ServingBase):
    """``POST /v1/chat/completions``: messages through the chat template, tools and their calls, → one body or SSE."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        template = self.config.chat_template or getattr(self.tokenizer, "chat_template", None)
        name = auto_tool_parser(template if isinstance(template, str) else None, self.config.tool_call_parser,
                                self.config.enable_auto_tool_choice)
        self.auto_parser = PARSERS[name]() if name is not None else None  # None: "auto" is refused

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
        if choice == "auto" and self.auto_parser is None:
            raise errors.InvalidRequest(
                'tool_choice "auto" needs a chat template that shows the model\'s tool-call format, or the '
                "server started with --enable-auto-tool-choice (and --tool-call-parser for the format); use "
                '"required" or a named function, which work on any model.', param="tool_choice")
        return ToolMode(choice, parser=self.auto_parser if choice == "auto" else None)

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

    def _chat_logprobs(self, lps: list[TokenLogprob]) -> p.ChatLogprobs:
        content = []
        for lp in lps:
            text = self._token_text(lp.token_id)
            content.append(p.ChatTokenLogprob(
                token=text, logprob=lp.logprob, bytes=list(text.encode("utf-8", "replace")),
                top_logprobs=[p.TopLogprob(token=(t_text := self._token_text(t)), logprob=v,
                                           bytes=list(t_text.encode("utf-8", "replace"))) for t, v in lp.top]))
        return p.ChatLogprobs(content=content)

    def _tool_deltas(self, choice: _Choice, c: CompletionOutput, tools: ToolMode) -> tuple[str, list[p.DeltaToolCall]]:
        """A tool-reading choice's content delta and its call deltas: a forced call's arguments as
        they are generated (tool_stream.py); an "auto" call whole once its block closed (its
        format is known only then)."""
        if choice.tools is None:
            choice.tools = ForcedCallStream(tools) if tools.parser is None else StreamingToolCalls(tools.parser)
        if isinstance(choice.tools, ForcedCallStream):
            return choice.tools.feed(c.text, c.finished and c.finish_reason != "abort")
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
