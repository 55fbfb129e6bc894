"""Token-bucket admits: the fluid formulas against an exact replay of discrete requests."""

from __future__ import annotations

import numpy as np
import pytest

from pagedserve.planner import bucket


def test_steady_overload_admits_burst_plus_refill() -> None:
    result = bucket.bucket_admits(rate=100, burst=500, window=60, offered_rate=300)
    assert result.offered_tokens == 18_000
    assert result.admitted_tokens == 500 + 100 * 60
    assert result.refused_tokens == 18_000 - 6_500


def test_steady_underload_admits_everything() -> None:
    result = bucket.bucket_admits(rate=100, burst=10, window=60, offered_rate=80)
    assert result.admitted_tokens == result.offered_tokens == 4800
    assert result.admitted_fraction == 1.0


def test_a_short_window_is_covered_by_the_burst() -> None:
    # Offered 300/s against 100/s: the 500-token burst lasts 500 / (300 − 100) = 2.5 s.
    assert bucket.bucket_admits(100, 500, 2.0, 300).admitted_tokens == 600
    assert bucket.bucket_admits(100, 500, 3.0, 300).admitted_tokens == 800


def test_one_burst_at_the_start_gets_the_bucket() -> None:
    assert bucket.bucket_admits(100, 500, 60, 300, pattern="burst").admitted_tokens == 500


def test_periodic_bursts_get_at_most_the_bucket_each() -> None:
    # 3,000 tokens every 10 s; the bucket refills 1,000 in 10 s but holds only 500.
    assert bucket.bucket_admits(100, 500, 60, 300, pattern="periodic", period=10).admitted_tokens == 6 * 500
    # A deep bucket: the first burst leaves 2,000, which with a 1,000 refill pays for the second
    # burst in full; from then on each burst gets just the 10 s refill.
    deep = bucket.bucket_admits(100, 5000, 60, 300, pattern="periodic", period=10)
    assert deep.admitted_tokens == 3000 + 3000 + 4 * 1000


def test_request_counts_are_whole_requests() -> None:
    result = bucket.bucket_admits(100, 505, 60, 300, cost=10)
    assert result.admitted_requests == 650  # 6,505 tokens pay for 650 whole requests
    assert result.offered_requests == 1800


def test_replay_of_evenly_spaced_requests_matches_the_formula() -> None:
    rate, burst, cost, window, offered = 100.0, 500.0, 10.0, 60.0, 300.0
    times = np.arange(0, window, cost / offered)
    admitted = bucket.replay_token_bucket(times, cost, rate, burst).sum()
    expected = bucket.bucket_admits(rate, burst, window, offered, cost=cost).admitted_requests
    assert abs(admitted - expected) <= 1


def test_replay_takes_whole_costs_and_refills_to_the_burst() -> None:
    admitted = bucket.replay_token_bucket([0.0, 0.0, 0.0, 1.0, 100.0, 100.0, 100.0], 4.0, rate=4.0, burst=8.0)
    assert admitted.tolist() == [True, True, False, True, True, True, False]


def test_bad_inputs_are_typed_errors() -> None:
    with pytest.raises(bucket.BucketError, match="sorted"):
        bucket.replay_token_bucket([1.0, 0.5], 1.0, 1.0, 1.0)
    with pytest.raises(bucket.BucketError, match="pattern"):
        bucket.bucket_admits(1, 1, 1, 1, pattern="sawtooth")
    with pytest.raises(bucket.BucketError, match="period"):
        bucket.bucket_admits(1, 1, 1, 1, pattern="periodic")
    with pytest.raises(bucket.BucketError):
        bucket.bucket_admits(-1, 1, 1, 1)
