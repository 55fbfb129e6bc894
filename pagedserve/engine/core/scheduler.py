"""Continuous batching: each step, decide which sequences run and how many tokens each computes.

There is no prefill phase and no decode phase. Every step has one token budget
(``max_num_batched_tokens``) handed out as ``{sequence: tokens}``: running sequences first
(those one token behind, i.e. decoding, before those still chunking through a prompt, so a
long prompt never stalls everyone's next token), then waiting ones in (priority, arrival)
order, each taking what is left of the budget, so a long prompt is computed in chunks.
Prefix-cache hits, chunked prefill, preemption and resume all fall out of that one rule.

Priority prefill first: a step that carries a prompt chunk (a waiting sequence, or a running one
still chunking through its prompt) carries no work of strictly worse priority than the best such
prompt. Running sequences of worse priority sit that step out: they keep their blocks and seats
(nothing is preempted or recomputed) and decode in the next step that has no better prompt to
compute; waiting ones of worse priority are not admitted in it. The point is the better prompt's
time to first token: on a CPU a step's time grows with its batch, so a paid prompt that joined a
step of free decodes would pay for them. Worse work is held back only in steps that carry a better
prompt, and never more than ``priority_prefill_max_pause`` steps in a row (a long better prompt is
chunked over several steps, and a stream of them could otherwise pause worse decodes without
end): the step after that batches everyone as usual. Equal priorities (every request at the
default 0) never trigger it, so their batching is exactly the plain rule above.

When blocks run out, the lowest-priority, newest running sequence is preempted: its blocks
are freed (full ones stay in the prefix cache) and it waits, with its original arrival, to be
recomputed. A waiting sequence of strictly better priority may preempt a worse running one,
for memory or for a seat. Starvation of low-priority work is bounded only by the arrival of
higher-priority work: a steady stream of priority-0 requests can keep priority-1 ones waiting.
"""

from __future__ import annotations

import bisect
import heapq
import logging
import time
from collections.abc import Hashable
from dataclasses import dataclass, field

from pagedserve.engine.core.ngram import TokenBuffer, propose
from pagedserve.engine.core.sequence import Sequence, SequenceStatus
from pagedserve.errors import QueueFull
from pagedserve.kv.block_manager import BlockManager

logger = logging.getLogger(__name__)


def speculable(seq: Sequence) -> bool:
    """Whether a sequence's drafts can be verified by the acceptance rule (engine/core/spec_decode.py):
    not with a grammar (the matcher would have to accept and roll back drafts), logprobs or
    prompt logprobs (they report per-token distributions the rule does not compute), or n > 1
    (its completions fork from one prompt). Such sequences decode one token a step, in the
    same batch as speculated ones."""
    p = seq.request.params
    return seq.grammar is None and p.structured_outputs is None and p.logprobs is None \
        and p.prompt_logprobs is None and p.n == 1


@dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    max_waiting: int | None = None
    reserve_max_model_len: bool = False  # worst-case reservation: the naive server
    kv_cache_dtype: str = "auto"
    # Blocks kept free when admitting new work, so running sequences can grow a few steps
    # before anyone must be preempted (avoids admitting a request only to evict it next step).
    watermark_fraction: float = 0.01
    # Speculative decoding (n-gram prompt lookup): most drafts per decoding sequence per step
    # (0 = off) and the n-gram lengths matched.
    num_speculative_tokens: int = 0
    ngram_max: int = 4
    ngram_min: int = 1
    # Priority prefill first (module docstring): a step with a prompt chunk leaves out work of worse
    # priority, for at most this many steps in a row.
    priority_prefill_first: bool = True
    priority_prefill_max_pause: int = 8


