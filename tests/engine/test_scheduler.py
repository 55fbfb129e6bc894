"""Scheduler and block manager together, without a model: plain Python, fast."""

from __future__ import annotations

import itertools

import pytest

from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.core.scheduler import Scheduler, SchedulerConfig
from pagedserve.engine.core.sequence import Request, Sequence, SequenceStatus
from pagedserve.errors import QueueFull
from pagedserve.kv.block_manager import BlockManager

_clock = itertools.count()


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, max_waiting=None, reserve=False,
                   max_model_len=256, prefill_first=True, max_pause=8):
    bm = BlockManager(num_blocks, block_size)
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len,
                          max_waiting=max_waiting, reserve_max_model_len=reserve, watermark_fraction=0.0,
                          priority_prefill_first=prefill_first, priority_prefill_max_pause=max_pause)
    return Scheduler(cfg, bm)


def make_seq(prompt_len, max_tokens, priority=0, token=7, rid=None):
    rid = rid or f"r{next(_clock)}"
    req = Request(rid, [token] * prompt_len, SamplingParams(max_tokens=max_tokens), priority, float(next(_clock)))
    seq = Sequence(req, 0, list(req.prompt_token_ids), prompt_len)
    req.seqs.append(seq)
    return seq


def run_step(sched: Scheduler):
    """One step as the engine does it, with a fake model that always emits token 1."""
    plan = sched.schedule()
    sched.update_after_step(plan)
    finished = []
    for seq, _ in plan.scheduled:
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(1)
            if seq.num_output_tokens >= seq.request.params.max_tokens:
                sched.finish(seq)
                finished.append(seq)
    sched.block_manager.check_invariants()
    return plan, finished


def drain(sched, max_steps=10_000):
    steps = 0
    while sched.num_unfinished:
        run_step(sched)
        steps += 1
        assert steps < max_steps, "scheduler made no progress"
    assert sched.block_manager.num_used_blocks == 0
    return steps


def test_long_prompt_is_chunked_while_every_decode_keeps_its_token():
    sched = make_scheduler(num_blocks=128, budget=16, max_num_seqs=9)
    decoders = [make_seq(4, 100, token=t) for t in range(8)]
    for s in decoders:
        sched.add(s)
    while not all(s.num_output_tokens for s in decoders):
        run_step(sched)
    long = make_seq(8 * 16, 10, token=99)  # 8x the step's token budget
    sched.add(long)
    chunks = 0
    while long.num_output_tokens == 0:
        before = {s: s.num_output_tokens for s in decoders}
        plan, _ = run_step(sched)
        planned = dict(plan.scheduled)
        # Every decoder got its token this step; the long prompt took what was left.
        assert all(s.num_output_tokens == before[s] + 1 for s in decoders)
        assert planned[long] == 16 - 8
        chunks += 1
    assert chunks == 128 // 8
    for s in decoders:
        sched.finish(s)
    drain(sched)


def test_full_cache_preempts_newest_and_everything_finishes():
    sched = make_scheduler(num_blocks=10, block_size=4, budget=64)
    seqs = [make_seq(6, 20) for _ in range(4)]  # each needs 7 blocks at the end: 4 can't coexist
    for s in seqs:
        sched.add(s)
    drain(sched)
    assert sched.num_preemptions > 0
    assert all(s.num_output_tokens == 20 for s in seqs)
    # The oldest request was never the victim while newer ones were running.
    assert seqs[0].num_preemptions == 0


def test_higher_priority_preempts_for_memory_within_one_step():
    sched = make_scheduler(num_blocks=12, block_size=4, budget=64)
    low = [make_seq(12, 30, priority=1, token=t) for t in range(3)]  # 3 × 3 blocks, growing: fills the pool
    for s in low:
        sched.add(s)
    for _ in range(5):
        run_step(sched)
    urgent = make_seq(12, 5, priority=0, token=3)
    sched.add(urgent)
    plan, _ = run_step(sched)
    assert urgent in [s for s, _ in plan.scheduled]
    assert any(s.status is SequenceStatus.WAITING for s in low)
    drain(sched)
    assert urgent.num_output_tokens == 5 and all(s.num_output_tokens == 30 for s in low)


