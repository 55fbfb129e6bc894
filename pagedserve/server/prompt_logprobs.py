"""The prompt's logprobs as the API shows them: vLLM's ``prompt_logprobs`` and ``echo``'s logprobs.

The engine computes, for each prompt token after the first, its logprob, its rank and the top
alternatives (:class:`~pagedserve.engine.outputs.TokenLogprob`, the first entry ``None``). Two
views of that list: vLLM's ``prompt_logprobs`` field (per position ``{token id: {logprob, rank,
decoded_token}}``, the prompt token first, then the top ``k``), and OpenAI's completions logprobs
for ``echo`` (parallel lists whose first ``token_logprobs`` entry is null).
"""

from __future__ import annotations

from collections.abc import Callable

from pagedserve.engine.outputs import TokenLogprob
from pagedserve.server import protocol as p


def vllm_prompt_logprobs(prompt_ids: list[int], lps: list[TokenLogprob | None] | None,
                         token_text: Callable[[int], str], k: int) -> p.PromptLogprobs:
    """vLLM's ``prompt_logprobs`` for ``k`` alternatives (the prompt token is always included)."""
    out: p.PromptLogprobs = []
    for i, token in enumerate(prompt_ids):
        lp = lps[i] if lps is not None and i < len(lps) else None
        if lp is None:
            out.append(None)
            continue
        entry = {str(token): p.PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=token_text(token))}
        for rank, (t, v) in enumerate(lp.top[:k], start=1):
            entry.setdefault(str(t), p.PromptLogprob(logprob=v, rank=rank, decoded_token=token_text(t)))
        out.append(entry)
    return out


def echo_logprobs(prompt_ids: list[int], lps: list[TokenLogprob | None] | None,
                  token_text: Callable[[int], str], k: int, special_ids: frozenset[int]) -> p.CompletionLogprobs:
    """Completions-style logprobs of the prompt tokens (``echo``): the first token's logprob and
    top alternatives are null, as OpenAI sends them. ``text_offset`` indexes the echoed text, in
    which special tokens (a BOS the tokenizer added) do not appear: they advance it by nothing."""
    out = p.CompletionLogprobs()
    offset = 0
    for i, token in enumerate(prompt_ids):
        text = token_text(token)
        lp = lps[i] if lps is not None and i < len(lps) else None
        out.tokens.append(text)
        out.token_logprobs.append(lp.logprob if lp is not None else None)
        out.top_logprobs.append({token_text(t): v for t, v in lp.top[:k]} if lp is not None and k else None)
        out.text_offset.append(offset)
        offset += 0 if token in special_ids else len(text)
    return out


def concat(first: p.CompletionLogprobs, second: p.CompletionLogprobs) -> p.CompletionLogprobs:
    """``first`` then ``second`` (whose text offsets are already past ``first``'s text)."""
    return p.CompletionLogprobs(tokens=first.tokens + second.tokens,
                                token_logprobs=first.token_logprobs + second.token_logprobs,
                                top_logprobs=first.top_logprobs + second.top_logprobs,
                                text_offset=first.text_offset + second.text_offset)
