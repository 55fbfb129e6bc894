"""The batched sampler: filters, penalties and per-row seeds."""

from __future__ import annotations

import pytest
import torch

from pagedserve.engine.core.sampler import ARGMAX_CHUNK, SamplingRow, chunked_argmax, draw, row_argmax, sample
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.errors import InvalidRequest


def row(gen=None, out=(), prompt=(), banned=(), **kw):
    return SamplingRow(SamplingParams(**kw), gen, list(prompt), list(out), list(banned))


def test_greedy_is_argmax_and_banned_tokens_are_skipped():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 2.0, 1.0]])
    res = sample(logits, [row(temperature=0), row(temperature=0, banned=[0])])
    assert res.token_ids == [1, 1]


def test_top_k_one_and_tiny_top_p_behave_like_greedy():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g)
    rows = [row(temperature=1.0, top_k=1), row(temperature=1.0, top_p=1e-6),
            row(temperature=1.0, min_p=0.999), row(temperature=0)]
    for _ in range(5):
        assert sample(logits, rows).token_ids == logits.argmax(-1).tolist()


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2])
    logits = probs.log().repeat(4000, 1)
    gen = torch.Generator().manual_seed(1)
    toks = torch.tensor(sample(logits, [row(temperature=1.0)] * 4000, gen).token_ids)
    freq = torch.bincount(toks, minlength=3).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03)


def test_top_k_two_never_picks_third():
    logits = torch.tensor([[3.0, 2.9, 2.8, -5.0]]).repeat(500, 1)
    toks = sample(logits, [row(temperature=1.0, top_k=2)] * 500, torch.Generator().manual_seed(2)).token_ids
    assert set(toks) == {0, 1}


def test_seeded_row_ignores_its_neighbours():
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(3))
    a = sample(logits[:1], [row(gen=torch.Generator().manual_seed(7), temperature=1.0)]).token_ids[0]
    rows = [row(temperature=1.0), row(gen=torch.Generator().manual_seed(7), temperature=1.0), row(temperature=0.5)]
    b = sample(torch.stack([logits[1], logits[0], logits[2]]), rows).token_ids[1]
    assert a == b


def test_penalties_push_repeated_tokens_down():
    logits = torch.tensor([[2.0, 1.9, 0.0]])
    assert sample(logits, [row(temperature=0)]).token_ids == [0]
    assert sample(logits, [row(temperature=0, out=[0], presence_penalty=0.5)]).token_ids == [1]
    assert sample(logits, [row(temperature=0, out=[0, 0], frequency_penalty=0.1)]).token_ids == [1]
    assert sample(logits, [row(temperature=0, prompt=[0], repetition_penalty=1.2)]).token_ids == [1]


def test_logprobs_are_of_the_raw_distribution():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    res = sample(logits, [row(temperature=0, logprobs=2)])
    lp = logits.log_softmax(-1)[0]
    assert res.logprobs[0].token_id == 2
    assert abs(res.logprobs[0].logprob - float(lp[2])) < 1e-6
    assert [t for t, _ in res.logprobs[0].top] == [2, 1]


def test_top_k_past_the_vocabulary_keeps_every_token():
    logits = torch.tensor([[3.0, 2.9, 2.8, 2.7]]).repeat(400, 1)
    rows = [row(temperature=1.0, top_k=2**31 - 1)] * 400
    toks = sample(logits, rows, torch.Generator().manual_seed(4)).token_ids
    assert set(toks) == {0, 1, 2, 3}


