"""Speculative decoding (n-gram prompt lookup): the proposer, the acceptance rule, and the engine.

Greedy output must be the plain engine's token for token (prefix caching, preemption, chunked
prefill, stop conditions landing inside an accepted run), with drafts actually accepted (so the
comparison can fail), no KV block leaked, and no block holding a rejected draft in the prefix
cache. The sampled rule is checked at unit level against the target distribution (chi-squared).
The tiny model runs in float32 so the one-token and the verifying batches agree to the bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from pagedserve.config import EngineConfig
from pagedserve.engine.frontend.engine import Engine
from pagedserve.engine.core.ngram import TokenBuffer, propose
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.core.scheduler import Scheduler, SchedulerConfig
from pagedserve.engine.core.sequence import SequenceStatus
from pagedserve.engine.core.spec_decode import accept_greedy, accept_sampled
from pagedserve.kv.block_manager import BlockManager
from tests.conftest import assert_no_leaks
from tests.engine.test_scheduler import make_seq

# Prompts the tiny random model continues in loops, so the proposer's drafts get accepted.
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8] * 4, [3, 7, 3, 7, 3, 7], list(range(10, 40)), [9, 5, 9, 5, 9]]


def _brute_propose(t, k, max_n, min_n):
    length = len(t)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        pattern = list(t[length - n:])
        for e in range(length - 2, n - 2, -1):
            if list(t[e - n + 1:e + 1]) == pattern:
                return list(t[e + 1:e + 1 + k])
    return []


def test_proposer_finds_the_latest_longest_match():
    assert propose(np.array([1, 2, 3, 4, 5, 9, 9, 1, 2, 3]), 3, 4, 1) == [4, 5, 9]
    assert propose(np.array([5, 6, 7, 8]), 3, 4, 1) == []
    assert propose(np.array([7, 1, 2, 9, 1, 2]), 4, 4, 3) == []  # only a 2-gram matches
    rng = np.random.default_rng(0)
    for _ in range(2000):
        t = rng.integers(0, 4, int(rng.integers(1, 40)))
        k, max_n = int(rng.integers(1, 6)), int(rng.integers(1, 6))
        min_n = int(rng.integers(1, max_n + 1))
        assert propose(t, k, max_n, min_n) == _brute_propose(t, k, max_n, min_n), (t.tolist(), k, max_n, min_n)
    buf, tokens = TokenBuffer(), list(rng.integers(0, 100, 10))
    for _ in range(200):  # the buffer grows with the list and copies only what is new
        tokens.append(int(rng.integers(0, 100)))
        assert buf.sync(tokens).tolist() == tokens


def test_greedy_acceptance_is_the_argmax_run():
    assert accept_greedy([4, 5, 6, 7], [4, 5, 6]) == [4, 5, 6, 7]  # all accepted + bonus
    assert accept_greedy([4, 9, 6, 7], [4, 5, 6]) == [4, 9]  # target's token at the first mismatch
    assert accept_greedy([8], []) == [8]


# chi-squared critical values at p = 0.001 by degrees of freedom
_CHI2_999 = {4: 18.47, 5: 20.52}


def _chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("draft", [0, 2, 4])  # a likely, a middling and an unlikely draft
def test_sampled_acceptance_keeps_the_target_distribution(draft):
    """Over many draws, the first token out is distributed as row 0 of the target whatever the
    draft, and the second (given the first draft was accepted) as row 1."""
    probs = torch.tensor([[0.40, 0.05, 0.25, 0.20, 0.10],
                          [0.10, 0.30, 0.15, 0.05, 0.40]])
    gen = torch.Generator().manual_seed(1234)
    first, second = np.zeros(5), np.zeros(5)
    draws = 4000
    for _ in range(draws):
        out = accept_sampled(probs, [draft], gen)
        first[out[0]] += 1
        if len(out) == 2:
            second[out[1]] += 1
    assert _chi2(first, probs[0].numpy()) < _CHI2_999[4], first
    assert abs(second.sum() / draws - float(probs[0, draft])) < 0.04  # accepted with p_target(draft)
    assert _chi2(second, probs[1].numpy()) < _CHI2_999[4], second


def test_sampled_acceptance_is_reproducible_with_a_seed():
    probs = torch.softmax(torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 3, dim=-1)
    drafts = probs[:3].argmax(dim=-1).tolist()  # likely drafts: runs of different lengths get accepted

    def draws(seed):
        gen = torch.Generator().manual_seed(seed)
        return [accept_sampled(probs, drafts, gen) for _ in range(30)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)


def _engine(tiny_model_dir, spec: bool, **kw) -> Engine:
    kw.setdefault("kv_cache_memory", "32MiB")
    return Engine(EngineConfig(model=str(tiny_model_dir), dtype="float32", speculative="ngram" if spec else None,
                               num_speculative_tokens=4, **kw))


@pytest.fixture(scope="module")
def engines(tiny_model_dir) -> dict[bool, Engine]:
    """One plain and one speculative engine (default settings), shared by the module's tests
    (each test checks counters as differences, and leaves both idle with no block held)."""
    return {False: _engine(tiny_model_dir, False), True: _engine(tiny_model_dir, True)}


def _accepted(engine: Engine) -> int:
    return engine.stats().spec_num_accepted_tokens


def _check_spec_state(engine: Engine) -> None:
    """After a step: the allocator is consistent, a decoding sequence holds exactly the blocks its
    tokens need, none past them (the drafts' blocks were rolled back), and every cached block in its table holds
    the sequence's own accepted tokens, never a rejected draft's."""
    bm = engine.core.block_manager
    bm.check_invariants()
    bs = bm.block_size
    for seq in engine.core.scheduler.running:
        assert not seq.draft_token_ids
        table = bm.tables[seq.seq_id]
        # no block past the sequence's own tokens (a draft's block would be one)
        assert bm.num_blocks_for(seq.num_computed_tokens) <= len(table) <= bm.num_blocks_for(seq.num_tokens), seq
        for i, block in enumerate(table):
            if block.cache_key is not None:
                assert block.cache_key[1] == tuple(seq.token_ids[i * bs:(i + 1) * bs]), (seq, i)


def _run(engine: Engine, prompts, params, check=True) -> dict:
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params[i] if isinstance(params, list) else params)
    done, streamed = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                streamed.setdefault((out.request_id, c.index), []).extend(c.delta_token_ids)
            if out.finished:
                done[out.request_id] = out
        if check:
            _check_spec_state(engine)
    for out in done.values():  # streaming emitted exactly the final tokens, accepted runs included
        for c in out.outputs:
            assert streamed[(out.request_id, c.index)] == c.token_ids
    assert_no_leaks(engine)
    return done


def _tokens(done: dict) -> dict:
    return {rid: [(c.token_ids, c.finish_reason) for c in out.outputs] for rid, out in done.items()}


@pytest.mark.parametrize("case", ["plain", "preemption", "chunked", "no-prefix-cache"])
def test_greedy_output_is_unchanged_and_drafts_are_accepted(tiny_model_dir, case):
    kw = {"plain": {}, "preemption": {"num_kv_blocks": 12, "max_model_len": 256},
          "chunked": {"max_num_batched_tokens": 16}, "no-prefix-cache": {"enable_prefix_caching": False}}[case]
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    prompts = PROMPTS + [PROMPTS[0]]  # a repeat: its prompt blocks are prefix-cache hits
    base = _run(_engine(tiny_model_dir, False, **kw), prompts, params, check=False)
    spec_engine = _engine(tiny_model_dir, True, **kw)
    spec = _run(spec_engine, prompts, params)
    assert _tokens(spec) == _tokens(base)
    st = spec_engine.stats()
    assert st.spec_num_accepted_tokens > 0 and st.spec_num_draft_tokens >= st.spec_num_accepted_tokens
    assert st.generation_tokens == 48 * len(prompts)
    if case == "preemption":
        assert st.num_preemptions > 0
    if case == "plain":  # again, from the prefix cache the first run filled (prompt and output blocks)
        again = _run(spec_engine, [p + base[str(i)].outputs[0].token_ids[:20] for i, p in enumerate(prompts)],
                     SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        assert spec_engine.stats().prefix_hit_tokens > 0
        assert [again[str(i)].outputs[0].token_ids for i in range(len(prompts))] == \
            [base[str(i)].outputs[0].token_ids[20:28] for i in range(len(prompts))]


def test_stops_inside_an_accepted_run(engines):
    """max_tokens, a stop token and a stop string that land in the middle of a step's accepted
    tokens end the completion exactly where plain decoding ends it."""
    base_engine, spec_engine = engines[False], engines[True]
    ref = _run(base_engine, [PROMPTS[1]], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    out = ref["0"].outputs[0]
    stop_token = out.token_ids[25]
    stop_text = base_engine.tokenizer.decode(out.token_ids[30:32])
    cases = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (7, 13, 22)]
    cases.append(SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop_token_ids=[stop_token]))
    cases.append(SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop_text]))
    cases.append(SamplingParams(max_tokens=40, temperature=0, min_tokens=30, stop_token_ids=[stop_token]))
    prompts = [PROMPTS[1]] * len(cases)
    base = _run(base_engine, prompts, cases, check=False)
    accepted = _accepted(spec_engine)
    spec = _run(spec_engine, prompts, cases)
    assert _tokens(spec) == _tokens(base)
    assert [base[str(i)].outputs[0].text for i in range(len(cases))] == \
        [spec[str(i)].outputs[0].text for i in range(len(cases))]
    assert [len(spec[str(i)].outputs[0].token_ids) for i in range(3)] == [7, 13, 22]
    assert spec["4"].outputs[0].finish_reason == "stop"
    assert _accepted(spec_engine) > accepted


def test_requests_that_are_not_speculated_share_the_batch(engines):
    """logprobs, n > 1 and penalties / logit_bias run next to speculated requests and get the
    plain engine's output; only the eligible ones draft."""
    params = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, n=2),
              SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, presence_penalty=0.5,
                             frequency_penalty=0.3, repetition_penalty=1.1, logit_bias={5: 3.0})]
    prompts = [PROMPTS[1]] * len(params)
    base = _run(engines[False], prompts, params, check=False)
    accepted = _accepted(engines[True])
    spec = _run(engines[True], prompts, params)
    assert _tokens(spec) == _tokens(base)
    assert [lp.token_id for lp in spec["1"].outputs[0].logprobs] == spec["1"].outputs[0].token_ids
    assert _accepted(engines[True]) > accepted


