"""Engine configuration: one dataclass, validated once at the edge (CLI, HTTP, ``LLM``)."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, fields
from pathlib import Path

ATTENTION_BACKEND_NAMES = ("auto", "reference", "sdpa", "matmul", "fused", "triton")
SPECULATIVE_METHODS = (None, "ngram")
MAX_SPECULATIVE_TOKENS = 16  # drafts verified per sequence per step
MAX_NGRAM = 16  # longest n-gram the prompt-lookup proposer matches
MAX_PRIORITY_PREFILL_PAUSE = 1024  # most steps in a row worse-priority work may wait for better prompts
MAX_NUM_THREADS = 1024  # the step's CPU threads (more than any machine here has cores)
MAX_NICE = 19  # the largest niceness Linux has


def cache_dir() -> Path:
    """Where built checkpoints and compiled kernels live: ``$PAGEDSERVE_CACHE`` or ``~/.cache/pagedserve``."""
    return Path(os.environ.get("PAGEDSERVE_CACHE", Path.home() / ".cache" / "pagedserve"))


_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4, "tb": 1000**4,
}


def parse_bytes(value: int | float | str) -> int:
    """Parse a memory size such as ``2GiB``, ``512MiB``, ``1.5GB`` or a plain byte count."""
    if isinstance(value, (int, float)):
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot parse memory size {value!r}: use e.g. 2GiB, 512MiB or a byte count")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


# KV storage precision: auto = the model dtype; the others are quantized with per-token, per-head scales.
KV_CACHE_DTYPES = ("auto", "fp8", "int8", "int4")
# int4 KV: each key channel's bits calibrated once per model (engine/core/key_bits.py), or 4 each.
INT4_KEY_BITS = ("calibrated", "uniform")
# Weight-only quantization applied at load: none, int8 (per-output-channel) or int4 (group-wise).
QUANTIZATIONS = ("none", "int8", "int4")

# The quality floor (docs/QUANTIZATION.md, "The quality floor"): a weight × KV precision combination
# is under it when its measured perplexity cost exceeds QUALITY_FLOOR. Issue #35 holds KV alone to
# +1.5 %; a combination rounds twice (weights and KV), so each may spend that much: +3 % in all.
QUALITY_FLOOR = 0.03
QUALITY_FLOOR_MODEL = "SmolLM2-135M-Instruct"
# Perplexity cost of each (quantization, kv_cache_dtype) on QUALITY_FLOOR_MODEL against its GGUF
# dequantized to float32 with float32 KV, every cell on the same 8 windows × 256 tokens of the Python
# tutorial's prose (the commands are in docs/QUANTIZATION.md). "int4" re-quantizes a Q4_1 file: two
# roundings, where a float checkpoint has one. The int4 KV cells are its layout since 2026-12-06 (keys
# with zero points, each channel at its calibrated bits). The engine warns at start-up for a cell
# under the floor.
MEASURED_PPL_COST: dict[tuple[str, str], float] = {
    ("none", "auto"): 0.0, ("none", "fp8"): -0.0010, ("none", "int8"): -0.0011, ("none", "int4"): 0.0024,
    ("int8", "auto"): 0.0040, ("int8", "fp8"): 0.0056, ("int8", "int8"): 0.0035, ("int8", "int4"): 0.0041,
    ("int4", "auto"): 0.0604, ("int4", "fp8"): 0.0600, ("int4", "int8"): 0.0609, ("int4", "int4"): 0.0631,
}


def under_quality_floor(quantization: str, kv_cache_dtype: str) -> float | None:
    """The measured perplexity cost of a combination under the floor, or None (at or above it)."""
    cost = MEASURED_PPL_COST.get((quantization, kv_cache_dtype))
    return cost if cost is not None and cost > QUALITY_FLOOR else None


def quality_floor_alternative(quantization: str, kv_cache_dtype: str) -> tuple[str, str]:
    """The nearest combination above the floor: the same weights with the smallest KV that passes,
    else the same KV with the smallest weights that pass, else full precision."""
    for kv in ("int4", "int8", "fp8", "auto"):  # fewest bytes first; int8 before fp8: same bytes, closer
        if (quantization, kv) in MEASURED_PPL_COST and under_quality_floor(quantization, kv) is None:
            return quantization, kv
    for weights in ("int4", "int8", "none"):
        if (weights, kv_cache_dtype) in MEASURED_PPL_COST and under_quality_floor(weights, kv_cache_dtype) is None:
            return weights, kv_cache_dtype
    return "none", "auto"


# How a float32 model's linear weights are stored on CPU (models/half_linear.py):
# auto = 16-bit where lossless (a bf16 or f16 checkpoint), else float32; float16 / bfloat16 round a
# float32 checkpoint's weights, so they are asked for by name.
DECODE_WEIGHTS = ("auto", "float32", "float16", "bfloat16")
GGUF_ACTIVATIONS = ("int16", "int8")
# How a CPU model's float linear weights are prepacked at load (models/packed.py): onednn = for
# oneDNN's matmuls; panel = float32 weights in 16-column panels for the native kernel (faster for
# decode batches of up to ~8 rows, slower for large ones); none = left as loaded.
PACK_WEIGHTS = ("auto", "onednn", "panel", "none")
# The most the native kernels' run-time dispatch may take (kernels/cpu_isa.h), best first: a newer
# CPU run as an older one (auto: all this CPU has).
CPU_ISAS = ("auto", "amx", "avx512", "avx2", "scalar")


_ENDPOINT = re.compile(r"(tcp://[^\s]+:(\d+|\*)|ipc://[^\s]+|inproc://[^\s]+)")


@dataclass
class KVEventsConfig:
    """KV block events (docs/SCALE_OUT.md): vLLM's ``--kv-events-config`` fields, with its defaults.

    ``endpoint`` follows vLLM's rule: an address with ``*`` (``tcp://*:5557``), ``::``, ``ipc://`` or
    ``inproc://`` is bound; any other is connected to (a router's subscriber that binds, as llm-d's
    does). ``replay_endpoint`` (bound, a ROUTER) resends the last ``buffer_steps`` batches from a
    sequence number a subscriber asks for. ``max_queue_size`` batches wait for the publisher thread;
    beyond that a batch is dropped (its sequence number is skipped, so subscribers see the gap).
    """

    enable_kv_cache_events: bool = False
    publisher: str = "zmq"  # zmq | null (vLLM's names; null publishes nothing)
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"kv events publisher must be 'zmq' or 'null', got {self.publisher!r}")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and _ENDPOINT.fullmatch(value)):
                raise ValueError(f"kv events {name} must be tcp://HOST:PORT, ipc://PATH or inproc://NAME, "
                                 f"got {value!r}")
        for name, low, high in (("buffer_steps", 0, 1_000_000), ("hwm", 0, 10_000_000),
                                ("max_queue_size", 1, 10_000_000)):
            value = getattr(self, name)
            if type(value) is not int or not low <= value <= high:
                raise ValueError(f"kv events {name} must be an integer in [{low}, {high}], got {value!r}")
        if not isinstance(self.topic, str) or len(self.topic) > 256:
            raise ValueError("kv events topic must be a string of at most 256 characters")

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """Parse vLLM's ``--kv-events-config`` JSON object; unknown keys are refused."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--kv-events-config is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"--kv-events-config: unknown keys {unknown}; known: {sorted(known)}")
        return cls(**data)


