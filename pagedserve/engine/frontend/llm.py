"""The offline API: ``LLM(model).generate(prompts, SamplingParams(...))`` and ``LLM.chat(messages)``.

Prompts come in vLLM's forms, so code written for ``vllm.LLM`` runs unchanged: a string, a list
of token ids, a ``{"prompt": str}`` or ``{"prompt_token_ids": [...]}`` dict (either may carry a
``cache_salt``), or a list mixing them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tqdm.auto import tqdm

from pagedserve.config import EngineConfig
from pagedserve.engine.frontend.engine import Engine
from pagedserve.engine.outputs import RequestOutput
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.errors import InvalidRequest

PromptType = str | list[int] | Mapping[str, Any]
ChatMessage = Mapping[str, Any]

_PROMPT_KEYS = {"prompt", "prompt_token_ids", "cache_salt"}


@dataclass
class _Prompt:
    """One prompt as the engine takes it: text or token ids, the text to report, a cache salt."""

    value: str | list[int]
    text: str | None
    cache_salt: str | None = None


def _one_prompt(prompt: object, where: str) -> _Prompt:
    if isinstance(prompt, str):
        return _Prompt(prompt, prompt)
    if isinstance(prompt, Mapping):
        unknown = set(prompt) - _PROMPT_KEYS
        if unknown:
            raise InvalidRequest(f"{where}: unsupported prompt keys {sorted(unknown)} "
                                 f"(this engine takes {sorted(_PROMPT_KEYS)}).", param="prompt")
        if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
            raise InvalidRequest(f"{where}: give exactly one of 'prompt' and 'prompt_token_ids'.", param="prompt")
        salt = prompt.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise InvalidRequest(f"{where}: cache_salt must be a string.", param="cache_salt")
        if "prompt" in prompt:
            if not isinstance(prompt["prompt"], str):
                raise InvalidRequest(f"{where}: 'prompt' must be a string.", param="prompt")
            return _Prompt(prompt["prompt"], prompt["prompt"], salt)
        return _Prompt(_token_ids(prompt["prompt_token_ids"], where), None, salt)
    if isinstance(prompt, Sequence):
        return _Prompt(_token_ids(prompt, where), None)
    raise InvalidRequest(f"{where}: a prompt is a string, a list of token ids or a dict, got "
                         f"{type(prompt).__name__}.", param="prompt")


def _token_ids(ids: object, where: str) -> list[int]:
    if not isinstance(ids, Sequence) or isinstance(ids, str) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise InvalidRequest(f"{where}: prompt_token_ids must be a list of integers.", param="prompt_token_ids")
    return list(ids)


def normalize_prompts(prompts: PromptType | Sequence[PromptType]) -> list[_Prompt]:
    """A single prompt or a list of them (any mix of vLLM's forms) → one :class:`_Prompt` each."""
    single = isinstance(prompts, (str, Mapping)) or (
        isinstance(prompts, Sequence) and len(prompts) > 0 and isinstance(prompts[0], int))
    items = [prompts] if single else list(prompts)  # type: ignore[list-item]
    return [_one_prompt(p, f"prompts[{i}]") for i, p in enumerate(items)]


def _is_conversation(messages: object) -> bool:
    """One conversation is a list of message dicts; a list of conversations is a list of lists."""
    return isinstance(messages, Sequence) and (len(messages) == 0 or isinstance(messages[0], Mapping))


class LLM:
    """Generate for a list of prompts at once; continuous batching does the rest.

    ``LLM("path/or/hub-id", dtype="float32", kv_cache_memory="2GiB")`` takes any
    :class:`~pagedserve.config.EngineConfig` field as a keyword.
    """

    def __init__(self, model: str, **engine_kwargs):
        self.engine = Engine(EngineConfig(model=model, **engine_kwargs))
        self._next_id = 0

    def get_tokenizer(self):
        """The tokenizer (vLLM's name for it; the ``tokenizer`` property is the same)."""
        return self.engine.tokenizer

    tokenizer = property(get_tokenizer)

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of ``prompts``."""
        return self._run(normalize_prompts(prompts), sampling_params, use_tqdm, priority)

    def chat(self, messages: Sequence[ChatMessage] | Sequence[Sequence[ChatMessage]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: Mapping[str, Any] | None = None,
             ) -> list[RequestOutput]:
        """Render one conversation (a list of ``{"role", "content"}``) or a list of them with the
        model's chat template (or ``chat_template``) and generate a reply to each.

        ``RequestOutput.prompt`` is the rendered text, as in vLLM.
        """
        if add_generation_prompt and continue_final_message:
            raise InvalidRequest("add_generation_prompt and continue_final_message cannot both be set.",
                                 param="continue_final_message")
        conversations = [messages] if _is_conversation(messages) else list(messages)
        template = chat_template if chat_template is not None else getattr(self.tokenizer, "chat_template", None)
        if template is None:
            raise InvalidRequest("this model's tokenizer has no chat template; pass chat_template= or use "
                                 "generate() with plain prompts.", param="chat_template")
        prompts = []
        for i, conversation in enumerate(conversations):
            if not _is_conversation(conversation) or not conversation:
                raise InvalidRequest(f"conversation {i} must be a non-empty list of {{'role', 'content'}} dicts.",
                                     param="messages")
            try:
                text = self.tokenizer.apply_chat_template(
                    [dict(m) for m in conversation], chat_template=template, tokenize=False,
                    add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                    **dict(chat_template_kwargs or {}))
            except Exception as exc:  # a template's own raise_exception("roles must alternate ...")
                raise InvalidRequest(f"the chat template refused conversation {i}: {exc}", param="messages") from exc
            # The template writes the special tokens (BOS and all) itself: add none when tokenizing.
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            prompts.append(_Prompt(ids, text))
        return self._run(prompts, sampling_params, use_tqdm, None)

    def _run(self, prompts: list[_Prompt], sampling_params: SamplingParams | Sequence[SamplingParams] | None,
             use_tqdm: bool, priority: Sequence[int] | None) -> list[RequestOutput]:
        params = sampling_params or SamplingParams()
        params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params_list) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError("give one priority per prompt")
        ids = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params_list)):
                request_id = str(self._next_id)
                self._next_id += 1
                self.engine.add_request(request_id, prompt.value, p, priority=priority[i] if priority else 0,
                                        cache_salt=prompt.cache_salt)
                ids.append(request_id)
        except BaseException:
            for request_id in ids:  # one bad prompt: none of the batch stays queued behind it
                self.engine.abort(request_id)
            raise
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
        outputs = [results[i] for i in ids]
        for out, prompt in zip(outputs, prompts):
            out.prompt = prompt.text  # chat's rendered text (the engine saw only its token ids)
        return outputs