def test_seeded_sampling_is_deterministic_and_top_k_1_is_greedy(engines):
    # min_p rather than top_p: the same processor path without a vocabulary-wide sort per row (cheaper)
    sampled = SamplingParams(max_tokens=40, temperature=0.7, min_p=0.05, seed=11, ignore_eos=True)
    top1 = SamplingParams(max_tokens=40, temperature=1.0, top_k=1, seed=3, ignore_eos=True)
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prompts = [PROMPTS[1], PROMPTS[1], PROMPTS[3]]
    engine = engines[True]
    before = engine.stats()
    first = _run(engine, prompts, [sampled, top1, greedy])
    second = _run(engine, prompts, [sampled, top1, greedy])
    assert _tokens(first) == _tokens(second)
    # top_k = 1 leaves one token per row: the acceptance rule must then reproduce greedy exactly
    assert first["1"].outputs[0].token_ids == _run(engine, [PROMPTS[1]], greedy)["0"].outputs[0].token_ids
    st = engine.stats()
    assert st.spec_num_drafts > before.spec_num_drafts and st.spec_num_accepted_tokens > before.spec_num_accepted_tokens


@pytest.mark.parametrize("bad", [{"num_speculative_tokens": 0}, {"num_speculative_tokens": 17},
                                 {"speculative": "eagle"}, {"ngram_prompt_lookup_min": 5},
                                 {"ngram_prompt_lookup_max": 0}])
