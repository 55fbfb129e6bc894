"""What a request will make a replica run, read from its body before it is forwarded.

The gateway reserves tokens and seats for a request before any replica sees it, so it must count
what the replica will really do, not what one prompt with ``n`` completions would:

* a completions ``prompt`` may be several prompts (a list of texts or of token-id lists); the
  replica makes each its own engine request, and ``usage.prompt_tokens`` sums their prompts;
* each prompt samples ``max(n, best_of)`` sequences (``best_of`` > ``n`` samples more than it
  answers, and ``usage.completion_tokens`` counts them all);
* so the request holds ``prompts × max(n, best_of)`` seats and may generate that many times its
  output cap;
* ``max_tokens: 0`` is valid on completions exactly when ``echo`` is true (the prompt and its
  logprobs, nothing generated), as the replica decides it.

Only the fields the gateway's arithmetic needs are checked here; everything else is the
replica's to validate (its 400 passes through and the reservation is refunded).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

COMPLETIONS = "/v1/completions"


@dataclass(frozen=True)
class Shape:
    """A request's size: its output cap per sequence, its prompts and sequences per prompt."""

    cap: int  # the largest output cap it sent (or the tier's default, written in)
    prompts: int  # engine requests the replica makes of it
    per_prompt: int  # sequences each prompt samples: max(n, best_of)
    n: int

    @property
    def seats(self) -> int:
        """Sequences the replica runs side by side for it: the seats it holds there."""
        return self.prompts * self.per_prompt

    @property
    def output_tokens(self) -> int:
        """The most output tokens it can be charged (``usage.completion_tokens`` counts best_of's too)."""
        return self.seats * self.cap

    @property
    def seats_param(self) -> str:
        """The field to name when its seat count is refused: the one that multiplies it most."""
        if self.prompts > 1:
            return "prompt"
        return "best_of" if self.per_prompt > self.n else "n"


def prompt_list(prompt: Any) -> list[Any]:
    """The prompts of a completions ``prompt``: one text or one token-id list is one prompt; a list
    of texts or of token-id lists is several (the replica's own reading of the field)."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return list(prompt)
    return [prompt]


def _count(body: dict[str, Any], field: str, default: int, minimum: int) -> int | str:
    v = body.get(field)
    if v is None:
        return default
    if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
        return f"'{field}' must be an integer >= {minimum}"
    return v


def read_shape(body: dict[str, Any], path: str, default_cap: int) -> Shape | str:
    """The request's :class:`Shape`, or what is wrong with the fields it is computed from. A body
    without an output cap gets ``default_cap`` written in (an uncapped request would reserve
    nothing sensible)."""
    completions = path == COMPLETIONS
    caps = []
    for f in ("max_tokens", "max_completion_tokens"):
        v = body.get(f)
        if v is None:
            continue
        # 0 only where the replica takes it: completions with echo (the prompt, nothing generated).
        least = 0 if completions and f == "max_tokens" and body.get("echo") is True else 1
        if not isinstance(v, int) or isinstance(v, bool) or v < least:
            hint = "" if least == 0 or not completions else " (0 only with echo: true)"
            return f"'{f}' must be an integer >= {least}{hint}"
        caps.append(v)
    if not caps:
        body["max_tokens" if completions else "max_completion_tokens"] = default_cap
        caps.append(default_cap)
    n = _count(body, "n", 1, 1)
    if isinstance(n, str):
        return n
    best_of: int | str = n
    prompts = 1
    if completions:  # chat has neither several prompts nor best_of (the replica refuses the field)
        best_of = _count(body, "best_of", n, 1)
        if isinstance(best_of, str):
            return best_of
        prompts = len(prompt_list(body.get("prompt")))
    return Shape(cap=max(caps), prompts=prompts, per_prompt=max(n, best_of), n=n)
