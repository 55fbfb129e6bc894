"""``POST /tokenize`` and ``POST /detokenize``."""

from __future__ import annotations

import msgspec
from fastapi.responses import Response

from pagedserve import errors
from pagedserve.server import protocol as p
from pagedserve.server.serving_base import ServingBase, _decode
from pagedserve.server.tokenization import encode


class TokenizeServing(ServingBase):
    """``POST /tokenize`` and ``POST /detokenize``."""

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
