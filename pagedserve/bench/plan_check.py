"""``pagedserve plan check``: the planner's predictions beside what the engine does on this machine.

Three comparisons, per model:

1. **Sizing, exact** — KV bytes per token, KV blocks and seats at max length for a memory
   budget: the planner's formulas against the engine's own pool. These must be equal.
2. **Decode** — the bound bandwidth ÷ bytes read per step, with this machine's bandwidth
   measured by a large tensor copy, against the engine's single-stream decode tokens/s (W2).
3. **Prefill** — 2 × params × prompt tokens ÷ FLOP/s, with FLOP/s measured on matmuls of the
   model's own shapes, against the engine's time to first token for one prompt.

For 2 and 3 the engine reaches a fraction of the bound (Python, attention, sampling, kernel
launch); that fraction is printed as measured, and no fudge factor enters the formulas.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from pagedserve.planner import sizing
from pagedserve.planner.report import dumps, render_table
from pagedserve.planner.shapes import ModelShape, load_model_shape
from pagedserve.planner.units import format_bytes, format_duration, format_rate, parse_size

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class SizingCheck:
    """Planner vs engine for one model and KV budget; ``matches`` is True when all three agree."""

    model: str
    dtype: str
    kv_budget: int
    block_size: int
    max_model_len: int
    planner_kv_bytes_per_token: float
    engine_kv_bytes_per_token: int
    planner_blocks: int
    engine_blocks: int
    planner_seats: int
    engine_seats: int

    @property
    def matches(self) -> bool:
        """The planner's figures equal the engine's, exactly."""
        return (self.planner_kv_bytes_per_token == self.engine_kv_bytes_per_token
                and self.planner_blocks == self.engine_blocks and self.planner_seats == self.engine_seats)


@dataclass(frozen=True)
class SpeedCheck:
    """A predicted bound and the engine's measurement of the same thing (higher is better for rates)."""

    model: str
    quantity: str
    machine_limit: float
    predicted: float
    measured: float
    unit: str

    @property
    def fraction_achieved(self) -> float:
        """Measured ÷ bound for rates, bound ÷ measured for durations: 1.0 is the machine's limit."""
        if self.unit == "s":
            return self.predicted / self.measured if self.measured > 0 else 0.0
        return self.measured / self.predicted if self.predicted > 0 else 0.0


