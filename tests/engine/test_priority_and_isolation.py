"""Engine-level scheduling guarantees: priority preemption with correct output, salt isolation."""

from __future__ import annotations

import re

from pagedserve.config import EngineConfig
from pagedserve.engine.frontend.engine import Engine
from pagedserve.engine.sampling_params import SamplingParams
from tests.conftest import assert_no_leaks
from tests.engine.test_parity import _prompts


def _collect(engine, done):
    for out in engine.step():
        if out.finished:
            done[out.request_id] = out.outputs[0].token_ids


def test_priority_request_starts_within_one_step_and_preempted_work_stays_correct(checkpoint_dir):
    model_dir = str(checkpoint_dir("llama"))
    low_prompts = _prompts([40, 45, 50, 38], seed=11)
    urgent_prompt = _prompts([30], seed=12)[0]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)

    # Reference: every request alone in a roomy pool.
    ref_engine = Engine(EngineConfig(model=model_dir, dtype="float32", num_kv_blocks=256, block_size=8))
    want = {}
    for i, p in enumerate(low_prompts + [urgent_prompt]):
        ref_engine.add_request(str(i), p, params)
        while ref_engine.has_unfinished_requests():
            _collect(ref_engine, want)

    # A pool that the four priority-1 requests fill (they need 4 x 9 blocks of 8 at their longest).
    engine = Engine(EngineConfig(model=model_dir, dtype="float32", num_kv_blocks=28, block_size=8,
                                 enable_prefix_caching=False))
    for i, p in enumerate(low_prompts):
        engine.add_request(str(i), p, params, priority=1)
    done = {}
    for _ in range(6):
        _collect(engine, done)
    st = engine.stats()
    assert st.kv_blocks_total - st.kv_blocks_used < 4, "the urgent request (30 tokens, 4 blocks) must not fit"
    engine.add_request("4", urgent_prompt, params, priority=0)
    _collect(engine, done)
    urgent_seq = engine.core.requests["4"].seqs[0]
    assert urgent_seq.num_computed_tokens > 0, "the priority-0 request did not start within one step"
    while engine.has_unfinished_requests():
        _collect(engine, done)
    assert engine.core.scheduler.num_preemptions > 0
    assert done == want
    assert_no_leaks(engine)


def test_cache_salt_isolates_prefix_hits(tiny_model_dir):
    engine = Engine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64))
    prompt = _prompts([40], seed=13)[0]
    params = SamplingParams(max_tokens=2, temperature=0)
    hits = []
    for rid, salt in (("a", "tenant-1"), ("b", "tenant-2"), ("c", "tenant-1"), ("d", None), ("e", None)):
        engine.add_request(rid, prompt, params, cache_salt=salt)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    hits.append(out.num_cached_tokens)
    # Same salt → hits (32 of 40 tokens: two full blocks); another salt or none → cold.
    assert hits == [0, 0, 32, 0, 32]
    assert_no_leaks(engine)


def test_long_prompt_chunks_in_while_decodes_continue(tiny_model_dir):
    engine = Engine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=256, max_num_batched_tokens=64))
    for i, p in enumerate(_prompts([10] * 8, seed=14)):
        engine.add_request(f"d{i}", p, SamplingParams(max_tokens=100, ignore_eos=True))
    while any(not r.seqs[0].num_output_tokens for r in engine.core.requests.values()):
        engine.step()
    engine.add_request("long", _prompts([8 * 64], seed=15)[0], SamplingParams(max_tokens=4, ignore_eos=True))
    long_seq = engine.core.requests["long"].seqs[0]
    steps = 0
    while long_seq.num_output_tokens == 0:
        before = {rid: r.seqs[0].num_output_tokens for rid, r in engine.core.requests.items() if rid != "long"}
        engine.step()
        steps += 1
        assert all(engine.core.requests[rid].seqs[0].num_output_tokens == n + 1 for rid, n in before.items())
    assert steps == -(-512 // (64 - 8))  # 56 prompt tokens per step beside the 8 decodes
    for rid in list(engine.core.requests):
        engine.abort(rid)
    assert_no_leaks(engine)


def _paid_into_free_decodes(model_dir, prefill_first):
    """Free (priority 1) requests decoding, with n-gram drafts, an n = 2 fork and a grammar; then
    a paid (priority 0) prompt arrives. Returns every completion's tokens, whether the paid prompt's
    step left every free sequence out, and the engine."""
    from pagedserve.engine.sampling_params import StructuredOutputsParams

    engine = Engine(EngineConfig(model=model_dir, dtype="float32", num_kv_blocks=128, block_size=8, max_num_seqs=8,
                                 speculative="ngram", priority_prefill_first=prefill_first))
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    # The grammar first, so it has compiled before the others start (they are all decoding when
    # the paid prompt comes); its regex keeps it decoding as long as they do.
    engine.add_request("free-regex", "Word:", SamplingParams(max_tokens=40, temperature=0, structured_outputs=
                                                             StructuredOutputsParams(regex="[a-z]{30,40}")),
                       priority=1)
    done = {}

    def collect():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [o.token_ids for o in out.outputs]

    while engine.core.compiling:
        collect()
    loops = [[1, 2, 3, 4, 5, 6, 7, 8] * 4, [3, 7, 3, 7, 3, 7], [9, 5, 9, 5, 9]]  # the tiny model repeats these
    for i, prompt in enumerate(loops):
        engine.add_request(f"free{i}", prompt, greedy, priority=1)
    engine.add_request("free-n2", _prompts([14], seed=21)[0],
                       SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, n=2), priority=1)
    def free():
        return [s for r in engine.core.requests.values() for s in r.seqs if not s.is_finished]

    while not engine.core.requests["free-n2"].forked or any(s.num_output_tokens == 0 for s in free()):
        collect()
    assert len(free()) == 6, "every free completion is decoding when the paid prompt arrives"
    before = {s: s.num_computed_tokens for s in free()}
    engine.add_request("paid", _prompts([24], seed=22)[0], greedy, priority=0)
    collect()
    paid = engine.core.requests["paid"].seqs[0]
    assert paid.num_output_tokens == 1, "the paid prompt ran in the step it arrived for"
    paused = all(s.num_computed_tokens == n and s.status.value == "running" for s, n in before.items())
    while engine.has_unfinished_requests():
        collect()
    assert engine.core.stats().spec_num_accepted_tokens > 0, "drafts were accepted (speculation ran)"
    assert engine.core.scheduler.num_preemptions == 0
    return done, paused, engine


def test_paid_prompt_runs_alone_and_every_output_matches_the_plain_rule(tiny_model_dir):
    model_dir = str(tiny_model_dir)
    with_rule, paused, engine = _paid_into_free_decodes(model_dir, prefill_first=True)
    assert paused, "the paid prompt's step left the free decodes out"
    assert_no_leaks(engine)
    without, paused, engine = _paid_into_free_decodes(model_dir, prefill_first=False)
    assert not paused, "without the rule the free decodes share the paid prompt's step"
    assert_no_leaks(engine)
    assert with_rule == without  # greedy output of every completion, token for token
    assert len(with_rule["free-n2"]) == 2 and len(with_rule) == 6
    assert re.fullmatch("[a-z]{30,40}", engine.tokenizer.decode(with_rule["free-regex"][0], skip_special_tokens=True))
