"""The gateway's seat queue: priority then arrival order, reserved seats, deadlines, cancellation,
the wait estimate, and vLLM's load gauges."""

from __future__ import annotations

import asyncio
import time

import pytest

from pagedserve.gateway.pools import Pool, Replica, ReplicaLoad
from pagedserve.gateway.seats import Dispatcher, Seat

PAID, MID, FREE = 0, 5, 10


def _setup(seats: int, reserved: int = 0, hold_s: float | None = None) -> tuple[Dispatcher, Pool, Replica]:
    r = Replica("http://r", healthy=True, load=ReplicaLoad(0, 0, seats), hold_s=hold_s)
    pool = Pool("p", [r], reserved_seats=reserved, best_priority=PAID)
    return Dispatcher({"p": pool}, default_service_s=1.0, affinity_slack_s=0.25), pool, r


def _far() -> float:
    return time.monotonic() + 60


def test_waiters_get_seats_by_priority_then_arrival() -> None:
    async def main() -> list[str]:
        d, pool, r = _setup(seats=1)
        holder = await d.acquire(pool, PAID, 1, "paid", None, _far())
        assert isinstance(holder, Seat) and holder.queued_s == 0.0
        order: list[str] = []

        async def wait(name: str, priority: int) -> None:
            seat = await d.acquire(pool, priority, 1, name, None, _far())
            assert isinstance(seat, Seat) and seat.queued_s > 0
            order.append(name)
            await asyncio.sleep(0.01)  # hold the seat a moment, then give it back
            d.release(seat)

        tasks = []
        for name, priority in (("free-1", FREE), ("mid", MID), ("free-2", FREE)):
            tasks.append(asyncio.create_task(wait(name, priority)))
            await asyncio.sleep(0.01)
        assert d.queued("p") == {"free-1": 1, "mid": 1, "free-2": 1}
        assert r.inflight_total == 1  # nothing beyond the seat was sent
        d.release(holder)
        await asyncio.gather(*tasks)
        assert r.inflight_total == 0 and not d.queued("p")
        return order

    assert asyncio.run(main()) == ["mid", "free-1", "free-2"]


def test_better_priority_takes_a_seat_a_worse_one_holds() -> None:
    """The engine preempts a worse running request for a better one, so paid is not queued behind free."""
    async def main() -> None:
        d, pool, r = _setup(seats=2)
        free = [await d.acquire(pool, FREE, 1, "free", None, _far()) for _ in range(2)]
        assert all(isinstance(s, Seat) for s in free)
        assert r.free_seats(FREE) == 0
        paid = await d.acquire(pool, PAID, 1, "paid", None, _far())
        assert isinstance(paid, Seat) and paid.queued_s == 0.0
        # Two of our own paid requests fill the seats for paid too: the third waits.
        paid2 = await d.acquire(pool, PAID, 1, "paid", None, _far())
        assert isinstance(paid2, Seat)
        assert await d.acquire(pool, PAID, 1, "paid", None, time.monotonic() + 0.05) == "timeout"
    asyncio.run(main())


def test_reserved_seats_are_kept_for_the_best_tier() -> None:
    async def main() -> None:
        d, pool, r = _setup(seats=3, reserved=1)
        free = [await d.acquire(pool, FREE, 1, "free", None, _far()) for _ in range(2)]
        assert all(isinstance(s, Seat) for s in free)
        # The third seat is paid's: free waits (and here runs out of time).
        assert await d.acquire(pool, FREE, 1, "free", None, time.monotonic() + 0.05) == "timeout"
        # A middle tier may take the seats free holds (the engine preempts free), but not paid's.
        mid = [await d.acquire(pool, MID, 1, "mid", None, _far()) for _ in range(2)]
        assert all(isinstance(s, Seat) for s in mid)
        assert await d.acquire(pool, MID, 1, "mid", None, time.monotonic() + 0.05) == "timeout"
        paid = await d.acquire(pool, PAID, 1, "paid", None, _far())
        assert isinstance(paid, Seat) and paid.queued_s == 0.0
        assert r.inflight_total == 5 and not d.queued("p")  # the timed-out waiters left the queue
    asyncio.run(main())


def test_a_timed_out_or_gone_waiter_leaves_and_a_cancelled_one_gives_its_seat_back() -> None:
    async def main() -> None:
        d, pool, r = _setup(seats=1)
        holder = await d.acquire(pool, FREE, 1, "free", None, _far())
        assert isinstance(holder, Seat)
        start = time.monotonic()
        assert await d.acquire(pool, FREE, 1, "free", None, start + 0.2) == "timeout"
        assert 0.19 <= time.monotonic() - start < 1.0

        async def gone() -> bool:
            return True
        d.check_interval_s = 0.02
        assert await d.acquire(pool, FREE, 1, "free", None, _far(), gone) == "gone"
        assert not d.queued("p")

        # A waiter cancelled right after the seat was handed to it must not keep the seat.
        waiter = asyncio.create_task(d.acquire(pool, FREE, 1, "free", None, _far()))
        await asyncio.sleep(0.01)
        d.release(holder)  # the seat goes to the waiter...
        waiter.cancel()    # ...whose task is cancelled before it runs again
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert r.inflight_total == 0
        d.release(holder)  # a second release of the same seat changes nothing
        assert r.inflight_total == 0
    asyncio.run(main())