def test_speculative_config_is_bounded(bad):
    with pytest.raises(ValueError):
        EngineConfig(model="x", **{"speculative": "ngram", **bad})


class SpecSchedulerMachine(RuleBasedStateMachine):
    """Random add / step (accepting a random number of drafts) / abort through the scheduler with
    drafting on, a small pool (preemption) and a two-token alphabet (prefix hits, drafts found)."""

    def __init__(self):
        super().__init__()
        bm = BlockManager(20, 2)
        self.sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=10, max_model_len=64,
                                               watermark_fraction=0.0, num_speculative_tokens=3), bm)
        self.live = []

    # Two priorities: priority prefill first holds drafting decodes back in some steps.
    @rule(prompt_len=st.integers(1, 9), max_tokens=st.integers(1, 12), token=st.integers(0, 1),
          priority=st.integers(0, 1))
    def add(self, prompt_len, max_tokens, token, priority):
        seq = make_seq(prompt_len, max_tokens, priority=priority, token=token)
        self.sched.add(seq)
        self.live.append(seq)

    @rule(data=st.data())
    def step(self, data):
        sched = self.sched
        plan = sched.schedule()
        sched.update_after_step(plan)
        for seq, _ in plan.scheduled:
            if seq.num_computed_tokens != seq.num_tokens:
                continue  # a prompt chunk short of its end
            drafts = seq.draft_token_ids
            accepted = data.draw(st.integers(0, len(drafts)))
            nxt = 1 - drafts[accepted] if accepted < len(drafts) else data.draw(st.integers(0, 1))
            for token in drafts[:accepted] + [nxt]:
                seq.token_ids.append(token)
                if seq.num_output_tokens >= seq.request.params.max_tokens:
                    sched.finish(seq)
                    break
            else:
                sched.accept_drafts(seq, accepted)
        self.live = [s for s in self.live if s.status is not SequenceStatus.FINISHED]

    @rule(data=st.data())
    def abort(self, data):
        if self.live:
            seq = data.draw(st.sampled_from(self.live))
            self.sched.finish(seq)
            self.live.remove(seq)

    @invariant()
    def consistent(self):
        bm = self.sched.block_manager
        bm.check_invariants()
        assert set(bm.tables) == {s.seq_id for s in self.sched.running}
        for seq in self.sched.running:
            assert not seq.draft_token_ids
            table = bm.tables[seq.seq_id]
            assert len(table) <= bm.num_blocks_for(seq.num_tokens)
            for i, block in enumerate(table):
                if block.cache_key is not None:
                    assert block.cache_key[1] == tuple(seq.token_ids[2 * i:2 * i + 2])

    def teardown(self):
        steps = 0
        while self.sched.num_unfinished:
            plan = self.sched.schedule()
            self.sched.update_after_step(plan)
            for seq, _ in plan.scheduled:
                if seq.num_computed_tokens == seq.num_tokens:
                    seq.token_ids.append(0)
                    if seq.num_output_tokens >= seq.request.params.max_tokens:
                        self.sched.finish(seq)
                    else:
                        self.sched.accept_drafts(seq, 0)
            steps += 1
            assert steps < 2000, "the scheduler stopped making progress"
        assert self.sched.block_manager.num_used_blocks == 0


TestSpecSchedulerProperties = SpecSchedulerMachine.TestCase
TestSpecSchedulerProperties.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