def test_higher_priority_preempts_for_a_seat():
    sched = make_scheduler(max_num_seqs=2)
    low = [make_seq(4, 50, priority=5) for _ in range(2)]
    for s in low:
        sched.add(s)
    run_step(sched)
    urgent = make_seq(4, 3, priority=0)
    sched.add(urgent)
    plan, _ = run_step(sched)
    assert urgent in [s for s, _ in plan.scheduled]
    assert low[1].status is SequenceStatus.WAITING  # the newer of the two equal-priority ones
    drain(sched)


def test_equal_priority_is_fcfs_and_preempted_keeps_its_place():
    sched = make_scheduler(max_num_seqs=1)
    a, b, c = make_seq(4, 3), make_seq(4, 3), make_seq(4, 3)
    for s in (c, a, b):  # queue order must follow arrival, not insertion
        sched.add(s)
    order = []
    while sched.num_unfinished:
        _, done = run_step(sched)
        order += done
    assert order == [a, b, c]


def test_max_waiting_refuses_with_queue_full():
    sched = make_scheduler(max_waiting=2)
    sched.add(make_seq(4, 3))
    sched.add(make_seq(4, 3))
    with pytest.raises(QueueFull) as err:
        sched.add(make_seq(4, 3))
    assert err.value.status_code == 503 and err.value.retry_after_s > 0
    drain(sched)


def test_worst_case_reservation_takes_max_model_len_up_front():
    sched = make_scheduler(num_blocks=64, block_size=4, max_model_len=64, reserve=True)
    seqs = [make_seq(4, 3) for _ in range(6)]
    for s in seqs:
        sched.add(s)
    run_step(sched)
    # 64 tokens = 16 blocks each: only 4 of 6 fit at once even though each uses 2 blocks.
    assert len(sched.running) == 4
    assert sched.block_manager.num_used_blocks == 64
    drain(sched)


def test_prefix_hits_skip_computed_tokens():
    sched = make_scheduler(block_size=4, budget=64)
    a = make_seq(16, 2)
    sched.add(a)
    drain(sched)
    b = make_seq(18, 2)
    sched.add(b)
    plan, _ = run_step(sched)
    assert plan.scheduled == [(b, 18 - 16)]
    assert b.request.num_cached_tokens == 16
    drain(sched)


def test_first_scheduling_is_stamped_when_the_plan_starts_and_kept_after_preemption(monkeypatch):
    # vLLM's queue time: enqueued → the start of the schedule() call that admits the request.
    # Planning the running batch first is not waiting, so everything admitted by one plan
    # carries that plan's start time, however many running sequences were planned before it.
    import types

    import pagedserve.engine.core.scheduler as scheduler_module
    ticks = itertools.count(100.0, 100.0)  # the scheduler's clock only: each schedule() reads it once
    monkeypatch.setattr(scheduler_module, "time", types.SimpleNamespace(monotonic=lambda: next(ticks)))
    sched = make_scheduler(num_blocks=64, budget=64, max_num_seqs=4)
    running = [make_seq(4, 8) for _ in range(2)]
    for seq in running:
        sched.add(seq)
    run_step(sched)  # plan 1 starts at t=100
    assert [s.request.metrics.first_scheduled_time for s in running] == [100.0, 100.0]
    late = [make_seq(4, 8), make_seq(4, 8)]
    for seq in late:
        sched.add(seq)
    run_step(sched)  # plan 2 (t=200): the two running decode first, then both newcomers join
    assert [s.request.metrics.first_scheduled_time for s in late] == [200.0, 200.0]
    urgent = make_seq(4, 8, priority=-1)
    sched.add(urgent)
    plan, _ = run_step(sched)  # plan 3 (t=300): all seats taken, so the newest running one is preempted
    assert late[-1].status is SequenceStatus.WAITING and late[-1].num_preemptions == 1
    assert urgent.request.metrics.first_scheduled_time == 300.0
    drain(sched)
    # Rescheduled after its preemption, it still reports when it was first scheduled.
    assert late[-1].request.metrics.first_scheduled_time == 200.0
    assert [s.request.metrics.first_scheduled_time for s in running] == [100.0, 100.0]


# ---- priority prefill first ----------------------------------------------------------------

