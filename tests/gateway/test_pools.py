"""Routing arithmetic: queue-wait estimates by priority, least-wait choice, prefix affinity."""

from __future__ import annotations

from pagedserve.gateway.config import PoolConfig, parse_config
from pagedserve.gateway.pools import Pool, Replica, ReplicaLoad, build_pools, prefix_key


def _replica(url: str, running: int, waiting: int, seats: int = 4, service_s: float = 2.0) -> Replica:
    r = Replica(url, healthy=True, load=ReplicaLoad(running, waiting, seats), service_s=service_s)
    return r


def test_wait_is_zero_while_seats_are_free() -> None:
    assert _replica("a", running=3, waiting=0).est_wait(0, 1.0) == 0.0


def test_wait_grows_with_the_queue() -> None:
    # 4 seats full, 4 waiting: a newcomer waits for 5 seats to free, one every 2 s / 4 seats.
    r = _replica("a", running=4, waiting=4)
    assert r.est_wait(0, 1.0) == 5 * 2.0 / 4


def test_requests_sent_since_the_poll_count() -> None:
    r = _replica("a", running=4, waiting=0)
    assert r.est_wait(0, 1.0) == 1 * 2.0 / 4
    r.started(0)
    r.started(0)
    assert r.est_wait(0, 1.0) == 3 * 2.0 / 4
    r.ended(0, None)
    assert r.est_wait(0, 1.0) == 2 * 2.0 / 4


def test_better_priority_does_not_wait_behind_worse() -> None:
    r = _replica("a", running=4, waiting=0)
    for _ in range(6):  # six free (priority 10) requests queue up behind the full seats
        r.started(10)
    free_wait, paid_wait = r.est_wait(10, 1.0), r.est_wait(0, 1.0)
    assert free_wait == 7 * 2.0 / 4
    assert paid_wait == 1 * 2.0 / 4  # the 4 running ones are not ours: maybe paid, so wait for a seat
    r.inflight_at_poll = 6  # the next poll sees our 6 free requests: 4 running, 2 waiting
    r.load = ReplicaLoad(4, 2, 4)
    assert r.est_wait(10, 1.0) == 3 * 2.0 / 4
    assert r.est_wait(0, 1.0) == 0.0  # paid preempts a running free request


def test_engine_measured_seat_turnover_is_used_when_saturated() -> None:
    # Saturated: 4 running, 3 waiting, the engine says the next would wait 2 s → a seat every 0.5 s.
    r = Replica("a", healthy=True, load=ReplicaLoad(4, 3, 4, est_queue_wait_s=2.0), service_s=10.0)
    assert r.est_wait(0, 1.0) == 4 * 0.5
    r.started(0)
    assert r.est_wait(0, 1.0) == 5 * 0.5


def test_engine_estimate_is_a_floor_for_the_last_in_line() -> None:
    r = Replica("a", healthy=True, load=ReplicaLoad(1, 0, 4, est_queue_wait_s=3.0))
    assert r.est_wait(0, 1.0) == 3.0
    r.started(10)
    assert r.est_wait(0, 1.0) == 0.0  # a queued worse-priority request is behind us


def test_choose_least_wait_and_skip_down_replicas() -> None:
    busy, idle, down = _replica("busy", 4, 8), _replica("idle", 1, 0), _replica("down", 0, 0)
    down.healthy = False
    pool = Pool("p", [busy, idle, down])
    for _ in range(5):
        choice = pool.choose(0, None, slack_s=0.25, default_service_s=1.0)
        assert choice is not None and choice[0] is idle and choice[1] == 0.0
    assert pool.est_wait(0, 1.0) == 0.0
    idle.healthy = busy.healthy = False
    assert pool.choose(0, None, slack_s=0.25, default_service_s=1.0) is None
    assert pool.est_wait(0, 1.0) == float("inf")


def test_prefix_affinity_within_slack() -> None:
    a, b = _replica("a", 1, 0), _replica("b", 1, 0)
    pool = Pool("p", [a, b])
    key = prefix_key({"messages": [{"role": "system", "content": "long system prompt"}]}, "salt")
    first = pool.choose(0, key, slack_s=0.25, default_service_s=1.0)
    assert first is not None
    home = first[0]
    for _ in range(6):  # both idle: the prefix goes home every time, not round-robin
        c = pool.choose(0, key, slack_s=0.25, default_service_s=1.0)
        assert c is not None and c[0] is home
    home.load = ReplicaLoad(4, 8, 4)  # home is now far busier than the slack: leave it
    c = pool.choose(0, key, slack_s=0.25, default_service_s=1.0)
    assert c is not None and c[0] is not home


def test_prefix_key_is_scoped_by_salt() -> None:
    body = {"prompt": "same prompt"}
    assert prefix_key(body, "key:a") != prefix_key(body, "key:b")
    assert prefix_key(body, "key:a") == prefix_key({"prompt": "same prompt"}, "key:a")


def test_same_url_in_two_pools_is_one_replica() -> None:
    pools = build_pools([PoolConfig("x", ["http://h:1"]), PoolConfig("y", ["http://h:1", "http://h:2"])])
    assert pools["x"].replicas[0] is pools["y"].replicas[0]


def test_pools_take_their_settings_and_best_tier_from_the_config() -> None:
    config = parse_config("""
[pools.shared]
replicas = ["http://h:1", "http://h:2"]
api_key = "k"
load_source = "vllm"
seats = 8
reserved_seats = 2

[pools.idle]
replicas = ["http://h:3"]

[tiers.paid]
token_rate = 100
token_burst = 1000
pools = ["shared"]
priority = 3

[tiers.free]
token_rate = 10
token_burst = 500
pools = ["shared"]
priority = 7

[keys]
"sk-1" = "free"
""")
    pools = build_pools(config.pools.values())
    shared, idle = pools["shared"], pools["idle"]
    assert [(r.url, r.api_key, r.load_source, r.seats) for r in shared.replicas] == [
        ("http://h:1", "k", "vllm", 8), ("http://h:2", "k", "vllm", 8)]
    # The reserve is kept for the best tier that uses the pool (priority 3), not for priority 0.
    assert (shared.reserved_seats, shared.best_priority) == (2, 3)
    assert shared.reserved_for(3) == 0 and shared.reserved_for(7) == 2
    assert (idle.best_priority, idle.reserved_for(5), idle.replicas[0].api_key) == (0, 0, None)


def test_better_priority_traffic_stretches_the_wait_of_worse() -> None:
    r = _replica("a", running=4, waiting=0)  # service 2 s over 4 seats: a seat every 0.5 s
    for _ in range(2):
        r.started(0)   # paid: half the seats
    for _ in range(4):
        r.started(10)  # free
    r.inflight_at_poll = 6
    r.load = ReplicaLoad(4, 2, 4)
    # Free: 6 ahead of it → 3 seats to wait for, at 0.5 s each, stretched by 1 / (1 − 2/4).
    assert r.est_wait(10, 1.0) == 3 * 0.5 / 0.5
    assert r.est_wait(0, 1.0) == 0.0
