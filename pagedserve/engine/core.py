"""EngineCore: token ids in, token ids out. One step = schedule → run the model → sample.

The core owns the scheduler, the block manager, the model runner and the sampler. It never sees
text: prompts arrive tokenized, outputs leave as new token ids per completion, and whoever holds
the tokenizer (the in-process :class:`~pagedserve.engine.engine.Engine`, or the server's front
end when the core runs in its own process) turns them into text and applies stop strings.

A request's fault is that request's alone: when a step raises, the core runs the step's
requests one at a time to find which one raised, fails only that one (its blocks are freed and
its output carries the error), and the rest of the batch goes on as if nothing happened.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Iterable
import logging
import os
import time

import torch

from pagedserve.config import EngineConfig
from pagedserve.engine.cuda_graphs import CudaGraphDecoder
from pagedserve.engine.memory import (CUDA_GRAPH_ALLOWANCE, ProfiledKVBudget, choose_auto_kv_budget, kv_budget_cap,
                                      profiled_kv_budget)
from pagedserve.engine.outputs import EngineStats, TokenLogprob
from pagedserve.engine.profile_run import measure_peak_activation, profile_step
from pagedserve.engine.runner import ModelInput, ModelRunner
from pagedserve.engine.sampler import SampleResult, SamplingRow, sample, token_logprobs
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from pagedserve.engine.sequence import Request, Sequence
from pagedserve.engine.spec_decode import verify
from pagedserve.engine.structured import GrammarCompiler
from pagedserve.engine.wire import CoreOutput, ModelFacts, SeqDelta  # noqa: F401  (named here too)
from pagedserve.errors import DuplicateRequestId, InvalidRequest, RequestTooLong
from pagedserve.kernels import cpu_has_native_bf16, kernel_error, native_ops, paged_decode_kernel
from pagedserve.kernels.triton_paged.availability import TRITON_KV_DTYPES, triton_unavailable
from pagedserve.kv.block_manager import BlockManager
from pagedserve.kv.cache import allocate_kv_caches, num_blocks_for_budget
from pagedserve.kv.groups import GroupedBlockManager, kv_groups, layer_slots
from pagedserve.kv.events import KVEventLog
from pagedserve.kv.quant import kv_cache_bytes_per_token, kv_dtype_name
from pagedserve.models.eos import eos_ids_from_files, eos_ids_from_transformers
from pagedserve.models.architectures import architecture_from_hf_config
from pagedserve.models.llama import ModelArchitecture
from pagedserve.models.loader import load_hf_config, load_model, resolve_dtype, resolve_model_dir
from pagedserve.models.quant import weight_bytes

logger = logging.getLogger(__name__)

def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _resolve_attention_backend(name: str, device: torch.device, kv_cache_dtype: str = "auto",
                               native_kernels: bool = True) -> str:
    """``auto`` → on GPU the Triton kernels, or SDPA where Triton is missing or has no kernel for the KV
    dtype (int4); on CPU the fused native decode kernel, or ``matmul`` where it can't be built or
    ``native_kernels`` is off."""
    if name == "triton":
        why = triton_unavailable(device)
        if why is None and kv_cache_dtype not in TRITON_KV_DTYPES:
            why = f"its kernels read {', '.join(TRITON_KV_DTYPES)} KV pools, not {kv_cache_dtype}"
        if why is not None:
            raise ValueError(f"attention_backend 'triton' cannot run here: {why}")
    if name == "auto":
        if device.type == "cuda":
            why = triton_unavailable(device)
            if why is None and kv_cache_dtype not in TRITON_KV_DTYPES:
                why = f"no Triton kernel for {kv_cache_dtype} KV pools"
            name = "triton" if why is None else "sdpa"
            logger.info("attention backend: %s%s", name, "" if why is None else f" ({why})")
            return name
        name = "fused" if native_kernels and paged_decode_kernel() is not None else "matmul"
        why = kernel_error() if native_kernels else "--no-native-kernels"
        logger.info("attention backend: %s%s", name, "" if name == "fused" else f" (fused kernel unavailable: {why})")
    elif name == "fused" and (device.type != "cpu" or not native_kernels or paged_decode_kernel() is None):
        why = "device is not a CPU" if device.type != "cpu" else "--no-native-kernels" if not native_kernels else \
            kernel_error()
        raise ValueError(f"attention_backend 'fused' needs the native CPU kernel, which is unavailable here: {why}")
    return name


def eos_token_ids(tokenizer_dir: str, model_dir: str) -> set[int]:
    """The ids that end a completion: the tokenizer's EOS plus generation_config.json's.

    Read from the files (:mod:`pagedserve.models.eos`: no transformers import at start-up); only
    where they don't settle it (a hub id as the tokenizer, an unnamed EOS token) is transformers'
    tokenizer built to ask."""
    ids = eos_ids_from_files(tokenizer_dir, model_dir)
    return ids if ids is not None else eos_ids_from_transformers(tokenizer_dir, model_dir)


def resolve_config(config: EngineConfig, hf_config, arch: ModelArchitecture, device: torch.device) -> EngineConfig:
    """A copy of ``config`` with every ``None``/``auto`` that the model decides filled in (the
    caller's object is left as it was)."""
    limit = arch.max_position_embeddings
    if arch.sliding_window:  # attention beyond the window is not implemented: cap instead
        limit = min(limit, arch.sliding_window)
    max_model_len = config.max_model_len
    if max_model_len is None:
        max_model_len = limit
    elif max_model_len > limit:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's limit of {limit} tokens")
    batched = config.max_num_batched_tokens or (8192 if device.type == "cuda" else 1024)
    return dataclasses.replace(config, max_model_len=max_model_len, max_num_batched_tokens=batched,
                               attention_backend=_resolve_attention_backend(config.attention_backend, device,
                                                                            config.kv_cache_dtype,
                                                                            config.native_kernels))


class EngineCore:
    """A paged-KV, continuously batched inference engine for one model, on token ids. Not thread-safe."""

    def __init__(self, config: EngineConfig):
        if config.num_threads is not None:
            # Before the weights are prepacked and the kernels run: all of the step uses this count.
            torch.set_num_threads(config.num_threads)
        self.device = resolve_device(config.device)
        model_dir = resolve_model_dir(config.model, config.revision)
        hf_config = load_hf_config(model_dir)
        self.arch = arch = architecture_from_hf_config(hf_config)
        self.dtype, why, kv_model_dtype = resolve_dtype(config.dtype, hf_config, self.device)
        logger.info("compute dtype %s (%s)", str(self.dtype).removeprefix("torch."), why)
        if self.dtype == torch.bfloat16 and self.device.type == "cpu" and not cpu_has_native_bf16():
            logger.warning("computing in bfloat16 on a CPU without AVX-512 BF16 or AMX: torch emulates bf16 "
                           "matmuls here, several times slower than float32; --dtype float32 is faster on this CPU "
                           "(a bf16 checkpoint's linear weights then stay bf16 for decode: --decode-weights)")
        self.config = config = resolve_config(config, hf_config, arch, self.device)
        self.model_name = config.model
        self.model_dir = str(model_dir)
        self.tokenizer_source = str(config.tokenizer or model_dir)
        self.eos_token_ids = eos_token_ids(self.tokenizer_source, self.model_dir)

        t0 = time.monotonic()
        model = load_model(model_dir, hf_config, self.dtype, self.device, config.max_model_len,
                           config.attention_backend, config.quantization, config.decode_weights,
                           config.gguf_activations, config.native_kernels, config.pack_weights, config.group_kernels)
        self.weight_bytes = weight_bytes(model)
        self.kv_dtype = kv_dtype_name(config.kv_cache_dtype, kv_model_dtype)  # e.g. "bfloat16" or "int8"
        # KV groups (kv/groups.py) for a model with sliding-window layers: a block then holds one
        # group's layers, and the pool's bytes per token are that many layers'.
        windows = getattr(arch, "layer_windows", ())
        self.kv_groups = kv_groups(windows) if config.free_window_blocks and any(windows) else None
        pool_layers = len(self.kv_groups[0].layers) if self.kv_groups else arch.num_layers
        self.kv_bytes_per_token = kv_cache_bytes_per_token(pool_layers, arch.num_kv_heads, arch.head_dim,
                                                           config.kv_cache_dtype, kv_model_dtype)
        kv_pool_dtype = kv_model_dtype if config.kv_cache_dtype == "auto" else self.dtype
        use_graphs = self.device.type == "cuda" and config.attention_backend == "triton" and config.cuda_graphs
        auto = None
        if config.kv_cache_memory == "auto" and not config.num_kv_blocks:
            if self.device.type == "cuda":
                auto = self._profiled_kv_budget(model, kv_pool_dtype, use_graphs)
            else:
                auto = choose_auto_kv_budget(arch, config, self.device, self.kv_bytes_per_token)
            logger.info("%s", auto.describe())
            self.config = config = dataclasses.replace(config, kv_cache_memory=auto.budget)
        self.num_kv_blocks = config.num_kv_blocks or num_blocks_for_budget(
            config.kv_cache_memory, config.block_size, self.kv_bytes_per_token)
        if self.num_kv_blocks < 1:
            if auto is not None:
                raise ValueError(f"{auto.describe()}: no KV block of {config.block_size} tokens × "
                                 f"{self.kv_bytes_per_token} B fits; free memory or give --kv-cache-memory")
            raise ValueError(f"a KV budget of {config.kv_cache_memory} bytes holds no block of "
                             f"{config.block_size} tokens × {self.kv_bytes_per_token} B; raise --kv-cache-memory")
        # Tokens of whole-model KV the pool holds (with KV groups a block holds one group's layers:
        # a sequence takes a block per group until its window groups give theirs back).
        pool_tokens = self.num_kv_blocks * config.block_size // (len(self.kv_groups) if self.kv_groups else 1)
        if pool_tokens < config.max_model_len and not self.kv_groups:
            logger.warning("the KV pool holds %d tokens, fewer than max_model_len %d: a request of that length "
                           "can never run (it is refused); raise --kv-cache-memory (%d B/token) or lower "
                           "--max-model-len", pool_tokens, config.max_model_len, self.kv_bytes_per_token)
        kv_caches = allocate_kv_caches(pool_layers, self.num_kv_blocks, config.block_size, arch.num_kv_heads,
                                       arch.head_dim,
                                       # the pools' own dtype for auto; what quantized pools dequantize to
                                       kv_pool_dtype, self.device, config.kv_cache_dtype)
        if self.kv_groups:  # each layer reads the pool slot of its position in its group
            kv_caches = [kv_caches[slot] for _, slot in layer_slots(self.kv_groups)]
        # KV block events for routers (docs/SCALE_OUT.md): off by default, and then nothing is hashed,
        # recorded or sent.
        events = config.kv_events if config.kv_events is not None and config.kv_events.enabled else None
        self.kv_event_log = KVEventLog(config.block_size) if events is not None else None
        if self.kv_groups:
            self.block_manager = GroupedBlockManager(self.num_kv_blocks, config.block_size, self.kv_groups,
                                                     config.enable_prefix_caching, self.kv_event_log,
                                                     config.max_num_batched_tokens)
        else:
            self.block_manager = BlockManager(self.num_kv_blocks, config.block_size, config.enable_prefix_caching,
                                              events=self.kv_event_log)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            max_waiting=config.max_waiting,
            reserve_max_model_len=config.kv_reservation == "max",
            kv_cache_dtype=self.kv_dtype,
            num_speculative_tokens=config.num_speculative_tokens if config.speculative == "ngram" else 0,
            ngram_max=config.ngram_prompt_lookup_max, ngram_min=config.ngram_prompt_lookup_min,
            priority_prefill_first=config.priority_prefill_first,
            priority_prefill_max_pause=config.priority_prefill_max_pause,
        ), self.block_manager)
        decode_graphs = None
        if use_graphs:
            decode_graphs = CudaGraphDecoder(model, kv_caches, config.max_num_seqs, config.max_model_len,
                                             config.block_size, self.device)
            decode_graphs.capture()
        self.runner = ModelRunner(model, kv_caches, self.block_manager, self.device, decode_graphs)
        ops = native_ops() if self.device.type == "cpu" and config.native_kernels else None
        decode_path = (model.enable_native_decode(kv_caches, ops)
                       if config.native_decode else "python (--no-native-decode)")
        logger.info("decode step: %s", decode_path)
        self.requests: dict[str, Request] = {}
        # Structured-output requests whose grammar is still compiling (on the compiler's thread):
        # they join the scheduler's waiting queue once it is ready.
        self.grammars = GrammarCompiler(self.tokenizer_source, arch.vocab_size, sorted(self.eos_token_ids))
        self.compiling: dict[str, tuple[Sequence, concurrent.futures.Future]] = {}
        self.num_generated_tokens = 0  # every sampled token since start, for the generation-token counter
        self.num_failed_requests = 0
        self.spec_num_drafts = self.spec_num_draft_tokens = self.spec_num_accepted_tokens = 0
        self.num_ended_requests = 0  # requests that left: finished, failed or aborted (for rates)
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.log_interval_s = 10.0  # how often step() logs throughput, queue and KV figures
        self._last_log, self._tokens_since_log = time.monotonic(), 0
        self.kv_event_publisher = None
        if events is not None:
            from pagedserve.engine.kv_events import ZmqEventPublisher

            self.kv_event_publisher = ZmqEventPublisher(events)
        logger.info(
            "loaded %s (%s, %s, %d layers, weights %s %.1f MiB) on %s (%d threads) in %.1fs; KV pool (%s): "
            "%d blocks × %d tokens = %d tokens (%.1f MiB at %d B/token), seats %d requests at max_model_len %d "
            "(%s reservation)",
            config.model, arch.model_type, str(self.dtype).removeprefix("torch."), arch.num_layers,
            config.quantization if config.quantization != "none" else "as stored", self.weight_bytes / 2**20,
            self.device, torch.get_num_threads(), time.monotonic() - t0, self.kv_dtype, self.num_kv_blocks,
            config.block_size, pool_tokens,
            self.num_kv_blocks * config.block_size * self.kv_bytes_per_token / 2**20, self.kv_bytes_per_token,
            pool_tokens // config.max_model_len, config.max_model_len, config.kv_reservation)
        if self.kv_groups:
            logger.info("KV groups (kv/groups.py): %s, %d layers each (the B/token above is one group's); a "
                        "sequence of max_model_len %d holds at most %d blocks, %d without window give-backs",
                        ", ".join("full" if g.window is None else f"window {g.window}" for g in self.kv_groups),
                        len(self.kv_groups[0].layers), config.max_model_len,
                        self.block_manager.num_blocks_for(config.max_model_len),
                        len(self.kv_groups) * -(-config.max_model_len // config.block_size))

    def _profiled_kv_budget(self, model, kv_pool_dtype: torch.dtype, use_graphs: bool) -> ProfiledKVBudget:
        """``auto`` on CUDA: the card's memory less what is in use and a profile step's peak (engine/memory.py)."""
        c, arch = self.config, self.arch
        step = profile_step(c.max_num_batched_tokens, c.max_model_len, c.max_num_seqs, c.block_size, self.device)
        peak = measure_peak_activation(model, step, arch.num_kv_heads, arch.head_dim, kv_pool_dtype,
                                       c.kv_cache_dtype, self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        return profiled_kv_budget(total, free, self.weight_bytes, peak, c.kv_cache_memory_fraction,
                                  CUDA_GRAPH_ALLOWANCE if use_graphs else 0,
                                  kv_budget_cap(c, self.kv_bytes_per_token), step.num_tokens)

    def facts(self) -> ModelFacts:
        c = self.config
        return ModelFacts(
            model_name=self.model_name, model_dir=self.model_dir, tokenizer=self.tokenizer_source,
            max_model_len=c.max_model_len, max_num_seqs=c.max_num_seqs, vocab_size=self.arch.vocab_size,
            eos_token_ids=tuple(sorted(self.eos_token_ids)), block_size=c.block_size,
            num_kv_blocks=self.num_kv_blocks, kv_bytes_per_token=self.kv_bytes_per_token, kv_dtype=self.kv_dtype,
            dtype=str(self.dtype).removeprefix("torch."), device=str(self.device),
            attention_backend=c.attention_backend, weight_bytes=self.weight_bytes,
            enable_prefix_caching=c.enable_prefix_caching, num_threads=torch.get_num_threads(),
            threads_pinned=os.environ.get("OMP_PROC_BIND", "false").strip().lower() not in ("false", ""))

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    priority: int = 0, cache_salt: str | None = None, arrival_time: float | None = None) -> None:
        """Queue a tokenized request that passed the front end's check (engine/request_check.py):
        the core asserts what that checked, and refuses only what depends on its own state, with
        a typed error: a duplicate id, a request its KV pool can never hold, a full queue.

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
        if self.block_manager.num_blocks_for(final_len) > self.num_kv_blocks:
            raise RequestTooLong(f"the request needs {final_len} tokens of KV cache but the whole pool holds "
                                 f"{self.num_kv_blocks * cfg.block_size}; lower max_tokens", param="max_tokens")
        params = dataclasses.replace(params, max_tokens=max_tokens)  # a copy: the caller's stays as it was
        req = Request(request_id, token_ids, params, priority, time.monotonic(), cache_salt)
        if arrival_time is not None:
            req.metrics.arrival_time = min(arrival_time, req.arrival_time)
        seq = self._new_sequence(req, 0, list(token_ids))
        if params.structured_outputs is None:
            self.scheduler.add(seq)  # may raise QueueFull before anything is recorded
        else:
            self.scheduler.check_room(len(self.compiling))  # QueueFull, counting those compiling
            self.compiling[request_id] = (seq, self.grammars.compile(params.structured_outputs))
        req.seqs.append(seq)
        self.requests[request_id] = req

    def _new_sequence(self, req: Request, index: int, token_ids: list[int]) -> Sequence:
        gen = None
        if req.params.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(req.params.seed + index)
        seq = Sequence(req, index, token_ids, len(req.prompt_token_ids), generator=gen)
        if req.compiled_grammar is not None:
            seq.grammar = self.grammars.matcher(req.compiled_grammar)
        if req.params.logprobs is not None:
            seq.logprobs = []
            seq.cumulative_logprob = 0.0
        return seq

    def abort(self, request_id: str, index: int | None = None) -> bool:
        """Drop a request (or, with ``index``, one of its completions) now, freeing its blocks.

        False if it is unknown or already done. A request whose last completion is dropped is gone.
        """
        req = self.requests.get(request_id)
        if req is None:
            return False
        for seq in req.seqs:
            if not seq.is_finished and (index is None or seq.index == index):
                self.scheduler.finish(seq)
        if index is None or all(s.is_finished for s in req.seqs):  # (an unforked n > 1 has one seq)
            del self.requests[request_id]
            self.num_ended_requests += 1
            self.compiling.pop(request_id, None)
            logger.debug("aborted request %s", request_id)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_request(self, request_id: str) -> bool:
        """True while the request is in the engine (waiting, compiling or running)."""
        return request_id in self.requests

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> list[CoreOutput]:
        """Run one scheduled batch and return the outputs of every request it advanced.

        With ``stream_interval`` N > 1 (the engine's, or the request's own if coarser) a running
        request's output is returned only when due (its first token, then every N tokens, and its
        finish); skipped steps' tokens arrive in the next output's deltas, so nothing is lost and
        the step may return no output at all.
        """
        failed: dict[str, str] = {}
        if self.compiling:
            self._admit_compiled(failed)
        plan = self.scheduler.schedule()
        if plan.is_empty:
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
        outputs = self._sample_and_finish(sampled, logits, failed)
        outputs = [self._fail(rid, msg) for rid, msg in failed.items()] + outputs
        self.publish_kv_events()
        return outputs

    def publish_kv_events(self) -> None:
        """Send what the prefix cache gained and lost since the last call, as one batch (the step
        calls it; so may whoever resets the cache between steps). A no-op with events off."""
        if self.kv_event_publisher is not None and self.kv_event_log is not None:
            events = self.kv_event_log.take()
            if events:
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
        logits = self.runner.execute(model_input)
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
        raise for a request in ``seqs``, as a kernel or sampler bug would. Does nothing here: it is
        the fault-isolation tests' seam (tests/helpers/faults.py overrides it in a subclass, run in
        the core process through ``spawn_core_process(core_factory=...)``)."""

    def _fail(self, request_id: str, message: str) -> CoreOutput:
        """End a request whose processing raised: free its blocks, report the error to its owner."""
        req = self.requests.pop(request_id)
        self.num_ended_requests += 1
        self.compiling.pop(request_id, None)
        for seq in req.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq)
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

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow], targets: list[Sequence],
                failed: dict[str, str], raw: torch.Tensor) -> SampleResult:
        """Sample every row at once; if that raises, row by row, failing the requests whose rows raise."""
        try:
            self._fault_point("sample", targets)
            return sample(logits, rows, self.generator, raw, self.config.native_kernels)
        except Exception:
            pass
        result = SampleResult([], [])
        for i, (row, seq) in enumerate(zip(rows, targets)):
            request_id = seq.request.request_id
            if request_id in failed:
                token, lp = -1, None
            else:
                try:
                    self._fault_point("sample", [seq])
                    one = sample(logits[i:i + 1], [row], self.generator, raw[i:i + 1], self.config.native_kernels)
                    token, lp = one.token_ids[0], one.logprobs[0]
                except Exception as exc:
                    failed[request_id] = f"{type(exc).__name__}: {exc}"
                    token, lp = -1, None
            result.token_ids.append(token)
            result.logprobs.append(lp)
        return result

    def _sample_and_finish(self, sampled: list[Sequence], logits: torch.Tensor,
                           failed: dict[str, str]) -> list[CoreOutput]:
        spec_tokens: dict[Sequence, list[int]] = {}
        # Only an engine that speculates looks for drafts: the plain step skips the scan of its batch.
        if self.scheduler.config.num_speculative_tokens and any(s.draft_token_ids for s in sampled):
            sampled, logits, spec_tokens = self._verify_drafts(sampled, logits, failed)
        # A prompt of an n > 1 request that just finished prefill samples n rows from one logits row.
        rows: list[SamplingRow] = []
        targets: list[Sequence] = []
        row_index: list[int] = []
        for i, seq in enumerate(sampled):
            req = seq.request
            branch = [seq]
            if req.params.n > 1 and not req.forked:
                branch += [self._new_sequence(req, k, list(seq.token_ids)) for k in range(1, req.params.n)]
            for s in branch:
                rows.append(self._sampling_row(s))
                targets.append(s)
                row_index.append(i)
        if len(row_index) != logits.shape[0]:
            logits = logits[torch.tensor(row_index, dtype=torch.long, device=logits.device)]
        raw = logits
        constrained = [i for i, s in enumerate(targets) if s.grammar is not None]
        if constrained:  # one bitmask for the batch, applied in one call; logprobs stay the model's
            logits = logits.clone()
            self.grammars.apply_masks(logits, [targets[i].grammar for i in constrained], constrained)
        result = self._sample(logits, rows, targets, failed, raw) if rows else SampleResult([], [])

        # Fork the new n > 1 branches before any token is appended (a parent may finish at once).
        for seq in targets:
            req = seq.request
            if seq.index > 0 and not req.forked and req.request_id not in failed:
                parent = req.seqs[0]
                seq.num_computed_tokens = parent.num_computed_tokens
                self.block_manager.fork(parent.seq_id, seq.seq_id)
                self.scheduler.add_running(seq)
                req.seqs.append(seq)
        now = time.monotonic()
        touched: dict[str, Request] = {}
        for seq, token, lp in zip(targets, result.token_ids, result.logprobs):
            req = seq.request
            if req.request_id in failed:
                continue
            self._append_token(seq, token, lp)
            touched[req.request_id] = req
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            req.metrics.last_token_time = now
        for seq, tokens in spec_tokens.items():
            self._append_accepted(seq, tokens)
            req = seq.request
            touched[req.request_id] = req
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            req.metrics.last_token_time = now
        for req in touched.values():
            if req.params.n > 1:
                req.forked = True
        outputs = []
        floor = self.config.stream_interval
        for req in touched.values():
            finished = all(s.is_finished for s in req.seqs)
            interval = max(floor, req.params.stream_interval)  # a request may ask for coarser, not finer
            if finished:
                req.metrics.finished_time = now
                del self.requests[req.request_id]
                self.num_ended_requests += 1
            elif interval > 1 and not self._output_due(req, interval):
                continue  # held back: the next output's deltas carry these tokens too
            outputs.append(self._request_output(req, finished))
        return outputs

    def _verify_drafts(self, sampled: list[Sequence], logits: torch.Tensor, failed: dict[str, str]
                       ) -> tuple[list[Sequence], torch.Tensor, dict[Sequence, list[int]]]:
        """Split off the sequences that verify drafts (``1 + k`` logits rows each) and run the
        acceptance rule on them (engine/spec_decode.py); the rest, one row each, are returned for
        the plain sampler. If verification raises, it is retried per sequence and only the
        requests whose own rows raise are failed."""
        plain_seqs: list[Sequence] = []
        plain_rows: list[int] = []
        spec: list[tuple[Sequence, int]] = []  # (sequence, its first logits row)
        row = 0
        for seq in sampled:
            if seq.draft_token_ids:
                spec.append((seq, row))
                row += 1 + len(seq.draft_token_ids)
            else:
                plain_seqs.append(seq)
                plain_rows.append(row)
                row += 1

        def rows_of(group: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, list[SamplingRow], list[list[int]]]:
            idx = [r + j for seq, r in group for j in range(1 + len(seq.draft_token_ids))]
            srows = [self._sampling_row(seq, seq.draft_token_ids[:j])
                     for seq, _ in group for j in range(1 + len(seq.draft_token_ids))]
            return logits[torch.tensor(idx, dtype=torch.long, device=logits.device)], srows, \
                [seq.draft_token_ids for seq, _ in group]

        accepted: dict[Sequence, list[int]] = {}
        group = [(s, r) for s, r in spec if s.request.request_id not in failed]
        try:
            self._fault_point("sample", [s for s, _ in group])
            if group:
                accepted = dict(zip([s for s, _ in group], verify(*rows_of(group), self.generator, self.config.native_kernels)))
        except Exception:
            for seq, r in group:
                try:
                    self._fault_point("sample", [seq])
                    accepted[seq] = verify(*rows_of([(seq, r)]), self.generator, self.config.native_kernels)[0]
                except Exception as exc:
                    failed[seq.request.request_id] = f"{type(exc).__name__}: {exc}"
        accepted = {s: t for s, t in accepted.items() if s.request.request_id not in failed}
        plain_logits = logits[torch.tensor(plain_rows, dtype=torch.long, device=logits.device)]
        return plain_seqs, plain_logits, accepted

    def _append_accepted(self, seq: Sequence, tokens: list[int]) -> None:
        """Append a verified run (accepted drafts, then the target's token) until a stop condition
        ends it; then roll the sequence's KV back to what was accepted."""
        num_drafts = len(seq.draft_token_ids)
        num_accepted = len(tokens) - 1
        self.spec_num_drafts += 1
        self.spec_num_draft_tokens += num_drafts
        self.spec_num_accepted_tokens += num_accepted
        for token in tokens:
            self._append_token(seq, token, None)
            if seq.is_finished:  # EOS, a stop token, max_tokens, max_model_len: the rest is dropped
                return
        self.scheduler.accept_drafts(seq, num_accepted)

    @staticmethod
    def _output_due(req: Request, interval: int) -> bool:
        """Whether a running request's output goes out this step under ``stream_interval`` > 1.

        Due when any of its sequences has its first token unsent (TTFT is never delayed), has
        ``interval`` or more tokens unsent, or has finished with tokens unsent (an n > 1 choice
        that ended gets its finish at once, not up to ``interval`` steps later).
        """
        for seq in req.seqs:
            unsent = seq.num_output_tokens - seq.sent_token_len
            if unsent > 0 and (seq.sent_token_len == 0 or unsent >= interval or seq.is_finished):
                return True
        return False

    def _sampling_row(self, seq: Sequence, drafts: list[int] = ()) -> SamplingRow:
        """The sampler's view of ``seq``'s next position, or of the position after ``drafts``
        (a verification row: penalties and min_tokens count the drafts before it as output)."""
        p = seq.request.params
        banned: list[int] = []
        if seq.num_output_tokens + len(drafts) < p.min_tokens:
            banned = list(self.eos_token_ids | set(p.stop_token_ids))
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
            lps = None
            if seq.logprobs is not None:
                lps = seq.logprobs[seq.sent_logprob_len:]
                seq.sent_logprob_len = len(seq.logprobs)
            seq.sent_token_len += len(new)
            deltas.append(SeqDelta(seq.index, new, lps, seq.finish_reason, seq.stop_reason,
                                   seq.cumulative_logprob))
        prompt_lps = None
        if req.prompt_logprobs is not None and not req.prompt_logprobs_sent:
            req.prompt_logprobs_sent, prompt_lps = True, req.prompt_logprobs
        return CoreOutput(req.request_id, deltas, finished, req.num_cached_tokens, req.metrics,
                          prompt_logprobs=prompt_lps)

    # ---- reporting -----------------------------------------------------------------------
    def stats(self) -> EngineStats:
        bm, sched, bs = self.block_manager, self.scheduler, self.config.block_size
        filled: dict[int, int] = {}
        for seq in sched.running:
            for i, block_id in enumerate(bm.block_ids(seq.seq_id)):
                n = min(bs, max(0, seq.num_computed_tokens - i * bs))
                if n > filled.get(block_id, 0):
                    filled[block_id] = n
        return EngineStats(
            num_running=len(sched.running), num_waiting=len(sched.waiting) + len(self.compiling),
            max_num_seqs=self.config.max_num_seqs, max_model_len=self.config.max_model_len, block_size=bs,
            kv_blocks_total=bm.num_blocks, kv_blocks_used=bm.num_used_blocks,
            kv_blocks_cached_free=bm.num_cached_free_blocks, kv_tokens_in_use=sum(filled.values()),
            kv_slots_allocated=bm.num_used_blocks * bs,
            naive_reserved_tokens=len(sched.running) * self.config.max_model_len,
            prefix_queried_tokens=bm.prefix_queried_tokens, prefix_hit_tokens=bm.prefix_hit_tokens,
            num_preemptions=sched.num_preemptions, kv_bytes_per_token=self.kv_bytes_per_token,
            generation_tokens=self.num_generated_tokens, failed_requests=self.num_failed_requests,
            spec_num_drafts=self.spec_num_drafts, spec_num_draft_tokens=self.spec_num_draft_tokens,
            spec_num_accepted_tokens=self.spec_num_accepted_tokens,
            ended_requests=self.num_ended_requests)
