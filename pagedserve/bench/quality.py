"""``pagedserve bench quality`` and ``bench quant-decode``: what quantization costs and what it buys.

``quality`` runs every weight precision × KV precision on a model that has learned something —
the stdlib-trained model of :mod:`pagedserve.bench.trained` (default), or a real model such as
the default SmolLM2-135M-Instruct GGUF — and reports, against the full-precision run
(unquantized weights, KV in the model dtype):

* perplexity on held-out text — the trained model's held-out stdlib tokens, or for any other
  model English prose (the Python tutorial, :mod:`pagedserve.bench.corpus`) — one prefill per
  window, the KV written into and read back from the (quantized) paged cache, exactly as the
  engine serves;
* mean KL divergence of the next-token distributions, full precision ‖ quantized, same positions;
* top-1 agreement — share of held-out positions where both runs rank the same token first;
* greedy agreement — share of identical tokens over N held-out prompts × M greedy tokens (free
  running: after the first flipped token a continuation usually differs to its end);
* weight bytes, KV bytes per token (scales included), seats at a fixed KV budget (the engine's own
  pool sizing) and single-stream decode tokens/s.

``quant-decode`` measures W2 (16-token prompt, 256 output tokens) for bf16, int8 and int4
weights side by side on the standard models, interleaving the runs so a busy machine slows all
precisions alike; it reports medians and ratios to bf16.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
from dataclasses import asdict, dataclass

import torch
from tqdm.auto import tqdm

from pagedserve.bench.common import machine_summary, resolve_model, run_engine, write_result
from pagedserve.bench.workloads import BenchRequest
from pagedserve.config import GGUF_ACTIVATIONS, KV_CACHE_DTYPES, QUALITY_FLOOR, QUANTIZATIONS
from pagedserve.planner.sizing import seats_at_max_len

FULL = ("none", "auto")  # the reference combination: weights and KV in the model dtype
GGUF_WEIGHTS = "gguf"  # a GGUF's own quantized tensors, kept as stored (Q4_1 -> the project's int4, ...)


def add_parser(bench) -> None:
    p = bench.add_parser(
        "quality", help="quantization quality table: perplexity, KL, greedy agreement, bytes, seats, decode speed",
        description="For each weight precision x KV precision: perplexity on held-out text, mean KL divergence and "
                    "greedy agreement against the full-precision run, weight bytes, KV bytes per token, seats at a "
                    "fixed KV budget and single-stream decode tokens/s. The default model is trained on the stdlib "
                    "sources on first use (minutes; cached); --model SmolLM2-135M-Instruct (or a GGUF file) measures "
                    "a real model on English prose (the Python tutorial from Debian's python3.11-doc). "
                    "See docs/QUANTIZATION.md.")
    p.add_argument("--model", default="trained",
                   help="'trained' (the stdlib-trained model, built on first use), a directory of a model from "
                        "pagedserve.bench.trained (it carries heldout_tokens.pt), or any other model: "
                        "SmolLM2-135M-Instruct, a GGUF file, a model directory (scored on --corpus)")
    p.add_argument("--weights", nargs="+", default=None, choices=list(QUANTIZATIONS) + [GGUF_WEIGHTS],
                   help="weight precisions to compare (none = full precision: the checkpoint's dtype, or a GGUF "
                        "dequantized to --dtype; gguf = a GGUF's own quantized tensors kept as stored); default: "
                        "none int8 int4, plus gguf for a GGUF model")
    p.add_argument("--dtype", default=None,
                   help="compute dtype (float32 | bfloat16 | float16); default: the checkpoint's, float32 for a GGUF "
                        "(bf16 matmul is emulated, and slow, on CPUs without AVX-512 BF16 / AMX)")
    p.add_argument("--corpus", default=None,
                   help="directory of .rst.txt/.txt text to score models other than 'trained' on (default: the "
                        "Python tutorial from python3.11-doc)")
    p.add_argument("--kv", nargs="+", default=list(KV_CACHE_DTYPES), choices=KV_CACHE_DTYPES,
                   help="KV cache precisions to compare (auto = the model dtype)")
    p.add_argument("--windows", type=int, default=16, help="held-out windows for perplexity and KL")
    p.add_argument("--window-len", type=int, default=256, help="tokens per perplexity window")
    p.add_argument("--chunk", type=_chunk, default=0, metavar="N",
                   help="score each window in prompt chunks of N tokens (1-32): the rows of a decode step, so the "
                        "decode kernels' precision (GGUF's integer kernels and their activations, 16-bit weights) is "
                        "what perplexity and KL measure; default 0: the whole window as one prefill, whose GEMM "
                        "dequantizes the weights")
    p.add_argument("--gguf-activations", default="int16", choices=list(GGUF_ACTIVATIONS),
                   help="the engine's --gguf-activations for GGUF weights kept quantized (default int16)")
    p.add_argument("--prompts", type=int, default=16, help="N: held-out prompts for greedy agreement")
    p.add_argument("--prompt-len", type=int, default=32, help="tokens per greedy prompt")
    p.add_argument("--gen-tokens", type=int, default=64, help="M: greedy tokens generated per prompt")
    p.add_argument("--kv-budget", default="64MiB", help="fixed KV memory budget for the seats column")
    p.add_argument("--max-model-len", type=int, default=1024, help="context length one seat reserves")
    p.add_argument("--decode-tokens", type=int, default=128, help="output tokens of the decode-speed run (0: skip)")
    p.add_argument("--repeats", type=int, default=3, help="timed decode runs per combination (median reported)")
    p.add_argument("--group-kernels", action="store_true",
                   help="int4 / grouped-int8 layers through the native group kernels (the engine's --group-kernels)")
    _add_threads_and_json(p)
    p.set_defaults(func=run_quality)

    d = bench.add_parser(
        "quant-decode", help="W2 decode tokens/s with bf16, int8 and int4 weights side by side",
        description="W2 of docs/WORKLOADS.md (one request, 16-token prompt, 256 output tokens, greedy) for each weight "
                    "precision on each model, runs interleaved round by round; reports medians and ratios to bf16.")
    d.add_argument("--models", nargs="+", default=["small", "qwen05-shape"],
                   help="standard model names or model directories")
    d.add_argument("--weights", nargs="+", default=list(QUANTIZATIONS), choices=QUANTIZATIONS,
                   help="weight precisions (none = the checkpoint's bf16)")
    d.add_argument("--repeats", type=int, default=3, help="timed rounds after one warm-up round (median reported)")
    d.add_argument("--output-len", type=int, default=256, help="output tokens per run (W2: 256)")
    _add_threads_and_json(d)
    d.set_defaults(func=run_quant_decode)


def _chunk(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 32:
        raise argparse.ArgumentTypeError("--chunk is 0 (whole windows) or 1-32 tokens")
    return value


def _add_threads_and_json(p: argparse.ArgumentParser) -> None:
    """The two options both quality commands share."""
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's); on a busy machine 1 can be much faster than 2")
    p.add_argument("--json", dest="json_out", default=None, help="write the results as JSON to this file")


# ---- measurements -------------------------------------------------------------------------------
@torch.inference_mode()
def window_logprobs(engine, token_ids: list[int], chunk: int = 0) -> torch.Tensor:
    """Next-token log-probabilities ``[len, vocab]`` for one window, run as one prefill through the
    paged cache, or as prompt chunks of ``chunk`` tokens (each reading the earlier ones from the
    cache): up to 32 rows a step takes the kernels of decode steps (GGUF's integer kernels, 16-bit
    weights' kernel), so their precision is what is scored, where a whole window's prefill
    dequantizes the weights for a GEMM.

    The window's K/V are written into blocks 0.. and attention reads them back from there, so a
    quantized KV cache costs what it costs in serving. The engine must be idle with prefix caching off
    (those blocks hold nothing anyone will read again).
    """
    from pagedserve.models.attention import AttentionMetadata

    if engine.has_unfinished_requests() or engine.core.config.enable_prefix_caching:
        raise RuntimeError("window_logprobs needs an idle engine built with enable_prefix_caching=False")
    runner, bs, dev = engine.core.runner, engine.core.config.block_size, engine.core.device
    n = len(token_ids)
    num_blocks = -(-n // bs)
    if num_blocks > engine.core.kv.num_blocks:
        raise ValueError(f"a window of {n} tokens needs {num_blocks} KV blocks; the pool has {engine.core.kv.num_blocks}")
    step = chunk if chunk > 0 else n
    logprobs = []
    for start in range(0, n, step):
        end = min(n, start + step)
        positions = torch.arange(start, end, device=dev)
        meta = AttentionMetadata(
            slot_mapping=positions,  # blocks 0, 1, ... in order: slot = position
            num_decodes=0, decode_block_tables=torch.zeros(0, 1, dtype=torch.long, device=dev),
            decode_context_lens=torch.zeros(0, dtype=torch.long, device=dev), decode_mask=None,
            prefills=[(0, end - start, end, torch.arange(-(-end // bs), device=dev))])
        hidden = runner.model(torch.tensor(token_ids[start:end], device=dev), positions, runner.kv_caches, meta)
        logprobs.append(runner.model.compute_logits(hidden).log_softmax(dim=-1).cpu())
    tails = getattr(runner.kv_caches[0][0], "tails", None)
    if tails is not None:  # int4: the window's open last block is no one's, its tail slot free again
        tails.release(range(num_blocks))
    return torch.cat(logprobs)


def heldout_windows(tokens: torch.Tensor, count: int, length: int) -> list[list[int]]:
    """``count`` evenly spaced windows of ``length + 1`` held-out tokens (inputs plus the last target)."""
    span = length + 1
    if len(tokens) < span:
        raise ValueError(f"held-out text has {len(tokens)} tokens, fewer than one window of {span}")
    stride = max(span, (len(tokens) - span) // max(1, count))
    starts = [i * stride for i in range(count) if i * stride + span <= len(tokens)]
    return [tokens[s:s + span].tolist() for s in starts]


def score_windows(engine, windows: list[list[int]], chunk: int = 0) -> tuple[float, list[torch.Tensor]]:
    """(perplexity, per-window log-probability tensors) over the windows' next-token targets
    (``chunk``: :func:`window_logprobs`)."""
    nll, count, logprobs = 0.0, 0, []
    for w in windows:
        lp = window_logprobs(engine, w[:-1], chunk)
        targets = torch.tensor(w[1:])
        nll -= float(lp.gather(1, targets.unsqueeze(1)).sum())
        count += len(targets)
        logprobs.append(lp)
    return math.exp(nll / count), logprobs


def mean_kl(reference: list[torch.Tensor], other: list[torch.Tensor]) -> float:
    """Mean over positions of KL(reference ‖ other), both given as log-probabilities."""
    total, count = 0.0, 0
    for p, q in zip(reference, other):
        p, q = p.double(), q.double()
        # Each position's KL is >= 0; float32 log-probabilities of two near-identical distributions
        # can sum to -1e-8 (measured), rounding and nothing else.
        total += float((p.exp() * (p - q)).sum(-1).clamp_min(0).sum())
        count += p.shape[0]
    return total / count


def greedy_tokens(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy continuations of every prompt (``ignore_eos``, so each has ``max_tokens`` tokens)."""
    from pagedserve.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    outs, _ = run_engine(engine, [BenchRequest(p, max_tokens) for p in prompts], lambda _: params)
    return [outs[str(i)].outputs[0].token_ids for i in range(len(prompts))]


def top1_agreement(reference: list[torch.Tensor], other: list[torch.Tensor]) -> float:
    """Share of held-out positions where both runs rank the same next token first (teacher-forced)."""
    same = sum(int((p.argmax(-1) == q.argmax(-1)).sum()) for p, q in zip(reference, other))
    return same / sum(p.shape[0] for p in reference)


def agreement(reference: list[list[int]], other: list[list[int]]) -> float:
    """Share of positions where two sets of greedy continuations hold the same token."""
    same = sum(a == b for ra, rb in zip(reference, other) for a, b in zip(ra, rb))
    return same / sum(len(r) for r in reference)


@dataclass
class QualityRow:
    """One weight × KV combination of the quality table."""

    weights: str
    kv: str
    model_dtype: str  # what "none" weights and "auto" KV mean for this checkpoint, e.g. bfloat16
    perplexity: float
    ppl_change: float  # relative to the full-precision run
    mean_kl: float
    top1_agreement: float  # teacher-forced, on the held-out windows
    greedy_agreement: float  # free-running: one flipped token changes the rest of that continuation
    weight_bytes: int
    kv_bytes_per_token: int
    seats: int
    decode_tok_s: float


def _decode_speed(engine, prompt: list[int], tokens: int, repeats: int) -> float:
    from pagedserve.bench.decode import decode_rate

    if tokens <= 0:
        return float("nan")
    req = BenchRequest(prompt, tokens)
    decode_rate(engine, req)  # warm-up
    return statistics.median(decode_rate(engine, req) for _ in range(repeats))


def corpus_tokens(model_dir: str, corpus: str | None) -> torch.Tensor:
    """The scoring text as one token stream: the trained model's held-out tokens, or else the corpus's
    prose paragraphs tokenized by the model's tokenizer (no special tokens), one per line."""
    from pathlib import Path

    if (Path(model_dir) / "heldout_tokens.pt").exists() and corpus is None:
        from pagedserve.bench.trained import load_heldout_tokens

        return load_heldout_tokens(model_dir)
    from transformers import AutoTokenizer

    from pagedserve.bench.corpus import load_prose

    paragraphs, _ = load_prose(corpus)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return torch.tensor(tokenizer.encode("\n".join(paragraphs), add_special_tokens=False))


def engine_config(model_dir: str, weights: str, kv: str, dtype: str | None, args):
    """The engine configuration of one weight precision: ``gguf`` loads a GGUF's quantized tensors as
    stored, computing in ``dtype`` (:func:`gguf_compute_view`); the others dequantize it to ``dtype``."""
    from pagedserve.config import EngineConfig

    model, quantization, want = model_dir, weights, dtype or "auto"
    if weights == GGUF_WEIGHTS:
        model, quantization, want = gguf_compute_view(model_dir, dtype), "none", "auto"
    return EngineConfig(model=model, dtype=want, quantization=quantization, kv_cache_dtype=kv,
                        kv_cache_memory=args.kv_budget, max_model_len=args.max_model_len, enable_prefix_caching=False,
                        group_kernels=getattr(args, "group_kernels", False),
                        gguf_activations=args.gguf_activations)


def gguf_compute_view(model_dir: str, dtype: str | None) -> str:
    """A prepared GGUF directory whose config names ``dtype`` as the checkpoint's own.

    The loader keeps GGUF tensors quantized only under ``--dtype auto`` (an explicit dtype asks for
    dequantized weights), and ``auto`` is bfloat16 for a quantized GGUF. To keep Q4_1 as stored and
    still compute in float32, this copy of the small prepared directory (config, tokenizer; the
    weights stay in the GGUF file it points to) says float32; it lives beside the original."""
    import json
    import shutil
    from pathlib import Path

    from pagedserve.models.gguf import gguf_source

    src = Path(model_dir)
    if gguf_source(src) is None:
        raise SystemExit(f"error: --weights gguf needs a GGUF model; {model_dir} is not one")
    if dtype in (None, "auto"):
        return model_dir
    out = src.with_name(f"{src.name}-compute-{dtype}")
    if not out.exists():
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(src, tmp, ignore=shutil.ignore_patterns("*.lock"))
        config = json.loads((tmp / "config.json").read_text())
        config["dtype"] = dtype
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        tmp.rename(out)
    return str(out)


@contextlib.contextmanager
def models_loaded_once():
    """Within the block, engines built with the same weights share one loaded model.

    A row's KV precision lives in the engine's pool, not in the model (which takes the pools as
    arguments), so the 4 KV rows of one weight precision can use one model. Loading SmolLM2 from
    its GGUF (dequantize, re-quantize or pack 211 tensors) took minutes on a shared 2-core machine,
    more than scoring a row; this turns 16 loads into 4. Patched for the block only: the cache is
    this call's, and gone after it."""
    from unittest import mock

    from pagedserve.engine.core import builder as core_builder

    loaded: dict[tuple, torch.nn.Module] = {}
    load = core_builder.load_model

    def cached(model_dir, arch, dtype, device, config):
        # the config's fields load_model reads (a row's KV precision is not one of them)
        key = (str(model_dir), dtype, str(device), *(getattr(config, name) for name in (
            "max_model_len", "attention_backend", "dtype", "quantization", "decode_weights", "gguf_activations",
            "native_kernels", "pack_weights", "group_kernels")))
        if key not in loaded:
            loaded.clear()  # one model at a time: rows run weight by weight
            loaded[key] = load(model_dir, arch, dtype, device, config)
        return loaded[key]

    with mock.patch.object(core_builder, "load_model", cached):
        yield


def measure_quality(model_dir: str, weights: list[str], kvs: list[str], args) -> list[QualityRow]:
    """Run every combination; the full-precision one first, as the reference."""
    with models_loaded_once():
        return _measure_quality(model_dir, weights, kvs, args)


def _measure_quality(model_dir: str, weights: list[str], kvs: list[str], args) -> list[QualityRow]:
    from pagedserve.engine.frontend.engine import Engine

    heldout = corpus_tokens(model_dir, getattr(args, "corpus", None))
    dtype = getattr(args, "dtype", None)
    windows = heldout_windows(heldout, args.windows, args.window_len)
    # Greedy prompts come from the second half of the held-out stream, away from the windows' starts.
    half = heldout[len(heldout) // 2:]
    step = max(args.prompt_len, (len(half) - args.prompt_len) // max(1, args.prompts))
    prompts = [half[i * step:i * step + args.prompt_len].tolist() for i in range(args.prompts)]
    combos = [FULL] + [(w, k) for w in weights for k in kvs if (w, k) != FULL]
    combos.sort(key=lambda c: weights.index(c[0]) if c[0] in weights else -1)  # weight by weight: one load each
    rows: list[QualityRow] = []
    ref_lp = ref_greedy = ref_ppl = None
    for w, k in tqdm(combos, desc="weight x KV combinations", unit="combo"):
        engine = Engine(engine_config(model_dir, w, k, dtype, args))
        ppl, lp = score_windows(engine, windows, args.chunk)
        greedy = greedy_tokens(engine, prompts, args.gen_tokens)
        if ref_lp is None:
            ref_lp, ref_greedy, ref_ppl = lp, greedy, ppl
        speed = _decode_speed(engine, prompts[0][:16], args.decode_tokens, args.repeats)
        rows.append(QualityRow(
            weights=gguf_types(model_dir) if w == GGUF_WEIGHTS else w, kv=k,
            model_dtype=str(engine.core.dtype).removeprefix("torch."), perplexity=ppl, ppl_change=ppl / ref_ppl - 1,
            mean_kl=mean_kl(ref_lp, lp),
            top1_agreement=top1_agreement(ref_lp, lp),
            greedy_agreement=agreement(ref_greedy, greedy), weight_bytes=engine.core.weight_bytes,
            kv_bytes_per_token=engine.core.kv.bytes_per_token,
            seats=seats_at_max_len(engine.core.kv.num_blocks, engine.core.config.block_size, args.max_model_len),
            decode_tok_s=speed))
        r = rows[-1]
        tqdm.write(f"{r.weights} x {r.kv}: perplexity {r.perplexity:.3f}, KL {r.mean_kl:.4f}, greedy "
                   f"{100 * r.greedy_agreement:.1f}%, {r.decode_tok_s:.1f} tok/s")
        del engine
    return rows


def gguf_types(model_dir: str) -> str:
    """How a GGUF's kept tensors are labelled: its quantized matrix types, e.g. ``Q4_1+Q8_0 (GGUF)``."""
    import json
    from pathlib import Path

    types = json.loads((Path(model_dir) / "gguf_source.json").read_text())["tensor_types"]
    kept = sorted((t for t in types if t not in ("F32", "F16", "BF16")), key=lambda t: -types[t])
    return "+".join(kept) + " (GGUF)" if kept else "GGUF"


def format_table(rows: list[QualityRow]) -> str:
    """The quality table as markdown; a row whose perplexity cost exceeds the quality floor
    (config.py's QUALITY_FLOOR) says so in its last column."""
    ref = rows[0]
    lines = ["| weights | KV | perplexity | Δ ppl | mean KL (nats) | top-1 agreement | greedy agreement | weight MiB | "
             f"KV B/token | seats | seats × | decode tok/s | floor (+{100 * QUALITY_FLOOR:.0f}%) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        w = r.model_dtype if r.weights == "none" else r.weights
        k = r.model_dtype if r.kv == "auto" else r.kv
        lines.append(f"| {w} | {k} | {r.perplexity:.3f} | {100 * r.ppl_change:+.2f}% | {r.mean_kl:.4f} | "
                     f"{100 * r.top1_agreement:.1f}% | {100 * r.greedy_agreement:.1f}% | {r.weight_bytes / 2**20:.2f} | {r.kv_bytes_per_token} | "
                     f"{r.seats} | {r.seats / ref.seats:.2f} | {r.decode_tok_s:.1f} | "
                     f"{'**under**' if r.ppl_change > QUALITY_FLOOR else 'above'} |")
    return "\n".join(lines)


def run_quality(args: argparse.Namespace) -> int:
    from pathlib import Path

    from pagedserve.bench.trained import ensure_trained_model

    if args.threads:
        torch.set_num_threads(args.threads)
    from pagedserve.models.gguf import gguf_source
    from pagedserve.models.loader import resolve_model_dir

    model_dir = str(ensure_trained_model()) if args.model == "trained" else str(resolve_model_dir(args.model))
    is_gguf = gguf_source(model_dir) is not None
    if getattr(args, "dtype", None) is None and is_gguf:
        args.dtype = "float32"
    weights = args.weights or ["none"] + ([GGUF_WEIGHTS] if is_gguf else []) + [w for w in QUANTIZATIONS if w != "none"]
    try:
        rows = measure_quality(model_dir, weights, args.kv, args)
    except (FileNotFoundError, ValueError) as e:  # no corpus, too little text
        raise SystemExit(f"error: {e}") from None
    text = "held-out" if (Path(model_dir) / "heldout_tokens.pt").exists() and args.corpus is None else \
        ("the Python tutorial's prose" if args.corpus is None else args.corpus)
    print(f"\nquantization quality on {args.model} ({machine_summary()}; full precision = {rows[0].model_dtype}"
          f"{', dequantized from the GGUF' if is_gguf else ''}): {args.windows} {text} windows x "
          f"{args.window_len} tokens{f' in chunks of {args.chunk}' if args.chunk else ''}"
          f"{f', GGUF activations {args.gguf_activations}' if is_gguf else ''}; "
          f"greedy {args.prompts} prompts x {args.gen_tokens} tokens; seats at "
          f"{args.kv_budget} KV and max_model_len {args.max_model_len}; decode: median of {args.repeats}, "
          f"{args.decode_tokens} tokens")
    print(format_table(rows))
    write_result(args.json_out, {"benchmark": "quality", "model": args.model, "rows": [asdict(r) for r in rows],
                                 "settings": {k: v for k, v in vars(args).items() if k != "func"}})
    return 0


def run_quant_decode(args: argparse.Namespace) -> int:
    from pagedserve.bench.decode import decode_rate
    from pagedserve.bench.workloads import w2_single_stream
    from pagedserve.config import EngineConfig
    from pagedserve.engine.frontend.engine import Engine

    if args.threads:
        torch.set_num_threads(args.threads)
    req = w2_single_stream()
    req.output_len = args.output_len
    results: dict[str, dict[str, list[float]]] = {}
    summary = {}
    for model in args.models:
        model_dir = resolve_model(model)
        engines = {w: Engine(EngineConfig(model=model_dir, quantization=w, kv_cache_memory="64MiB",
                                          max_model_len=1024)) for w in args.weights}
        rates: dict[str, list[float]] = {w: [] for w in args.weights}
        # Round-robin rounds: background load on a shared machine then hits every precision alike.
        for rnd in tqdm(range(args.repeats + 1), desc=f"W2 on {model}", unit="round"):
            for w, engine in engines.items():
                rate = decode_rate(engine, req)
                if rnd:  # round 0 warms up
                    rates[w].append(rate)
        results[model] = rates
        summary[model] = {w: {"median_tok_s": statistics.median(r), "weight_bytes": engines[w].weight_bytes}
                          for w, r in rates.items()}
        del engines
    print(f"\nW2 decode tokens/s by weight precision ({machine_summary()}; {args.output_len} output tokens, "
          f"median of {args.repeats} interleaved rounds)")
    print("| model | weights | weight MiB | decode tok/s (median) | runs | × bf16 |")
    print("|---|---|---|---|---|---|")
    for model, by_w in summary.items():
        base = by_w.get("none", {}).get("median_tok_s")
        for w, s in by_w.items():
            ratio = f"{s['median_tok_s'] / base:.2f}" if base else "-"
            runs = ", ".join(f"{r:.1f}" for r in results[model][w])
            print(f"| {model} | {'bf16' if w == 'none' else w} | {s['weight_bytes'] / 2**20:.1f} | "
                  f"{s['median_tok_s']:.1f} | {runs} | {ratio} |")
    write_result(args.json_out, {"workload": "W2", "benchmark": "quant-decode", "runs": results, "summary": summary})
    return 0
