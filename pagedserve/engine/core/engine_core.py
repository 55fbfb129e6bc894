"""EngineCore: token ids in, token ids out. One step = schedule → run the model → sample.

Three parts, three modules: :mod:`~pagedserve.engine.core.builder` builds what the core steps (the
model, the KV pool, the block manager, scheduler and runner); this module holds the requests and
runs the step (schedule, execute, fault isolation); :mod:`~pagedserve.engine.core.assembly` samples
the logits, appends tokens, decides finishes and assembles the outputs. It never sees text: whoever
holds the tokenizer (a front end) turns the new token ids into text and applies stop strings.

A request's fault is that request's alone: when a step raises, the core runs the step's
requests one at a time to find which one raised, fails only that one (its blocks are freed and
its output carries the error), and the rest of the batch goes on as if nothing happened.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import Iterable

import torch

from pagedserve.config import EngineConfig
from pagedserve.engine.core.builder import CoreParts, build_core
from pagedserve.engine.core.assembly import OutputAssembler
from pagedserve.engine.outputs import EngineStats, TokenLogprob
from pagedserve.engine.core.runner import ModelInput
from pagedserve.engine.core.sampler import token_logprobs
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.core.scheduler import SchedulerOutput
from pagedserve.engine.core.sequence import Request, Sequence
from pagedserve.engine.wire import CoreOutput
from pagedserve.errors import DuplicateRequestId, InvalidRequest, RequestTooLong

logger = logging.getLogger(__name__)


class EngineCore(CoreParts):
    """A paged-KV, continuously batched inference engine for one model, on token ids. Not thread-safe.

    Its parts (:class:`~pagedserve.engine.core.builder.CoreParts`: config, model facts, block manager,
    scheduler, runner, ...) are built by :func:`~pagedserve.engine.core.builder.build_core`."""

    def __init__(self, config: EngineConfig):
        super().__init__(**vars(build_core(config)))
        self.assembler = OutputAssembler(self.config, self.scheduler, self.grammars, self.eos_token_ids, self.device,
                                         self._fault_point)
        self.requests: dict[str, Request] = {}
        # Structured-output requests whose grammar is still compiling (on the compiler's thread):
        # they join the scheduler's waiting queue once it is ready.
        self.compiling: dict[str, tuple[Sequence, concurrent.futures.Future]] = {}
        self.num_failed_requests = 0
        self.num_ended_requests = 0  # requests that left: finished, failed or aborted (for rates)
        self.log_interval_s = 10.0  # how often step() logs throughput, queue and KV figures
        self._last_log, self._tokens_since_log = time.monotonic(), 0

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    priority: int = 0, cache_salt: str | None = None, arrival_time: float | None = None) -> None:
        """Queue a tokenized request that passed the front end's check (engine/frontend/request_check.py);
        the core asserts that, and refuses only what depends on its own state.

        ``arrival_time`` (``time.monotonic``) is when the server received it, if earlier than now:
        TTFT and end-to-end time count from there; queue time counts from now."""
        if request_id in self.requests:  # another front end's request may hold the id
            raise DuplicateRequestId(f"request id {request_id!r} is already in use", param="request_id")
        token_ids = list(prompt_token_ids)
        cfg = self.config
        assert token_ids and 0 <= min(token_ids) and max(token_ids) < self.arch.vocab_size, "unchecked prompt"
        assert params.n <= cfg.max_num_seqs and len(token_ids) < cfg.max_model_len, "unchecked request"
        assert params.max_tokens is None or len(token_ids) + params.max_tokens <= cfg.max_model_len
        max_tokens = params.max_tokens or cfg.max_model_len - len(token_ids)
        final_len = cfg.max_model_len if cfg.kv_reservation == "max" else len(token_ids) + max_tokens
        if self.block_manager.num_blocks_for(final_len) > self.kv.num_blocks:
            raise RequestTooLong(f"the request needs {final_len} tokens of KV cache but the whole pool holds "
                                 f"{self.kv.num_blocks * cfg.block_size}; lower max_tokens", param="max_tokens")
        params = dataclasses.replace(params, max_tokens=max_tokens)  # a copy: the caller's stays as it was
        req = Request(request_id, token_ids, params, priority, time.monotonic(), cache_salt)
        if arrival_time is not None:
            req.metrics.arrival_time = min(arrival_time, req.arrival_time)
        seq = self.assembler.new_sequence(req, 0, list(token_ids))
        if params.structured_outputs is None:
            self.scheduler.add(seq)  # may raise QueueFull before anything is recorded
        else:
            self.scheduler.check_room(len(self.compiling))  # QueueFull, counting those compiling
            self.compiling[request_id] = (seq, self.grammars.compile(params.structured_outputs))
        req.seqs.append(seq)
        self.requests[request_id] = req

    def abort(self, request_id: str, index: int | None = None) -> bool:
        """Drop a request (or, with ``index``, one of its completions) now, freeing its blocks.

        False if it is unknown or already done. A request whose last completion is dropped is gone.
        """
        req = self.requests.get(request_id)
        if req is not None and self._end(req, index):
            logger.debug("aborted request %s", request_id)
        return req is not None

    def _end(self, req: Request, index: int | None = None) -> bool:
        """Finish the request's unfinished completions (``index``: that one); True if the request is gone."""
        for seq in req.seqs:
            if not seq.is_finished and (index is None or seq.index == index):
                self.scheduler.finish(seq)
        if index is None or all(s.is_finished for s in req.seqs):  # (an unforked n > 1 has one seq)
            del self.requests[req.request_id]
            self.num_ended_requests += 1
            self.compiling.pop(req.request_id, None)
            return True
        return False

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> list[CoreOutput]:
        """Run one scheduled batch and return the outputs due (``stream_interval``: the assembler's) of
        the requests it advanced; a step may return none."""
        failed: dict[str, str] = {}
        self._admit_compiled(failed)
        plan = self.scheduler.schedule()
        if not plan.scheduled:
            if self.compiling and not failed:
                # Nothing else to run: wait (briefly, so aborts and new requests are seen) for a grammar.
                concurrent.futures.wait([f for _, f in self.compiling.values()], timeout=0.005,
                                        return_when=concurrent.futures.FIRST_COMPLETED)
            return [self._fail(rid, msg) for rid, msg in failed.items()]
        if plan.copies:
            self.runner.copy_blocks(plan.copies)
        try:
            sampled, logits = self._execute(plan)
        except Exception as exc:  # someone in this batch broke it: find who, run the rest
            logger.warning("a step of %d sequences raised (%s: %s); running its requests one at a time to "
                           "find the one that fails", len(plan.scheduled), type(exc).__name__, exc)
            sampled, logits = self._execute_isolated(plan, failed)
        self.scheduler.update_after_step(plan)
        self._tokens_since_log += plan.num_batched_tokens
        now = time.monotonic()
        if now - self._last_log >= self.log_interval_s:
            self._log_stats(now)
        outputs, ended = self.assembler.finish_step(sampled, logits, failed)
        for req in ended:
            self._end(req)
        outputs = [self._fail(rid, msg) for rid, msg in failed.items()] + outputs
        self.publish_kv_events()
        return outputs

    def publish_kv_events(self) -> None:
        """Send what the prefix cache gained and lost since the last call, as one batch (the step
        calls it; so may whoever resets the cache between steps). A no-op with events off."""
        if self.kv_event_publisher is not None and (events := self.kv_event_log.take()):  # (built with the log)
            self.kv_event_publisher.publish(events)

    def close(self) -> None:
        """Release what outlives a step: the KV event publisher's thread and sockets."""
        if self.kv_event_publisher is not None:
            self.publish_kv_events()
            self.kv_event_publisher.shutdown()
            self.kv_event_publisher = None

    def _admit_compiled(self, failed: dict[str, str]) -> None:
        """Move the requests whose grammar has compiled into the waiting queue (or fail them)."""
        for request_id, (seq, future) in list(self.compiling.items()):
            if not future.done():
                continue
            del self.compiling[request_id]
            try:
                seq.request.compiled_grammar = future.result()
            except Exception as exc:
                failed[request_id] = str(exc) if isinstance(exc, InvalidRequest) else f"{type(exc).__name__}: {exc}"
                continue
            seq.grammar = self.grammars.matcher(seq.request.compiled_grammar)
            self.scheduler.add(seq, check=False)

    def _execute(self, plan: SchedulerOutput) -> tuple[list[Sequence], torch.Tensor]:
        self._fault_point("execute", (s for s, _ in plan.scheduled))
        model_input = self.runner.prepare(plan)
        seqs = model_input.sampled_seqs  # (the per-sequence check only where the head can use its answer)
        argmax_only = self.runner.screens_head(len(seqs)) and self.assembler.argmax_suffices(seqs)
        logits = self.runner.execute(model_input, argmax_only)
        if model_input.prompt_spans:
            self._collect_prompt_logprobs(model_input)
        return model_input.sampled_seqs, logits

    def _collect_prompt_logprobs(self, model_input: ModelInput, rows_per_pass: int = 256) -> None:
        """Prompt logprobs of the step's prompt chunks that asked for them (appended only once all are
        computed, so a step that raises and is re-run request by request adds nothing twice)."""
        assert model_input.prompt_spans is not None
        done = 0
        pending: list[tuple[Request, list[TokenLogprob]]] = []
        for seq, first, count in model_input.prompt_spans:
            k = seq.request.params.prompt_logprobs or 0
            lps: list[TokenLogprob] = []
            for off in range(0, count, rows_per_pass):
                m = min(rows_per_pass, count - off)
                logits = self.runner.prompt_logits(model_input, done + off, m)
                pos = first + off
                targets = torch.tensor(seq.token_ids[pos + 1:pos + 1 + m], dtype=torch.long, device=logits.device)
                lps += token_logprobs(logits, targets, k)
            pending.append((seq.request, lps))
            done += count
        for req, lps in pending:
            assert req.prompt_logprobs is not None
            req.prompt_logprobs.extend(lps)

    def _execute_isolated(self, plan: SchedulerOutput, failed: dict[str, str]) -> tuple[list[Sequence], torch.Tensor]:
        """Run each request of a failed plan on its own; the ones that still raise are failed (their
        sequences taken out of the plan), the others' logits are returned as the batch would have."""
        by_request: dict[str, list[tuple[Sequence, int]]] = {}
        for seq, n in plan.scheduled:
            by_request.setdefault(seq.request.request_id, []).append((seq, n))
        sampled: list[Sequence] = []
        rows: list[torch.Tensor] = []
        for request_id, part in by_request.items():
            try:
                seqs, logits = self._execute(SchedulerOutput(scheduled=part))
            except Exception as exc:
                failed[request_id] = f"{type(exc).__name__}: {exc}"
                continue
            sampled += seqs
            rows.append(logits)
        plan.scheduled = [(s, n) for s, n in plan.scheduled if s.request.request_id not in failed]
        logits = torch.cat(rows) if rows else torch.empty(0, self.arch.vocab_size)
        return sampled, logits

    def _fault_point(self, stage: str, seqs: Iterable[Sequence]) -> None:
        """Where a step's stage (``execute``: the model; ``sample``: sampling and verification) may
        raise for a request in ``seqs``, as a kernel or sampler bug would (or take longer, as a slow
        model would). Does nothing here: it is the fault-isolation tests' seam (tests/helpers/faults.py
        overrides it in a subclass, run in the core process through
        ``spawn_core_process(core_factory=...)``)."""

    def _fail(self, request_id: str, message: str) -> CoreOutput:
        """End a request whose processing raised: free its blocks, report the error to its owner."""
        req = self.requests[request_id]
        self._end(req)
        self.num_failed_requests += 1
        req.metrics.finished_time = time.monotonic()
        logger.error("request %s failed and was ended alone (the rest of its batch goes on): %s", request_id, message)
        return CoreOutput(request_id, [], True, req.num_cached_tokens, req.metrics, error=message)

    def _log_stats(self, now: float) -> None:
        st = self.stats()
        logger.info("%.0f tokens/s computed; running %d, waiting %d; KV blocks %d/%d used (%d cached free), "
                    "utilization %.2f; prefix-cache hit rate %.1f%%; %d preemptions so far",
                    self._tokens_since_log / (now - self._last_log), st.num_running, st.num_waiting,
                    st.kv_blocks_used, st.kv_blocks_total, st.kv_blocks_cached_free, st.kv_utilization,
                    100 * st.prefix_hit_rate, st.num_preemptions)
        if st.spec_num_draft_tokens:
            logger.info("speculative decoding: %d of %d draft tokens accepted (%.1f%%) over %d drafts",
                        st.spec_num_accepted_tokens, st.spec_num_draft_tokens, 100 * st.spec_acceptance_rate,
                        st.spec_num_drafts)
        self._last_log, self._tokens_since_log = now, 0

    # ---- reporting -----------------------------------------------------------------------
    def stats(self) -> EngineStats:
        bm, sched, bs, out = self.block_manager, self.scheduler, self.config.block_size, self.assembler
        in_use = bm.tokens_in_use((seq.seq_id, seq.num_computed_tokens) for seq in sched.running)
        return EngineStats(
            num_running=len(sched.running), num_waiting=len(sched.waiting) + len(self.compiling),
            max_num_seqs=self.config.max_num_seqs, max_model_len=self.config.max_model_len, block_size=bs,
            kv_blocks_total=bm.num_blocks, kv_blocks_used=bm.num_used_blocks,
            kv_blocks_cached_free=bm.num_cached_free_blocks, kv_tokens_in_use=in_use,
            kv_slots_allocated=bm.num_used_blocks * bs,
            naive_reserved_tokens=len(sched.running) * self.config.max_model_len,
            prefix_queried_tokens=bm.prefix_queried_tokens, prefix_hit_tokens=bm.prefix_hit_tokens,
            num_preemptions=sched.num_preemptions, kv_bytes_per_token=self.kv.bytes_per_token,
            generation_tokens=out.num_generated_tokens, failed_requests=self.num_failed_requests,
            spec_num_drafts=out.spec_num_drafts, spec_num_draft_tokens=out.spec_num_draft_tokens,
            spec_num_accepted_tokens=out.spec_num_accepted_tokens,
            ended_requests=self.num_ended_requests)
