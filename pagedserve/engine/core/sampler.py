"""Batched sampling: one set of tensor ops over every row of the step, no loop over the vocabulary.

Order of operations (as in vLLM): min_tokens masking, logit_bias (one scatter-add over the
batch), repetition / presence / frequency penalties, then greedy rows take the argmax; random rows
are divided by their temperature, cut by top-k, top-p and min-p, softmaxed and drawn by inverse
transform: one uniform per row, the first token whose cumulative probability passes it. Each
seeded row draws its uniform from its own generator, so the same seed gives the same tokens
whatever else shares the batch. Log-probabilities are those of the model's raw distribution, as
the OpenAI API reports them.

Why one uniform per row and not the exponential race (``argmax(p / q)``, ``q ~ Exp(1)``, one
draw per vocabulary entry): torch fills random tensors on one CPU thread, and 64 rows × 32,000
exponentials took 51 ms, a third of a decode step of 64; the cumulative sum takes 2 ms.

On a GPU every step of this stays on the device: which processors and filters apply is decided
from the rows' parameters on the host, so the one transfer back is the sampled token ids (plus
the log-probabilities of the rows that ask for them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.engine.outputs import TokenLogprob
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.kernels import native_ops


# Chunk width of row_argmax's first pass: wide enough that the chunk maxima are few, narrow
# enough that the winning chunk's second pass is short (256 and 64 measure within 20% of it).
ARGMAX_CHUNK = 128


def row_argmax(x: torch.Tensor, native: bool = True) -> torch.Tensor:
    """``x.argmax(dim=-1)`` for a ``[rows, vocab]`` tensor, the same result, up to 8x faster on CPU
    at a decode batch's size (``pagedserve bench sampler``).

    float32 rows on a CPU with the native kernels go to ``row_argmax`` (``kernels/layer_ops.cpp``),
    one pass per row on the calling thread: torch's reductions fork its OpenMP team, and with
    another process on a core each fork waited out a time slice (11 ms a step, measured under load).

    Torch's CPU argmax walks each row one element at a time (about 30 us per 32,000-token row),
    while ``amax`` is vectorized (1.6 us per row). So: the maximum of each 128-wide chunk, the first
    chunk holding the row's maximum, and the argmax within that chunk only. Ties and NaN go to the
    first index, as in torch; a vocabulary that is not a multiple of the chunk keeps its tail in a
    second, short comparison."""
    x = x if x.stride(-1) == 1 else x.contiguous()  # the chunk view needs each row's elements side by side
    ops = native_ops() if native and x.device.type == "cpu" and x.dtype == torch.float32 and x.shape[1] else None
    return chunked_argmax(x) if ops is None else ops.row_argmax(x)


def chunked_argmax(x: torch.Tensor) -> torch.Tensor:
    """:func:`row_argmax` in torch ops (any device and dtype), for a ``[rows, vocab]`` tensor whose
    rows are contiguous."""
    rows, vocab = x.shape
    chunks = vocab // ARGMAX_CHUNK
    if chunks < 2:
        return x.argmax(dim=-1)
    body = x[:, :chunks * ARGMAX_CHUNK].view(rows, chunks, ARGMAX_CHUNK)
    best_chunk = body.amax(dim=-1).argmax(dim=-1)
    winners = body[torch.arange(rows, device=x.device), best_chunk]
    index = best_chunk * ARGMAX_CHUNK + winners.argmax(dim=-1)
    if chunks * ARGMAX_CHUNK < vocab:
        tail_value, tail_index = x[:, chunks * ARGMAX_CHUNK:].max(dim=-1)
        best = x.gather(1, index.unsqueeze(1)).squeeze(1)
        # Strictly larger (the body's index comes first on a tie), or a NaN the body lacks.
        later = (tail_value > best) | (tail_value.isnan() & ~best.isnan())
        index = torch.where(later, tail_index + chunks * ARGMAX_CHUNK, index)
    return index


@dataclass
class SamplingRow:
    """What the sampler needs to know about one row of logits."""

    params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    banned_token_ids: list[int]  # EOS/stop ids while fewer than min_tokens were generated


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


def _counts(rows: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """``[S, vocab]`` occurrence counts of each row's tokens (padding lands in a dropped column)."""
    width = max((len(r) for r in rows), default=0)
    counts = torch.zeros(len(rows), vocab + 1, device=device)
    if width:
        ids = torch.full((len(rows), width), vocab, dtype=torch.long)
        for i, r in enumerate(rows):
            if r:
                ids[i, :len(r)] = torch.tensor(r)
        counts.scatter_add_(1, ids.to(device), torch.ones(ids.shape, device=device))
    return counts[:, :vocab]


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    vocab, device = logits.shape[1], logits.device
    rep, pres, freq = (torch.tensor([getattr(r.params, name) for r in rows], device=device).unsqueeze(1)
                       for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"))
    out_counts = _counts([r.output_token_ids for r in rows], vocab, device)
    if any(r.params.repetition_penalty != 1.0 for r in rows):  # asked of the rows, not of a GPU tensor
        seen = (_counts([r.prompt_token_ids for r in rows], vocab, device) + out_counts) > 0
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalized, logits)
    return logits - freq * out_counts - pres * (out_counts > 0).float()


def apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Add every row's ``logit_bias`` in one ``index_add_`` over the flattened batch (a copy).

    The Python work is over the bias entries (at most ``MAX_LOGIT_BIAS`` a row), never the vocabulary.
    Their token ids are the model's: the front end's request check refused any other.
    """
    vocab, device = logits.shape[1], logits.device
    entries = [(i * vocab + token, bias) for i, r in enumerate(rows)
               for token, bias in (r.params.logit_bias or {}).items()]
    if not entries:
        return logits
    flat, values = zip(*entries)
    out = logits.clone()
    out.view(-1).index_add_(0, torch.tensor(flat, device=device),
                            torch.tensor(values, dtype=logits.dtype, device=device))
    return out


def _filter_top_k_top_p_min_p(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    device, vocab = logits.device, logits.shape[1]
    top_k = torch.tensor([r.params.top_k or vocab for r in rows], device=device)
    top_p = torch.tensor([r.params.top_p for r in rows], device=device)
    min_p = torch.tensor([r.params.min_p for r in rows], device=device)
    # Which filters apply is asked of the rows' parameters (host values), never of the tensors: on a
    # GPU each such question would wait for the device and copy its answer back.
    if any((r.params.top_k or vocab) < vocab or r.params.top_p < 1.0 for r in rows):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=device).unsqueeze(0)
        drop = ranks >= top_k.unsqueeze(1)
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop |= (probs.cumsum(dim=-1) - probs) > top_p.unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    if any(r.params.min_p > 0 for r in rows):
        probs = logits.softmax(dim=-1)
        keep = probs >= min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(~keep, float("-inf"))
    return logits


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, k: int) -> list[TokenLogprob]:
    """Each row's log-probability of its ``targets`` token, that token's rank and the row's top ``k``
    (prompt logprobs: row ``q`` is the logits at prompt position ``q``, its target the token at ``q + 1``).

    Every row's log-probabilities are vocabulary-wide: the caller (``EngineCore._collect_prompt_logprobs``)
    passes a long prompt's rows a few hundred at a time.
    """
    lp = logits.log_softmax(dim=-1)
    chosen = lp.gather(1, targets.unsqueeze(1))
    ranks = ((lp > chosen).sum(dim=-1) + 1).tolist()
    top_vals, top_ids = lp.topk(k, dim=-1) if k else (None, None)
    tops = [list(zip(i, v)) for i, v in zip(top_ids.tolist(), top_vals.tolist())] if k else [[] for _ in ranks]
    return [TokenLogprob(t, v, top, rank)
            for t, v, top, rank in zip(targets.tolist(), chosen.squeeze(1).tolist(), tops, ranks)]


def process_logits(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The processors every row goes through before a token is chosen: min_tokens bans,
    logit_bias, penalties (greedy rows then take the argmax). A copy where anything applies."""
    banned = [(i, t) for i, r in enumerate(rows) for t in r.banned_token_ids if t < logits.shape[1]]
    if banned:
        logits = logits.clone()
        rows_idx, tok_idx = zip(*banned)
        logits[list(rows_idx), list(tok_idx)] = float("-inf")
    if any(r.params.logit_bias for r in rows):
        logits = apply_logit_bias(logits, rows)
    if any(r.params.needs_penalties for r in rows):
        logits = apply_penalties(logits, rows)
    return logits