def _decoding(sched, seqs):
    """Step until every one of ``seqs`` has its first output token (they are all decoding)."""
    while not all(s.num_output_tokens for s in seqs):
        run_step(sched)


def _ids(plan):
    return [(s.request.request_id, n) for s, n in plan.scheduled]


def test_better_priority_prompt_runs_alone_and_the_paused_decodes_resume(caplog):
    import logging

    caplog.set_level(logging.DEBUG, logger="pagedserve.engine.core.scheduler")
    sched = make_scheduler(num_blocks=64, budget=32, max_num_seqs=8)
    free = [make_seq(4, 20, priority=1, token=t) for t in range(7)]
    for s in free:
        sched.add(s)
    _decoding(sched, free)
    before = {s: (s.num_tokens, s.num_computed_tokens, list(sched.block_manager.block_ids(s.seq_id))) for s in free}
    paid = make_seq(8, 3, priority=0, token=50)
    sched.add(paid)
    plan, _ = run_step(sched)
    assert plan.scheduled == [(paid, 8)], "the paid prompt's step carries the prefill alone"
    # The decision is logged at debug level only (once per such step, never at info).
    held = [r for r in caplog.records if "sit this step out" in r.getMessage()]
    assert len(held) == 1 and held[0].levelno == logging.DEBUG and "7 running" in held[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.INFO]
    assert not plan.preempted and sched.num_preemptions == 0
    # The free decodes sat out: still running, same tokens, same blocks (nothing freed or recomputed).
    for s in free:
        assert s.status is SequenceStatus.RUNNING
        assert (s.num_tokens, s.num_computed_tokens, list(sched.block_manager.block_ids(s.seq_id))) == before[s]
    plan, _ = run_step(sched)  # no prompt left: everyone decodes, paid first
    assert _ids(plan) == [(paid.request.request_id, 1)] + [(s.request.request_id, 1) for s in free]
    assert sched.consecutive_pauses == 0
    drain(sched)
    assert paid.num_output_tokens == 3 and all(s.num_output_tokens == 20 for s in free)


def test_rule_off_batches_the_prompt_with_every_decode():
    sched = make_scheduler(prefill_first=False)
    free = [make_seq(4, 20, priority=1, token=t) for t in range(7)]
    for s in free:
        sched.add(s)
    _decoding(sched, free)
    paid = make_seq(8, 3, priority=0, token=50)
    sched.add(paid)
    plan, _ = run_step(sched)
    assert _ids(plan) == [(s.request.request_id, 1) for s in free] + [(paid.request.request_id, 8)]
    drain(sched)


def _scripted_plans(prefill_first, priorities, seed=5):
    """A fixed workload of staggered arrivals (prompts chunked, decodes, seat and memory preemption);
    returns every step's plan as (request id, tokens) lists."""
    import random

    rng = random.Random(seed)
    sched = make_scheduler(num_blocks=14, block_size=4, max_num_seqs=4, budget=12, prefill_first=prefill_first)
    arrivals = {}
    for i in range(20):
        arrivals.setdefault(rng.randrange(20), []).append(
            (f"q{i}", rng.randrange(1, 20), rng.randrange(1, 20), priorities[i % len(priorities)]))
    plans, step = [], 0
    while step < 20 or sched.num_unfinished:
        for rid, plen, mt, prio in arrivals.get(step, []):
            sched.add(make_seq(plen, mt, priority=prio, token=plen % 3, rid=rid))
        plan, _ = run_step(sched)
        plans.append(_ids(plan))
        step += 1
        assert step < 2000
    assert sched.block_manager.num_used_blocks == 0
    return plans


def test_equal_priorities_batch_exactly_as_without_the_rule():
    assert _scripted_plans(True, [0]) == _scripted_plans(False, [0])
    assert _scripted_plans(True, [3]) == _scripted_plans(False, [3])
    # The comparison can fail: with two priorities the rule does change plans.
    assert _scripted_plans(True, [0, 1]) != _scripted_plans(False, [0, 1])


