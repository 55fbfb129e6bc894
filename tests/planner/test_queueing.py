"""Queueing formulas: Erlang C, M/M/c tails, M/G/1, priority, capacity loss, shedding."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedserve.planner import queueing


def test_erlang_c_matches_a_hand_computed_value() -> None:
    # c = 2, A = 1 Erlang: P0 = 1/3 and C = (A^c / c!) (c / (c − A)) P0 = 1/3.
    assert queueing.erlang_c(2, 1.0) == pytest.approx(1 / 3)
    assert queueing.erlang_c(1, 0.7) == pytest.approx(0.7)  # M/M/1: an arrival waits with probability ρ
    assert queueing.erlang_c(3, 3.5) == 1.0


def test_erlang_c_stays_finite_for_thousands_of_servers() -> None:
    p = queueing.erlang_c(5000, 4900.0)
    assert 0 < p < 1


def test_mm1_mean_and_tail() -> None:
    q = queueing.mm1(16.0, 0.05)
    assert q.utilization == pytest.approx(0.8)
    assert q.mean_wait == pytest.approx(0.8 * 0.05 / 0.2)
    # P(W > t) = ρ exp(−(μ − λ) t): at the p95 it is exactly 5%.
    assert 0.8 * math.exp(-(20 - 16) * q.percentile_wait) == pytest.approx(0.05)
    assert q.mean_response == pytest.approx(q.mean_wait + 0.05)


def test_mmc_tail_is_zero_when_few_arrivals_wait() -> None:
    q = queueing.mmc(10.0, 0.1, servers=10)  # utilization 0.1
    assert q.p_wait < 0.05 and q.percentile_wait == 0.0 and q.mean_wait > 0


def test_unstable_queue_reports_infinite_waits() -> None:
    q = queueing.mmc(100.0, 0.1, servers=5)
    assert not q.stable and math.isinf(q.mean_wait) and math.isinf(q.percentile_wait)
    assert math.isinf(queueing.mg1(30.0, 0.05, 0.5).mean_wait)


@given(rho=st.floats(0.01, 0.98), service=st.floats(1e-3, 10.0))
def test_mg1_at_cv_one_is_mm1_and_at_cv_zero_halves_the_wait(rho: float, service: float) -> None:
    rate = rho / service
    mm1 = queueing.mm1(rate, service)
    assert queueing.mg1(rate, service, 1.0).mean_wait == pytest.approx(mm1.mean_wait)
    assert queueing.mg1(rate, service, 1.0).percentile_wait == pytest.approx(mm1.percentile_wait)
    assert queueing.mg1(rate, service, 0.0).mean_wait == pytest.approx(mm1.mean_wait / 2)


@given(high=st.floats(0.01, 0.45), low=st.floats(0.01, 0.45), servers=st.sampled_from([1, 2, 8]))
def test_priority_waits_conserve_work(high: float, low: float, servers: int) -> None:
    # Kleinrock's conservation law: reordering a work-conserving queue leaves the mean wait unchanged.
    service = 0.05
    rates = [high * servers / service, low * servers / service]
    waits = queueing.priority_waits(rates, service, servers)
    fcfs = queueing.mmc(sum(rates), service, servers).mean_wait
    assert (rates[0] * waits[0] + rates[1] * waits[1]) / sum(rates) == pytest.approx(fcfs, rel=1e-9)
    assert waits[0] <= fcfs <= waits[1]


def test_priority_keeps_the_top_tier_bounded_when_the_pool_is_overloaded() -> None:
    waits = queueing.priority_waits([8.0, 20.0], 0.05)  # total utilization 1.4
    assert math.isfinite(waits[0]) and math.isinf(waits[1])
    with pytest.raises(queueing.QueueingError, match="exponential"):
        queueing.priority_waits([1.0, 1.0], 0.05, servers=4, service_cv=0.5)


def test_single_server_capacity_loss_slows_the_server() -> None:
    drop = queueing.capacity_drop(10.0, 0.05, servers=1, loss_fraction=0.2)
    assert drop.after.service_time == pytest.approx(0.0625)
    assert drop.after.utilization == pytest.approx(0.625)
    assert drop.wait_ratio > 1
    assert drop.shed_to_stay_bounded == 0.0
    assert drop.shed_to_recover == pytest.approx(10.0 - 0.5 * 16.0)


def test_solving_from_waits_rejects_waits_no_mm1_pool_explains() -> None:
    with pytest.raises(queueing.QueueingError):
        queueing.solve_mm1_from_waits(0.1, 0.12, 0.3)  # grows by less than 1/(1 − loss)
    with pytest.raises(queueing.QueueingError):
        queueing.solve_mm1_from_waits(0.1, 0.5, 1.2)


@given(rho=st.floats(0.05, 0.65), loss=st.floats(0.05, 0.3))
def test_solving_from_waits_inverts_the_forward_model(rho: float, loss: float) -> None:
    service = 0.04
    drop = queueing.capacity_drop(rho / service, service, 1, loss)
    solved_rho, solved_service = queueing.solve_mm1_from_waits(drop.before.mean_wait, drop.after.mean_wait, loss)
    assert solved_rho == pytest.approx(rho, rel=1e-6)
    assert solved_service == pytest.approx(service, rel=1e-6)


def test_shed_for_utilization() -> None:
    assert queueing.shed_for_utilization(90.0, 0.1, 10, 0.8) == pytest.approx(10.0)
    assert queueing.shed_for_utilization(50.0, 0.1, 10, 0.8) == 0.0
    with pytest.raises(queueing.QueueingError):
        queueing.shed_for_utilization(90.0, 0.1, 10, 1.0)


@pytest.mark.parametrize(("percentile", "target"), [(None, 0.05), (0.95, 0.2), (0.99, 0.2)])
def test_shedding_for_a_wait_lands_on_the_target(percentile: float | None, target: float) -> None:
    before = queueing.mmc(95.0, 0.1, 10, percentile or 0.95)
    assert (before.percentile_wait if percentile else before.mean_wait) > target
    shed = queueing.shed_for_wait(95.0, 0.1, 10, target, percentile)
    assert 0 < shed < 95
    after = queueing.mmc(95.0 - shed, 0.1, 10, percentile or 0.95)
    wait = after.percentile_wait if percentile else after.mean_wait
    assert wait == pytest.approx(target, rel=1e-6)
    assert queueing.shed_for_wait(10.0, 0.1, 10, target, percentile) == 0.0


def test_bad_inputs_are_typed_errors() -> None:
    with pytest.raises(queueing.QueueingError):
        queueing.mmc(-1.0, 0.1)
    with pytest.raises(queueing.QueueingError):
        queueing.mmc(1.0, 0.0)
    with pytest.raises(queueing.QueueingError):
        queueing.mmc(1.0, 0.1, percentile=1.5)
    with pytest.raises(queueing.QueueingError):
        queueing.erlang_c(0, 1.0)
    with pytest.raises(queueing.QueueingError):
        queueing.capacity_drop(1.0, 0.1, 1, 1.0)
