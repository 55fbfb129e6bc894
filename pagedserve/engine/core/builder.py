"""Building an engine core: the configuration resolved against the model, the weights loaded, the
KV pool sized and allocated, and the block manager, scheduler and runner wired over it.

:func:`build_core` returns the parts (:class:`CoreParts`); :class:`~pagedserve.engine.core.engine_core.EngineCore`
steps them. Every ``auto`` is decided here, once, and logged with its reason.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedserve.config import (MEASURED_PPL_COST, QUALITY_FLOOR, QUALITY_FLOOR_MODEL, EngineConfig,
                               quality_floor_alternative, under_quality_floor)
from pagedserve.engine.core.cuda_graphs import CudaGraphDecoder
from pagedserve.engine.core.heap import keep_step_memory
from pagedserve.engine.core.huge_pages import move_model_to_huge_pages
from pagedserve.engine.core.key_bits import model_key_bits
from pagedserve.engine.core.memory import (CUDA_GRAPH_ALLOWANCE, AutoKVBudget, ProfiledKVBudget, choose_auto_kv_budget,
                                      kv_budget_cap, profiled_kv_budget)
from pagedserve.engine.core.profile_run import measure_peak_activation, profile_step
from pagedserve.engine.core.runner import ModelRunner
from pagedserve.engine.core.scheduler import Scheduler, SchedulerConfig
from pagedserve.engine.core.structured import GrammarCompiler
from pagedserve.engine.wire import ModelFacts
from pagedserve.kernels import cpu_has_native_bf16, isa_paths, kernel_error, limit_isa, native_ops
from pagedserve.kernels.triton_paged.availability import TRITON_KV_DTYPES, triton_unavailable
from pagedserve.kv.block_manager import BlockManager
from pagedserve.kv.cache import allocate_kv_caches, num_blocks_for_budget
from pagedserve.kv.events import KVEventLog
from pagedserve.kv.groups import GroupedBlockManager, KVGroup, kv_groups, layer_slots
from pagedserve.kv.quant import kv_cache_bytes_per_token, kv_dtype_name
from pagedserve.kv.sizing import kv_tail_bytes_per_sequence
from pagedserve.models.architectures import architecture_from_hf_config
from pagedserve.models.eos import eos_ids_from_files, eos_ids_from_transformers
from pagedserve.models.llama import ModelArchitecture
from pagedserve.models.hf_config import read_hf_config
from pagedserve.models.loader import load_model, resolve_dtype, resolve_model_dir
from pagedserve.models.quant import weight_bytes

if TYPE_CHECKING:
    from pagedserve.engine.core.kv_events import ZmqEventPublisher

logger = logging.getLogger(__name__)


def _resolve_attention_backend(c: EngineConfig, device: torch.device) -> str:
    """``c.attention_backend`` checked against ``device``, the KV dtype and ``native_kernels``; ``auto`` → on GPU
    the Triton kernels, or SDPA where Triton is missing or has no kernel for the KV dtype (int4); on CPU the
    fused native decode kernel, or ``matmul`` where it can't be built or ``native_kernels`` is off."""
    name, kv_cache_dtype, native_kernels = c.attention_backend, c.kv_cache_dtype, c.native_kernels
    if name == "triton" or (name == "auto" and device.type == "cuda"):
        why = triton_unavailable(device)
        if why is None and kv_cache_dtype not in TRITON_KV_DTYPES:
            why = (f"its kernels read {', '.join(TRITON_KV_DTYPES)} KV pools, not {kv_cache_dtype}" if name == "triton"
                   else f"no Triton kernel for {kv_cache_dtype} KV pools")
        if name == "triton" and why is not None:
            raise ValueError(f"attention_backend 'triton' cannot run here: {why}")
        if name == "auto":
            name = "triton" if why is None else "sdpa"
            logger.info("attention backend: %s%s", name, "" if why is None else f" ({why})")
    elif name == "auto":
        name = "fused" if native_kernels and native_ops() is not None else "matmul"
        why = kernel_error() if native_kernels else "--no-native-kernels"
        logger.info("attention backend: %s%s", name, "" if name == "fused" else f" (fused kernel unavailable: {why})")
    elif name == "fused" and (device.type != "cpu" or not native_kernels or native_ops() is None):
        why = "device is not a CPU" if device.type != "cpu" else "--no-native-kernels" if not native_kernels else \
            kernel_error()
        raise ValueError(f"attention_backend 'fused' needs the native CPU kernel, which is unavailable here: {why}")
    return name


