"""The core's block map: per-block states that agree with the allocator, and a feed that makes
snapshots only while watched, only on change, at a bounded rate."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from pagedserve.config import EngineConfig
from pagedserve.engine.block_map import CACHED, FREE, OWNED, SHARED
from pagedserve.engine.core.block_map_feed import BlockMapFeed, build_block_map
from pagedserve.engine.frontend.engine import Engine
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.core.scheduler import Scheduler, SchedulerConfig
from pagedserve.kv.block_manager import BlockManager
from tests.conftest import assert_no_leaks


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> Engine:  # type: ignore[no-untyped-def]
    return Engine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64, max_model_len=256, block_size=16))


def _counts(snap) -> dict[int, int]:  # type: ignore[no-untyped-def]
    states = np.frombuffer(snap.state, np.uint8)
    return {s: int((states == s).sum()) for s in (FREE, OWNED, CACHED, SHARED)}


def test_states_match_the_allocator_while_running_and_after(engine: Engine) -> None:
    prompt = list(range(1, 50))  # 3 full blocks + 1 partial
    engine.add_request("fork", prompt, SamplingParams(max_tokens=8, n=2, ignore_eos=True, temperature=1.0, seed=1))
    engine.add_request("solo", prompt[:20], SamplingParams(max_tokens=40, ignore_eos=True))
    for _ in range(3):
        engine.step()
    bm = engine.core.block_manager
    snap = build_block_map(engine.core)
    c = _counts(snap)
    assert c[OWNED] + c[SHARED] == bm.num_used_blocks
    assert c[CACHED] == bm.num_cached_free_blocks
    assert c[SHARED] >= 3, "the two completions of 'fork' share their prompt's full blocks"
    refs = np.frombuffer(snap.refs, np.uint8)
    owners = np.frombuffer(snap.owner, "<i4")
    shared = np.frombuffer(snap.state, np.uint8) == SHARED
    assert (refs[shared] >= 2).all() and (owners[np.frombuffer(snap.state, np.uint8) == FREE] == -1).all()
    listed = {(r.request_id, r.index) for r in snap.requests}
    assert {("fork", 0), ("fork", 1), ("solo", 0)} <= listed
    assert all(r.state == "running" and r.num_blocks > 0 for r in snap.requests)
    while engine.has_unfinished_requests():
        engine.step()
    done = build_block_map(engine.core)
    c = _counts(done)
    assert c[OWNED] == c[SHARED] == 0 and c[CACHED] == bm.num_cached_free_blocks > 0 and not done.requests
    # Cached blocks of one prompt's chain carry one prefix id: the chain's first block's content.
    cached = np.frombuffer(done.owner, "<i4")[np.frombuffer(done.state, np.uint8) == CACHED]
    assert len(set(cached.tolist())) < len(cached)
    assert_no_leaks(engine)


def test_feed_is_off_until_watched_then_bounded_and_sends_only_changes(engine: Engine) -> None:
    feed = BlockMapFeed(max_hz=10.0)
    assert feed.maybe_build(engine.core, 0.0, idle=True) is None, "nobody watches: no snapshot"
    feed.watch(True)
    first = feed.maybe_build(engine.core, 100.0)
    assert first is not None and first.version == 1, "a new watcher gets a snapshot at once"
    assert feed.maybe_build(engine.core, 100.05) is None, "within 1/max_hz: nothing"
    assert feed.maybe_build(engine.core, 101.0) is None, "nothing changed: nothing sent"
    engine.add_request("r", list(range(1, 30)), SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    assert feed.maybe_build(engine.core, 101.01) is None, "rate-limited"
    second = feed.maybe_build(engine.core, 102.0)
    assert second is not None and second.version == 2 and second.num_running == 1
    while engine.has_unfinished_requests():
        engine.step()
    final = feed.maybe_build(engine.core, 102.01, idle=True)
    assert final is not None and final.num_running == 0, "going idle sends the final state at once"
    feed.watch(False)
    assert feed.maybe_build(engine.core, 200.0, idle=True) is None
    assert_no_leaks(engine)


def test_a_large_pool_is_sampled_less_often() -> None:
    """100k blocks, half of them held: one snapshot stays in milliseconds, and the feed spaces them
    out so snapshots cost at most cpu_share of the loop."""
    bm = BlockManager(100_000, 16)
    sched = Scheduler(SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=1024, max_model_len=4096), bm)
    for seq_id in range(200):
        assert bm.allocate(seq_id, 250 * 16)
    core = SimpleNamespace(block_manager=bm, scheduler=sched)
    snap = build_block_map(core)  # type: ignore[arg-type]
    assert _counts(snap)[OWNED] == 50_000 and snap.build_s < 0.5
    feed = BlockMapFeed(max_hz=10.0, cpu_share=0.01)
    feed.watch(True)
    built = feed.maybe_build(core, 0.0)  # type: ignore[arg-type]
    assert built is not None
    assert feed._next_at >= built.build_s / 0.01
