"""AsyncEngine with the real Engine in-process: streaming, abort, admission errors, idling, shutdown."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from pagedserve import errors
from pagedserve.config import EngineConfig
from pagedserve.engine.frontend.async_engine import AsyncEngine
from pagedserve.engine.frontend.client import EngineDeadError
from pagedserve.engine.frontend.engine import Engine
from pagedserve.engine.sampling_params import SamplingParams
from tests.conftest import assert_no_leaks

LONG = SamplingParams(max_tokens=200, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> Engine:  # type: ignore[no-untyped-def]
    return Engine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64, max_model_len=512, max_num_seqs=2,
                               max_waiting=1))


@pytest.fixture
def fresh(engine: Engine) -> Iterator[Engine]:
    """The shared engine; every test must leave it without requests or referenced blocks."""
    yield engine
    assert_no_leaks(engine)


def test_streams_deltas_until_finished(fresh: Engine) -> None:
    async def main() -> tuple[list[int], str]:
        ae = AsyncEngine(fresh.core)
        await ae.start()
        stream = await ae.add_request("r1", [5, 6, 7], SamplingParams(max_tokens=12, ignore_eos=True))
        deltas: list[int] = []
        final = None
        async with stream:
            async for out in stream:
                deltas += out.outputs[0].delta_token_ids
                final = out
        await ae.shutdown()
        assert final is not None and final.finished
        return deltas, final.outputs[0].finish_reason or ""

    deltas, reason = asyncio.run(main())
    assert len(deltas) == 12 and reason == "length"


def test_leaving_early_aborts_and_frees_blocks(fresh: Engine) -> None:
    async def main() -> None:
        ae = AsyncEngine(fresh.core)
        await ae.start()
        stream = await ae.add_request("r2", [5, 6, 7], LONG)
        async with stream:
            async for out in stream:
                if len(out.outputs[0].token_ids) >= 3:
                    break
        for _ in range(100):  # the abort is applied before the next step
            if ae.stats().kv_blocks_used == 0 and ae.stats().num_running == 0:
                break
            await asyncio.sleep(0.01)
        assert ae.stats().kv_blocks_used == 0
        await ae.shutdown()

    asyncio.run(main())


def test_admission_errors_reach_the_caller(fresh: Engine) -> None:
    async def main() -> None:
        ae = AsyncEngine(fresh.core)
        await ae.start()
        with pytest.raises(errors.RequestTooLong):
            await ae.add_request("too-long", [5] * 600, SamplingParams(max_tokens=1))
        with pytest.raises(errors.InvalidRequest):
            await ae.add_request("empty", [], SamplingParams(max_tokens=1))
        running = [await ae.add_request(f"seat{i}", [5, 6], LONG) for i in range(2)]
        waiting = await ae.add_request("waits", [5, 6], LONG)
        with pytest.raises(errors.QueueFull):
            await ae.add_request("refused", [5, 6], LONG)
        with pytest.raises(errors.DuplicateRequestId):
            await ae.add_request("waits", [5, 6], LONG)
        for s in [*running, waiting]:
            s.abort()
        await ae.shutdown()
        with pytest.raises(EngineDeadError):
            await ae.add_request("late", [5], LONG)

    asyncio.run(main())


def test_idle_loop_does_not_step(fresh: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = 0
    real_step = fresh.core.step

    def counting_step():  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        return real_step()

    monkeypatch.setattr(fresh.core, "step", counting_step)

    async def main() -> None:
        ae = AsyncEngine(fresh.core)
        await ae.start()
        stream = await ae.add_request("short", [5], SamplingParams(max_tokens=3, ignore_eos=True))
        async with stream:
            async for _ in stream:
                pass
        busy_calls = calls
        await asyncio.sleep(0.3)  # idle: the thread sleeps on its condition variable
        assert calls == busy_calls
        assert ae.is_running
        await ae.shutdown()
        assert not ae.is_running

    asyncio.run(main())
    assert 3 <= calls <= 6


def test_shutdown_aborts_in_flight_requests(fresh: Engine) -> None:
    async def main() -> list[int]:
        ae = AsyncEngine(fresh.core)
        await ae.start()
        streams = [await ae.add_request(f"inflight{i}", [5, 6, 7], LONG) for i in range(2)]
        await streams[0].__anext__()
        await ae.shutdown(drain_timeout_s=0.0)
        counts = []
        for s in streams:  # each stream ends instead of hanging
            n = 0
            async for _ in s:
                n += 1
            counts.append(n)
        assert ae.stats().kv_blocks_used == 0
        return counts

    assert all(n < 200 for n in asyncio.run(main()))


def test_a_crashing_step_fails_streams_and_refuses_new_work(fresh: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_step():  # type: ignore[no-untyped-def]
        raise RuntimeError("simulated kernel failure")

    monkeypatch.setattr(fresh.core, "step", broken_step)

    async def main() -> None:
        ae = AsyncEngine(fresh.core)
        await ae.start()
        stream = await ae.add_request("doomed", [5, 6], LONG)
        with pytest.raises(EngineDeadError, match="simulated kernel failure"):
            async for _ in stream:
                pass
        assert not ae.is_running
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(ae.add_request("after", [5], LONG), timeout=5)
        await asyncio.wait_for(ae.shutdown(), timeout=5)

    asyncio.run(main())
    fresh.abort("doomed")  # the step thread is gone, so the test may touch the engine directly


def test_queue_wait_estimate_counts_only_the_seats_that_must_free_up():
    from pagedserve.engine.frontend.client import queue_wait_estimate

    # A request queued a moment ago, before the next scheduling pass, with a seat left: nobody waits.
    assert queue_wait_estimate(running=0, waiting=1, seats=2, finished_per_s=0.5, mean_e2e_s=4.0) == 0.0
    assert queue_wait_estimate(running=1, waiting=0, seats=2, finished_per_s=0.5, mean_e2e_s=4.0) == 0.0
    # Full: one seat must free up (at 0.5 per second: 2 s); each waiter ahead adds one more.
    assert queue_wait_estimate(running=2, waiting=0, seats=2, finished_per_s=0.5, mean_e2e_s=4.0) == 2.0
    assert queue_wait_estimate(running=1, waiting=3, seats=2, finished_per_s=0.5, mean_e2e_s=4.0) == 6.0
    # Nothing finished lately: recent requests' mean end-to-end time per seat.
    assert queue_wait_estimate(running=2, waiting=1, seats=2, finished_per_s=0.0, mean_e2e_s=4.0) == 4.0
