"""Which 4-bit KV layout keeps SmolLM2's quality: candidate formats simulated on real weights.

Before a KV format is built into the pools and kernels, its cost is measured here: transformers'
SmolLM2-135M-Instruct (the default model's GGUF, dequantized to float32) with an attention function
that rounds each layer's post-RoPE keys and values through the candidate format before attending,
scored on held-out prose windows (the Python tutorial, as `bench quality`). Every format is run on
the same windows in one process; the table gives perplexity against float32 KV, the mean KL of the
next-token distributions, top-1 agreement, and the bytes per token the format would store.

Formats (`--formats`, all by default):

* ``token``          int4 per token and head, one absmax scale per 64 values (the original format)
* ``token-rot``      the same after a Hadamard rotation of each vector (``--kv-cache-dtype int4`` until 2026-12-04)
* ``kivi``           KIVI: keys per channel over each 16-token block (scale and zero point per
                     channel), values per token (scale and zero point per vector)
* ``kchan-vrot``     keys per channel over each block (absmax scale, symmetric), values rotated per token
                     (with the tail: ``--kv-cache-dtype int4`` 2026-12-04 to 12-05)
* ``kzero-vrot``     keys per channel over each block, asymmetric: a float8 step and an int8 zero point
                     per channel (two bytes, as kchan's scale), values rotated per token (with the tail:
                     ``--kv-cache-dtype int4`` since 2026-12-05, kv/int4.py)
* ``k5zero-v3rot``   kzero-vrot with a bit moved from V to K: 5-bit key codes, 3-bit value codes, the
                     same bytes
* ``kmix-vrot``      kzero-vrot with each key channel's bits chosen per layer and KV head (1 to 8, 4 on
                     average: the same bytes, e.g. as bit planes): calibrated once on prose outside the
                     held-out windows (``--calib-tokens``), a channel's share of the score error taken
                     as E[q_c^2] x E[block range_c^2] / (2^b - 1)^2 and the bits given greedily where they
                     remove the most of it
* ``kasym8-vrot``    the same with the channel's minimum as float8 instead of an int8 zero point, both
                     relative to a float16 unit per block and head
* ``kexact-vrot``, ``kchan-vexact``  one side left exact: which of K and V costs the recall
* ``...+tail``       any of the above with the sequence's last, unfilled block kept in full precision:
                     a query sees its own block's keys and values exact, earlier blocks quantized (a
                     per-channel key scale needs the block's 16 tokens, so the block waits in float
                     until it fills)
* ``...+sink``       (after ``+tail`` or alone) the sequence's first block kept exact too: the first
                     tokens draw much of every query's attention (the attention sink)

Run: ``python examples/int4_kv_study.py --windows 8 --window-len 512`` (2 threads: minutes), or with
``--needles 100`` needle recall instead of perplexity, on the haystacks ``bench retrieval`` builds
(the same seed): each haystack's shared document prefilled once, each question answered greedily
through the format, every format paired against float32 needle by needle.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from pagedserve.engine.core.key_bits import allocate_bits

BLOCK = 16
QMAX4 = 7.0  # symmetric int4: -7..7
LEVELS4 = 15.0  # asymmetric int4: 0..15


def hadamard(n: int) -> torch.Tensor:
    from pagedserve.kv.quant import hadamard_matrix

    return hadamard_matrix(n)


def per_vector_sym(x: torch.Tensor) -> torch.Tensor:
    """Symmetric int4 over the last dimension (one scale per vector), rounded back to float."""
    scale = x.abs().amax(-1, keepdim=True).clamp_min(1e-6) / QMAX4
    return (x / scale).round().clamp(-QMAX4, QMAX4) * scale.half().float()


def per_vector_asym(x: torch.Tensor) -> torch.Tensor:
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    scale = ((hi - lo) / LEVELS4).clamp_min(1e-6)
    return ((x - lo) / scale).round().clamp(0, LEVELS4) * scale.half().float() + lo.half().float()


def block_ranges(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [b, heads, T, d] padded into 16-token blocks [b, heads, T/16, 16, d], with each channel's
    minimum and maximum over each block's valid rows [b, heads, T/16, 1, d]."""
    t = x.shape[2]
    xp = torch.nn.functional.pad(x, (0, 0, 0, (-t) % BLOCK)).unflatten(2, (-1, BLOCK))
    valid = (torch.arange(xp.shape[2] * BLOCK).view(-1, BLOCK) < t).view(1, 1, -1, BLOCK, 1)
    big = torch.finfo(x.dtype).max
    return xp, torch.where(valid, xp, big).amin(3, keepdim=True), torch.where(valid, xp, -big).amax(3, keepdim=True)


