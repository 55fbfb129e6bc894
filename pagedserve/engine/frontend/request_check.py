"""The front end's request check: what a request must satisfy before it is sent to the core.

Validation happens once per layer: the HTTP schema (the server's pydantic models, bounded by the
constants of :mod:`pagedserve.engine.sampling_params`), then this check, run by whatever takes a
request for the engine (:meth:`~pagedserve.engine.frontend.client.EngineClient.add_request` for both
clients, :meth:`~pagedserve.engine.frontend.engine.Engine.add_request` offline), then the core, which
trusts its input and only asserts it. The core still refuses what depends on its state: a
duplicate request id, a full queue, a request its KV pool can never hold.

One vocabulary size: the model's (``ModelFacts.vocab_size``, the width of its embedding and of
its logits), which may exceed the tokenizer's length (padded embeddings).
"""

from __future__ import annotations

from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.wire import ModelFacts
from pagedserve.errors import InvalidRequest, RequestTooLong


def check_request(facts: ModelFacts, prompt_token_ids: list[int], params: SamplingParams) -> None:
    """Raise the typed error (:class:`InvalidRequest`, :class:`RequestTooLong`) that makes this
    request unservable by an engine with ``facts``, whatever the engine's state."""
    params.validate()
    if not prompt_token_ids:
        raise InvalidRequest("the prompt is empty", param="prompt")
    vocab = facts.vocab_size
    if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
        raise InvalidRequest(f"prompt token ids must be in [0, {vocab})", param="prompt")
    if params.logit_bias and max(params.logit_bias) >= vocab:
        raise InvalidRequest(f"logit_bias token ids must be in [0, {vocab}), got {max(params.logit_bias)}",
                             param="logit_bias")
    if params.n > facts.max_num_seqs:
        raise InvalidRequest(f"n={params.n} completions need {params.n} seats, but this engine runs at most "
                             f"max_num_seqs={facts.max_num_seqs} sequences; lower n", param="n")
    prompt_len, limit = len(prompt_token_ids), facts.max_model_len
    if prompt_len >= limit:
        raise RequestTooLong(f"the prompt has {prompt_len} tokens, but max_model_len is {limit} tokens (prompt "
                             "plus at least one output token); shorten the prompt", param="prompt")
    if params.max_tokens is not None and prompt_len + params.max_tokens > limit:
        raise RequestTooLong(f"prompt ({prompt_len} tokens) + max_tokens ({params.max_tokens}) = "
                             f"{prompt_len + params.max_tokens} tokens exceeds max_model_len {limit}; lower "
                             "max_tokens or shorten the prompt", param="max_tokens")