def checkpoint_dtype(model_dir: Path) -> str:
    """The dtype a checkpoint was saved in (``config.json``'s ``dtype``/``torch_dtype``), else float32."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return "float32"
    saved = str(config.get("dtype") or config.get("torch_dtype") or "float32").removeprefix("torch.")
    return saved if saved in DTYPE_BYTES else "float32"


def resolve_model(model: str) -> Path:
    """A model directory: a standard name is built (once) into the cache; a path is taken as is."""
    from pagedserve.models.standard import STANDARD_MODELS, ensure_standard_model

    if model in STANDARD_MODELS:
        return ensure_standard_model(model)
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(f"{model!r} is neither a standard model name nor a directory with a config.json")
    return path


def check_sizing(engine: Any, shape: ModelShape, dtype: str, kv_budget: int, kv_cache_dtype: str = "auto") -> SizingCheck:
    """Compare the planner's KV bytes/token, blocks and seats with a running engine's pool.

    ``kv_cache_dtype`` ``auto`` stores KV in the model ``dtype``; fp8 / int8 / int4 add their scales
    on both sides, so the comparison covers the quantized pools too; int4's tail blocks (one per
    ``max_num_seqs`` seat) come out of the budget first.
    """
    cfg = engine.core.config
    precision = dtype if kv_cache_dtype == "auto" else kv_cache_dtype
    bpt = shape.kv_pool_bytes_per_token(precision, cfg.block_size)
    tails = cfg.max_num_seqs * shape.kv_tail_bytes_per_sequence(precision, cfg.block_size)
    blocks = sizing.num_kv_blocks(kv_budget - tails, bpt, cfg.block_size)
    return SizingCheck(
        model=shape.name, dtype=dtype if kv_cache_dtype == "auto" else f"{dtype}, KV {kv_cache_dtype}", kv_budget=kv_budget, block_size=cfg.block_size,
        max_model_len=cfg.max_model_len, planner_kv_bytes_per_token=bpt,
        engine_kv_bytes_per_token=engine.core.kv.bytes_per_token, planner_blocks=blocks, engine_blocks=engine.core.kv.num_blocks,
        planner_seats=sizing.seats_at_max_len(blocks, cfg.block_size, cfg.max_model_len),
        engine_seats=engine.core.kv.num_blocks * cfg.block_size // cfg.max_model_len)


def measure_bandwidth(device: str, size_bytes: int = 512 * 2**20, repeats: int = 7) -> float:
    """Memory bandwidth in bytes/s: a large tensor copy reads and writes ``size_bytes`` each (best of ``repeats``)."""
    import torch

    src = torch.ones(size_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 1):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - start)
    # The first copy also faults pages in; of the rest the fastest counts, since other processes
    # on the machine can only slow a copy down.
    return 2 * size_bytes / min(times[1:])


def prefill_matmuls(shape: ModelShape, tokens: int) -> list[tuple[int, int, int, int]]:
    """(rows, in, out, how many) of every matmul a prefill of ``tokens`` runs.

    The decoder's weights see every prompt token; the LM head only the last one, since a
    prefill samples a single next token (the engine, like vLLM, computes logits only there).
    """
    h, q, kv, inter = shape.hidden_size, shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim, \
        shape.intermediate_size
    layers = shape.num_layers
    return [(tokens, h, q, layers), (tokens, h, kv, 2 * layers), (tokens, q, h, layers),
            (tokens, h, inter, 2 * layers), (tokens, inter, h, layers), (1, h, shape.vocab_size, 1)]


def measure_flops(shape: ModelShape, tokens: int, dtype: str, device: str, blocks: int = 7,
                  block_seconds: float = 0.01) -> float:
    """FLOP/s this machine achieves on the matmuls of a ``tokens``-token prefill of this model.

    Each distinct matmul runs in ``blocks`` timed blocks of back-to-back calls (each block at
    least ``block_seconds``); the fastest block counts, since other processes on the machine can
    only slow a block down. The times are weighted by how many times the model runs each matmul.
    """
    import torch

    torch_dtype = getattr(torch, dtype)
    total_flop = total_time = 0.0
    for rows, d_in, d_out, count in prefill_matmuls(shape, tokens):
        x = torch.randn(rows, d_in, dtype=torch_dtype, device=device)
        w = torch.randn(d_in, d_out, dtype=torch_dtype, device=device)
        torch.matmul(x, w)  # warm-up: kernel selection, page faults
        _sync(device)
        start = time.perf_counter()
        torch.matmul(x, w)
        _sync(device)
        calls = max(1, int(block_seconds / max(time.perf_counter() - start, 1e-7)))
        best = math.inf
        for _ in range(blocks):
            start = time.perf_counter()
            for _ in range(calls):
                torch.matmul(x, w)
            _sync(device)
            best = min(best, (time.perf_counter() - start) / calls)
        total_time += best * count
        total_flop += 2.0 * rows * d_in * d_out * count
    return total_flop / total_time


def _random_prompt(length: int, vocab: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(100, vocab - 1) for _ in range(length)]  # clear of the special tokens


def measure_decode(engine: Any, prompt_len: int, output_tokens: int, seed: int = 0) -> float:
    """The engine's single-stream decode tokens/s (W2): tokens after the first ÷ time after the first."""
    from pagedserve.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True)
    engine.add_request(f"decode-{seed}", _random_prompt(prompt_len, engine.tokenizer.vocab_size, seed), params)
    first = last = None
    produced = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            produced = len(out.outputs[0].token_ids)
            if first is None and produced:
                first = now
            last = now
    if first is None or last is None or produced < 2 or last <= first:
        raise RuntimeError("the engine produced too few tokens to time decode")
    return (produced - 1) / (last - first)