def per_channel_blocks(x: torch.Tensor, asym: bool) -> torch.Tensor:
    """x [b, heads, T, d]: each channel over each 16-token block (positions 16k..16k+15) shares a scale
    (a partial last block's padding does not widen the range)."""
    xp, lo, hi = block_ranges(x)
    if asym:
        scale = ((hi - lo) / LEVELS4).clamp_min(1e-6)
        q = ((xp - lo) / scale).round().clamp(0, LEVELS4) * scale.half().float() + lo.half().float()
    else:
        scale = torch.maximum(lo.abs(), hi.abs()).clamp_min(1e-6) / QMAX4
        q = (xp / scale).round().clamp(-QMAX4, QMAX4) * scale.half().float()
    return q.flatten(2, 3)[:, :, :x.shape[2]]


def fp8_step(x: torch.Tensor, down: bool) -> torch.Tensor:
    """x rounded to float8 e4m3 towards -inf (down) or +inf, as float32."""
    y = x.to(torch.float8_e4m3fn)
    bits = y.view(torch.uint8).to(torch.int16)
    wrong = (y.float() > x) if down else (y.float() < x)
    neg = bits >= 128
    mag = bits & 0x7F
    # one step away from the wrong side: towards -inf shrinks a positive magnitude, grows a negative one
    grow = wrong & (neg if down else ~neg)
    shrink = wrong & ~(neg if down else ~neg)
    mag = torch.where(grow, mag + 1, torch.where(shrink & (mag > 0), mag - 1, mag))
    # crossing zero: the smallest magnitude of the other sign
    cross = shrink & ((bits & 0x7F) == 0)
    sign = torch.where(cross, 128 - (bits & 0x80), bits & 0x80)
    mag = torch.where(cross, torch.ones_like(mag), mag)
    return (sign | mag).to(torch.uint8).view(torch.float8_e4m3fn).float()


def per_channel_blocks_fp8(x: torch.Tensor) -> torch.Tensor:
    """Asymmetric int4 per channel over each 16-token block, its minimum and step stored as float8
    e4m3 relative to a power-of-two unit per block and head: the bytes of a float16 absmax scale."""
    xp, lo, hi = block_ranges(x)
    peak = torch.maximum(lo.abs(), hi.abs()).amax(-1, keepdim=True).clamp_min(1e-6)
    unit = torch.exp2(torch.ceil(torch.log2(peak / 256)))
    lo8 = fp8_step(lo / unit, down=True)
    step8 = fp8_step(((hi / unit - lo8) / LEVELS4).clamp_min(2.0 ** -9), down=False)
    q = ((xp / unit - lo8) / step8).round().clamp(0, LEVELS4) * step8 + lo8
    return (q * unit).flatten(2, 3)[:, :, :x.shape[2]]


def per_channel_blocks_zero(x: torch.Tensor, levels: float | torch.Tensor = LEVELS4) -> torch.Tensor:
    """Asymmetric int4 per channel over each 16-token block as ``step_c · (q + z_c)``, q in 0..15:
    each channel's step as float8 e4m3 (rounded up) and its zero point z_c as int8 — two bytes a
    channel, as a float16 absmax scale (``--kv-cache-dtype int4`` since 2026-12-05). ``levels`` 31:
    the same with 5-bit codes; a ``[kv_heads, head_dim]`` tensor: each channel its own (``kmix``)."""
    xp, lo, hi = block_ranges(x)
    if isinstance(levels, torch.Tensor):
        levels = levels.view(1, levels.shape[0], 1, 1, levels.shape[1]).float()
    # the step covers the range, |lo| / step within int8; a rounded zero point clips at most half a step
    step = torch.maximum((hi - lo) / levels, torch.maximum(lo.abs(), hi.abs()) / 127).clamp(2.0 ** -9, 448)
    step8 = fp8_step(step, down=False)
    z = torch.round(lo / step8).clamp(-128, 127)
    q = torch.minimum((xp / step8 - z).round().clamp(min=0), torch.as_tensor(levels))
    return ((q + z) * step8).flatten(2, 3)[:, :, :x.shape[2]]


