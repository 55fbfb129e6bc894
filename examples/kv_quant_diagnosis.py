"""Why a KV format loses quality on a real model: the K/V statistics and K-only / V-only runs.

Not a product command: the measurement behind docs/QUANTIZATION.md's int4 diagnosis, kept so it
can be re-run. One engine loads the model (full-precision KV); each window of the bench's corpus
(:mod:`pagedserve.bench.corpus`) is scored once with the float pool, whose K and V (post-RoPE, as
stored) give, per layer: the channel absmax profile, the ratio of the largest channel absmax to
the median one, and each format's round-trip error on K and on V separately. Then the same
windows are scored with K and/or V passed through a format's round trip (quantize, dequantize)
as they are written: perplexity and mean KL against the float run, per format and per side.

    python examples/kv_quant_diagnosis.py --windows 4 --window-len 256 --threads 2 \
        --formats int4 int4-rot int4-asym --sides k v kv
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from pagedserve.bench.quality import corpus_tokens, heldout_windows, mean_kl
from pagedserve.kv.cache import HeadMajorKVCache
from pagedserve.kv.quant import dequantize_kv, hadamard_matrix, quantize_kv
from pagedserve.models.attention import AttentionMetadata


def _asym_int4(x: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """Round trip of asymmetric int4 (16 levels between each group's min and max, float16 scale and
    zero point): a candidate format, simulated here only."""
    shape = x.shape
    xg = x.float().reshape(*shape[:-1], groups, shape[-1] // groups)
    lo, hi = xg.amin(-1, keepdim=True), xg.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp(min=1e-6).half().float()
    lo = lo.half().float()
    q = ((xg - lo) / scale).round().clamp(0, 15)
    return (q * scale + lo).reshape(shape)


def _sym_groups(x: torch.Tensor, kind: str, groups: int) -> torch.Tensor:
    """Round trip of the stored format with one scale per group of head_dim / groups values."""
    shape = x.shape
    xg = x.reshape(*shape[:-1], groups, shape[-1] // groups)
    data, scales = quantize_kv(xg, kind)
    return dequantize_kv(data, scales, kind, torch.float32).reshape(shape)


def round_trip(fmt: str):
    """``fmt`` → a function ``x [..., head_dim] → dequantized x`` in float32.

    ``int4`` / ``int8`` / ``fp8``: per-vector symmetric, not rotated (the old format);
    ``-rot``: rotated by the normalised Hadamard matrix first (what the int4 pool now stores);
    ``-rrot``: the same with random signs on the channels first;
    ``-asym``: asymmetric int4; ``-g2``: two scales per vector; combinations chain (``int4-rot-asym``)."""
    parts = fmt.split("-")
    kind, opts = parts[0], set(parts[1:])

    def fn(x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        h = hadamard_matrix(x.shape[-1], x.dtype) if opts & {"rot", "rrot"} else None
        if "rrot" in opts:  # random signs first (QuaRot's randomised Hadamard): R = diag(s) H, R^-1 = H diag(s)
            s = torch.randint(0, 2, (x.shape[-1],), generator=torch.Generator().manual_seed(0)) * 2 - 1
            h = s.to(x.dtype).unsqueeze(1) * h
        y = x @ h if h is not None else x
        if "asym" in opts:
            y = _asym_int4(y, 2 if "g2" in opts else 1)
        elif "g2" in opts:
            y = _sym_groups(y, kind, 2)
        else:
            data, scales = quantize_kv(y, kind)
            y = dequantize_kv(data, scales, kind, torch.float32)
        return y @ h.T if h is not None else y  # orthogonal: the inverse is the transpose
    return fn


class RoundTripCache(HeadMajorKVCache):
    """A float pool that stores what a format's round trip gives back: the format's values, without
    its storage, so any format can be scored and K and V can differ."""

    def __init__(self, like: HeadMajorKVCache, fn):
        kvh, nb, bs, hd = like.data.shape
        super().__init__(nb, bs, kvh, hd, like.data.dtype, like.data.device)
        self.fn = fn

    def write(self, slot_mapping, x):
        super().write(slot_mapping, self.fn(x).to(x.dtype) if self.fn else x)


@torch.inference_mode()
def window_logprobs(runner, caches, token_ids, dev):
    n = len(token_ids)
    positions = torch.arange(n, device=dev)
    bs = caches[0][0].data.shape[2]
    meta = AttentionMetadata(positions, 0, torch.zeros(0, 1, dtype=torch.long), torch.zeros(0, dtype=torch.long),
                             None, [(0, n, n, torch.arange(-(-n // bs)))])
    hidden = runner.model(torch.tensor(token_ids, device=dev), positions, caches, meta)
    return runner.model.compute_logits(hidden).log_softmax(-1)


def stored(cache: HeadMajorKVCache, n: int) -> torch.Tensor:
    """The first ``n`` slots of a float pool as ``[n, kv_heads, head_dim]``."""
    kvh, nb, bs, hd = cache.data.shape
    return cache.data.view(kvh, nb * bs, hd)[:, :n].transpose(0, 1).float()


def rel_err(x: torch.Tensor, fn) -> float:
    """‖fn(x) − x‖ / ‖x‖ over all vectors."""
    return float((fn(x) - x).norm() / x.norm())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--window-len", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--formats", nargs="+", default=["int4", "int4-rot"])
    p.add_argument("--sides", nargs="+", default=["k", "v", "kv"], choices=["k", "v", "kv"])
    p.add_argument("--no-stats", action="store_true", help="skip the per-layer statistics")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from pagedserve.config import EngineConfig
    from pagedserve.engine.frontend.engine import Engine
    from pagedserve.models.loader import resolve_model_dir

    t0 = time.time()
    model_dir = str(resolve_model_dir(args.model))
    engine = Engine(EngineConfig(model=model_dir, dtype="float32", kv_cache_memory="256MiB",
                                 max_model_len=max(1024, args.window_len + 1), enable_prefix_caching=False))
    runner, dev = engine.runner, engine.device
    windows = heldout_windows(corpus_tokens(model_dir, None), args.windows, args.window_len)
    print(f"loaded in {time.time() - t0:.0f} s; {len(windows)} windows x {args.window_len} tokens")
    float_caches = runner.kv_caches
    ref, ks, vs = [], None, None
    for w in windows:
        lp = window_logprobs(runner, float_caches, w[:-1], dev)
        ref.append(lp)
        if ks is None:  # statistics from the first window's K/V
            ks = [stored(k, len(w) - 1) for k, _ in float_caches]
            vs = [stored(v, len(w) - 1) for _, v in float_caches]
    nll = -sum(float(lp.gather(1, torch.tensor(w[1:]).unsqueeze(1)).sum()) for lp, w in zip(ref, windows))
    base_ppl = math.exp(nll / sum(len(w) - 1 for w in windows))
    print(f"float KV perplexity {base_ppl:.3f} ({time.time() - t0:.0f} s)")

    if not args.no_stats:
        fmts = args.formats
        print("\nper layer, first window: channel absmax max/median (K, V); top K channels; relative "
              "round-trip error ‖x̂−x‖/‖x‖ of K and V per format")
        print("| layer | K max/med | V max/med | K top channels (absmax) | "
              + " | ".join(f"K {f} | V {f}" for f in fmts) + " |")
        print("|---|---|---|---|" + "---|---|" * len(fmts))
        for layer, (k, v) in enumerate(zip(ks, vs)):
            kc = k.abs().amax(dim=(0, 1))  # per channel, over tokens and heads
            vc = v.abs().amax(dim=(0, 1))
            top = kc.topk(3)
            tops = ", ".join(f"{int(i)}:{float(a):.1f}" for a, i in zip(top.values, top.indices))
            errs = " | ".join(f"{rel_err(k, round_trip(f)):.3f} | {rel_err(v, round_trip(f)):.3f}" for f in fmts)
            print(f"| {layer} | {float(kc.max() / kc.median()):.1f} | {float(vc.max() / vc.median()):.1f} | "
                  f"{tops} (median {float(kc.median()):.2f}) | {errs} |")
        allk, allv = torch.cat(ks), torch.cat(vs)
        print("| all | | | | " + " | ".join(f"{rel_err(allk, round_trip(f)):.3f} | {rel_err(allv, round_trip(f)):.3f}"
                                           for f in fmts) + " |")

    print("\n| format | quantized | perplexity | Δ ppl | mean KL |")
    print("|---|---|---|---|---|")
    for fmt in args.formats:
        fn = round_trip(fmt)
        for side in args.sides:
            caches = [(RoundTripCache(k, fn if "k" in side else None), RoundTripCache(v, fn if "v" in side else None))
                      for k, v in float_caches]
            lps = [window_logprobs(runner, caches, w[:-1], dev) for w in windows]
            nll = -sum(float(lp.gather(1, torch.tensor(w[1:]).unsqueeze(1)).sum()) for lp, w in zip(lps, windows))
            ppl = math.exp(nll / sum(len(w) - 1 for w in windows))
            print(f"| {fmt} | {side.upper()} | {ppl:.3f} | {100 * (ppl / base_ppl - 1):+.2f}% | "
                  f"{mean_kl(ref, lps):.4f} |", flush=True)
    print(f"({time.time() - t0:.0f} s in all)")


if __name__ == "__main__":
    main()