@dataclass
class EngineConfig:
    """Everything the engine needs to start; defaults suit a small CPU machine.

    ``kv_cache_memory`` is the KV pool's byte budget; the number of blocks follows from the
    planner's bytes-per-token formula. ``"auto"`` sizes it from free memory once the weights are
    loaded: ``kv_cache_memory_fraction`` of it less an activation reserve (engine/core/memory.py). ``num_kv_blocks`` overrides it (tests use it to force a
    tiny pool). ``kv_reservation="max"`` makes every admitted request reserve ``max_model_len``
    tokens up front, the naive server kept for side-by-side comparison.
    ``kv_cache_dtype`` (``auto`` | ``fp8`` | ``int8`` | ``int4``) and ``quantization`` (``none`` |
    ``int8`` | ``int4``) are the KV and weight precision dials, set separately (docs/QUANTIZATION.md).
    ``decode_weights``: a float32 model's linear weights stored 16-bit for decode on CPU (``auto``:
    only where lossless, a bf16 or f16 checkpoint).
    ``gguf_activations``: how the GGUF kernels quantize a layer's activations, ``int16`` (int8 plus
    the int8 of its remainder: near-float logits) or ``int8`` (llama.cpp's, less integer work).
    ``native_decode``: on CPU, decode steps run every decoder layer in one native call where the
    model's layers and KV pools allow it (False: always the Python model, the reference).
    ``native_kernels``: on CPU, compile (once, on first use) and use the native kernels
    (pagedserve/kernels); False keeps to the pure-torch paths and compiles nothing.
    ``head_screen``: on CPU with the native kernels, a step of a few rows that are all plain greedy
    reads an int8 copy of a float LM head and computes exactly only the rows that can hold the
    argmax; a GGUF Q8_0 head, in steps of 4 such rows or more, is multiplied at int8 activations and
    only its rows that can win at int16 (models/head_screen.py: the same tokens; False: the full
    head every step).
    ``pack_weights`` (``auto`` | ``onednn`` | ``panel`` | ``none``): how float linear weights are
    prepacked at load on CPU (``auto``: bf16 into the AMX-BF16 tile layout for the native kernel where
    the CPU has AMX-BF16 or AVX512-BF16, the rest for oneDNN). ``cpu_isa`` (``auto`` | ``amx`` |
    ``avx512`` | ``avx2`` | ``scalar``): the most the native kernels' CPUID dispatch takes in this
    process, and the compute dtype ``auto`` picks as for that CPU (below ``avx512``: no native bf16);
    torch's own kernels follow their environment (``bench compare --cpu-isa`` sets it for its workers).
    ``group_kernels``: int4 / grouped-int8 layers through the native group kernels
    (opt-in: faster on some CPUs, batch-size-dependent rounding; docs/QUANTIZATION.md).
    ``stream_interval`` is how many new tokens a running request gathers before ``step()`` returns
    its next output (the first token and the finish always go out at once; 1 = every token).
    ``kv_events`` publishes the prefix cache's block events for routers (off unless given and enabled).
    ``priority_prefill_first``: a step that computes a prompt chunk leaves out running and waiting
    work of strictly worse priority (kept in place, not preempted), for at most
    ``priority_prefill_max_pause`` steps in a row (engine/core/scheduler.py; equal priorities never
    trigger it).
    """

    model: str
    tokenizer: str | None = None
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    block_size: int = 16
    kv_cache_memory: int | str = "1GiB"  # bytes, "2GiB", or "auto" (from free memory, engine/core/memory.py)
    kv_cache_memory_fraction: float = 0.9  # auto: the share of the (free) memory the engine may use
    num_kv_blocks: int | None = None
    kv_cache_dtype: str = "auto"  # auto | fp8 | int8 | int4
    int4_key_bits: str = "calibrated"  # calibrated | uniform: int4 KV's bits per key channel
    quantization: str = "none"  # none | int8 | int4 (weight-only, applied at load)
    decode_weights: str = "auto"  # auto | float32 | float16 | bfloat16 (CPU, float32 model)
    gguf_activations: str = "int16"  # int16 | int8: the GGUF kernels' activation precision
    native_decode: bool = True  # CPU: a decode step's layers in one native call where it can (models/native_decode.py)
    native_kernels: bool = True  # CPU: build and use the native kernels (False: pure torch, nothing compiled)
    head_screen: bool = True  # CPU: plain-greedy steps screen the LM head (models/head_screen.py)
    pack_weights: str = "auto"  # auto | onednn | panel | none: CPU prepacking of float linear weights at load
    cpu_isa: str = "auto"  # auto | amx | avx512 | avx2 | scalar: the most the native kernels' dispatch takes
    group_kernels: bool = False  # int4 / grouped-int8 layers through the native group kernels (opt-in)
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None  # default: 2048 on CPU, 8192 on GPU
    max_waiting: int | None = None
    enable_prefix_caching: bool = True
    # Sliding-window layers (Gemma 3) in KV groups that give back blocks outside their window
    # (kv/groups.py); False: one table per sequence for every layer, windows only masked.
    free_window_blocks: bool = True
    kv_reservation: str = "paged"  # paged | max
    attention_backend: str = "auto"  # auto | reference | sdpa | matmul | fused | triton
    # CUDA with the triton backend: decode-only steps replay CUDA graphs captured at start for a
    # ladder of padded batch sizes (engine/core/cuda_graphs.py); prefill steps run eagerly. False: every
    # step eager (slower per token, nothing captured). Ignored on CPU and with other backends.
    cuda_graphs: bool = True
    seed: int = 0
    revision: str | None = None
    trust_remote_code: bool = False
    stream_interval: int = 1  # emit a running request's output every N new tokens (first token: at once)
    kv_events: KVEventsConfig | None = None
    # Speculative decoding (docs/ARCHITECTURE.md, "Speculative decoding"): None = off; "ngram" =
    # prompt lookup, up to num_speculative_tokens drafts per decode step, found by matching the
    # sequence's last ngram_prompt_lookup_max .. _min tokens earlier in its own prompt + output.
    speculative: str | None = None
    num_speculative_tokens: int = 4
    ngram_prompt_lookup_max: int = 4
    ngram_prompt_lookup_min: int = 1
    priority_prefill_first: bool = True
    priority_prefill_max_pause: int = 8
    # CPU threads of the model step (torch's intra-op pool, in the process that runs the engine);
    # None = torch's default, one per core it may use.
    num_threads: int | None = None
    # Niceness of the engine core's own process (serve; the in-process engine ignores it): above 0
    # the core also runs under SCHED_BATCH, so on cores it shares with HTTP front ends, a gateway or
    # clients, their short bursts preempt the step loop instead of waiting out its time slice.
    engine_core_nice: int = 0
    # Pin the engine core's step threads one per CPU core (serve; the in-process engine ignores it),
    # when the step has exactly one thread per core it may use and the environment sets no OpenMP
    # affinity of its own. Unpinned, a worker woken after an idle moment can land on its master's
    # core and the two spin against each other for a time slice: an idle server's first token late.
    bind_step_threads: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.kv_cache_memory, str) and self.kv_cache_memory.strip().lower() == "auto":
            self.kv_cache_memory = "auto"  # sized by the engine once the weights are loaded
        else:
            self.kv_cache_memory = parse_bytes(self.kv_cache_memory)
        fraction = self.kv_cache_memory_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1], got {fraction!r}")
        if self.block_size < 1 or self.block_size > 1024:
            raise ValueError(f"block_size must be in [1, 1024], got {self.block_size}")
        if self.kv_reservation not in ("paged", "max"):
            raise ValueError(f"kv_reservation must be 'paged' or 'max', got {self.kv_reservation!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.attention_backend not in ATTENTION_BACKEND_NAMES:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKEND_NAMES)}, "
                             f"got {self.attention_backend!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.int4_key_bits not in INT4_KEY_BITS:
            raise ValueError(f"int4_key_bits must be one of {', '.join(INT4_KEY_BITS)}, got {self.int4_key_bits!r}")
        if self.quantization is None:
            self.quantization = "none"
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.gguf_activations not in GGUF_ACTIVATIONS:
            raise ValueError(f"gguf_activations must be one of {', '.join(GGUF_ACTIVATIONS)}, "
                             f"got {self.gguf_activations!r}")
        if self.pack_weights not in PACK_WEIGHTS:
            raise ValueError(f"pack_weights must be one of {', '.join(PACK_WEIGHTS)}, got {self.pack_weights!r}")
        if self.cpu_isa not in CPU_ISAS:
            raise ValueError(f"cpu_isa must be one of {', '.join(CPU_ISAS)}, got {self.cpu_isa!r}")
        for name in ("native_kernels", "group_kernels", "head_screen"):
            if type(getattr(self, name)) is not bool:
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.decode_weights not in DECODE_WEIGHTS:
            raise ValueError(f"decode_weights must be one of {', '.join(DECODE_WEIGHTS)}, got {self.decode_weights!r}")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_waiting is not None and self.max_waiting < 0:
            raise ValueError("max_waiting must be >= 0")
        if type(self.stream_interval) is not int or self.stream_interval < 1:  # bool and 2.5 are refused too
            raise ValueError(f"stream_interval must be an integer >= 1 (1 = emit every token), "
                             f"got {self.stream_interval!r}")
        self._check_speculative()
        if type(self.priority_prefill_first) is not bool:
            raise ValueError(f"priority_prefill_first must be true or false, got {self.priority_prefill_first!r}")
        pause = self.priority_prefill_max_pause
        if type(pause) is not int or not 1 <= pause <= MAX_PRIORITY_PREFILL_PAUSE:
            raise ValueError(f"priority_prefill_max_pause must be an integer in [1, {MAX_PRIORITY_PREFILL_PAUSE}] "
                             f"(steps), got {pause!r}")
        threads = self.num_threads
        if threads is not None and (type(threads) is not int or not 1 <= threads <= MAX_NUM_THREADS):
            raise ValueError(f"num_threads must be an integer in [1, {MAX_NUM_THREADS}], got {threads!r}")
        if type(self.cuda_graphs) is not bool:
            raise ValueError(f"cuda_graphs must be true or false, got {self.cuda_graphs!r}")
        if type(self.bind_step_threads) is not bool:
            raise ValueError(f"bind_step_threads must be true or false, got {self.bind_step_threads!r}")
        nice = self.engine_core_nice
        if type(nice) is not int or not 0 <= nice <= MAX_NICE:
            raise ValueError(f"engine_core_nice must be an integer in [0, {MAX_NICE}], got {nice!r}")
        if isinstance(self.kv_events, dict):  # e.g. LLM(..., kv_events={"enable_kv_cache_events": True, ...})
            self.kv_events = KVEventsConfig(**self.kv_events)

    def _check_speculative(self) -> None:
        if self.speculative not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative must be one of {', '.join(str(m) for m in SPECULATIVE_METHODS)}, "
                             f"got {self.speculative!r}")
        for name, low, high in (("num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS),
                                ("ngram_prompt_lookup_max", 1, MAX_NGRAM), ("ngram_prompt_lookup_min", 1, MAX_NGRAM)):
            value = getattr(self, name)
            if type(value) is not int or not low <= value <= high:
                raise ValueError(f"{name} must be an integer in [{low}, {high}], got {value!r}")
        if self.ngram_prompt_lookup_min > self.ngram_prompt_lookup_max:
            raise ValueError(f"ngram_prompt_lookup_min ({self.ngram_prompt_lookup_min}) must not exceed "
                             f"ngram_prompt_lookup_max ({self.ngram_prompt_lookup_max})")
