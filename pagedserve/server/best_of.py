"""``best_of``: of ``best_of`` sampled completions per prompt, answer the ``n`` most likely.

The engine runs each prompt with ``best_of`` completions (its seats bounded like ``n``'s) and
the chosen tokens' logprobs; the handler keeps, per prompt, the ``n`` with the highest cumulative
logprob (the core's running sum of those logprobs, less the tokens a stop string cut, as vLLM
ranks them) and renumbers them ``i * n + j`` in that order. Only non-streamed answers can do this: the ranking is known only at the end (OpenAI
refuses ``stream`` with ``best_of`` > ``n`` too).
"""

from __future__ import annotations

from typing import Protocol, TypeVar

from pagedserve.engine.outputs import CompletionOutput


class _Ranked(Protocol):
    latest: CompletionOutput | None


C = TypeVar("C", bound=_Ranked)


def cumulative_logprob(choice: _Ranked) -> float:
    """The choice's cumulative logprob (the engine computes it when logprobs are on, as best_of sets)."""
    if choice.latest is None or choice.latest.cumulative_logprob is None:
        return float("-inf")
    return choice.latest.cumulative_logprob


def select_best(choices: dict[int, C], num_prompts: int, best_of: int, n: int) -> dict[int, C]:
    """``choices`` indexed ``i * best_of + j`` → the ``n`` best of each prompt, indexed ``i * n + j``."""
    out: dict[int, C] = {}
    for i in range(num_prompts):
        group = [choices[k] for k in range(i * best_of, (i + 1) * best_of) if k in choices]
        group.sort(key=cumulative_logprob, reverse=True)  # stable: ties keep sampling order
        for j, c in enumerate(group[:n]):
            out[i * n + j] = c
    return out