def sampling_probs(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The distribution random rows draw from: processed logits ÷ temperature, cut by top-k,
    top-p and min-p, softmaxed (all ``rows`` must be non-greedy)."""
    if any(r.params.temperature != 1.0 for r in rows):  # 1.0 (the API's default) skips a copy of the batch
        logits = logits / torch.tensor([r.params.temperature for r in rows], device=logits.device).unsqueeze(1)
    return _filter_top_k_top_p_min_p(logits, rows).softmax(dim=-1)


def draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` (``[S, vocab]``, rows need not sum to 1): the first whose
    cumulative mass passes ``uniforms`` (``[S]``, in [0, 1)) times the row's total. A zero-mass
    token is never chosen (its cumulative value equals its predecessor's)."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    # u × total can round up to total itself; the largest float below it keeps the pick in range.
    below_total = torch.nextafter(total, torch.zeros_like(total))
    target = torch.minimum(uniforms.unsqueeze(1).to(cdf.dtype) * total, below_total)
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


def _uniforms(rows: list[SamplingRow], default_generator: torch.Generator | None,
              device: torch.device) -> torch.Tensor:
    """One uniform in [0, 1) per row: a seeded row's from its own generator, the rest from the default."""
    u = torch.empty(len(rows), device=device)
    unseeded = [j for j, r in enumerate(rows) if r.generator is None]
    if unseeded:
        u[unseeded] = torch.rand(len(unseeded), device=device, generator=default_generator)
    for j, r in enumerate(rows):
        if r.generator is not None:
            u[j] = torch.rand(1, device=device, generator=r.generator)
    return u


def sample(logits: torch.Tensor, rows: list[SamplingRow], default_generator: torch.Generator | None = None,
           raw: torch.Tensor | None = None, native: bool = True) -> SampleResult:
    """Pick one token per row of ``logits`` (``[S, vocab]``, float32). ``raw``: the logits before a
    grammar's mask, whose distribution the logprobs report (default: ``logits``). ``native``: the
    greedy pick may use the native kernel (False with ``--no-native-kernels``)."""
    raw = logits if raw is None else raw
    logits = process_logits(logits, rows)

    random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
    if not random_rows:
        chosen = row_argmax(logits, native)
    else:
        # Each pass over the batch's logits costs 1-2 ms on CPU at 64 rows: an all-sampled batch
        # (the API's default temperature) makes no argmax and no gathered copy.
        idx = None if len(random_rows) == len(rows) else torch.tensor(random_rows, device=logits.device)
        sub_rows = rows if idx is None else [rows[i] for i in random_rows]
        probs = sampling_probs(logits if idx is None else logits[idx], sub_rows)
        drawn = draw(probs, _uniforms(sub_rows, default_generator, probs.device))
        if idx is None:
            chosen = drawn
        else:
            chosen = row_argmax(logits, native)
            chosen[idx] = drawn

    token_ids = chosen.tolist()
    logprobs: list[TokenLogprob | None] = [None] * len(rows)
    want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if want:
        lp = raw[want].log_softmax(dim=-1)
        k = max(rows[i].params.logprobs for i in want)
        top_vals, top_ids = lp.topk(k, dim=-1) if k else (None, None)
        chosen_lp = lp.gather(1, chosen[want].unsqueeze(1)).squeeze(1).tolist()
        for j, i in enumerate(want):
            n = rows[i].params.logprobs
            top = list(zip(top_ids[j, :n].tolist(), top_vals[j, :n].tolist())) if n else []
            logprobs[i] = TokenLogprob(token_ids[i], chosen_lp[j], top)
    return SampleResult(token_ids, logprobs)