def calibrate_key_levels(model, tokens: torch.Tensor, state: dict, start: int, count: int) -> dict[int, torch.Tensor]:
    """``kmix``'s levels per layer: float32 passes over ``tokens[start:start + count]`` (512 at a
    time) record each layer's E[q_c^2] (over the query heads of each KV head) and mean squared block
    range of its post-RoPE keys per channel; ``allocate_bits`` (engine/core/key_bits.py, the engine's
    calibration) turns their product into bits."""
    state["format"], state["stats"] = "float32", {}
    with torch.no_grad():
        for s in range(start, start + count, 512):
            model(tokens[s:min(s + 512, start + count)].unsqueeze(0))
    stats = state.pop("stats")
    levels = {}
    for layer, (q2, r2) in stats.items():
        weight = q2 * r2
        bits = torch.stack([allocate_bits(weight[h], 4 * weight.shape[1]) for h in range(weight.shape[0])])
        levels[layer] = 2.0 ** bits.float() - 1
    return levels


def per_vector_sym3(x: torch.Tensor) -> torch.Tensor:
    """Symmetric 3-bit codes (-3..3) over the last dimension, one float16 scale per vector."""
    scale = x.abs().amax(-1, keepdim=True).clamp_min(1e-6) / 3.0
    return (x / scale).round().clamp(-3, 3) * scale.half().float()


def rotated(fn, x: torch.Tensor) -> torch.Tensor:
    hm = hadamard(x.shape[-1]).to(x.dtype)
    return fn(x @ hm) @ hm


FORMATS = {
    "token": (per_vector_sym, per_vector_sym),
    "token-rot": (lambda k: rotated(per_vector_sym, k), lambda v: rotated(per_vector_sym, v)),
    "kivi": (lambda k: per_channel_blocks(k, asym=True), per_vector_asym),
    "kchan-vrot": (lambda k: per_channel_blocks(k, asym=False), lambda v: rotated(per_vector_sym, v)),
    "kasym8-vrot": (per_channel_blocks_fp8, lambda v: rotated(per_vector_sym, v)),
    "kzero-vrot": (per_channel_blocks_zero, lambda v: rotated(per_vector_sym, v)),
    "k5zero-v3rot": (lambda k: per_channel_blocks_zero(k, 31.0), lambda v: rotated(per_vector_sym3, v)),
    "kmix-vrot": (None, lambda v: rotated(per_vector_sym, v)),  # keys: per_channel_blocks_zero with each layer's levels
    "kexact-vrot": (lambda k: k, lambda v: rotated(per_vector_sym, v)),
    "kchan-vexact": (lambda k: per_channel_blocks(k, asym=False), lambda v: v),
}


def bits_per_value(name: str, head_dim: int) -> float:
    """Stored bits per K or V value, averaged over K and V, scales (float16) included (a tail or
    sink block is a per-sequence constant, not a per-token cost)."""
    base = name.split("+")[0]
    per_token = {"sym": 4 + 16 / head_dim, "asym": 4 + 32 / head_dim}
    per_channel = {"sym": 4 + 16 / BLOCK, "asym": 4 + 32 / BLOCK}
    k, v = {"token": (per_token["sym"], per_token["sym"]), "token-rot": (per_token["sym"], per_token["sym"]),
            "kivi": (per_channel["asym"], per_token["asym"]),
            "kchan-vrot": (per_channel["sym"], per_token["sym"]),
            "kzero-vrot": (per_channel["sym"], per_token["sym"]),  # a float8 step and an int8 zero: 2 bytes
            "kmix-vrot": (per_channel["sym"], per_token["sym"]),  # 4 bits a key value on average
            "k5zero-v3rot": (per_channel["sym"] + 1, per_token["sym"] - 1),  # the same bytes, a bit moved to K
            "kasym8-vrot": (per_channel["sym"] + 16 / (BLOCK * head_dim), per_token["sym"]),  # + a unit per head
            "kexact-vrot": (16.0, per_token["sym"]), "kchan-vexact": (per_channel["sym"], 16.0)}[base]
    return (k + v) / 2