@dataclass
class SchedulerOutput:
    """This step's plan: sequences in batch order and how many new tokens each computes."""

    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst) blocks
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    """Owns the waiting heap and the running list; asks the BlockManager for pages, never touches tensors."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: list[Sequence] = []  # heap by sort_key
        self.running: list[Sequence] = []  # sorted by sort_key: the worst is last
        self.num_preemptions = 0
        # Consecutive steps that held worse-priority work back for a better prompt (bounded by
        # config.priority_prefill_max_pause).
        self.consecutive_pauses = 0
        # Worst-case reservation never grows a table after admission, so it needs no headroom.
        self.watermark_blocks = 0 if config.reserve_max_model_len else int(
            block_manager.num_blocks * config.watermark_fraction)

    # ---- queue management ----------------------------------------------------------------
    def check_room(self, elsewhere: int = 0) -> None:
        """Raise QueueFull if one more waiting request (besides ``elsewhere`` held outside the
        queue, e.g. compiling a grammar) would pass ``max_waiting``."""
        waiting = len(self.waiting) + elsewhere
        if self.config.max_waiting is not None and waiting >= self.config.max_waiting:
            raise QueueFull(f"the waiting queue is full ({waiting} requests); retry later", retry_after_s=1.0)

    def add(self, seq: Sequence, check: bool = True) -> None:
        if check:
            self.check_room()
        heapq.heappush(self.waiting, seq)

    def add_running(self, seq: Sequence) -> None:
        """Insert a sequence that already holds blocks (a forked n > 1 child)."""
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, seq, key=lambda s: s.sort_key)

    def finish(self, seq: Sequence) -> None:
        """Release a finished or aborted sequence from whichever queue holds it."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
            heapq.heapify(self.waiting)
        seq.status = SequenceStatus.FINISHED
        seq.draft_token_ids = []
        self.block_manager.free(seq.seq_id)

    @property
    def seats_in_use(self) -> int:
        """Running sequences plus the seats an n > 1 request holds for the completions it forks
        after its prompt (they join the batch without another admission, so they are counted now)."""
        return len(self.running) + sum(s.request.params.n - 1 for s in self.running if not s.request.forked)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def _extra_key(self, seq: Sequence) -> Hashable:
        return (self.config.kv_cache_dtype, seq.request.cache_salt)

    def _target_tokens(self, seq: Sequence, num_new: int) -> int:
        target = seq.num_computed_tokens + num_new
        return max(target, self.config.max_model_len) if self.config.reserve_max_model_len else target

    # ---- the step plan -------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        # A request's first scheduling is stamped with the time this plan started, as vLLM V1
        # does: its queue time ends when the step that admits it begins planning, so planning
        # the running batch first is not counted as waiting.
        now = time.monotonic()
        out = SchedulerOutput()
        planned: dict[Sequence, int] = {}

        # 1. Running sequences: decodes first, then prompt chunks, each in priority order. With a
        # better-priority prompt to compute, only work of that priority or better joins the step.
        decoding = [s for s in self.running if s.num_tokens - s.num_computed_tokens == 1]
        chunking = [s for s in self.running if s.num_tokens - s.num_computed_tokens > 1]
        floor = self._prefill_floor(chunking)
        # Running work is held back only when some of it is worse than the floor; otherwise the plan
        # is the plain rule's, draft order included.
        held_running = [s for s in self.running if s.priority > floor] if floor is not None else []
        if held_running:
            decoding = [s for s in decoding if s.priority <= floor]
            chunking = [s for s in chunking if s.priority <= floor]
        budget = self._plan_running(decoding + chunking, planned, out, self.config.max_num_batched_tokens)
        # Drafts come after every running sequence has its blocks, so they never cause a preemption.
        # In a step held for a better prompt they come after admission, so they cannot take the
        # budget that prompt needs.
        if not held_running:
            budget = self._plan_all_drafts(decoding, planned, budget)

        # 2. Waiting sequences, best (priority, arrival) first.
        budget, held_waiting = self._admit_waiting(planned, out, budget, floor, now)
        if held_running:
            budget = self._plan_all_drafts(decoding, planned, budget)
        self._count_pause(floor, held_running, held_waiting)

        # Batch order: the order sequences were planned in (decodes first).
        out.scheduled = [(s, n) for s, n in planned.items() if s.status is SequenceStatus.RUNNING]
        out.copies = self.block_manager.take_pending_copies()
        return out

    def _plan_running(self, seqs: list[Sequence], planned: dict[Sequence, int], out: SchedulerOutput,
                      budget: int) -> int:
        """Give running sequences their next tokens' blocks, in order, preempting the worst
        running ones while the KV cache is full; returns the token budget left."""
        bm = self.block_manager
        for seq in seqs:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not bm.allocate(seq.seq_id, self._target_tokens(seq, num_new),
                                  num_computed_tokens=seq.num_computed_tokens):
                victim = self.running[-1]
                budget += planned.pop(victim, 0)
                self._preempt(victim, "because the KV cache is full")
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                planned[seq] = num_new
                budget -= num_new
        return budget

    def _admit_waiting(self, planned: dict[Sequence, int], out: SchedulerOutput, budget: int,
                       floor: int | None, now: float) -> tuple[int, bool]:
        """Admit waiting sequences, best (priority, arrival) first, while seats, blocks and budget
        last. A step that had to preempt for memory admits only work of strictly better priority
        than what it preempted. Returns the budget left and whether the floor held one back."""
        bm = self.block_manager
        held_waiting = False
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if out.preempted and seq.priority >= min(p.priority for p in out.preempted):
                break
            if floor is not None and seq.priority > floor:
                held_waiting = True
                break
            seats = seq.request.params.n if not seq.request.forked else 1
            if self.seats_in_use + seats <= self.config.max_num_seqs:
                # Prompt logprobs need every prompt position's logits: cached blocks have none (as in vLLM,
                # such a request skips the prefix cache; it still fills it for others).
                wants_prompt_logits = seq.request.prompt_logprobs is not None and \
                    len(seq.request.prompt_logprobs) < seq.num_prompt_tokens
                hits = [] if wants_prompt_logits else bm.find_cached_prefix(seq.token_ids, self._extra_key(seq))
                num_cached = len(hits) * bm.block_size
                num_new = min(seq.num_tokens - num_cached, budget)
                seq.num_computed_tokens = num_cached
                reserve = self.watermark_blocks if self.running else 0
                if bm.allocate(seq.seq_id, self._target_tokens(seq, num_new), hits,
                               num_computed_tokens=num_cached, reserve=reserve):
                    heapq.heappop(self.waiting)
                    bm.record_prefix_lookup(seq.num_tokens, num_cached)
                    if seq.request.metrics.first_scheduled_time is None:
                        seq.request.metrics.first_scheduled_time = now
                        seq.request.num_cached_tokens = num_cached
                    self.add_running(seq)
                    planned[seq] = num_new
                    budget -= num_new
                    continue
                seq.num_computed_tokens = 0
            # No seat, or no blocks for it: room only by preempting worse work, else admission stops.
            if not self._preempt_worse_than(seq, planned, out):
                break
            budget = self.config.max_num_batched_tokens - sum(planned.values())
        return budget, held_waiting

    def _prefill_floor(self, chunking: list[Sequence]) -> int | None:
        """The worst priority this step may carry so that its best prompt runs without worse work
        beside it (priority prefill first), or None for the plain rule: off, no prompt to compute,
        or worse work already held back ``priority_prefill_max_pause`` steps in a row."""
        cfg = self.config
        if not cfg.priority_prefill_first:
            return None
        prompts = [s.priority for s in chunking + self.waiting[:1]]  # the waiting heap's head is its best
        if not prompts:
            return None
        if self.consecutive_pauses >= cfg.priority_prefill_max_pause:
            logger.debug("priority prefill first: worse-priority work waited %d steps in a row; this step "
                         "batches everyone", self.consecutive_pauses)
            return None  # (the count restarts: this step holds nothing back)
        return min(prompts)

    def _count_pause(self, floor: int | None, held_running: list[Sequence], held_waiting: bool) -> None:
        """Count a step that held worse work back (running sequences left out, or waiting ones not
        admitted) toward the bound; a step that held nothing back resets the count."""
        held_running = [s for s in held_running if s.status is SequenceStatus.RUNNING]  # some preempted since
        if not held_running and not held_waiting:
            self.consecutive_pauses = 0
            return
        self.consecutive_pauses += 1
        logger.debug("priority prefill first: a priority-%d prompt runs without worse work; %d running "
                     "sequences of worse priority sit this step out%s (%d steps in a row)", floor,
                     len(held_running), " and worse waiting ones are not admitted" if held_waiting else "",
                     self.consecutive_pauses)

    def _plan_all_drafts(self, decoding: list[Sequence], planned: dict[Sequence, int], budget: int) -> int:
        """Plan drafts for this step's decodes (speculative decoding on); returns the budget left."""
        if not self.config.num_speculative_tokens:
            return budget
        for seq in decoding:
            if budget <= 0:
                break
            if seq.status is SequenceStatus.RUNNING and planned.get(seq) == 1:
                num_drafts = self._plan_drafts(seq, budget)
                planned[seq] += num_drafts
                budget -= num_drafts
        return budget

    def _plan_drafts(self, seq: Sequence, budget: int) -> int:
        """Propose drafts for a decoding sequence and make room for them; returns how many.

        Drafts only use room that is free: their slots come from blocks the pool has beyond the
        admission watermark (no preemption), else the sequence drafts into the slots its table
        already has, or none. They never pass ``max_tokens`` or ``max_model_len``: the step
        gains at most ``len(drafts) + 1`` tokens.
        """
        seq.draft_token_ids = []
        p = seq.request.params
        if not speculable(seq):
            return 0
        room = min(self.config.num_speculative_tokens, budget,
                   p.max_tokens - seq.num_output_tokens - 1,
                   self.config.max_model_len - seq.num_tokens - 1)
        if room <= 0:
            return 0
        if seq.token_buffer is None:
            seq.token_buffer = TokenBuffer()
        drafts = propose(seq.token_buffer.sync(seq.token_ids), room, self.config.ngram_max, self.config.ngram_min)
        if not drafts:
            return 0
        bm = self.block_manager
        if not bm.allocate(seq.seq_id, self._target_tokens(seq, 1 + len(drafts)),
                           num_computed_tokens=seq.num_computed_tokens, reserve=self.watermark_blocks):
            # No block to spare: draft only into the slots the table already has.
            slots = len(bm.tables[seq.seq_id]) * bm.block_size - seq.num_computed_tokens - 1
            drafts = drafts[:max(0, slots)]
        seq.draft_token_ids = drafts
        return len(drafts)

    def accept_drafts(self, seq: Sequence, num_accepted: int) -> None:
        """After verification: the last token and ``num_accepted`` drafts have valid KV; the rest
        are rolled back. Blocks past the sequence's tokens are freed, and only full blocks of
        accepted tokens enter the prefix cache (a block with a rejected draft's KV is never hashed)."""
        seq.draft_token_ids = []
        seq.num_computed_tokens += num_accepted
        bm = self.block_manager
        bm.cache_full_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens, self._extra_key(seq))
        bm.truncate(seq.seq_id, self._target_tokens(seq, seq.num_tokens - seq.num_computed_tokens))

    def _preempt_worse_than(self, seq: Sequence, planned: dict[Sequence, int], out: SchedulerOutput) -> bool:
        """Preempt the worst running sequence if its priority is strictly worse than ``seq``'s (unlike a
        preemption for memory, this one does not stop admission for the step)."""
        if not self.running or self.running[-1].priority <= seq.priority:
            return False
        victim = self.running[-1]
        planned.pop(victim, None)
        self._preempt(victim, f"for higher-priority request {seq.request.request_id}")
        return True

    def _preempt(self, victim: Sequence, reason: str) -> None:
        """Free the victim's blocks and put it back in the waiting heap (original arrival kept)."""
        self.running.remove(victim)
        victim.draft_token_ids = []
        lost = victim.num_computed_tokens
        self.block_manager.free(victim.seq_id)
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        victim.status = SequenceStatus.WAITING
        self.num_preemptions += 1
        heapq.heappush(self.waiting, victim)
        logger.info("preempted request %s (completion %d, priority %d) %s: dropped %d computed tokens "
                    "to recompute later", victim.request.request_id, victim.index, victim.priority,
                    reason, lost)

    # ---- after the model ran -------------------------------------------------------------
    def update_after_step(self, out: SchedulerOutput) -> None:
        """Advance ``num_computed_tokens`` and register newly full blocks in the prefix cache.

        A sequence with drafts advances by its last token only: which drafts hold valid KV is
        known after verification (:meth:`accept_drafts`)."""
        for seq, num_new in out.scheduled:
            seq.num_computed_tokens += num_new - len(seq.draft_token_ids)
            self.block_manager.cache_full_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens,
                                                 self._extra_key(seq))
