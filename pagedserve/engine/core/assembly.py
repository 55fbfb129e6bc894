"""After the model: sample the step's logits, append the tokens, decide what finished, and
assemble each advanced request's :class:`~pagedserve.engine.wire.CoreOutput` (its new tokens
since the last output, under ``stream_interval``).
A fault while sampling or verifying drafts is retried row by row, so only the requests whose own
rows raise are failed (``failed``: request id → message, shared with the core's step).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Iterable

import torch

from pagedserve.config import EngineConfig
from pagedserve.engine.outputs import TokenLogprob
from pagedserve.engine.core.sampler import SampleResult, SamplingRow, sample
from pagedserve.engine.core.scheduler import Scheduler
from pagedserve.engine.core.sequence import Request, Sequence
from pagedserve.engine.core.spec_decode import verify
from pagedserve.engine.core.structured import GrammarCompiler
from pagedserve.engine.wire import CoreOutput, SeqDelta

logger = logging.getLogger(__name__)

FaultPoint = Callable[[str, Iterable[Sequence]], None]


class OutputAssembler:
    """Sampling, token appends, stop conditions and output deltas for one engine core."""

    def __init__(self, config: EngineConfig, scheduler: Scheduler, grammars: GrammarCompiler,
                 eos_token_ids: set[int], device: torch.device, fault_point: FaultPoint):
        self.config = config
        self.scheduler = scheduler
        self.grammars = grammars
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.fault_point = fault_point  # the core's (tests/helpers/faults.py overrides it)
        self.generator = torch.Generator(device=device).manual_seed(config.seed)
        self.num_generated_tokens = 0  # every sampled token since start, for the generation-token counter
        self.spec_num_drafts = self.spec_num_draft_tokens = self.spec_num_accepted_tokens = 0

    def new_sequence(self, req: Request, index: int, token_ids: list[int]) -> Sequence:
        """Completion ``index`` of ``req``: its own generator (a seeded request), grammar matcher and logprobs."""
        seed = req.params.seed
        gen = None if seed is None else torch.Generator(device=self.device).manual_seed(seed + index)
        seq = Sequence(req, index, token_ids, len(req.prompt_token_ids), generator=gen)
        if req.compiled_grammar is not None:
            seq.grammar = self.grammars.matcher(req.compiled_grammar)
        if req.params.logprobs is not None:
            seq.logprobs = []
            seq.cumulative_logprob = 0.0
        return seq

    def finish_step(self, sampled: list[Sequence], logits: torch.Tensor,
                    failed: dict[str, str]) -> tuple[list[CoreOutput], list[Request]]:
        """Sample, append and assemble: the outputs due this step, and the requests that ended."""
        spec_tokens: dict[Sequence, list[int]] = {}
        # Only an engine that speculates looks for drafts: the plain step skips the scan of its batch.
        if self.scheduler.config.num_speculative_tokens and any(s.draft_token_ids for s in sampled):
            sampled, logits, spec_tokens = self._verify_drafts(sampled, logits, failed)
        targets, rows, logits, raw = self._rows(sampled, logits)
        result = self._sample(logits, rows, targets, failed, raw) if rows else SampleResult([], [])
        self._fork_branches(targets, failed)
        touched = self._append_all(targets, result, spec_tokens, failed)
        return self._assemble(touched.values())

    def _rows(self, sampled: list[Sequence], logits: torch.Tensor
              ) -> tuple[list[Sequence], list[SamplingRow], torch.Tensor, torch.Tensor]:
        """One sampling row per sequence; a prompt of an n > 1 request that just finished prefill
        samples n rows (its new branches) from one logits row. Returns the rows' sequences, the
        rows, the logits to sample (a grammar's mask applied) and the raw logits (for logprobs)."""
        targets: list[Sequence] = []
        row_index: list[int] = []  # each target's logits row
        for i, seq in enumerate(sampled):
            req = seq.request
            branch = [seq]
            if req.params.n > 1 and not req.forked:
                branch += [self.new_sequence(req, k, list(seq.token_ids)) for k in range(1, req.params.n)]
            targets += branch
            row_index += [i] * len(branch)
        rows = [self._sampling_row(s) for s in targets]
        if len(row_index) != logits.shape[0]:
            logits = logits[torch.tensor(row_index, dtype=torch.long, device=logits.device)]
        raw = logits
        constrained = [i for i, s in enumerate(targets) if s.grammar is not None]
        if constrained:  # one bitmask for the batch, applied in one call; logprobs stay the model's
            logits = logits.clone()
            self.grammars.apply_masks(logits, [targets[i].grammar for i in constrained], constrained)
        return targets, rows, logits, raw

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow], targets: list[Sequence],
                failed: dict[str, str], raw: torch.Tensor) -> SampleResult:
        """Sample every row at once; if that raises, row by row, failing the requests whose rows raise."""
        native = self.config.native_kernels
        with contextlib.suppress(Exception):  # and if it raises, row by row below
            self.fault_point("sample", targets)
            return sample(logits, rows, self.generator, raw, native)
        result = SampleResult([-1] * len(rows), [None] * len(rows))  # -1, None: a failed request's rows
        for i, (row, seq) in enumerate(zip(rows, targets)):
            request_id = seq.request.request_id
            if request_id in failed:
                continue
            try:
                self.fault_point("sample", [seq])
                one = sample(logits[i:i + 1], [row], self.generator, raw[i:i + 1], native)
                result.token_ids[i], result.logprobs[i] = one.token_ids[0], one.logprobs[0]
            except Exception as exc:
                failed[request_id] = f"{type(exc).__name__}: {exc}"
        return result

    def _fork_branches(self, targets: list[Sequence], failed: dict[str, str]) -> None:
        """Fork the new n > 1 branches before any token is appended (a parent may finish at once)."""
        for seq in targets:
            req = seq.request
            if seq.index > 0 and not req.forked and req.request_id not in failed:
                parent = req.seqs[0]
                seq.num_computed_tokens = parent.num_computed_tokens
                self.scheduler.block_manager.fork(parent.seq_id, seq.seq_id)
                self.scheduler.add_running(seq)
                req.seqs.append(seq)

    def _append_all(self, targets: list[Sequence], result: SampleResult, spec_tokens: dict[Sequence, list[int]],
                    failed: dict[str, str]) -> dict[str, Request]:
        """Append the sampled tokens and the verified runs; returns the requests they advanced."""
        now = time.monotonic()
        touched: dict[str, Request] = {}

        def advanced(req: Request) -> None:
            touched[req.request_id] = req
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            req.metrics.last_token_time = now

        for seq, token, lp in zip(targets, result.token_ids, result.logprobs):
            if seq.request.request_id not in failed:
                self._append_token(seq, token, lp)
                advanced(seq.request)
        for seq, tokens in spec_tokens.items():
            self._append_accepted(seq, tokens)
            advanced(seq.request)
        for req in touched.values():
            if req.params.n > 1:
                req.forked = True
        return touched

    def _assemble(self, touched: Iterable[Request]) -> tuple[list[CoreOutput], list[Request]]:
        """The outputs due among the advanced requests (``stream_interval``), and those that ended."""
        outputs: list[CoreOutput] = []
        ended: list[Request] = []
        now = time.monotonic()
        floor = self.config.stream_interval
        for req in touched:
            finished = all(s.is_finished for s in req.seqs)
            interval = max(floor, req.params.stream_interval)  # a request may ask for coarser, not finer
            if finished:
                req.metrics.finished_time = now
                ended.append(req)
            elif interval > 1 and not self._output_due(req, interval):
                continue  # held back: the next output's deltas carry these tokens too
            outputs.append(self._request_output(req, finished))
        return outputs, ended

    def _verify_drafts(self, sampled: list[Sequence], logits: torch.Tensor, failed: dict[str, str]
                       ) -> tuple[list[Sequence], torch.Tensor, dict[Sequence, list[int]]]:
        """Split off the sequences that verify drafts (``1 + k`` logits rows each) and run the
        acceptance rule on them (engine/core/spec_decode.py); the rest, one row each, are returned for
        the plain sampler. If verification raises, it is retried per sequence and only the
        requests whose own rows raise are failed."""
        # (sequence, its first logits row), for those that verify drafts and for the plain ones
        firsts = list(zip(sampled, itertools.accumulate((1 + len(s.draft_token_ids) for s in sampled), initial=0)))
        spec = [(s, r) for s, r in firsts if s.draft_token_ids]
        plain = [(s, r) for s, r in firsts if not s.draft_token_ids]

        def rows_of(group: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, list[SamplingRow], list[list[int]]]:
            idx = [r + j for seq, r in group for j in range(1 + len(seq.draft_token_ids))]
            srows = [self._sampling_row(seq, seq.draft_token_ids[:j])
                     for seq, _ in group for j in range(1 + len(seq.draft_token_ids))]
            return logits[torch.tensor(idx, dtype=torch.long, device=logits.device)], srows, \
                [seq.draft_token_ids for seq, _ in group]

        native = self.config.native_kernels
        accepted: dict[Sequence, list[int]] = {}
        group = [(s, r) for s, r in spec if s.request.request_id not in failed]
        try:
            self.fault_point("sample", [s for s, _ in group])
            if group:
                accepted = dict(zip([s for s, _ in group], verify(*rows_of(group), self.generator, native)))
        except Exception:
            for seq, r in group:
                try:
                    self.fault_point("sample", [seq])
                    accepted[seq] = verify(*rows_of([(seq, r)]), self.generator, native)[0]
                except Exception as exc:
                    failed[seq.request.request_id] = f"{type(exc).__name__}: {exc}"
        plain_logits = logits[torch.tensor([r for _, r in plain], dtype=torch.long, device=logits.device)]
        return [s for s, _ in plain], plain_logits, accepted

    def _append_accepted(self, seq: Sequence, tokens: list[int]) -> None:
        """Append a verified run (accepted drafts, then the target's token) until a stop condition
        ends it; then roll the sequence's KV back to what was accepted."""
        num_accepted = len(tokens) - 1
        self.spec_num_drafts += 1
        self.spec_num_draft_tokens += len(seq.draft_token_ids)
        self.spec_num_accepted_tokens += num_accepted
        for token in tokens:
            self._append_token(seq, token, None)
            if seq.is_finished:  # EOS, a stop token, max_tokens, max_model_len: the rest is dropped
                return
        self.scheduler.accept_drafts(seq, num_accepted)

    @staticmethod
    def _output_due(req: Request, interval: int) -> bool:
        """Whether a running request's output goes out this step under ``stream_interval`` > 1: when any
        of its sequences has its first token unsent (TTFT is never delayed), ``interval`` or more tokens
        unsent, or has finished with tokens unsent (an n > 1 choice's finish goes at once)."""
        return any((unsent := seq.num_output_tokens - seq.sent_token_len) > 0
                   and (seq.sent_token_len == 0 or unsent >= interval or seq.is_finished) for seq in req.seqs)

    @staticmethod
    def argmax_suffices(seqs: list[Sequence]) -> bool:
        """Whether a step's logits serve a greedy pick and nothing else: every sampled sequence plain
        greedy (no logprobs, logit bias, penalties, min_tokens ban, grammar, drafts or n > 1 to fork),
        so the model may return logits that keep only their argmax (models/head_screen.py)."""
        for seq in seqs:
            p = seq.request.params
            if (not p.greedy or p.logprobs is not None or p.logit_bias or p.needs_penalties or p.n > 1
                    or seq.grammar is not None or seq.draft_token_ids or seq.num_output_tokens < p.min_tokens):
                return False
        return True

    def _sampling_row(self, seq: Sequence, drafts: list[int] = ()) -> SamplingRow:
        """The sampler's view of ``seq``'s next position, or of the position after ``drafts``
        (a verification row: penalties and min_tokens count the drafts before it as output)."""
        p = seq.request.params
        early = seq.num_output_tokens + len(drafts) < p.min_tokens
        banned = list(self.eos_token_ids | set(p.stop_token_ids)) if early else []
        output = seq.output_token_ids + list(drafts) if drafts else seq.output_token_ids
        return SamplingRow(p, seq.generator, seq.request.prompt_token_ids, output, banned)

    def _append_token(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> None:
        if seq.grammar is not None and not seq.grammar.accept_token(token):
            # The mask left nothing the grammar allows (min_tokens banned its end, say): end here,
            # without the token, rather than emit output the grammar does not match.
            logger.debug("request %s: grammar refused token %d; finishing", seq.request.request_id, token)
            seq.finish_reason, seq.stop_reason = "stop", None
            self.scheduler.finish(seq)
            return
        seq.token_ids.append(token)
        self.num_generated_tokens += 1  # counted here, streamed or not (stream_interval, aborts)
        if seq.logprobs is not None and logprob is not None:
            seq.logprobs.append(logprob)
            seq.cumulative_logprob += logprob.logprob
        p = seq.request.params
        reason: tuple[str, int | None] | None = None
        if seq.grammar is not None and seq.grammar.is_terminated():
            reason = ("stop", token if token in p.stop_token_ids else None)
        elif not p.ignore_eos and token in self.eos_token_ids and seq.num_output_tokens > p.min_tokens - 1:
            reason = ("stop", None)
        elif token in p.stop_token_ids:
            reason = ("stop", token)
        elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.config.max_model_len:
            reason = ("length", None)
        if reason is not None:
            seq.finish_reason, seq.stop_reason = reason
            self.scheduler.finish(seq)

    def _request_output(self, req: Request, finished: bool) -> CoreOutput:
        deltas = []
        for seq in sorted(req.seqs, key=lambda s: s.index):
            new = seq.token_ids[seq.num_prompt_tokens + seq.sent_token_len:]
            if not new and (seq.finish_sent or not seq.is_finished):
                continue  # nothing new for this completion
            seq.finish_sent = seq.is_finished
            lps = None if seq.logprobs is None else seq.logprobs[seq.sent_logprob_len:]
            seq.sent_logprob_len = len(seq.logprobs or ())
            seq.sent_token_len += len(new)
            deltas.append(SeqDelta(seq.index, new, lps, seq.finish_reason, seq.stop_reason,
                                   seq.cumulative_logprob))
        prompt_lps = None if req.prompt_logprobs_sent else req.prompt_logprobs  # once, when computed
        req.prompt_logprobs_sent = req.prompt_logprobs is not None
        return CoreOutput(req.request_id, deltas, finished, req.num_cached_tokens, req.metrics,
                          prompt_logprobs=prompt_lps)
