"""Verifying speculative drafts: which proposed tokens the target model accepts, and the token after.

A sequence with ``k`` drafts ``d_0 .. d_{k-1}`` gets ``k + 1`` rows of target logits from one
forward pass: row ``j`` is the target's next-token distribution after the accepted context plus
``d_0 .. d_{j-1}``. Every row first goes through the same processors the plain sampler applies
(min_tokens bans, logit_bias, penalties counted over the output so far plus the earlier drafts;
then temperature, top-k, top-p, min-p for sampled requests), so a row is exactly the
distribution plain decoding would sample from at that position.

* Greedy: accept ``d_j`` while it equals row ``j``'s argmax; at the first mismatch append the
  argmax instead (or, all ``k`` accepted, the bonus argmax of row ``k``). The output is the
  plain greedy output token for token.
* Sampled: the n-gram proposer's draft distribution is a point mass on ``d_j``, so the
  rejection rule of speculative sampling reduces to: accept ``d_j`` with probability
  ``p_j(d_j)``; on rejection draw from ``p_j`` with ``d_j`` removed and renormalised. A token
  then comes out with probability ``p(d)·1[x=d] + (1 - p(d))·p(x)/(1 - p(d))·1[x≠d] = p(x)``:
  the target's distribution, whatever the draft. After ``k`` acceptances the bonus token is a
  plain draw from row ``k``. Draws use the request's own generator when it has a seed.
"""

from __future__ import annotations

import torch

from pagedserve.engine.core.sampler import SamplingRow, draw, process_logits, row_argmax, sampling_probs


def _draw_one(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw from ``probs`` (``[vocab]``, need not sum to 1), as the plain sampler draws."""
    return int(draw(probs.unsqueeze(0), torch.rand(1, device=probs.device, generator=generator))[0])


def accept_sampled(probs: torch.Tensor, drafts: list[int], generator: torch.Generator | None) -> list[int]:
    """The tokens a sampled sequence gains from ``probs`` (``[k + 1, vocab]``, the target's rows)
    and its ``k`` drafts: the accepted drafts, then one token drawn by the rejection rule."""
    k = a = len(drafts)  # a: the drafts accepted
    if k:
        draft_idx = torch.tensor(drafts, device=probs.device)
        p_draft = probs[:k].gather(1, draft_idx.unsqueeze(1)).squeeze(1)
        u = torch.rand(k, generator=generator, device=probs.device)
        rejected = (u >= p_draft).nonzero()
        a = int(rejected[0]) if rejected.numel() else k
    if a == k:
        return drafts + [_draw_one(probs[k], generator)]
    residual = probs[a].clone()
    residual[drafts[a]] = 0.0  # p_target with the rejected draft removed (the draw renormalises)
    return drafts[:a] + [_draw_one(residual, generator)]


def accept_greedy(argmax: list[int], drafts: list[int]) -> list[int]:
    """Accepted drafts while each equals the target's argmax, then the target's own token."""
    accepted = next((j for j, d in enumerate(drafts) if d != argmax[j]), len(drafts))
    return drafts[:accepted] + [argmax[accepted]]


def verify(logits: torch.Tensor, rows: list[SamplingRow], drafts: list[list[int]],
           default_generator: torch.Generator | None, native: bool = True) -> list[list[int]]:
    """New tokens for each speculated sequence. ``logits`` holds ``len(d) + 1`` consecutive rows per
    sequence (``rows`` one :class:`SamplingRow` per logits row, in the same order)."""
    processed = process_logits(logits, rows)
    argmax = row_argmax(processed, native).tolist()
    out: list[list[int]] = []
    start = 0
    for d in drafts:
        end = start + len(d) + 1
        row = rows[start]
        if row.params.greedy:
            out.append(accept_greedy(argmax[start:end], d))
        else:
            probs = sampling_probs(processed[start:end], rows[start:end])
            gen = row.generator if row.generator is not None else default_generator
            out.append(accept_sampled(probs, d, gen))
        start = end
    return out
