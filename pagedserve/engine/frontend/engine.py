"""The synchronous in-process engine: an :class:`EngineCore`, a tokenizer and the output processor.

The offline :class:`~pagedserve.engine.frontend.llm.LLM`, the benchmarks and the tests drive it step
by step (no thread, no event loop). The same :class:`OutputProcessor` the clients use turns the
core's token ids into text, so detokenization and stop strings live in one place.
"""

from __future__ import annotations

from collections.abc import Callable

from pagedserve.config import EngineConfig
from pagedserve.engine.core.engine_core import EngineCore
from pagedserve.engine.frontend.output_processor import OutputProcessor
from pagedserve.engine.outputs import EngineStats, RequestOutput
from pagedserve.engine.frontend.request_check import check_request
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.errors import InvalidRequest
from pagedserve.tokenizer import load_tokenizer


class Engine:
    """A paged-KV, continuously batched inference engine for one model, text in and out. Not thread-safe."""

    def __init__(self, config: EngineConfig, core_factory: Callable[[EngineConfig], EngineCore] = EngineCore):
        self.core = core_factory(config)  # another factory: the fault tests' seam (tests/helpers/faults.py)
        self.facts = self.core.facts()
        self.tokenizer = load_tokenizer(self.core.tokenizer_source)
        self.output_processor = OutputProcessor(self.tokenizer)

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    priority: int = 0, cache_salt: str | None = None, arrival_time: float | None = None) -> None:
        if not prompt:  # checked before tokenizing: a BOS token alone is not a prompt
            raise InvalidRequest("the prompt is empty", param="prompt")
        token_ids = self.tokenize(prompt)
        check_request(self.facts, token_ids, params)  # the front end's one check; the core trusts it
        self.core.add_request(request_id, token_ids, params, priority, cache_salt, arrival_time)
        self.output_processor.add(request_id, token_ids, params, prompt if isinstance(prompt, str) else None)

    def abort(self, request_id: str, index: int | None = None) -> bool:
        if index is None:
            self.output_processor.abort(request_id)
        return self.core.abort(request_id, index)

    def step(self) -> list[RequestOutput]:
        """One core step, turned into text outputs (see :meth:`EngineCore.step`)."""
        processed = self.output_processor.process(self.core.step())
        for request_id, index in processed.finish_in_core:
            self.core.abort(request_id, index)
        return processed.outputs

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def stats(self) -> EngineStats:
        return self.core.stats()

    def close(self) -> None:
        self.core.close()