def test_estimate_counts_the_queue_ahead_and_the_seats_that_serve_it() -> None:
    async def main() -> None:
        d, pool, r = _setup(seats=3, reserved=1, hold_s=2.0)
        assert d.estimate(pool, FREE) == 0.0  # a seat is free
        seats = [await d.acquire(pool, FREE, 1, "free", None, _far()) for _ in range(2)]
        # Free's two seats are full; each is held 2 s: the next one frees in about 2 / 2 s.
        assert d.estimate(pool, FREE) == pytest.approx(1 * 2.0 / 2)
        waiters = [asyncio.create_task(d.acquire(pool, FREE, 1, "free", None, _far())) for _ in range(3)]
        await asyncio.sleep(0.01)
        assert d.estimate(pool, FREE) == pytest.approx(4 * 2.0 / 2)  # 3 queued ahead + itself
        assert d.estimate(pool, PAID) == 0.0  # paid has its reserved seat, and queues behind no free request
        paid = await d.acquire(pool, PAID, 1, "paid", None, _far())
        paid2 = await d.acquire(pool, PAID, 1, "paid", None, _far())
        assert isinstance(paid, Seat) and isinstance(paid2, Seat)
        # A second paid request holds a seat beyond the reserve: one fewer seat serves free's queue.
        assert d.estimate(pool, FREE) == pytest.approx(4 * 2.0 / 1)
        for w in waiters:
            w.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
        for s in [*seats, paid, paid2]:
            d.release(s)  # type: ignore[arg-type]
        assert r.inflight_total == 0
    asyncio.run(main())


def test_requests_of_other_clients_fill_seats_until_a_poll_says_otherwise() -> None:
    async def main() -> None:
        d, pool, r = _setup(seats=2)
        r.load = ReplicaLoad(2, 0, 2)  # two requests this gateway did not send
        assert r.free_seats(PAID) == 0
        waiter = asyncio.create_task(d.acquire(pool, PAID, 1, "paid", None, _far()))
        await asyncio.sleep(0.01)
        assert not waiter.done()
        r.load = ReplicaLoad(1, 0, 2)  # the next poll: one of them ended
        d.pump()                       # what the poller calls after every round
        seat = await waiter
        assert isinstance(seat, Seat) and seat.replica is r
    asyncio.run(main())


def test_unknown_seat_count_never_queues_here() -> None:
    """A vLLM replica without the pool's `seats`: requests go straight through; its own queue
    (the waiting gauge) is what the wait estimate sees."""
    async def main() -> None:
        r = Replica("http://v", healthy=True, load=ReplicaLoad(3, 0, None), service_s=3.0)
        pool = Pool("v", [r])
        d = Dispatcher({"v": pool}, default_service_s=1.0, affinity_slack_s=0.25)
        seats = [await d.acquire(pool, FREE, 1, "free", None, _far()) for _ in range(5)]
        assert all(isinstance(s, Seat) for s in seats) and r.inflight_total == 5
        assert d.estimate(pool, FREE) == 0.0
        r.load, r.inflight_at_poll = ReplicaLoad(3, 2, None), 5  # vLLM queues 2 of ours behind 3 running
        # Saturated: its running count is its seat count; a newcomer waits for 3 of them to free up.
        assert d.estimate(pool, FREE) == pytest.approx((5 - 3 + 1) * 3.0 / 3)
        r.seats_override = 4  # the pool's `seats`: now the gateway gates
        assert d.estimate(pool, FREE) > 0 and r.free_seats(FREE) < 0
    asyncio.run(main())


VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 5.0
vllm:num_requests_running{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
vllm:num_requests_waiting_by_reason{reason="capacity"} 99.0
vllm:gpu_cache_usage_perc{model_name="m"} 0.5
"""


def test_vllm_gauges_are_read_and_summed_over_engines() -> None:
    load = ReplicaLoad.from_vllm_metrics(VLLM_METRICS)
    assert load is not None and (load.running, load.waiting, load.max_num_seqs) == (7, 3, None)
    assert ReplicaLoad.from_vllm_metrics("vllm:num_requests_running 4\n") == ReplicaLoad(4, 0, None)
    assert ReplicaLoad.from_vllm_metrics("pagedserve_num_requests_running 4\n") is None
