"""``POST /v1/completions``: prompts (text, token ids, several) → engine requests → one body or SSE."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagedserve import errors
from pagedserve.engine import RequestStream
from pagedserve.engine.outputs import RequestOutput, TokenLogprob
from pagedserve.server import protocol as p
from pagedserve.server.best_of import select_best
from pagedserve.server.errors import error_body
from pagedserve.server.fanout import RequestGroup
from pagedserve.server.prompt_logprobs import concat, echo_logprobs, vllm_prompt_logprobs
from pagedserve.server.serving_base import SSEResponse, ServingBase, _Choice, _CompletionView, _echo_texts, _now, _sse
from pagedserve.server.tokenization import encode


class CompletionsServing(ServingBase):
    """``POST /v1/completions``: prompts (text, token ids, several) → engine requests → one body or SSE."""

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
                ids = list(prompt)
                if not ids:
                    raise errors.InvalidRequest("prompt must not be empty.", param=param)
                # Here too, against the same vocabulary as the client's check (the model's), so the
                # error names which prompt of a list is wrong.
                vocab = self.engine.facts.vocab_size
                bad = next((t for t in ids if t >= vocab), None)
                if bad is not None:
                    raise errors.InvalidRequest(
                        f"Token id {bad} in prompt is out of range: ids must be in [0, {vocab}).", param=param)
            if not ids:
                raise errors.InvalidRequest("prompt must not be empty (it tokenized to no tokens).", param=param)
            out.append(ids)
        return out

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
