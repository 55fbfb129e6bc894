"""The bodies of ``pagedserve plan …`` and ``pagedserve simulate``: parsed arguments in, a report out.

Each ``run_*`` function takes the argparse namespace and returns ``(text, payload)``: the
table people read and the dictionary ``--json`` prints. The CLI module does the printing.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from pagedserve.planner import bucket, charts, queueing, sizing
from pagedserve.planner.report import render_pairs, render_table
from pagedserve.planner.shapes import ModelShape, ModelShapeError, load_model_shape
from pagedserve.planner.simulator import PoolSpec, SimConfig, SimResult, TierSpec, simulate
from pagedserve.planner.units import (format_bytes, format_duration, format_percent, format_rate, parse_bandwidth,
                                      parse_duration, parse_si, parse_size)

Report = tuple[str, dict[str, Any]]


def resolve_shape(args: argparse.Namespace, need_dims: bool = True) -> ModelShape | None:
    """The model shape from ``--model`` or from ``--layers/--kv-heads/--head-dim`` (and ``--params``)."""
    params = int(parse_si(args.params, "parameter count")) if getattr(args, "params", None) else None
    if getattr(args, "model", None):
        shape = load_model_shape(args.model)
        if params is not None:
            shape = ModelShape(**{**shape.__dict__, "params": params})
        return shape
    dims = (getattr(args, "layers", None), getattr(args, "kv_heads", None), getattr(args, "head_dim", None))
    if all(d is not None for d in dims):
        return ModelShape("custom", dims[0], dims[1], dims[2], params=params)
    if any(d is not None for d in dims):
        raise ModelShapeError("give all three of --layers, --kv-heads and --head-dim (or --model)")
    if need_dims:
        raise ModelShapeError("give --model (a standard name, config.json, model dir or hub id) "
                              "or --layers/--kv-heads/--head-dim")
    return None


def resolve_params(args: argparse.Namespace) -> tuple[float, str]:
    """Parameters a token multiplies through, and where the figure came from."""
    if getattr(args, "params", None):
        return parse_si(args.params, "parameter count"), "--params"
    if getattr(args, "model", None):
        shape = load_model_shape(args.model)
        return float(shape.matmul_params), f"{shape.name} (matmul parameters, {shape.total_params:,} in all)"
    raise ModelShapeError("give --params (e.g. 8B) or --model")


def run_kv(args: argparse.Namespace) -> Report:
    """KV bytes per token, per request at a context length, and for N users, per KV precision."""
    shape = resolve_shape(args)
    assert shape is not None
    rows, payload = [], []
    for precision in args.kv_dtype or sizing.KV_PRECISIONS:
        bpt = shape.kv_pool_bytes_per_token(precision)
        per_seq = shape.kv_tail_bytes_per_sequence(precision)
        per_request = sizing.kv_bytes_per_request(bpt, args.context) + per_seq
        rows.append((precision, format_bytes(bpt), f"{bpt:,.0f}", format_bytes(per_seq), format_bytes(per_request),
                     format_bytes(per_request * args.users)))
        payload.append({"kv_dtype": precision, "bytes_per_token": bpt, "bytes_per_sequence": per_seq,
                        "bytes_per_request": per_request, "bytes_for_users": per_request * args.users})
    title = (f"KV cache of {shape.name}: 2 x {shape.num_layers} layers x {shape.num_kv_heads} KV heads x "
             f"{shape.head_dim} dims x bytes/element (+ a 2-byte scale per K and V vector for fp8/int8, per V "
             f"vector and per key channel of each 16-token block for int4) per token; int4 also keeps each "
             f"sequence's open block at 16 bits (per sequence)")
    text = render_table(["KV dtype", "per token", "bytes", "per sequence", f"per request @ {args.context:,} tok",
                         f"{args.users} users"], rows, title)
    if args.plot:
        contexts = [2**k for k in range(9, 18)]
        charts.kv_vs_context(Path(args.plot), {p["kv_dtype"]: p["bytes_per_token"] for p in payload}, contexts,
                             f"KV per request, {shape.name}")
    return text, {"model": shape.name, "context": args.context, "users": args.users, "rows": payload}


def _free_memory(args: argparse.Namespace, shape: ModelShape | None) -> tuple[float, list[tuple[str, str]]]:
    """The KV budget: ``--free-memory``, or the card minus weights and overhead."""
    if args.free_memory:
        return float(parse_size(args.free_memory)), []
    if not args.card_memory:
        raise sizing.SizingError("give --free-memory, or --card-memory (with --weights-dtype and --overhead)")
    params = parse_si(args.params, "parameter count") if args.params else (shape.total_params if shape else None)
    if params is None:
        raise sizing.SizingError("--card-memory needs the model's size: --model or --params")
    weights = sizing.weight_bytes(params, args.weights_dtype)
    card = parse_size(args.card_memory)
    overhead = parse_size(args.overhead)
    free = sizing.kv_memory_left(card, weights, overhead, args.memory_fraction)
    return free, [("card memory", format_bytes(card)), (f"weights ({args.weights_dtype})", format_bytes(weights)),
                  ("overhead", format_bytes(overhead)), ("memory fraction", f"{args.memory_fraction:g}")]


def run_seats(args: argparse.Namespace) -> Report:
    """Seats under worst-case reservation and under paging, and what reservation leaves idle."""
    shape = resolve_shape(args)
    assert shape is not None
    free, card_rows = _free_memory(args, shape)
    max_len, block = args.max_model_len, args.block_size
    bpt = shape.kv_pool_bytes_per_token(args.kv_dtype, block)
    per_seq = shape.kv_tail_bytes_per_sequence(args.kv_dtype, block)  # int4's tail, one per seat
    seats = sizing.worst_case_seats(free, bpt, max_len, per_seq)
    blocks = sizing.num_kv_blocks(free - seats * per_seq, bpt, block)  # the engine at max_num_seqs = seats
    mean_len = args.mean_len if args.mean_len is not None else max_len
    paged = sizing.paged_seats(free, bpt, block, mean_len, per_seq)
    users = args.users if args.users is not None else seats
    plan = sizing.reservation_plan(bpt, max_len, mean_len, users, block)
    pairs = card_rows + [
        ("KV budget", format_bytes(free)),
        (f"KV per token ({args.kv_dtype})", format_bytes(bpt)),
        *([("KV per sequence (int4 tail)", format_bytes(per_seq))] if per_seq else []),
        (f"KV per request @ {max_len:,} tok", format_bytes(plan.reserved_bytes)),
        ("worst-case seats", f"{seats} (request {seats + 1} refused)"),
        (f"KV blocks of {block} tokens", f"{blocks:,}"),
        ("seats at max len, paged", str(sizing.seats_at_max_len(blocks, block, max_len))),
        (f"paged seats @ mean {mean_len:,} tok", f"{paged} ({paged / seats:.1f}x worst case)" if seats else str(paged)),
        ("in use per request", f"{format_bytes(plan.used_bytes)} of {format_bytes(plan.reserved_bytes)}"),
        ("worst-case utilization", format_percent(plan.utilization)),
        (f"reserved for {users} users", format_bytes(plan.reserved_total)),
        (f"idle across {users} users", f"{format_bytes(plan.idle_total)} of {format_bytes(plan.reserved_total)}"),
        ("paging tail waste (max)", f"{block - 1} tok = {format_bytes(plan.tail_waste_bytes)} per request"),
    ]
    if args.plot:
        contexts = [2**k for k in range(9, 18)]
        by_precision = {p: shape.kv_pool_bytes_per_token(p) for p in sizing.KV_PRECISIONS}
        charts.seats_vs_context(Path(args.plot), free, by_precision, contexts,
                                f"Seats in {format_bytes(free)} of KV, {shape.name}")
    payload = {"model": shape.name, "kv_dtype": args.kv_dtype, "free_bytes": free, "bytes_per_token": bpt,
               "bytes_per_sequence": per_seq,
               "max_model_len": max_len, "worst_case_seats": seats, "num_kv_blocks": blocks, "block_size": block,
               "seats_at_max_len": sizing.seats_at_max_len(blocks, block, max_len), "mean_len": mean_len,
               "paged_seats": paged, "reservation": plan}
    return render_pairs(pairs, f"Seats for {shape.name}"), payload


def run_weights(args: argparse.Namespace) -> Report:
    """Weight bytes per precision, with scales where they apply, and what a card has left for KV."""
    if args.params:
        params, source = parse_si(args.params, "parameter count"), "--params"
    elif args.model:
        shape = load_model_shape(args.model)  # a checkpoint stores every parameter, embeddings included
        params, source = float(shape.total_params), f"{shape.name}, all stored parameters"
    else:
        raise ModelShapeError("give --params (e.g. 8B) or --model")
    rows, payload = [], []
    card = parse_size(args.card_memory) if args.card_memory else None
    overhead = parse_size(args.overhead)
    for precision in args.weights_dtype or sizing.WEIGHT_PRECISIONS:
        core = sizing.weight_bytes(params, precision)
        full = sizing.weight_bytes(params, precision, args.group_size, args.scale_bytes)
        left = None
        if card is not None:
            try:
                left = sizing.kv_memory_left(card, full, overhead, args.memory_fraction)
            except sizing.SizingError:
                left = -1.0
        rows.append((precision, format_bytes(core, binary=False), format_bytes(full - core, binary=False),
                     format_bytes(full, binary=False),
                     "-" if left is None else ("does not fit" if left < 0 else format_bytes(left))))
        payload.append({"weights_dtype": precision, "bytes": core, "scale_bytes": full - core, "total_bytes": full,
                        "kv_memory_left": left})
    headers = ["precision", "weights", f"scales (group {args.group_size})" if args.group_size else "scales", "total",
               f"left for KV on {format_bytes(card, binary=False)}" if card else "left for KV"]
    return render_table(headers, rows, f"Weights of {params:,.0f} parameters ({source})"), \
        {"params": params, "rows": payload}


def run_decode(args: argparse.Namespace) -> Report:
    """Decode tokens/s per stream bounded by bandwidth ÷ bytes read per step, per weight precision."""
    params, source = resolve_params(args)
    bandwidth = parse_bandwidth(args.bandwidth)
    shape = resolve_shape(args, need_dims=False) if (args.model or args.layers) else None
    bpt = shape.kv_pool_bytes_per_token(args.kv_dtype) if shape and args.context else 0.0
    if args.context and not shape:
        raise ModelShapeError("--context needs the model's KV shape: --model or --layers/--kv-heads/--head-dim")
    rows, payload = [], []
    for precision in args.weights_dtype or sizing.WEIGHT_PRECISIONS:
        weights = sizing.weight_bytes(params, precision, args.group_size, args.scale_bytes)
        per_step = sizing.decode_bytes_per_step(weights, bpt, args.context, args.batch)
        per_stream = sizing.decode_tokens_per_s(bandwidth, weights, bpt, args.context, args.batch)
        rows.append((precision, format_bytes(weights, binary=False), format_bytes(per_step, binary=False),
                     f"{per_stream:,.1f}", f"{per_stream * args.batch:,.1f}", format_duration(1 / per_stream)))
        payload.append({"weights_dtype": precision, "weight_bytes": weights, "bytes_per_step": per_step,
                        "tokens_per_s_per_stream": per_stream, "tokens_per_s_total": per_stream * args.batch})
    title = (f"Decode bound at {format_rate(bandwidth, 'B/s')}: {params:,.0f} params ({source}), batch {args.batch}, "
             f"context {args.context:,}")
    headers = ["weights", "weight bytes", "read per step", "tok/s per stream", "tok/s total", "per token"]
    return render_table(headers, rows, title), {"params": params, "bandwidth": bandwidth, "batch": args.batch,
                                                "context": args.context, "kv_bytes_per_token": bpt, "rows": payload}


def run_prefill(args: argparse.Namespace) -> Report:
    """Prefill seconds ≈ 2 × params × prompt tokens ÷ achieved FLOP/s, for each prompt length asked."""
    params, source = resolve_params(args)
    flops = parse_si(args.flops, "FLOP/s")
    rows, payload = [], []
    for tokens in args.prompt_tokens:
        seconds = sizing.prefill_seconds(params, tokens, flops)
        rows.append((f"{tokens:,}", f"{2 * params * tokens:.3g}", format_duration(seconds),
                     f"{tokens / seconds:,.0f}" if seconds else "inf"))
        payload.append({"prompt_tokens": tokens, "flop": 2 * params * tokens, "seconds": seconds})
    return render_table(["prompt tokens", "FLOP", "prefill", "tokens/s"], rows,
                        f"Prefill at {format_rate(flops, 'FLOP/s')}: {params:,.0f} params ({source})"), \
        {"params": params, "flops": flops, "rows": payload}


def run_bucket(args: argparse.Namespace) -> Report:
    """Tokens (and requests) a token bucket admits over a window for an arrival pattern."""
    result = bucket.bucket_admits(args.rate, args.burst, parse_duration(args.window), args.offered_rate,
                                  args.pattern, parse_duration(args.period) if args.period else None, args.cost)
    pairs = [("pattern", args.pattern), ("window", format_duration(result.window)),
             ("offered tokens", f"{result.offered_tokens:,.0f}"), ("admitted tokens", f"{result.admitted_tokens:,.0f}"),
             ("refused tokens", f"{result.refused_tokens:,.0f}"), ("admitted share", format_percent(result.admitted_fraction))]
    if args.cost:
        pairs += [("offered requests", f"{result.offered_requests:,.1f}"),
                  ("admitted requests", f"{result.admitted_requests:,.0f}")]
    title = f"Token bucket: {args.rate:g} tokens/s, burst {args.burst:g}, offered {args.offered_rate:g} tokens/s"
    return render_pairs(pairs, title), {"result": result}


def _queue_rows(label: str, q: queueing.QueueResult) -> tuple[str, ...]:
    return (label, str(q.servers), format_duration(q.service_time), f"{q.arrival_rate:,.2f}", f"{q.utilization:.3f}",
            format_percent(q.p_wait), format_duration(q.mean_wait), format_duration(q.percentile_wait))


def run_queue(args: argparse.Namespace) -> Report:
    """Mean and tail queue wait of a pool (M/M/c, or M/G/1 with --service-cv), priority tiers, capacity loss."""
    lines, payload = [], {}
    service = parse_duration(args.service_time) if args.service_time else None
    rate = args.arrival_rate
    if args.from_waits:
        if args.servers != 1 or args.arrival_rate is not None or args.service_time:
            raise queueing.QueueingError("--from-waits solves a one-seat M/M/1 pool for its arrival rate and "
                                         "service time: drop --servers, --arrival-rate and --service-time")
        if args.loss is None:
            raise queueing.QueueingError("--from-waits needs --loss (the fraction of capacity removed)")
        before, after = (parse_duration(w) for w in args.from_waits)
        rho, service = queueing.solve_mm1_from_waits(before, after, args.loss)
        rate = rho / service
        lines.append(f"Solved M/M/1: utilization {rho:.4f}, service time {format_duration(service)} "
                     f"({rate:,.2f} arrivals/s) gives a mean wait of {format_duration(before)} before the loss.")
        payload["solved"] = {"utilization": rho, "service_time": service, "arrival_rate": rate}
    if rate is None and args.tier_rates:
        rate = sum(args.tier_rates)
    if service is None or rate is None:
        raise queueing.QueueingError("give --arrival-rate and --service-time (or --from-waits with --loss)")
    pct = args.percentile
    headers = ["pool", "seats", "service", "arrivals/s", "utilization", "P(wait)", "mean wait", f"p{pct * 100:g} wait"]
    if args.service_cv is not None and args.servers == 1:
        result = queueing.mg1(rate, service, args.service_cv, pct)
        label = f"M/G/1 (cv {args.service_cv:g})"
        note = "" if args.service_cv == 1 else f"  (p{pct * 100:g} is an exponential-tail approximation for M/G/1)"
    else:
        if args.service_cv is not None and args.service_cv != 1:
            raise queueing.QueueingError("--service-cv other than 1 needs --servers 1 (M/G/1); "
                                         "use `pagedserve simulate` for M/G/c")
        result = queueing.mmc(rate, service, args.servers, pct)
        label, note = ("M/M/1" if args.servers == 1 else f"M/M/{args.servers}"), ""
    rows = [_queue_rows(label, result)]
    payload["queue"] = result
    if not result.stable:
        lines.append(f"Utilization {result.utilization:.2f} >= 1: the queue grows without bound. Shed at least "
                     f"{rate - args.servers / service:,.2f} arrivals/s to keep it bounded.")
    if args.loss is not None:
        drop = queueing.capacity_drop(rate, service, args.servers, args.loss, pct)
        rows.append(_queue_rows(f"after -{args.loss:.0%} capacity", drop.after))
        payload["capacity_drop"] = drop
        if drop.after.stable:
            lines.append(f"Losing {args.loss:.0%} of capacity multiplies the mean wait by {drop.wait_ratio:.1f}x "
                         f"({format_duration(drop.before.mean_wait)} -> {format_duration(drop.after.mean_wait)}); "
                         f"shedding {drop.shed_to_recover:,.2f} arrivals/s restores utilization "
                         f"{drop.before.utilization:.2f}.")
        else:
            lines.append(f"Losing {args.loss:.0%} of capacity pushes utilization to {drop.after.utilization:.2f} "
                         f"(> 1): waits grow without bound. Shed more than {drop.shed_to_stay_bounded:,.2f} arrivals/s "
                         f"to stay bounded, or {drop.shed_to_recover:,.2f}/s to get back to utilization "
                         f"{min(drop.before.utilization, 1):.2f}.")
    text = render_table(headers, rows, "Queue wait (time before service starts)") + ("\n" + note.strip() if note else "")
    if args.tier_rates:
        cv = args.service_cv if args.service_cv is not None else 1.0
        waits = queueing.priority_waits(args.tier_rates, service, args.servers, cv)
        tier_rows = [(f"tier {i + 1}" + (" (highest)" if i == 0 else ""), f"{r:,.2f}", format_duration(w))
                     for i, (r, w) in enumerate(zip(args.tier_rates, waits))]
        text += "\n\n" + render_table(["priority tier", "arrivals/s", "mean wait"], tier_rows,
                                      "Non-preemptive priority (the tiers share the pool)")
        payload["priority_waits"] = waits
    if lines:
        text += "\n\n" + "\n".join(lines)
    if args.plot:
        charts.wait_vs_utilization(Path(args.plot), service, args.servers, result.utilization, pct,
                                   f"{label}, service {format_duration(service)}")
    return text, payload


def run_shed(args: argparse.Namespace) -> Report:
    """Arrivals/s to shed to bring a pool back to a target utilization or wait."""
    service = parse_duration(args.service_time)
    rate = args.arrival_rate
    if (args.target_utilization is None) == (args.target_wait is None):
        raise queueing.QueueingError("give exactly one of --target-utilization and --target-wait")
    if args.target_utilization is not None:
        shed = queueing.shed_for_utilization(rate, service, args.servers, args.target_utilization)
        target = f"utilization <= {args.target_utilization:g}"
    else:
        wait = parse_duration(args.target_wait)
        shed = queueing.shed_for_wait(rate, service, args.servers, wait, args.percentile)
        target = f"{'mean' if args.percentile is None else f'p{args.percentile * 100:g}'} wait <= {format_duration(wait)}"
    kept = rate - shed
    before = queueing.mmc(rate, service, args.servers)
    after = queueing.mmc(kept, service, args.servers)
    pairs = [("target", target), ("arrivals/s offered", f"{rate:,.2f}"), ("arrivals/s to shed", f"{shed:,.2f}"),
             ("share shed", format_percent(shed / rate if rate else 0.0)), ("arrivals/s kept", f"{kept:,.2f}"),
             ("utilization", f"{before.utilization:.3f} -> {after.utilization:.3f}"),
             ("mean wait", f"{format_duration(before.mean_wait)} -> {format_duration(after.mean_wait)}"),
             ("p95 wait", f"{format_duration(before.percentile_wait)} -> {format_duration(after.percentile_wait)}")]
    return render_pairs(pairs, f"Shedding for an M/M/{args.servers} pool, service {format_duration(service)}"), \
        {"target": target, "arrival_rate": rate, "shed_rate": shed, "kept_rate": kept, "before": before, "after": after}


def sim_config_from_args(args: argparse.Namespace) -> SimConfig:
    """A :class:`SimConfig` from ``--config FILE.toml`` or from the single-pool flags."""
    if args.config:
        import tomllib

        try:
            data = tomllib.loads(Path(args.config).read_text())
        except (OSError, tomllib.TOMLDecodeError) as err:
            raise ValueError(f"cannot read simulation config {args.config}: {err}") from None
        pools = [_pool_from_dict(p) for p in data.get("pools", [{}])]
        tiers = [_tier_from_dict(t, pools[0].name) for t in data.get("tiers", [])]
        if not tiers:
            raise ValueError(f"{args.config} has no [[tiers]]")
        return SimConfig(pools=pools, tiers=tiers, num_requests=int(data.get("requests", args.requests)),
                         seed=int(data.get("seed", args.seed)), warmup_fraction=float(data.get("warmup", args.warmup)),
                         trace=Path(data["trace"]) if "trace" in data else (Path(args.trace) if args.trace else None))
    pool = PoolSpec("default", args.servers, parse_duration(args.service_time), args.service_dist,
                    args.service_cv if args.service_cv is not None else 1.0)
    tiers = [parse_tier_spec(spec) for spec in args.tier] if args.tier else \
        [TierSpec("default", args.arrival_rate if args.arrival_rate is not None else 0.8 * pool.servers / pool.service_time)]
    return SimConfig(pools=[pool], tiers=tiers, num_requests=args.requests, seed=args.seed,
                     warmup_fraction=args.warmup, trace=Path(args.trace) if args.trace else None)


_TIER_KEYS = {"priority": int, "pool": str, "bucket_rate": float, "bucket_burst": float, "cost": float,
              "wait_budget": parse_duration}


def parse_tier_spec(spec: str) -> TierSpec:
    """``NAME:RATE[,key=value...]`` → a tier, e.g. ``free:60,priority=1,bucket_rate=50,wait_budget=500ms``."""
    head, _, rest = spec.partition(",")
    name, sep, rate = head.partition(":")
    if not sep or not name:
        raise ValueError(f"tier {spec!r}: write NAME:RATE[,key=value...]")
    fields: dict[str, Any] = {"name": name, "arrival_rate": float(rate)}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not eq or key not in _TIER_KEYS:
            raise ValueError(f"tier {spec!r}: unknown setting {item!r}; known: {', '.join(_TIER_KEYS)}")
        fields[key] = _TIER_KEYS[key](value.strip())
    return TierSpec(**fields)


def _pool_from_dict(data: dict[str, Any]) -> PoolSpec:
    return PoolSpec(name=str(data.get("name", "default")), servers=int(data.get("servers", 1)),
                    service_time=parse_duration(data.get("service_time", 0.05)),
                    service_dist=str(data.get("service_dist", "exp")), service_cv=float(data.get("service_cv", 1.0)))


def _tier_from_dict(data: dict[str, Any], default_pool: str) -> TierSpec:
    unknown = set(data) - {"name", "rate", "arrival_rate", *_TIER_KEYS}
    if unknown:
        raise ValueError(f"tier {data.get('name')!r}: unknown keys {sorted(unknown)}")
    return TierSpec(name=str(data["name"]), arrival_rate=float(data.get("rate", data.get("arrival_rate", 0.0))),
                    priority=int(data.get("priority", 0)), pool=str(data.get("pool", default_pool)),
                    bucket_rate=None if data.get("bucket_rate") is None else float(data["bucket_rate"]),
                    bucket_burst=None if data.get("bucket_burst") is None else float(data["bucket_burst"]),
                    cost=float(data.get("cost", 1.0)),
                    wait_budget=None if data.get("wait_budget") is None else parse_duration(data["wait_budget"]))


def formula_waits(config: SimConfig) -> dict[str, float]:
    """The formulas' mean wait per tier, where they apply: exponential service (or one seat), no gates."""
    out: dict[str, float] = {}
    for pool in config.pools:
        tiers = sorted((t for t in config.tiers if t.pool == pool.name), key=lambda t: t.priority)
        if any(t.bucket_rate is not None or t.wait_budget is not None for t in tiers) or config.trace is not None:
            continue
        if pool.servers > 1 and pool.service_dist != "exp":
            continue
        # Tiers that share a priority share one FIFO queue: merge their rates.
        levels: dict[int, float] = {}
        for t in tiers:
            levels[t.priority] = levels.get(t.priority, 0.0) + t.arrival_rate
        waits = queueing.priority_waits(list(levels.values()), pool.service_time, pool.servers, pool.effective_cv)
        by_level = dict(zip(levels, waits))
        for t in tiers:
            out[t.name] = by_level[t.priority]
    return out