def eos_token_ids(tokenizer_dir: str, model_dir: str) -> set[int]:
    """The ids that end a completion: the tokenizer's EOS plus generation_config.json's, from the
    files where they settle it (:mod:`pagedserve.models.eos`: no transformers import at start-up)."""
    ids = eos_ids_from_files(tokenizer_dir, model_dir)
    return ids if ids is not None else eos_ids_from_transformers(tokenizer_dir, model_dir)


def resolve_config(config: EngineConfig, arch: ModelArchitecture, device: torch.device) -> EngineConfig:
    """A copy of ``config`` with every ``None``/``auto`` that the model decides filled in."""
    # Attention beyond a sliding window is not implemented: the window caps the length instead.
    limit = min(arch.max_position_embeddings, arch.sliding_window or arch.max_position_embeddings)
    max_model_len = limit if config.max_model_len is None else config.max_model_len
    if max_model_len > limit:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's limit of {limit} tokens")
    # CPU: vLLM's API-server default there. Chunks of 1,024 (the earlier default) fell where oneDNN's
    # bf16 GEMM ran a 768-wide linear on one of two threads (1.2-1.3 against 2.3-2.6 TFLOP/s at
    # 1,536-2,048 rows, Sapphire Rapids): W1 on `small` 839 -> 893 output tok/s (docs/BENCHMARKS.md).
    batched = config.max_num_batched_tokens or (8192 if device.type == "cuda" else 2048)
    return dataclasses.replace(config, max_model_len=max_model_len, max_num_batched_tokens=batched,
                               attention_backend=_resolve_attention_backend(config, device))


@dataclass
class KVPool:
    """The KV pool's shape, decided once the weights are loaded."""

    groups: list[KVGroup] | None  # sliding-window models: the layers' KV groups (kv/groups.py)
    pool_layers: int  # layers whose K/V one block holds
    bytes_per_token: int
    dtype: str  # "bfloat16", "int8", ...
    pool_dtype: torch.dtype  # the pools' own dtype, or what quantized pools dequantize to
    num_blocks: int
    block_size: int
    tail_slots: int = 0  # int4: open blocks held in float16 (kv/int4.py), one per sequence and KV group

    @property
    def tokens(self) -> int:
        """Tokens of whole-model KV the pool holds (with KV groups a sequence takes a block per group)."""
        return self.num_blocks * self.block_size // (len(self.groups) if self.groups else 1)


@dataclass(eq=False)
class CoreParts:
    """What an engine core steps (the core is these parts, :class:`EngineCore` subclasses it): the resolved
    config, the model's facts and the wired parts."""

    config: EngineConfig  # every auto and None decided
    device: torch.device
    arch: ModelArchitecture
    dtype: torch.dtype
    model_dir: str
    tokenizer_source: str
    eos_token_ids: set[int]
    weight_bytes: int
    kv: KVPool
    block_manager: BlockManager | GroupedBlockManager
    kv_event_log: KVEventLog | None
    kv_event_publisher: ZmqEventPublisher | None  # with KV events on: sends the log's batches
    scheduler: Scheduler
    runner: ModelRunner
    grammars: GrammarCompiler

    def facts(self) -> ModelFacts:
        c = self.config
        return ModelFacts(
            model_name=c.model, model_dir=self.model_dir, tokenizer=self.tokenizer_source,
            max_model_len=c.max_model_len, max_num_seqs=c.max_num_seqs, vocab_size=self.arch.vocab_size,
            eos_token_ids=tuple(sorted(self.eos_token_ids)), block_size=c.block_size,
            num_kv_blocks=self.kv.num_blocks, kv_bytes_per_token=self.kv.bytes_per_token, kv_dtype=self.kv.dtype,
            dtype=str(self.dtype).removeprefix("torch."), device=str(self.device),
            attention_backend=c.attention_backend, weight_bytes=self.weight_bytes,
            enable_prefix_caching=c.enable_prefix_caching, num_threads=torch.get_num_threads(),
            threads_pinned=os.environ.get("OMP_PROC_BIND", "false").strip().lower() not in ("false", ""))


