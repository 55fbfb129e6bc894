"""W6 bench plumbing: the gateway config it writes is valid, and its summary counts are right."""

from __future__ import annotations

import argparse
import math

import pytest

from pagedserve.bench.tiers import (FREE_KEY, PAID_KEY, EngineTimes, Shot, TiersBenchConfig, _summarise,
                                   add_parser, format_table, gateway_toml, paid_verdicts, plot_waits,
                                   read_request_log)
from pagedserve.gateway.config import parse_config
from pagedserve.gateway.keys import KeyRing
from tests.helpers.servers import wait_for_idle


def test_gateway_toml_is_valid_and_paid_outranks_free() -> None:
    cfg = parse_config(gateway_toml(["http://127.0.0.1:1"], TiersBenchConfig(), 8080))
    paid, free = cfg.tiers["paid"], cfg.tiers["free"]
    assert paid.priority < free.priority and paid.pools == free.pools == ["shared"]
    assert (paid.max_queue_wait_s, free.max_queue_wait_s) == (1.0, 5.0)
    assert cfg.pools["shared"].reserved_seats == TiersBenchConfig().reserved_seats == 2
    ring = KeyRing(cfg.keys)
    assert ring.lookup(PAID_KEY).tier == "paid" and ring.lookup(FREE_KEY).tier == "free"  # type: ignore[union-attr]


def test_summary_counts_shed_and_waits() -> None:
    shots = [Shot("paid", 200, ttft=0.15, queued=0.0, request_id="p1"), Shot("paid", 200, ttft=0.05, request_id="p2"),
             Shot("free", 200, ttft=2.05, queued=2.0, request_id="f1"), Shot("free", 429, code="overloaded"),
             Shot("free", 429, code="rate_limit_exceeded"), Shot("free", 502, code="replica_unreachable")]
    log = {"p1": EngineTimes(0.002, 0.012, 0.006), "p2": EngineTimes(0.001, 0.004, 0.002),
           "f1": EngineTimes(0.0005, 0.03)}  # an older line: no to_core
    ph = _summarise("paid+free", 8, {"paid": 1.0, "free": 3.0}, shots, idle_ttft=0.05, engine_log=log)
    paid, free = ph.tiers["paid"], ph.tiers["free"]
    assert (paid.offered, paid.admitted, paid.shed, paid.unmatched) == (2, 2, {}, 0)
    assert paid.waits == pytest.approx([0.002, 0.001])  # gateway queue (none) + engine queue
    assert paid.ttft_excess["p50"] == pytest.approx(0.05)  # TTFT − idle TTFT, floored at 0: median of 0.1 and 0
    assert paid.engine_ttft["p50"] == pytest.approx(0.008)
    assert paid.engine_to_core["p50"] == pytest.approx(0.004)
    assert free.engine_ttft["p50"] == pytest.approx(0.03) and math.isnan(free.engine_to_core["p95"])
    assert paid.outside_engine["p50"] == pytest.approx(0.092)  # client − replica TTFT: median of 0.138 and 0.046
    assert free.waits == pytest.approx([2.0005])
    assert (free.offered, free.admitted, free.errors) == (4, 1, 1)
    assert free.shed == {"overloaded": 1, "rate_limit_exceeded": 1}
    table = format_table({"phases": [ph]})
    assert "| paid+free | 8 | free | 3.00 | 4 | 1 | 1 overloaded, 1 rate_limit_exceeded |" in table


def test_summary_counts_gateway_queue_and_sheds_after_waiting() -> None:
    shots = [Shot("free", 200, ttft=3.0, queued=2.9), Shot("free", 200, ttft=0.1, queued=0.0),
             Shot("free", 429, code="overloaded", queued=4.95), Shot("free", 429, code="overloaded", queued=0.0)]
    free = _summarise("paid+free", 8, {"free": 3.0}, shots, idle_ttft=0.05, engine_log={}).tiers["free"]
    assert free.shed == {"overloaded": 2} and free.shed_after_wait == 1
    assert free.unmatched == 2 and free.waits == []  # no request log line: not counted as a zero wait
    assert free.gateway_queue["p50"] == pytest.approx(1.45)


def test_request_log_lines_are_parsed(tmp_path) -> None:
    log = tmp_path / "engine.log"
    log.write_text(
        "2026-11-29 14:00:00,000 INFO pagedserve.requests: request w6-paid-1-0 finished: priority=0 reason=length "
        "prompt_tokens=64 output_tokens=64 cached_tokens=0 to_core_ms=2.50 queue_ms=0.12 ttft_ms=5.40 e2e_ms=250.00\n"
        "2026-11-29 14:00:00,000 INFO pagedserve.requests: request older-1 finished: priority=0 reason=length "
        "prompt_tokens=64 output_tokens=64 cached_tokens=0 queue_ms=0.12 ttft_ms=5.40 e2e_ms=250.00\n"
        "2026-11-29 14:00:00,001 INFO pagedserve.engine: 900 tokens/s computed\n"
        "2026-11-29 14:00:00,002 INFO pagedserve.requests: request x finished: priority=0 reason=length "
        "prompt_tokens=1 output_tokens=1 cached_tokens=0 queue_ms=- ttft_ms=- e2e_ms=-\n")
    times = read_request_log(log)
    assert set(times) == {"w6-paid-1-0", "older-1"}
    new, old = times["w6-paid-1-0"], times["older-1"]
    assert (new.queue, new.ttft, new.to_core) == pytest.approx((0.00012, 0.0054, 0.0025))
    assert (old.queue, old.ttft, old.to_core) == (pytest.approx(0.00012), pytest.approx(0.0054), None)