def run_simulate(args: argparse.Namespace) -> Report:
    """Run the discrete-event simulator and report per tier (with the formulas beside it when they apply)."""
    config = sim_config_from_args(args)
    result: SimResult = simulate(config)
    predicted = formula_waits(config)
    rows = []
    for t in result.tiers:
        formula = predicted.get(t.name)
        rows.append((t.name, t.pool, f"{t.offered:,}", f"{t.refused_by_bucket:,}", f"{t.shed:,}", f"{t.served:,}",
                     format_duration(t.wait_p50), format_duration(t.wait_p95), format_duration(t.wait_p99),
                     format_duration(t.mean_wait), "-" if formula is None else format_duration(formula)))
    headers = ["tier", "pool", "offered", "bucket refused", "shed", "served", "wait p50", "wait p95", "wait p99",
               "mean wait", "formula mean"]
    text = render_table(headers, rows, f"Simulated {result.num_requests:,} requests over "
                        f"{format_duration(result.duration)} (seed {config.seed}) in {result.wall_seconds:.2f} s")
    text += "\n\n" + render_table(["pool", "seats", "utilization"],
                                  [(p.name, str(p.servers), f"{p.utilization:.3f}") for p in result.pools])
    if args.plot:
        _plot_sim(Path(args.plot), config, result)
    return text, {"config": config, "result": result, "formula_mean_waits": predicted}


def _plot_sim(path: Path, config: SimConfig, result: SimResult) -> None:
    """Per-tier wait percentiles as bars (p50, p95, p99), in ms."""
    plt = charts._pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    width = 0.25
    for k, (label, attr) in enumerate((("p50", "wait_p50"), ("p95", "wait_p95"), ("p99", "wait_p99"))):
        values = [0.0 if math.isnan(getattr(t, attr)) else getattr(t, attr) * 1e3 for t in result.tiers]
        ax.bar([i + (k - 1) * width for i in range(len(result.tiers))], values, width, label=label)
    ax.set_xticks(range(len(result.tiers)), [t.name for t in result.tiers])
    ax.set_ylabel("queue wait (ms)")
    ax.set_title(f"Simulated waits, {result.num_requests:,} requests (seed {config.seed})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
