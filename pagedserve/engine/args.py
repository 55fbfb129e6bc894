"""The engine's command-line flags, shared by ``serve``, ``generate``, ``bench`` and ``plan check``."""

from __future__ import annotations

import argparse
import dataclasses

from pagedserve.config import (ATTENTION_BACKEND_NAMES, CPU_ISAS, DECODE_WEIGHTS, GGUF_ACTIVATIONS, INT4_KEY_BITS,
                               KV_CACHE_DTYPES, MAX_NGRAM, MAX_PRIORITY_PREFILL_PAUSE, MAX_SPECULATIVE_TOKENS,
                               PACK_WEIGHTS, QUANTIZATIONS, EngineConfig, KVEventsConfig)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine's flags: the engine group, then speculative decoding's."""
    g = parser.add_argument_group("engine")
    _add_model_args(g)
    _add_scheduling_args(g)
    _add_backend_args(g)
    s = parser.add_argument_group("speculative decoding")
    s.add_argument("--speculative", default=None, choices=["ngram"],
                   help="speculative decoding: ngram = prompt lookup (vLLM's ngram method): each decode step drafts "
                        "the tokens that followed the latest earlier occurrence of the sequence's last few tokens "
                        "in its own prompt + output, and verifies them in the same forward pass; greedy output is "
                        "unchanged, sampled output keeps its distribution (default: off)")
    s.add_argument("--num-speculative-tokens", type=int, default=4, metavar="K",
                   help=f"with --speculative: most draft tokens per sequence per step, 1..{MAX_SPECULATIVE_TOKENS} "
                        "(default 4)")
    s.add_argument("--ngram-prompt-lookup-max", type=int, default=4, metavar="N",
                   help=f"with --speculative ngram: longest n-gram matched, 1..{MAX_NGRAM} (default 4)")
    s.add_argument("--ngram-prompt-lookup-min", type=int, default=1, metavar="N",
                   help="with --speculative ngram: shortest n-gram matched, 1..--ngram-prompt-lookup-max (default 1)")


def _add_model_args(g: argparse._ArgumentGroup) -> None:
    """The model, its precision and how its weights are laid out and computed."""
    g.add_argument("--model", default=None,
                   help="Hugging Face model directory or hub id (Llama 2/3, Mistral, Qwen2, Qwen3; safetensors)")
    g.add_argument("--tokenizer", default=None, help="tokenizer directory or hub id (default: the model's)")
    g.add_argument("--revision", default=None, help="hub revision (branch, tag or commit) of the model")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weight and activation dtype; auto = the checkpoint's (float16 becomes bfloat16 on CPU)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="KV cache precision: auto = the model dtype; fp8 (e4m3) or int8 store each token's K/V per "
                        "head with a float16 scale (about doubles the seats); int4 stores keys per channel per block, "
                        "values per token, each sequence's open block at 16 bits (about 3.4x the seats)")
    g.add_argument("--int4-key-bits", default="calibrated", choices=list(INT4_KEY_BITS),
                   help="with --kv-cache-dtype int4: calibrated = each key channel's bits (1-8, 4 on average, the "
                        "same bytes) chosen once per model from a short text, cached under $PAGEDSERVE_CACHE/key-bits "
                        "(about 5 s the first time); uniform = 4 bits a channel")
    g.add_argument("--quantization", default="none", choices=list(QUANTIZATIONS),
                   help="weight-only quantization applied at load: int8 per output channel, int4 in groups of 32 "
                        "(embeddings and norms stay in --dtype); cuts the bytes every decode step reads. A weight x KV "
                        "combination under the quality floor (int4 here, docs/QUANTIZATION.md) warns at start-up")
    g.add_argument("--decode-weights", default="auto", choices=list(DECODE_WEIGHTS),
                   help="with a model computed in float32 (the default on a CPU without native bf16; --dtype "
                        "float32 elsewhere): how linear weights are stored. float16 / bfloat16 keep them 16-bit and "
                        "widen them in registers, so decode reads half float32's bytes (prompt chunks still run "
                        "float32 GEMMs); auto does so only where lossless, for a bf16 or f16 checkpoint (a float32 "
                        "one stays float32); float16 rounds a float32 checkpoint's weights. Ignored elsewhere "
                        "(default auto)")
    g.add_argument("--gguf-activations", default="int16", choices=list(GGUF_ACTIVATIONS),
                   help="how the native GGUF kernels quantize a layer's activations before the integer dot "
                        "products: int16 (int8 plus the int8 of its remainder: logits within ~0.001 of a float "
                        "computation, so a prompt answers the same cold and after a prefix-cache hit) or int8 "
                        "(llama.cpp's: about half the integer work, logits off by up to ~0.1, enough to swap "
                        "near-tied tokens). An LM head always takes int16 (default int16)")
    g.add_argument("--no-native-decode", dest="native_decode", action="store_false",
                   help="on CPU, run decode steps through the Python model layer by layer instead of one native "
                        "call for all layers (the native call is taken where the layers and KV pools allow it: "
                        "decode-only steps, model-dtype KV pools, the fused attention backend; same results)")
    g.add_argument("--no-native-kernels", dest="native_kernels", action="store_false",
                   help="on CPU, use none of the native kernels (pagedserve/kernels, compiled with g++ on first "
                        "use, ~30 s once per machine and torch install, cached under $PAGEDSERVE_CACHE/kernels): "
                        "pure-torch paths only, nothing compiled; slower, for checking or a machine without a "
                        "compiler (default: built and used where they build)")
    g.add_argument("--no-head-screen", dest="head_screen", action="store_false",
                   help="on CPU, compute the whole LM head every step; by default a step of up to 4 rows that are "
                        "all plain greedy (no logprobs, penalties, logit bias or grammar) first reads an int8 copy "
                        "of a float head (half a bf16 head's bytes, kept beside it) and computes exactly only the "
                        "rows whose bound can reach the largest logit; a GGUF Q8_0 head, in plain-greedy steps of 4 rows or "
                        "more, is multiplied at int8 activations and computes at int16 only the rows that can win: "
                        "the same tokens (default: on)")
    g.add_argument("--pack-weights", default="auto", choices=list(PACK_WEIGHTS),
                   help="how a CPU model's float linear weights are prepacked at load: auto (bf16 weights in "
                        "the AMX-BF16 tile layout for the native kernel where the CPU has AMX-BF16 (faster than "
                        "oneDNN up to ~1,000 rows, 0.87x for 2,048-token prompt chunks) or AVX512-BF16 "
                        "(vdpbf16ps: 1.9x oneDNN for one row, 1.04-1.1x from 48 rows up); the rest for "
                        "oneDNN), onednn (all for "
                        "oneDNN's matmuls), panel (float32 weights in 16-column panels for the native kernel: "
                        "faster than oneDNN on AVX2 for decode batches of up to ~8 rows, slower for large "
                        "batches) or none (left as loaded). Not used with --quantization (default auto)")
    g.add_argument("--cpu-isa", default="auto", choices=list(CPU_ISAS),
                   help="the most the native kernels' CPUID dispatch takes: avx2 runs a newer CPU's kernels as on "
                        "an AVX2-only one (and --dtype auto then computes in float32, as there), to reproduce or "
                        "measure that machine; torch's own kernels follow ONEDNN_MAX_CPU_ISA, "
                        "MKL_ENABLE_INSTRUCTIONS and ATEN_CPU_CAPABILITY (default auto: all this CPU has)")
    g.add_argument("--group-kernels", action="store_true",
                   help="run int4 and grouped-int8 layers (--quantization int4, a GGUF's Q4_0 / Q4_1 / Q8_0 "
                        "when not kept as GGUF blocks) through the native group kernels instead of torch's "
                        "int4pack / int8 kernels: faster on some CPUs, but rounding then depends on the batch "
                        "size (docs/QUANTIZATION.md; default off)")


def _add_scheduling_args(g: argparse._ArgumentGroup) -> None:
    """The device, the KV pool, and what one step batches and in which order."""
    g.add_argument("--device", default="auto", help="auto (CUDA when present, else CPU), cpu, cuda or cuda:N")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block (page)")
    g.add_argument("--kv-cache-memory", default="1GiB",
                   help="memory budget of the KV pool, e.g. 2GiB or 512MiB; blocks = budget ÷ (block size × KV bytes/token). "
                        "auto: sized from free memory once the weights are loaded, like vLLM's --gpu-memory-utilization "
                        "(--kv-cache-memory-fraction of it, less an activation reserve: on CUDA a profiled step's "
                        "peak, on CPU an estimate from MemAvailable; every term is logged) (default 1GiB)")
    g.add_argument("--kv-cache-memory-fraction", "--gpu-memory-utilization", type=float, default=0.9,
                   metavar="F", dest="kv_cache_memory_fraction",
                   help="with --kv-cache-memory auto: the share of memory the engine may use, in (0, 1]: of the "
                        "card's total on CUDA (weights, a profiled step's peak activations, CUDA graphs and other "
                        "users counted against it, as vLLM's --gpu-memory-utilization), of the available memory "
                        "on CPU (default 0.9)")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="exact number of KV blocks (overrides --kv-cache-memory)")
    # what one step batches and in which order
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output in tokens (default: the model's max_position_embeddings)")
    g.add_argument("--max-num-seqs", type=int, default=64, help="most sequences in one batch")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget per step, shared by decodes and prompt chunks (default 2048 on CPU, 8192 on GPU)")
    g.add_argument("--max-waiting", type=int, default=None,
                   help="waiting-queue length beyond which new requests are refused (default: unbounded)")
    g.add_argument("--no-prefix-caching", action="store_true", help="turn automatic prefix caching off")
    g.add_argument("--no-free-window-blocks", dest="free_window_blocks", action="store_false",
                   help="sliding-window layers (Gemma 3) keep every block of their context, windows only masked "
                        "(default: their own block tables, giving back blocks wholly outside the window)")
    g.add_argument("--no-priority-prefill-first", dest="priority_prefill_first", action="store_false",
                   help="turn priority prefill first off. On (the default), a step that computes a prompt chunk "
                        "leaves out running decodes and waiting requests of strictly worse priority (they keep "
                        "their KV blocks and seats and go on next step), so a high-priority prompt's first token "
                        "is not slowed by a batch of lower-priority decodes; equal priorities never trigger it")
    g.add_argument("--priority-prefill-max-pause", type=int, default=8, metavar="STEPS",
                   help="with priority prefill first: most steps in a row that worse-priority work may be left out "
                        f"for better prompts (a long prompt chunked over steps, or a stream of them), 1.."
                        f"{MAX_PRIORITY_PREFILL_PAUSE}; the next step batches everyone (default 8)")


def _add_backend_args(g: argparse._ArgumentGroup) -> None:
    """Attention, CUDA graphs, threads, streaming and KV events."""
    g.add_argument("--kv-reservation", default="paged", choices=["paged", "max"],
                   help="paged: blocks as the context grows; max: reserve max_model_len per request (the naive server)")
    g.add_argument("--attention-backend", default="auto", choices=list(ATTENTION_BACKEND_NAMES),
                   help="paged attention implementation: auto = fused on CPU (native decode kernel, compiled on "
                        "first use; matmul if it cannot be built), triton on GPU (Triton kernels reading the KV "
                        "pools in place; sdpa where Triton is not installed or the KV cache is int4); "
                        "reference = plain torch, for checking")
    g.add_argument("--no-cuda-graphs", "--enforce-eager", dest="cuda_graphs", action="store_false",
                   help="on CUDA with the triton backend, run every decode step eagerly instead of replaying the "
                        "CUDA graphs captured at start for padded batch sizes (1, 2, 4, 8, then every 8 up to "
                        "--max-num-seqs); graphs remove the per-kernel launch cost that dominates small decode "
                        "batches, at a few seconds of capture and some memory at start (--enforce-eager: vLLM's name)")
    g.add_argument("--seed", type=int, default=0, help="seed of the engine's generator for unseeded sampling")
    g.add_argument("--num-threads", type=int, default=None, metavar="N",
                   help="CPU threads of the model step (torch's intra-op pool, in the engine core's process), "
                        "1..1024. A step is a chain of parallel regions split evenly over the threads, so when "
                        "HTTP fronts, a gateway or load generators share the cores, a thread they preempt "
                        "stalls the others: fewer threads than cores can then be faster (default: one per "
                        "core torch may use)")
    g.add_argument("--stream-interval", type=int, default=1, metavar="N",
                   help="stream a request's output every N new tokens instead of every token: the first token "
                        "always goes out at once (TTFT unchanged) and the finish flushes the rest; N > 1 means "
                        "fewer outputs, SSE events and socket writes per token in server, gateway and clients, "
                        "at the cost of burstier streams (default 1: every token)")
    g.add_argument("--kv-events-endpoint", default=None, metavar="URL",
                   help="publish KV block events (blocks entering and leaving the prefix cache, vLLM's "
                        "msgpack layout, for llm-d / AIBrix / Dynamo routers; docs/SCALE_OUT.md) on a ZMQ PUB "
                        "socket at URL. As in vLLM, tcp://*:5557, ipc:// and inproc:// addresses are bound, "
                        "any other (tcp://router-host:5557) is connected to (default: off)")
    g.add_argument("--kv-events-config", default=None, metavar="JSON",
                   help="vLLM's KV events config as JSON, e.g. '{\"enable_kv_cache_events\": true, "
                        "\"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\", \"topic\": \"kv\"}' "
                        "(also replay_endpoint, buffer_steps, hwm, max_queue_size); --kv-events-endpoint, "
                        "if given too, sets its endpoint and turns it on")


def engine_config_from_args(args: argparse.Namespace, model: str | None = None) -> EngineConfig:
    """Build an EngineConfig from parsed flags; ``model`` overrides ``--model`` (e.g. a default).
    Every flag whose destination is an EngineConfig field's name sets it; a field with no flag in
    this parser (``--engine-core-nice`` is serve's alone) keeps its default."""
    fields = {f.name for f in dataclasses.fields(EngineConfig)} - {"model", "enable_prefix_caching", "kv_events"}
    return EngineConfig(model=model or args.model, enable_prefix_caching=not args.no_prefix_caching,
                        kv_events=kv_events_config_from_args(args),
                        **{name: value for name, value in vars(args).items() if name in fields})


def kv_events_config_from_args(args: argparse.Namespace) -> KVEventsConfig | None:
    """``--kv-events-config`` and/or ``--kv-events-endpoint``; None when neither is given."""
    text, endpoint = getattr(args, "kv_events_config", None), getattr(args, "kv_events_endpoint", None)
    if text is None and endpoint is None:
        return None
    config = KVEventsConfig.from_json(text) if text is not None else KVEventsConfig()
    if endpoint is not None:
        config = KVEventsConfig(**{**vars(config), "enable_kv_cache_events": True, "publisher": "zmq",
                                   "endpoint": endpoint})
    return config
