"""Hypothesis: random add / step / abort sequences through the scheduler and block manager.

After every operation the allocator's invariants hold; every request eventually finishes; when
all are done, every block is free. Prompts come from a tiny alphabet so prefixes are shared and
cached blocks are hit, evicted and reused; the pool is small so preemption happens. Priority
prefill first (engine/core/scheduler.py) is on with a short pause bound: a running sequence is left
out of a step that has budget to spare only when the step carries a prompt chunk of strictly
better priority, and never more than the bound's steps in a row.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedserve.engine.core.sequence import SequenceStatus
from tests.engine.test_scheduler import make_scheduler, make_seq, run_step


BUDGET = 8
MAX_PAUSE = 3


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.sched = make_scheduler(num_blocks=16, block_size=2, max_num_seqs=4, budget=BUDGET, max_model_len=64,
                                    max_pause=MAX_PAUSE)
        self.live = []
        self.held_steps = 0  # steps in a row that left running work out with budget to spare

    @rule(prompt_len=st.integers(1, 9), max_tokens=st.integers(1, 6), priority=st.integers(0, 2),
          token=st.integers(0, 1))
    def add(self, prompt_len, max_tokens, priority, token):
        seq = make_seq(prompt_len, max_tokens, priority=priority, token=token)
        self.sched.add(seq)
        self.live.append(seq)

    @rule()
    def step(self):
        running = list(self.sched.running)
        decoding = {s for s in running if s.num_tokens - s.num_computed_tokens == 1}
        plan, _ = run_step(self.sched)
        scheduled = {s for s, _ in plan.scheduled}
        left_out = [s for s in running if s not in scheduled and s.status is SequenceStatus.RUNNING]
        if left_out and plan.num_batched_tokens < BUDGET:
            prompts = [s.priority for s, n in plan.scheduled if s not in decoding or n > 1]
            assert prompts and min(prompts) < min(s.priority for s in left_out), \
                "a running sequence sat out a step that had no better prompt and budget to spare"
            self.held_steps += 1
            assert self.held_steps <= MAX_PAUSE, "worse work was held back past the pause bound"
        else:
            self.held_steps = 0
        self.live = [s for s in self.live if s.status is not SequenceStatus.FINISHED]

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data):
        seq = data.draw(st.sampled_from(self.live))
        self.sched.finish(seq)
        self.live.remove(seq)

    @invariant()
    def allocator_is_consistent(self):
        bm = self.sched.block_manager
        bm.check_invariants()
        held = {s.seq_id for s in self.sched.running}
        assert set(bm.tables) == held, "only running sequences hold blocks"
        assert len(self.sched.running) <= 4

    def teardown(self):
        steps = 0
        while self.sched.num_unfinished:
            run_step(self.sched)
            steps += 1
            assert steps < 2000, "the scheduler stopped making progress"
        assert self.sched.block_manager.num_used_blocks == 0


TestSchedulerProperties = SchedulerMachine.TestCase
TestSchedulerProperties.settings = settings(max_examples=120, stateful_step_count=50, deadline=None)
