"""The simulator against the formulas (M/M/1, M/M/c, M/G/1, priority, token bucket), and its mechanics."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from pagedserve.planner import bucket, queueing
from pagedserve.planner.simulator import (PoolSpec, SimConfig, SimulationError, TierSpec, fcfs_waits,
                                          priority_waits_run, simulate)

SERVICE = 0.05
# Requests per utilization: enough that the estimate of a mean or p95 wait is within about 3%
# for any seed (its noise grows steeply as utilization nears 1).
REQUESTS = {0.5: 1_000_000, 0.8: 3_000_000, 0.9: 4_000_000}


def _one_pool(servers: int, rate: float, requests: int, seed: int = 0, dist: str = "exp", cv: float = 1.0,
              **tier: object) -> SimConfig:
    return SimConfig(pools=[PoolSpec("p", servers, SERVICE, dist, cv)],
                     tiers=[TierSpec("t", rate, pool="p", **tier)], num_requests=requests, seed=seed)


@pytest.mark.parametrize("servers", [1, 4])
@pytest.mark.parametrize("rho", [0.5, 0.8, 0.9])
def test_simulated_waits_agree_with_mmc_within_5_percent(servers: int, rho: float) -> None:
    rate = rho * servers / SERVICE
    result = simulate(_one_pool(servers, rate, REQUESTS[rho], seed=1))
    formula = queueing.mmc(rate, SERVICE, servers)
    tier = result.tier("t")
    assert tier.mean_wait == pytest.approx(formula.mean_wait, rel=0.05)
    assert tier.wait_p95 == pytest.approx(formula.percentile_wait, rel=0.05)
    assert result.pools[0].utilization == pytest.approx(rho, rel=0.01)


def test_simulated_mg1_agrees_with_pollaczek_khinchine() -> None:
    rate = 0.8 / SERVICE
    for dist, cv in (("det", 0.0), ("lognormal", 0.5), ("gamma", 2.0)):
        result = simulate(_one_pool(1, rate, 2_000_000, seed=2, dist=dist, cv=cv))
        assert result.tier("t").mean_wait == pytest.approx(queueing.mg1(rate, SERVICE, cv).mean_wait, rel=0.05), dist


@pytest.mark.parametrize("servers", [1, 4])
def test_simulated_priority_tiers_agree_with_cobham(servers: int) -> None:
    paid, free = 0.3 * servers / SERVICE, 0.5 * servers / SERVICE
    config = SimConfig(pools=[PoolSpec("p", servers, SERVICE)],
                       tiers=[TierSpec("paid", paid, priority=0, pool="p"), TierSpec("free", free, priority=1, pool="p")],
                       num_requests=2_000_000, seed=3)
    result = simulate(config)
    expected = queueing.priority_waits([paid, free], SERVICE, servers)
    assert result.tier("paid").mean_wait == pytest.approx(expected[0], rel=0.05)
    assert result.tier("free").mean_wait == pytest.approx(expected[1], rel=0.05)


@pytest.mark.parametrize("overload", [0.5, 3.0])
def test_simulated_bucket_admits_agree_with_the_formula(overload: float) -> None:
    # Requests cost 10 tokens; the bucket refills 1,000 tokens/s (100 requests/s) with a burst of 2,000.
    rate, burst, cost = 1000.0, 2000.0, 10.0
    offered = overload * rate / cost
    result = simulate(_one_pool(64, offered, 200_000, seed=4, bucket_rate=rate, bucket_burst=burst, cost=cost))
    tier = result.tier("t")
    expected = bucket.bucket_admits(rate, burst, result.duration, offered * cost, cost=cost).admitted_requests
    assert tier.served + tier.refused_by_bucket == tier.offered
    assert tier.served == pytest.approx(expected, rel=0.01)


def test_shedding_over_a_wait_budget_caps_the_wait() -> None:
    rate = 0.98 / SERVICE
    free = simulate(_one_pool(1, rate, 200_000, seed=5))
    gated = simulate(_one_pool(1, rate, 200_000, seed=5, wait_budget=0.25))
    assert free.tier("t").shed == 0 and gated.tier("t").shed > 0
    assert gated.tier("t").served + gated.tier("t").shed == gated.tier("t").offered
    assert gated.tier("t").wait_p99 < free.tier("t").wait_p99 / 2


def test_fast_path_and_event_loop_give_identical_waits() -> None:
    rng = np.random.default_rng(6)
    arrivals = np.cumsum(rng.exponential(1 / 70, 20_000))
    services = rng.exponential(SERVICE, 20_000)
    for servers in (1, 4):
        loop, shed = priority_waits_run(arrivals, services, np.zeros(20_000, dtype=int), np.full(20_000, np.inf),
                                        servers, SERVICE)
        assert not shed.any()
        np.testing.assert_allclose(fcfs_waits(arrivals, services, servers), loop, atol=1e-9)


def test_runs_are_reproducible_by_seed() -> None:
    a = simulate(_one_pool(2, 30.0, 50_000, seed=7))
    b = simulate(_one_pool(2, 30.0, 50_000, seed=7))
    c = simulate(_one_pool(2, 30.0, 50_000, seed=8))
    assert a.tiers == b.tiers and a.duration == b.duration
    assert a.tiers != c.tiers


def test_a_million_requests_take_seconds() -> None:
    started = time.perf_counter()
    result = simulate(SimConfig(pools=[PoolSpec("p", 8, SERVICE)],
                                tiers=[TierSpec("paid", 60.0, 0, "p"), TierSpec("free", 80.0, 1, "p")],
                                num_requests=1_000_000))
    assert result.num_requests == 1_000_000
    assert time.perf_counter() - started < 20  # a few seconds even on a busy 2-core machine


def test_trace_driven_arrivals(tmp_path: Path) -> None:
    trace = tmp_path / "trace.csv"
    trace.write_text("time,tier,service_time\n0.0,paid,1.0\n0.1,free,1.0\n0.2,paid,1.0\n3.0,free,0.5\n")
    config = SimConfig(pools=[PoolSpec("p", 1, 1.0)], tiers=[TierSpec("paid", 0, 0, "p"), TierSpec("free", 0, 1, "p")],
                       trace=trace, warmup_fraction=0.0)
    result = simulate(config)
    # paid@0 runs 0–1; paid@0.2 outranks free@0.1, runs 1–2; free@0.1 runs 2–3; free@3 finds the seat free.
    assert result.tier("paid").offered == 2 and result.tier("free").offered == 2
    assert result.tier("paid").mean_wait == pytest.approx((0 + 0.8) / 2)
    assert result.tier("free").mean_wait == pytest.approx((1.9 + 0) / 2)


def test_bad_setups_are_typed_errors(tmp_path: Path) -> None:
    with pytest.raises(SimulationError, match="unknown pool"):
        SimConfig(pools=[PoolSpec("a")], tiers=[TierSpec("t", 1.0, pool="b")])
    with pytest.raises(SimulationError, match="distribution"):
        PoolSpec("a", service_dist="pareto")
    with pytest.raises(SimulationError):
        TierSpec("t", -1.0)
    with pytest.raises(SimulationError, match="add up to 0"):
        simulate(SimConfig(pools=[PoolSpec()], tiers=[TierSpec(arrival_rate=0.0)]))
    trace = tmp_path / "bad.csv"
    trace.write_text("time,tier\n0.0,gold\n")
    with pytest.raises(SimulationError, match="unknown tier"):
        simulate(SimConfig(tiers=[TierSpec()], trace=trace))