@pytest.mark.parametrize("kw,param", [
    ({"top_k": 1180591620717411303424}, "top_k"),  # issue 13: overflowed the sampler's int64 tensor
    ({"top_k": 2**31}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": float("nan")}, "top_p"),
    ({"min_p": float("inf")}, "min_p"),
    ({"presence_penalty": float("nan")}, "presence_penalty"),
    ({"frequency_penalty": float("-inf")}, "frequency_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"seed": 2**63}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"max_tokens": 2**31}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"min_tokens": 2**40, "max_tokens": None}, "min_tokens"),
    ({"n": 129}, "n"),
    ({"n": True}, "n"),
    ({"logprobs": 21}, "logprobs"),
    ({"stop": [f"s{i}" for i in range(17)]}, "stop"),
    ({"stop": ["s" * 513]}, "stop"),
    ({"stop_token_ids": list(range(129))}, "stop_token_ids"),
    ({"stop_token_ids": [2**31]}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"temperature": "hot"}, "temperature"),
])
def test_sampling_params_refuse_what_the_engine_cannot_hold(kw, param):
    with pytest.raises(InvalidRequest) as info:
        SamplingParams(**kw).validate()
    assert info.value.param == param, info.value
    assert str(info.value)


def test_sampling_params_at_the_bounds_are_accepted():
    import numpy as np

    SamplingParams(top_k=2**31 - 1, seed=-(2**63), n=128, max_tokens=2**31 - 1, min_tokens=2**31 - 1,
                   stop=["s" * 512] * 16, stop_token_ids=list(range(128)), logprobs=20)
    SamplingParams(seed=2**63 - 1, temperature=100, top_p=1e-9, repetition_penalty=10,
                   presence_penalty=-2, frequency_penalty=2, min_p=1)
    p = SamplingParams(max_tokens=np.int64(8), temperature=np.float32(0.5), top_k=-1, stop_token_ids=(1, 2))
    assert p.top_k == 0 and p.stop_token_ids == [1, 2]


def test_draw_never_picks_a_zero_mass_token():
    # Inverse transform over [0, .5, 0, .5, 0]: u = 0 and u just below 1 are the edges where a
    # rounding slip would land on a zero-mass neighbour (or past the vocabulary).
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]]).repeat(4, 1)
    u = torch.tensor([0.0, 0.25, 0.5, float(torch.nextafter(torch.tensor(1.0), torch.tensor(0.0)))])
    assert draw(probs, u).tolist() == [1, 1, 3, 3]


@pytest.mark.parametrize("argmax", [row_argmax, chunked_argmax])  # the native kernel (where built), torch ops
@pytest.mark.parametrize("vocab", [7, ARGMAX_CHUNK, 2 * ARGMAX_CHUNK, 32000, 32003, 49152 + 5])
def test_row_argmax_matches_torch_with_ties_infinities_and_nans(vocab, argmax):
    """Both argmaxes pick what torch's does: the first maximum, the first NaN, a tail past the last
    whole chunk included."""
    gen = torch.Generator().manual_seed(vocab)
    rows = [torch.randn(vocab, generator=gen),
            torch.randint(0, 3, (vocab,), generator=gen).float(),   # ties everywhere
            torch.full((vocab,), float("-inf")),                    # nothing allowed (a fully masked row)
            torch.zeros(vocab)]
    tail_max = torch.randn(vocab, generator=gen)
    tail_max[-1] = 100.0                                            # the maximum in the tail
    tied_tail = torch.zeros(vocab)
    tied_tail[vocab // 3] = tied_tail[-1] = 5.0                     # a tie between body and tail: body wins
    nan_tail = torch.randn(vocab, generator=gen)
    nan_tail[-1] = float("nan")
    nan_body = torch.randn(vocab, generator=gen)
    nan_body[vocab // 2] = nan_body[-1] = float("nan")
    inf_body = torch.randn(vocab, generator=gen)
    inf_body[vocab // 2] = inf_body[-1] = float("inf")              # the first infinity wins
    signed_zeros = -torch.rand(vocab, generator=gen)
    signed_zeros[vocab // 3] = -0.0
    signed_zeros[-1] = 0.0                                          # -0.0 == 0.0: the first of them
    x = torch.stack(rows + [tail_max, tied_tail, nan_tail, nan_body, inf_body, signed_zeros])
    assert argmax(x).tolist() == x.argmax(dim=-1).tolist()
    assert argmax(x[:0]).shape == (0,)
    if argmax is row_argmax:
        columns = x.t().contiguous().t()  # the same values, laid out column by column
        assert argmax(columns).tolist() == x.argmax(dim=-1).tolist()


class _HostReads(torch.overrides.TorchFunctionMode):
    """Counts the tensor operations that read a tensor's values back to the host: on a GPU each is a
    device sync and a copy back (``.tolist()``, ``.item()``, ``if tensor:``, ``int(tensor)``)."""

    READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__,
             torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.cpu, torch.Tensor.numpy}

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            self.reads.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def test_a_step_reads_back_only_the_sampled_ids():
    """Greedy, penalised, top-k, top-p, min-p and seeded rows in one batch: every decision is taken
    on the host from the rows' parameters, so the one value read back is the list of token ids."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 300, generator=g)
    rows = [row(temperature=0), row(temperature=0, repetition_penalty=1.3, out=[1, 2], prompt=[3]),
            row(temperature=0.7, top_k=20), row(temperature=1.0, top_p=0.9, presence_penalty=0.5, out=[4]),
            row(temperature=1.0, min_p=0.1), row(gen=torch.Generator().manual_seed(3), temperature=0.8,
                                                  frequency_penalty=0.2, logit_bias={7: 2.0}, out=[7])]
    with _HostReads() as mode:
        result = sample(logits, rows, torch.Generator().manual_seed(1))
    assert mode.reads == ["tolist"]
    assert len(result.token_ids) == 6