def test_a_given_capacity_is_checked_and_reaches_the_config() -> None:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="bench"))
    assert parser.parse_args(["tiers"]).capacity is None  # default: measured
    assert parser.parse_args(["tiers", "--capacity", "25.5"]).capacity == 25.5
    assert TiersBenchConfig(capacity_rps=25.5).capacity_rps == 25.5
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="capacity_rps"):
            TiersBenchConfig(capacity_rps=bad)


def _paid_phase(name: str, seats: int, ttfts: list[float], free_rate: float = 0.0):
    shots = [Shot("paid", 200, ttft=t, request_id=f"{name}{i}") for i, t in enumerate(ttfts)]
    shots += [Shot("free", 429, code="overloaded")] * (3 if free_rate else 0)
    rates = {"paid": 1.0} | ({"free": free_rate} if free_rate else {})
    return _summarise(name, seats, rates, shots, idle_ttft=0.01, engine_log={})


def test_the_verdict_pools_every_rounds_paid_ttfts(tmp_path) -> None:
    # Round 1 is quiet on both sides, round 2 slow on both: each round's own ratio is 1.5, the pooled
    # p95s compare the two sides' slowest requests over both rounds.
    phases = [_paid_phase("paid-only #1", 8, [0.010] * 20), _paid_phase("paid+free #1", 8, [0.015] * 20, 3.0),
              _paid_phase("paid-only #2", 8, [0.020] * 20), _paid_phase("paid+free #2", 8, [0.030] * 20, 3.0),
              _paid_phase("paid-only -30% #1", 6, [0.010] * 20), _paid_phase("paid+free -30% #1", 6, [0.012] * 20, 3.0)]
    eight, six = paid_verdicts(phases)
    assert (eight.seats, six.seats) == (8, 6) and (eight.phase, six.phase) == ("paid+free", "paid+free -30%")
    assert eight.round_ratios == pytest.approx([1.5, 1.5]) and eight.median_round_ratio == pytest.approx(1.5)
    assert (eight.alone_p95, eight.with_free_p95) == (pytest.approx(0.020), pytest.approx(0.030))
    assert eight.ratio == pytest.approx(1.5)
    assert six.round_ratios == pytest.approx([1.2]) and six.ratio == pytest.approx(1.2)
    # Pooled, not the mean of the rounds' p95s: one slow request in each side's 40 is under the p95.
    phases[1] = _paid_phase("paid+free #1", 8, [0.015] * 19 + [0.5], 3.0)
    assert paid_verdicts(phases)[0].with_free_p95 == pytest.approx(0.030)
    plot_waits({"config": {"paid_budget_s": 1.0, "free_budget_s": 5.0, "removed_fraction": 0.3, "paid_load": 0.25,
                           "free_load": 3.0}, "phases": phases}, tmp_path / "w6_waits.png")
    assert (tmp_path / "w6_waits.png").stat().st_size > 0


def test_rounds_are_checked_and_reach_the_config() -> None:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="bench"))
    assert parser.parse_args(["tiers"]).rounds == 1
    assert parser.parse_args(["tiers", "--rounds", "3"]).rounds == 3
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match="rounds"):
            TiersBenchConfig(rounds=bad)  # type: ignore[arg-type]


def test_bad_flags_end_in_one_line_not_a_traceback() -> None:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="bench"))
    for argv in (["tiers", "--capacity", "-1"], ["tiers", "--reserved-seats", "99"], ["tiers", "--rounds", "0"]):
        args = parser.parse_args(argv)
        with pytest.raises(SystemExit) as exc:
            args.func(args)
        assert str(exc.value).startswith("pagedserve bench tiers: ") and "\n" not in str(exc.value)


def test_the_stack_keeps_the_replica_and_gateway_logs(tiny_model_dir, tmp_path) -> None:
    import httpx

    from pagedserve.bench.tiers import serving_stack

    cfg = TiersBenchConfig(server_args=["--dtype", "float32", "--max-model-len", "256"])
    with serving_stack(tiny_model_dir, 4, cfg, tmp_path) as stack:
        r = httpx.post(f"{stack.url}/v1/completions", timeout=60, headers={"Authorization": f"Bearer {PAID_KEY}"},
                       json={"model": "w6", "prompt": [5, 6, 7, 8], "max_tokens": 2, "request_id": "w6-paid-log"})
        assert r.status_code == 200, r.text
        replica = parse_config((tmp_path / "gateway-4.toml").read_text()).pools["shared"].replicas[0]
        assert wait_for_idle(replica)["kv_blocks_used"] == 0
    gateway_log = (tmp_path / "gateway-4.log").read_text()
    assert "admit reason=admitted tier=paid" in gateway_log and "queued_s=" in gateway_log  # why it waited, or not
    assert "w6-paid-log" in read_request_log(stack.engine_log)
