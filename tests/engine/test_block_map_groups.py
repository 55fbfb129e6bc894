"""The block map of a pool shared by KV groups (a tiny Gemma 3: one full-attention group, two
32-token window groups): each held or cached block carries its group in the snapshot's state
byte, and per group the snapshot counts what the block manager's own tables hold, step by step;
a one-table pool's snapshot has no group marks at all."""

from __future__ import annotations

import numpy as np
import pytest

from pagedserve.config import EngineConfig
from pagedserve.engine.block_map import CACHED, FREE, OWNED, SHARED
from pagedserve.engine.core.block_map_feed import build_block_map, split_group_bits
from pagedserve.engine.core.engine_core import EngineCore
from pagedserve.engine.frontend.engine import Engine
from pagedserve.engine.sampling_params import SamplingParams
from tests.conftest import assert_no_leaks

BLOCK = 16


@pytest.fixture(scope="module")
def core(tiny_gemma3_gguf) -> EngineCore:  # type: ignore[no-untyped-def]
    """The engine core alone, token ids in: a front end would only add Gemma 3's tokenizer
    (transformers', 262k tokens), seconds to load and of no use here."""
    return EngineCore(EngineConfig(model=str(tiny_gemma3_gguf), num_kv_blocks=128, max_model_len=512,
                                   block_size=BLOCK, max_num_batched_tokens=64))


def _per_group(snap) -> dict[tuple[int, bool], dict[str, int]]:  # type: ignore[no-untyped-def]
    """``(group, window) → {"used", "cached"}`` from a snapshot, as the dashboard's page counts it."""
    states, tags = split_group_bits(np.frombuffer(snap.state, np.uint8))
    assert not tags[states == FREE].any(), "a free block carries no group"
    assert tags[states != FREE].all(), "every held or cached block of a grouped pool carries its group"
    out: dict[tuple[int, bool], dict[str, int]] = {}
    for tag in np.unique(tags[tags > 0]).tolist():
        mine = tags == tag
        out[(tag >> 1) - 1, bool(tag & 1)] = {"used": int(np.isin(states[mine], (OWNED, SHARED)).sum()),
                                              "cached": int((states[mine] == CACHED).sum())}
    return out


def _held(bm) -> dict[int, set[int]]:  # type: ignore[no-untyped-def]
    """Per group, the blocks its tables hold (the null block left out), read from the manager."""
    null = bm.inner.null_block
    held: dict[int, set[int]] = {g: set() for g in range(len(bm.groups))}
    for _, g, table in bm.group_tables():
        held[g].update(b.block_id for b in table if b is not null)
    return held


def test_each_groups_blocks_match_the_managers_tables_step_by_step(core: EngineCore) -> None:
    bm = core.block_manager
    assert [g.window for g in bm.groups] == [None, 32, 32]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    prompts = {"a": list(range(100, 300)), "b": list(range(5000, 5090))}  # 200 and 90 tokens: past the window
    for rid, p in prompts.items():
        core.add_request(rid, p, params)
    steps = 0
    window_below_full = False
    while core.has_unfinished_requests():
        core.step()
        steps += 1
        snap = build_block_map(core)
        per_group, held = _per_group(snap), _held(bm)
        for g, blocks in held.items():
            assert per_group.get((g, g > 0), {"used": 0})["used"] == len(blocks), (steps, g)
        assert sum(c["used"] for c in per_group.values()) == bm.num_used_blocks
        assert sum(c["cached"] for c in per_group.values()) == bm.num_cached_free_blocks
        # the requests' listed blocks count every group's
        assert sum(r.num_blocks for r in snap.requests) == sum(len(b) for b in held.values())
        if held[0] and max(len(held[1]), len(held[2])) < len(held[0]):
            window_below_full = True
    assert window_below_full, "the window groups never held fewer blocks than the full group"
    # Idle: every group cached the same full blocks of both sequences' computed tokens.
    done = _per_group(build_block_map(core))
    want = sum((len(p) + params.max_tokens - 1) // BLOCK for p in prompts.values())
    assert done == {(0, False): {"used": 0, "cached": want}, (1, True): {"used": 0, "cached": want},
                    (2, True): {"used": 0, "cached": want}}
    assert_no_leaks(core)


def test_a_one_table_pool_has_no_group_marks(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    engine = Engine(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=32, max_model_len=256, block_size=BLOCK))
    engine.add_request("r", list(range(1, 40)), SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    snap = build_block_map(engine.core)
    assert set(np.frombuffer(snap.state, np.uint8).tolist()) <= {FREE, OWNED, CACHED, SHARED}
    assert snap.requests[0].num_blocks == len(engine.core.block_manager.tables[snap.requests[0].seq_id])
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_leaks(engine)