def make_attention(state: dict):
    """An attention function for transformers' registry that rounds K and V through state['format']."""

    def attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        name = state["format"]
        groups = query.shape[1] // key.shape[1]
        t = query.shape[2]
        scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
        causal = torch.ones(t, key.shape[2], dtype=torch.bool).tril(key.shape[2] - t)
        if "stats" in state:  # calibrate_key_levels' pass
            _, lo, hi = block_ranges(key)
            q2 = (query.float() ** 2).unflatten(1, (key.shape[1], groups)).mean((0, 2, 3))
            r2 = ((hi - lo) ** 2).mean((0, 2, 3))
            old = state["stats"].get(module.layer_idx)
            state["stats"][module.layer_idx] = (q2, r2) if old is None else (old[0] + q2, old[1] + r2)
        if name == "float32":
            kq, vq, tail = key, value, None
        else:
            base, *extras = name.split("+")
            kfn, vfn = FORMATS[base]
            if base == "kmix-vrot":
                kq = per_channel_blocks_zero(key, state["key_levels"][module.layer_idx])
            else:
                kq = kfn(key)
            vq = vfn(value)
            tail = None
            pos_k = torch.arange(key.shape[2])[None, :]
            if "tail" in extras:  # a query's own block stays exact
                pos_q = torch.arange(key.shape[2] - t, key.shape[2])
                tail = (pos_q[:, None] // BLOCK) == (pos_k // BLOCK)
            if "sink" in extras:  # the sequence's first block stays exact (the attention sink's keys)
                sink = (pos_k < BLOCK).expand(t, -1)
                tail = sink if tail is None else tail | sink
        kq, vq = kq.repeat_interleave(groups, 1), vq.repeat_interleave(groups, 1)
        scores = query @ kq.transpose(-1, -2) * scaling
        if tail is not None:
            exact = query @ key.repeat_interleave(groups, 1).transpose(-1, -2) * scaling
            scores = torch.where(tail, exact, scores)
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        if tail is None:
            out = probs @ vq
        else:
            v_exact = value.repeat_interleave(groups, 1)
            out = (probs * tail) @ v_exact + (probs * ~tail) @ vq
        return out.transpose(1, 2).contiguous(), None

    return attend


def answer_needles(model, tokenizer, ctx, max_tokens: int = 16) -> list[str]:
    """Greedy answers to one haystack's questions: the shared document is prefilled once and its
    (exact) cache copied for each question; the attention function rounds what it reads, so every
    question sees the document through the format as the engine's prefix cache would serve it."""
    import copy

    from transformers import DynamicCache

    prompts = ctx.prompts
    shared = 0
    while all(len(p) > shared + 1 and p[shared] == prompts[0][shared] for p in prompts):
        shared += 1
    answers = []
    with torch.no_grad():
        base = DynamicCache()
        if shared:
            model(torch.tensor([prompts[0][:shared]]), past_key_values=base, use_cache=True)
        for p in prompts:
            cache = copy.deepcopy(base)
            logits = model(torch.tensor([p[shared:]]), past_key_values=cache, use_cache=True).logits
            out = []
            for _ in range(max_tokens):
                tok = int(logits[0, -1].argmax())
                if tok == tokenizer.eos_token_id:
                    break
                out.append(tok)
                logits = model(torch.tensor([[tok]]), past_key_values=cache, use_cache=True).logits
            answers.append(tokenizer.decode(out))
    return answers


def needle_study(model, tokenizer, state: dict, args) -> None:
    """Recall per format on the contexts ``bench retrieval`` builds with the same settings, each
    format paired against float32 needle by needle."""
    from pagedserve.bench.corpus import load_prose
    from pagedserve.bench.paired_stats import compare_paired
    from pagedserve.bench.retrieval import make_contexts, recalled

    paragraphs, _ = load_prose()
    contexts = make_contexts(tokenizer, paragraphs, args.all_lengths, args.needles, args.needles_per_context,
                             [0.1, 0.3, 0.5, 0.7, 0.9], 0)
    contexts = [c for c in contexts if c.length in args.lengths]
    found: dict[str, list[bool]] = {}
    for name in ["float32"] + [f for f in args.formats if f != "float32"]:
        state["format"] = name
        start = time.perf_counter()
        hits = []
        for c in contexts:
            hits += [recalled(a, n.code) for a, n in zip(answer_needles(model, tokenizer, c), c.needles)]
        found[name] = hits
        line = f"{name}: {sum(hits)}/{len(hits)} ({time.perf_counter() - start:.0f} s)"
        if name != "float32":
            line += "; vs float32 " + compare_paired(found["float32"], hits).describe()
        print(line, flush=True)


def main() -> None:
    from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from pagedserve.bench.corpus import load_prose
    from pagedserve.bench.quality import heldout_windows, mean_kl, top1_agreement
    from pagedserve.models.default import ensure_default_model
    from pagedserve.models.gguf import prepare_gguf_dir

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--windows", type=int, default=8, help="held-out windows")
    p.add_argument("--window-len", type=int, default=512, help="tokens per window")
    p.add_argument("--formats", nargs="+", default=[f + s for f in FORMATS for s in ("", "+tail")])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--needles", type=int, default=0,
                   help="instead of perplexity: needle recall over this many needles per length, the haystacks "
                        "`bench retrieval --needles N --needles-per-context K` builds (seed 0)")
    p.add_argument("--needles-per-context", type=int, default=10)
    p.add_argument("--lengths", nargs="+", type=int, default=[1024], help="lengths asked (needle mode)")
    p.add_argument("--all-lengths", nargs="+", type=int, default=[1024, 2048, 4096, 7168],
                   help="the retrieval run's --lengths, which decide the seeded haystacks")
    p.add_argument("--calib-tokens", type=int, default=3072,
                   help="kmix: prose tokens its key bits are calibrated on (outside the held-out windows)")
    p.add_argument("--calib-part", default="",
                   help="kmix: calibrate on this part of the Python docs (e.g. howto) instead of the tutorial")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    path = ensure_default_model()
    prepared = prepare_gguf_dir(path)
    config = AutoConfig.from_pretrained(prepared)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]
    state = {"format": "float32"}
    AttentionInterface.register("int4_study", make_attention(state))
    config._attn_implementation = "int4_study"
    model = AutoModelForCausalLM.from_config(config).float().eval()
    model.load_state_dict(tensors, strict=False)
    model.tie_weights()
    tokenizer = AutoTokenizer.from_pretrained(prepared)
    paragraphs, _ = load_prose()
    tokens = torch.tensor(tokenizer.encode("\n\n".join(paragraphs), add_special_tokens=False))
    windows = heldout_windows(tokens, args.windows, args.window_len)
    if any(f.startswith("kmix") for f in args.formats):
        if args.calib_part:  # another text: its first tokens
            other, _ = load_prose(part=args.calib_part)
            calib = torch.tensor(tokenizer.encode("\n\n".join(other), add_special_tokens=False))
            state["key_levels"] = calibrate_key_levels(model, calib, state, 0, args.calib_tokens)
        else:  # between the first two held-out windows (heldout_windows' spacing), not in either
            start, gap = args.window_len + 100, (len(tokens) - args.window_len - 1) // args.windows
            if start + args.calib_tokens > gap:
                raise SystemExit(f"--calib-tokens {args.calib_tokens} overlaps a held-out window (at most {gap - start})")
            state["key_levels"] = calibrate_key_levels(model, tokens, state, start, args.calib_tokens)
    if args.needles:
        needle_study(model, tokenizer, state, args)
        return

    def score(name: str):
        state["format"] = name
        nll, count, lps = 0.0, 0, []
        with torch.no_grad():
            for w in windows:
                lp = model(torch.tensor([w[:-1]])).logits[0].float().log_softmax(-1)
                nll -= float(lp.gather(1, torch.tensor(w[1:]).unsqueeze(1)).sum())
                count += len(w) - 1
                lps.append(lp)
        return math.exp(nll / count), lps

    start = time.perf_counter()
    ref_ppl, ref = score("float32")
    head_dim = config.hidden_size // config.num_attention_heads
    print(f"SmolLM2-135M-Instruct, {len(windows)} windows x {args.window_len} tokens, float32 KV perplexity "
          f"{ref_ppl:.3f} ({time.perf_counter() - start:.0f} s)\n")
    print("| KV format | bits per value | × bf16 bytes | perplexity | vs float32 | mean KL | top-1 agreement |")
    print("|---|---|---|---|---|---|---|")
    for name in args.formats:
        ppl, lps = score(name)
        bits = bits_per_value(name, head_dim)
        print(f"| {name} | {bits:.2f} | {bits / 16:.3f} | {ppl:.3f} | {100 * (ppl / ref_ppl - 1):+.1f} % | "
              f"{mean_kl(ref, lps):.4f} | {100 * top1_agreement(ref, lps):.1f} % |", flush=True)


if __name__ == "__main__":
    main()
