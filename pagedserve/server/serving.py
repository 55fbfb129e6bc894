"""The OpenAI handlers over one engine client: request → prompt + SamplingParams → engine → OpenAI
response, either one JSON body or server-sent events ending in ``data: [DONE]``.

One class per route family, over what they share (:mod:`pagedserve.server.serving_base`):
completions (:mod:`~pagedserve.server.serving_completions`), chat completions
(:mod:`~pagedserve.server.serving_chat`), tokenize and detokenize
(:mod:`~pagedserve.server.serving_tokenize`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedserve.server.serving_base import ClientDisconnected
from pagedserve.server.serving_chat import ChatServing
from pagedserve.server.serving_completions import CompletionsServing
from pagedserve.server.serving_tokenize import TokenizeServing

if TYPE_CHECKING:
    from fastapi import Request
    from fastapi.responses import Response

    from pagedserve.engine import EngineClient
    from pagedserve.server import protocol as p
    from pagedserve.server.config import ServerConfig
    from pagedserve.server.tokenization import TokenizerWorker

__all__ = ["ClientDisconnected", "OpenAIServing"]


class OpenAIServing:
    """The routes' handlers: one per route family, all over the same client, config and tokenizers."""

    def __init__(self, engine: EngineClient, config: ServerConfig, tokenizers: TokenizerWorker):
        self.completions_api = CompletionsServing(engine, config, tokenizers)
        self.chat_api = ChatServing(engine, config, tokenizers)
        self.tokenize_api = TokenizeServing(engine, config, tokenizers)
        self.model_name = self.completions_api.model_name
        self.max_model_len = self.completions_api.max_model_len

    async def completions(self, req: p.CompletionRequest, http: Request) -> Response:
        return await self.completions_api.completions(req, http)

    async def chat(self, req: p.ChatCompletionRequest, http: Request) -> Response:
        return await self.chat_api.chat(req, http)

    async def tokenize(self, req: p.TokenizeRequest) -> Response:
        return await self.tokenize_api.tokenize(req)

    async def detokenize(self, req: p.DetokenizeRequest) -> Response:
        return await self.tokenize_api.detokenize(req)
