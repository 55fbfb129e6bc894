"""Scheduler and block manager together, without a model: plain Python, fast."""

from __future__ import annotations

import itertools

import pytest

from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.scheduler import Scheduler, SchedulerConfig
from pagedserve.engine.sequence import Request, Sequence, SequenceStatus
from pagedserve.errors import QueueFull
from pagedserve.kv.block_manager import BlockManager

_clock = itertools.count()


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, max_waiting=None, reserve=False,
                   max_model_len=256):
    bm = BlockManager(num_blocks, block_size)
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len,
                          max_waiting=max_waiting, reserve_max_model_len=reserve, watermark_fraction=0.0)
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

    import pagedserve.engine.scheduler as scheduler_module
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