def test_long_better_prompt_pauses_worse_decodes_for_its_chunks_only():
    sched = make_scheduler(num_blocks=128, budget=16, max_num_seqs=8)
    free = [make_seq(4, 40, priority=2, token=t) for t in range(7)]
    for s in free:
        sched.add(s)
    _decoding(sched, free)
    paid = make_seq(40, 2, priority=0, token=60)  # 3 chunks: 16 + 16 + 8
    sched.add(paid)
    chunks = [run_step(sched)[0] for _ in range(3)]
    assert [_ids(p) for p in chunks] == [[(paid.request.request_id, n)] for n in (16, 16, 8)]
    assert sched.consecutive_pauses == 3
    plan, _ = run_step(sched)
    assert len(plan.scheduled) == 8 and sched.consecutive_pauses == 0
    drain(sched)
    assert all(s.num_output_tokens == 40 for s in free)


def test_max_pause_bounds_how_long_worse_decodes_wait():
    sched = make_scheduler(num_blocks=128, budget=16, max_num_seqs=8, max_pause=2)
    free = [make_seq(4, 40, priority=1, token=t) for t in range(7)]
    for s in free:
        sched.add(s)
    _decoding(sched, free)
    paid = make_seq(48, 2, priority=0, token=60)
    sched.add(paid)
    plans = [run_step(sched)[0] for _ in range(4)]
    assert [_ids(p) for p in plans[:2]] == [[(paid.request.request_id, 16)]] * 2
    # Third step: the bound is reached, so the free decodes join and the prompt takes what is left.
    assert _ids(plans[2]) == [(s.request.request_id, 1) for s in free] + [(paid.request.request_id, 9)]
    assert _ids(plans[3]) == [(paid.request.request_id, 7)]  # paused again: the count restarted
    drain(sched)


def test_worse_waiting_prompts_are_not_admitted_beside_a_better_one():
    sched = make_scheduler(budget=64)
    free = make_seq(8, 3, priority=1, token=1)
    paid = make_seq(8, 3, priority=0, token=2)
    sched.add(free)
    sched.add(paid)
    plan, _ = run_step(sched)
    assert _ids(plan) == [(paid.request.request_id, 8)]
    plan, _ = run_step(sched)  # the paid decode is better than the free prompt: nothing is held
    assert _ids(plan) == [(paid.request.request_id, 1), (free.request.request_id, 8)]
    drain(sched)


def test_better_prompt_takes_a_seat_from_a_paused_decode():
    sched = make_scheduler(max_num_seqs=4, budget=32)
    free = [make_seq(4, 20, priority=1, token=t) for t in range(4)]
    for s in free:
        sched.add(s)
    _decoding(sched, free)
    paid = make_seq(8, 3, priority=0)
    sched.add(paid)
    plan, _ = run_step(sched)
    assert _ids(plan) == [(paid.request.request_id, 8)]
    assert free[-1].status is SequenceStatus.WAITING and sched.num_preemptions == 1  # the newest free one
    assert all(s.status is SequenceStatus.RUNNING for s in free[:3])
    drain(sched)
    assert all(s.num_output_tokens == 20 for s in free)


@pytest.mark.parametrize("bad", [{"priority_prefill_max_pause": 0}, {"priority_prefill_max_pause": 1025},
                                 {"priority_prefill_max_pause": 2.5}, {"priority_prefill_max_pause": True},
                                 {"priority_prefill_first": "no"}])
def test_priority_prefill_config_is_bounded(bad):
    from pagedserve.config import EngineConfig

    with pytest.raises(ValueError, match="priority_prefill"):
        EngineConfig(model="x", **bad)


def test_priority_prefill_flags_reach_the_config():
    import argparse

    from pagedserve.engine.args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    cfg = engine_config_from_args(parser.parse_args(["--model", "x"]))
    assert cfg.priority_prefill_first is True and cfg.priority_prefill_max_pause == 8
    cfg = engine_config_from_args(parser.parse_args(["--model", "x", "--no-priority-prefill-first",
                                                     "--priority-prefill-max-pause", "3"]))
    assert cfg.priority_prefill_first is False and cfg.priority_prefill_max_pause == 3
    with pytest.raises(ValueError, match="priority_prefill_max_pause"):
        engine_config_from_args(parser.parse_args(["--model", "x", "--priority-prefill-max-pause", "0"]))