def measure_prefill(engine: Any, prompt_len: int, seed: int = 0) -> float:
    """Seconds from adding one ``prompt_len``-token request to its first token (the whole prefill)."""
    from pagedserve.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    prompt = _random_prompt(prompt_len, engine.tokenizer.vocab_size, seed + 1000)
    start = time.perf_counter()
    engine.add_request(f"prefill-{seed}", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


@dataclass(frozen=True)
class CheckConfig:
    """What ``plan check`` runs: which model, the KV budget and the timing workloads."""

    model: str
    kv_cache_memory: int
    block_size: int = 16
    max_model_len: int | None = None
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    device: str = "auto"
    prompt_tokens: int = 512
    decode_prompt_tokens: int = 16
    decode_tokens: int = 256
    repeats: int = 1
    sizing_only: bool = False
    copy_bytes: int = 512 * 2**20  # size of the bandwidth probe: well past every CPU cache


def run_check(config: CheckConfig) -> dict[str, Any]:
    """Start the engine for one model and return its sizing check and (unless sizing only) speed checks."""
    import torch

    from pagedserve.config import EngineConfig
    from pagedserve.engine.frontend.engine import Engine

    model_dir = resolve_model(config.model)
    shape = load_model_shape(str(model_dir))
    shape = ModelShape(**{**shape.__dict__, "name": config.model})
    dtype = checkpoint_dtype(model_dir) if config.dtype == "auto" else config.dtype
    device = ("cuda" if torch.cuda.is_available() else "cpu") if config.device == "auto" else config.device
    engine = Engine(EngineConfig(model=str(model_dir), dtype=dtype, device=device, block_size=config.block_size,
                                 kv_cache_memory=config.kv_cache_memory, max_model_len=config.max_model_len,
                                 kv_cache_dtype=config.kv_cache_dtype, enable_prefix_caching=False))
    result: dict[str, Any] = {"model": config.model, "device": device, "dtype": dtype,
                              "sizing": check_sizing(engine, shape, dtype, config.kv_cache_memory,
                                                     config.kv_cache_dtype)}
    if config.sizing_only:
        return result
    element = DTYPE_BYTES[dtype]
    # The machine's limits are measured before and after the engine's runs and the better kept,
    # so a burst of load from other processes during one probe does not lower the bound.
    bandwidth = measure_bandwidth(device, config.copy_bytes)
    flops = measure_flops(shape, config.prompt_tokens, dtype, device)
    measure_decode(engine, config.decode_prompt_tokens, 8, seed=99)  # warm-up: first-call costs stay out
    measure_prefill(engine, config.prompt_tokens, seed=99)
    # Best of the repeats, like the machine's limits: noise from other processes only slows a run.
    decode = max(measure_decode(engine, config.decode_prompt_tokens, config.decode_tokens, seed=i)
                 for i in range(config.repeats))
    prefill = min(measure_prefill(engine, config.prompt_tokens, seed=i) for i in range(config.repeats))
    bandwidth = max(bandwidth, measure_bandwidth(device, config.copy_bytes))
    flops = max(flops, measure_flops(shape, config.prompt_tokens, dtype, device))
    weights = shape.matmul_params * element
    # W2's stream reads, on average, the KV of half its final context each step.
    mean_context = config.decode_prompt_tokens + config.decode_tokens // 2
    kv_bpt = shape.kv_pool_bytes_per_token(dtype if config.kv_cache_dtype == "auto" else config.kv_cache_dtype)
    decode_bound = sizing.decode_tokens_per_s(bandwidth, weights, kv_bpt, mean_context)
    prefill_bound = sizing.prefill_seconds(shape.body_params, config.prompt_tokens, flops, shape.lm_head_params)
    result.update(
        bandwidth=bandwidth, flops=flops, weight_bytes_per_step=weights, matmul_params=shape.matmul_params,
        body_params=shape.body_params, lm_head_params=shape.lm_head_params,
        decode=SpeedCheck(config.model, f"decode tok/s, 1 stream ({config.decode_tokens} tokens)", bandwidth,
                          decode_bound, decode, "tok/s"),
        prefill=SpeedCheck(config.model, f"prefill of {config.prompt_tokens} tokens", flops, prefill_bound,
                           prefill, "s"))
    return result


def render_check(results: list[dict[str, Any]]) -> str:
    """Tables for people: sizing (planner = engine?) and speed (bound, measured, fraction achieved)."""
    rows = []
    for r in results:
        s: SizingCheck = r["sizing"]
        rows.append((s.model, s.dtype, format_bytes(s.kv_budget), f"{s.planner_kv_bytes_per_token:,.0f}",
                     f"{s.engine_kv_bytes_per_token:,}", f"{s.planner_blocks:,}", f"{s.engine_blocks:,}",
                     str(s.planner_seats), str(s.engine_seats), "yes" if s.matches else "NO"))
    out = [render_table(["model", "dtype", "KV budget", "planner B/tok", "engine B/tok", "planner blocks",
                         "engine blocks", "planner seats", "engine seats", "equal"], rows,
                        f"KV pool sizing (seats at max_model_len {results[0]['sizing'].max_model_len:,}, "
                        f"block {results[0]['sizing'].block_size})")]
    speed_rows = []
    for r in results:
        if "decode" not in r:
            continue
        d: SpeedCheck = r["decode"]
        p: SpeedCheck = r["prefill"]
        speed_rows.append((r["model"], "decode (1 stream)", f"bandwidth {format_rate(r['bandwidth'], 'B/s')}",
                           f"{d.predicted:,.1f} tok/s", f"{d.measured:,.1f} tok/s", f"{d.fraction_achieved:.1%}"))
        speed_rows.append((r["model"], p.quantity, f"matmul {format_rate(r['flops'], 'FLOP/s')}",
                           format_duration(p.predicted), format_duration(p.measured), f"{p.fraction_achieved:.1%}"))
    if speed_rows:
        device = results[0]["device"]
        out.append(render_table(["model", "what", f"this machine ({device})", "planner bound", "engine measured",
                                 "achieved"], speed_rows, "Speed: the planner's bound beside the engine"))
    return "\n\n".join(out)


def add_parser(plan_sub: argparse._SubParsersAction) -> None:
    """Register ``pagedserve plan check``."""
    parser = plan_sub.add_parser(
        "check", help="run the engine here and put the planner's predictions beside what it measures",
        description="Start the engine on this machine for each --model and compare: KV bytes/token, blocks and seats "
                    "(must be equal); decode tokens/s against bandwidth ÷ bytes per step (bandwidth measured here); "
                    "prefill seconds against 2 × params × tokens ÷ FLOP/s (FLOP/s measured here).")
    parser.add_argument("--model", action="append",
                        help="standard model name or model directory (repeatable; default: small and qwen05-shape)")
    parser.add_argument("--kv-cache-memory", default="256MiB", help="KV budget given to the engine (default 256MiB)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    parser.add_argument("--max-model-len", type=int, help="context limit (default: the model's)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="model and KV dtype (default: the checkpoint's)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "int8", "int4"],
                        help="KV precision of the engine's pool: auto = --dtype; fp8 / int8 / int4 are compared "
                             "with their scales counted on both sides (default auto)")
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto (default)")
    parser.add_argument("--prompt-tokens", type=int, default=512, help="prompt length for the prefill check (default 512)")
    parser.add_argument("--decode-tokens", type=int, default=256,
                        help="output tokens of the decode check, a 16-token prompt as in W2 (default 256)")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs of each check; the best is kept (default 1)")
    parser.add_argument("--sizing-only", action="store_true", help="only the sizing comparison, no timing runs")
    parser.add_argument("--json", action="store_true", help="print JSON for scripts instead of tables")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Run ``plan check``; exit 0 when sizing matches everywhere, 1 when it does not, 2 on bad input."""
    models = args.model or ["small", "qwen05-shape"]
    try:
        budget = parse_size(args.kv_cache_memory)
        configs = [CheckConfig(model=m, kv_cache_memory=budget, block_size=args.block_size,
                               max_model_len=args.max_model_len, dtype=args.dtype,
                               kv_cache_dtype=args.kv_cache_dtype, device=args.device,
                               prompt_tokens=args.prompt_tokens, decode_tokens=args.decode_tokens,
                               repeats=args.repeats, sizing_only=args.sizing_only) for m in models]
        results = [run_check(c) for c in tqdm(configs, desc="plan check", unit="model", disable=len(configs) < 2)]
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(dumps(results) if args.json else render_check(results))
    return 0 if all(r["sizing"].matches for r in results) else 1


def _sync(device: str) -> None:
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.synchronize()