def build_core(config: EngineConfig) -> CoreParts:
    """Load the model and build everything an engine core steps (the caller's config is not changed)."""
    if config.num_threads is not None:
        # Before the weights are prepacked and the kernels run: all of the step uses this count.
        torch.set_num_threads(config.num_threads)
    device = torch.device(config.device if config.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        keep_step_memory()
    model_dir = resolve_model_dir(config.model, config.revision)
    hf_config = read_hf_config(model_dir)  # without transformers
    arch = architecture_from_hf_config(hf_config)
    if device.type == "cpu" and config.native_kernels:
        # Before the model loads: its GGUF layers choose their layout and rows by the path "auto" takes.
        limit_isa(config.cpu_isa)
        if config.cpu_isa != "auto":
            logger.info("native kernels: at most the %s path (--cpu-isa; this CPU runs %s)", config.cpu_isa,
                        ", ".join(isa_paths()))
    dtype, why, kv_model_dtype = resolve_dtype(config.dtype, hf_config, device, config.cpu_isa)
    logger.info("compute dtype %s (%s)", str(dtype).removeprefix("torch."), why)
    if dtype == torch.bfloat16 and device.type == "cpu" and not cpu_has_native_bf16(config.cpu_isa):
        logger.warning("computing in bfloat16 on a CPU without AVX-512 BF16 or AMX: torch emulates bf16 "
                       "matmuls here, several times slower than float32; --dtype float32 is faster on this CPU "
                       "(a bf16 checkpoint's linear weights then stay bf16 for decode: --decode-weights)")
    config = resolve_config(config, arch, device)
    _warn_under_quality_floor(config.quantization, config.kv_cache_dtype)
    tokenizer_source = str(config.tokenizer or model_dir)
    eos = eos_token_ids(tokenizer_source, str(model_dir))

    t0 = time.monotonic()
    model = load_model(model_dir, arch, dtype, device, config)
    size = weight_bytes(model)
    if device.type == "cpu":
        move_model_to_huge_pages(model)  # before the decode stack takes the tensors (its pointers)
    use_graphs = device.type == "cuda" and config.attention_backend == "triton" and config.cuda_graphs
    config, kv = _size_kv_pool(config, model, arch, dtype, kv_model_dtype, device, size, use_graphs)
    ops = native_ops() if device.type == "cpu" and config.native_kernels else None
    kv_caches = allocate_kv_caches(kv.pool_layers, kv.num_blocks, config.block_size, arch.num_kv_heads,
                                   arch.head_dim, kv.pool_dtype, device, config.kv_cache_dtype, kv.tail_slots,
                                   len(kv.groups) if kv.groups else 1, ops)
    if kv.groups:  # each layer reads the pool slot of its position in its group
        kv_caches = [kv_caches[slot] for _, slot in layer_slots(kv.groups)]
    if config.kv_cache_dtype == "int4" and config.int4_key_bits == "calibrated":
        # per model layer: a pool slot shared by KV groups holds each group's blocks in its layer's bits
        key_bits = model_key_bits(model, model_dir, tokenizer_source, arch, dtype, config)
        kv_caches = [(k.with_key_bits(bits), v) for (k, v), bits in zip(kv_caches, key_bits)]
    # KV events (docs/SCALE_OUT.md): the prefix cache's event log and its publisher; off by default, and then
    # nothing is hashed, recorded or sent
    event_log = publisher = None
    if config.kv_events is not None and config.kv_events.enabled:
        from pagedserve.engine.core.kv_events import ZmqEventPublisher  # zmq only when asked for

        event_log, publisher = KVEventLog(config.block_size), ZmqEventPublisher(config.kv_events)
    if kv.groups:
        block_manager = GroupedBlockManager(kv.num_blocks, config.block_size, kv.groups, config.enable_prefix_caching,
                                            event_log, config.max_num_batched_tokens)
    else:
        block_manager = BlockManager(kv.num_blocks, config.block_size, config.enable_prefix_caching, events=event_log)
    if kv.tail_slots:  # a block no table holds gives its tail slot back
        getattr(block_manager, "inner", block_manager).on_release = kv_caches[0][0].tails.release
    decode_graphs = CudaGraphDecoder(model, kv_caches, config, device) if use_graphs else None
    runner = ModelRunner(model, kv_caches, block_manager, device, decode_graphs)
    decode_path = (model.enable_native_decode(kv_caches, ops) if config.native_decode
                   else "python (--no-native-decode)")
    logger.info("decode step: %s", decode_path)
    parts = CoreParts(config, device, arch, dtype, str(model_dir), tokenizer_source, eos, size, kv, block_manager,
                      event_log, publisher, _scheduler(config, kv.dtype, block_manager), runner,
                      GrammarCompiler(tokenizer_source, arch.vocab_size, sorted(eos)))
    _log_loaded(parts, time.monotonic() - t0)
    return parts


def _warn_under_quality_floor(quantization: str, kv_cache_dtype: str) -> None:
    """One warning when the weight × KV precisions asked for are under the quality floor
    (config.py: measured on the default model, the precisions' cost and not this model's)."""
    cost = under_quality_floor(quantization, kv_cache_dtype)
    if cost is None:
        return
    weights, kv = quality_floor_alternative(quantization, kv_cache_dtype)
    logger.warning("--quantization %s with --kv-cache-dtype %s is under the quality floor: +%.1f%% perplexity "
                   "measured on %s, over the +%.0f%% floor (docs/QUANTIZATION.md); use --quantization %s "
                   "--kv-cache-dtype %s instead (%+.1f%% there)", quantization, kv_cache_dtype, 100 * cost,
                   QUALITY_FLOOR_MODEL, 100 * QUALITY_FLOOR, weights, kv, 100 * MEASURED_PPL_COST[weights, kv])


def _size_kv_pool(config: EngineConfig, model: torch.nn.Module, arch: ModelArchitecture, dtype: torch.dtype,
                  kv_model_dtype: torch.dtype, device: torch.device, size: int,
                  use_graphs: bool) -> tuple[EngineConfig, KVPool]:
    """The KV pool's blocks from the budget (``auto``: from free memory, engine/core/memory.py), and the
    config with that budget filled in."""
    kv_dtype = kv_dtype_name(config.kv_cache_dtype, kv_model_dtype)  # e.g. "bfloat16" or "int8"
    # KV groups (kv/groups.py) for a model with sliding-window layers: a block then holds one
    # group's layers, and the pool's bytes per token are that many layers'.
    windows = getattr(arch, "layer_windows", ())
    groups = kv_groups(windows) if config.free_window_blocks and any(windows) else None
    pool_layers = len(groups[0].layers) if groups else arch.num_layers
    per_token = kv_cache_bytes_per_token(pool_layers, arch.num_kv_heads, arch.head_dim, config.kv_cache_dtype,
                                         kv_model_dtype, config.block_size)
    tail_slots = config.max_num_seqs * (len(groups) if groups else 1) if config.kv_cache_dtype == "int4" else 0
    tail_bytes = tail_slots * kv_tail_bytes_per_sequence(pool_layers, arch.num_kv_heads, arch.head_dim,
                                                         config.kv_cache_dtype, config.block_size)
    pool_dtype = kv_model_dtype if config.kv_cache_dtype == "auto" else dtype
    auto: AutoKVBudget | ProfiledKVBudget | None = None
    if config.kv_cache_memory == "auto" and not config.num_kv_blocks:
        if device.type == "cuda":  # the card's memory less what is in use and a profile step's peak (memory.py)
            step = profile_step(config, device)
            peak = measure_peak_activation(model, step, pool_dtype, config.kv_cache_dtype, device)
            free, total = torch.cuda.mem_get_info(device)
            auto = profiled_kv_budget(total, free, size, peak, config.kv_cache_memory_fraction,
                                      CUDA_GRAPH_ALLOWANCE if use_graphs else 0,
                                      kv_budget_cap(config, per_token, tail_bytes), step.num_tokens)
        else:
            auto = choose_auto_kv_budget(arch, config, per_token, tail_bytes)
        logger.info("%s", auto.describe())
        config = dataclasses.replace(config, kv_cache_memory=auto.budget)
    num_blocks = config.num_kv_blocks or num_blocks_for_budget(config.kv_cache_memory - tail_bytes, config.block_size,
                                                               per_token)
    if num_blocks < 1:
        if auto is not None:
            raise ValueError(f"{auto.describe()}: no KV block of {config.block_size} tokens × "
                             f"{per_token} B fits; free memory or give --kv-cache-memory")
        tails = f" beside int4's tail blocks ({tail_slots} × {tail_bytes // tail_slots} B)" if tail_slots else ""
        raise ValueError(f"a KV budget of {config.kv_cache_memory} bytes holds no block of "
                         f"{config.block_size} tokens × {per_token} B{tails}; raise --kv-cache-memory")
    kv = KVPool(groups, pool_layers, per_token, kv_dtype, pool_dtype, num_blocks, config.block_size, tail_slots)
    if kv.tokens < config.max_model_len and not groups:
        logger.warning("the KV pool holds %d tokens, fewer than max_model_len %d: a request of that length "
                       "can never run (it is refused); raise --kv-cache-memory (%d B/token) or lower "
                       "--max-model-len", kv.tokens, config.max_model_len, per_token)
    return config, kv


def _scheduler(c: EngineConfig, kv_dtype: str, block_manager: BlockManager | GroupedBlockManager) -> Scheduler:
    return Scheduler(SchedulerConfig(
        max_num_seqs=c.max_num_seqs, max_num_batched_tokens=c.max_num_batched_tokens, max_model_len=c.max_model_len,
        max_waiting=c.max_waiting, reserve_max_model_len=c.kv_reservation == "max", kv_cache_dtype=kv_dtype,
        num_speculative_tokens=c.num_speculative_tokens if c.speculative == "ngram" else 0,
        ngram_max=c.ngram_prompt_lookup_max, ngram_min=c.ngram_prompt_lookup_min,
        priority_prefill_first=c.priority_prefill_first, priority_prefill_max_pause=c.priority_prefill_max_pause,
    ), block_manager)


def _log_loaded(p: CoreParts, seconds: float) -> None:
    config, arch, kv = p.config, p.arch, p.kv
    logger.info(
        "loaded %s (%s, %s, %d layers, weights %s %.1f MiB) on %s (%d threads) in %.1fs; KV pool (%s): "
        "%d blocks × %d tokens = %d tokens (%.1f MiB at %d B/token), seats %d requests at max_model_len %d "
        "(%s reservation); steps of up to %d sequences and %d tokens",
        config.model, arch.model_type, str(p.dtype).removeprefix("torch."), arch.num_layers,
        config.quantization if config.quantization != "none" else "as stored", p.weight_bytes / 2**20,
        p.device, torch.get_num_threads(), seconds, kv.dtype, kv.num_blocks, config.block_size, kv.tokens,
        kv.num_blocks * config.block_size * kv.bytes_per_token / 2**20, kv.bytes_per_token,
        kv.tokens // config.max_model_len, config.max_model_len, config.kv_reservation, config.max_num_seqs,
        config.max_num_batched_tokens)
    if kv.groups:
        logger.info("KV groups (kv/groups.py): %s, %d layers each (the B/token above is one group's); a "
                    "sequence of max_model_len %d holds at most %d blocks, %d without window give-backs",
                    ", ".join("full" if g.window is None else f"window {g.window}" for g in kv.groups),
                    len(kv.groups[0].layers), config.max_model_len, p.block_manager.num_blocks_for(config.max_model_len),
                    len(kv.groups) * -(-config.max_model_len // config.block_size))
