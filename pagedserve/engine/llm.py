"""The offline API: ``LLM(model).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

from collections.abc import Sequence

from tqdm.auto import tqdm

from pagedserve.config import EngineConfig
from pagedserve.engine.engine import Engine
from pagedserve.engine.outputs import RequestOutput
from pagedserve.engine.sampling_params import SamplingParams


class LLM:
    """Generate for a list of prompts at once; continuous batching does the rest.

    ``LLM("path/or/hub-id", dtype="float32", kv_cache_memory="2GiB")`` takes any
    :class:`~pagedserve.config.EngineConfig` field as a keyword.
    """

    def __init__(self, model: str, **engine_kwargs):
        self.engine = Engine(EngineConfig(model=model, **engine_kwargs))
        self._next_id = 0

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: str | list[int] | Sequence[str | list[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of ``prompts``."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt, as text or as token ids
        params = sampling_params or SamplingParams()
        params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params_list) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        ids = []
        for i, (prompt, p) in enumerate(zip(prompts, params_list)):
            request_id = str(self._next_id)
            self._next_id += 1
            self.engine.add_request(request_id, prompt, p, priority=priority[i] if priority else 0)
            ids.append(request_id)
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
        return [results[i] for i in ids]
