"""KV groups (kv/groups.py): Gemma 3's layers in equal groups over one pool, window groups giving
their blocks back, allocations all-or-nothing, prefix hits only where every group has the blocks."""

from __future__ import annotations

import pytest

from pagedserve.kv.groups import GroupedBlockManager, KVGroup, kv_groups, layer_slots
from pagedserve.kv.sizing import window_blocks
from tests.helpers.kv_groups import group_blocks_in_use

GEMMA3_270M = [None if (i + 1) % 6 == 0 else 512 for i in range(18)]
BS = 16


def test_gemma3_layers_form_one_full_and_five_window_groups_of_three():
    groups = kv_groups(GEMMA3_270M)
    assert groups[0] == KVGroup(None, (5, 11, 17))
    assert [g.window for g in groups] == [None] + [512] * 5
    assert groups[1].layers == (0, 1, 2) and groups[-1].layers == (14, 15, 16)
    slots = layer_slots(groups)
    assert slots[5] == (0, 0) and slots[17] == (0, 2) and slots[3] == (2, 0)
    assert sorted(slots) == [(g, j) for g in range(6) for j in range(3)]  # each (group, slot) once


def test_uneven_counts_fall_back_to_their_gcd():
    groups = kv_groups([None, 8, 8, None, 8, 8])  # 2 full, 4 window: groups of 2
    assert [(g.window, g.layers) for g in groups] == [(None, (0, 3)), (8, (1, 2)), (8, (4, 5))]


def _grow(bm: GroupedBlockManager, seq_id: int, tokens: list[int], upto: int, step: int) -> None:
    """Compute ``tokens`` ``step`` at a time up to ``upto``, as the scheduler drives the manager."""
    done = 0
    while done < upto:
        n = min(step, upto - done)
        assert bm.allocate(seq_id, done + n, num_computed_tokens=done)
        done += n
        bm.cache_full_blocks(seq_id, tokens, done)


def test_window_groups_hold_their_window_and_give_the_rest_back():
    groups = kv_groups(GEMMA3_270M)
    bm = GroupedBlockManager(2000, BS, groups, max_chunk_tokens=256)
    tokens = list(range(3000))
    _grow(bm, 1, tokens, 2000, 256)  # prompt in chunks
    _grow_decode = [bm.allocate(1, n + 1, num_computed_tokens=n) and bm.cache_full_blocks(1, tokens, n + 1)
                    for n in range(2000, 2100)]
    assert len(_grow_decode) == 100
    bm.check_invariants()
    full = -(-2100 // BS)
    assert len(bm.block_ids(1, 0)) == full and 0 not in bm.block_ids(1, 0)
    for g in range(1, 6):
        ids = bm.block_ids(1, g)
        assert len(ids) == full  # positions keep their index...
        held = [b for b in ids if b != bm.inner.null_block.block_id]
        assert len(held) <= window_blocks(512, BS)  # ...but only the window's blocks are held
    assert group_blocks_in_use(bm, window=True) <= 5 * window_blocks(512, BS)
    assert group_blocks_in_use(bm, window=False) == full
    bm.free(1)
    bm.check_invariants()
    assert bm.num_used_blocks == 0 and not bm.tables


def test_tokens_in_use_reads_the_first_groups_tables():
    bm = GroupedBlockManager(400, BS, kv_groups(GEMMA3_270M), max_chunk_tokens=64)
    _grow(bm, 1, list(range(700)), 700, 64)
    _grow(bm, 2, list(range(1000, 1100)), 90, 64)
    first_group = bm.block_ids(1) + bm.block_ids(2)
    assert len(set(first_group)) == len(first_group)  # the full group: no null entries, nothing shared
    assert bm.tokens_in_use([(1, 700), (2, 90)]) == 790
    bm.free(1)
    bm.free(2)
    assert bm.num_used_blocks == 0


def test_an_allocation_is_all_groups_or_none():
    bm = GroupedBlockManager(40, BS, kv_groups(GEMMA3_270M))
    assert bm.allocate(1, 5 * BS)  # 6 groups x 5 blocks = 30 of the 39 usable
    before = bm.num_free_blocks
    assert not bm.allocate(2, 2 * BS)  # 12 more do not fit: nothing taken
    assert bm.num_free_blocks == before and 2 not in bm.tables
    bm.free(1)
    bm.check_invariants()
    assert bm.num_used_blocks == 0


def test_a_prefix_hit_needs_the_blocks_of_every_group():
    groups = kv_groups(GEMMA3_270M)
    bm = GroupedBlockManager(400, BS, groups, max_chunk_tokens=64)
    tokens = list(range(700))
    _grow(bm, 1, tokens, 700, 64)
    # the window groups gave back (and kept cached) their early blocks: all groups still hit
    assert len(bm.find_cached_prefix(tokens, None)) == 699 // BS
    bm.free(1)
    # another sequence takes every never-used block and a few more off the free queue's head: the
    # window groups' oldest given-back blocks, whose content is evicted. The full group still holds the
    # whole prefix, but no hit is whole.
    assert bm.allocate(9, (bm.inner.free_queue.num_unbuilt // 6 + 1) * BS)
    assert len(bm.inner.find_cached_prefix(tokens, (None, 0))) == 699 // BS
    assert bm.find_cached_prefix(tokens, None) == []
    bm.free(9)
    bm.check_invariants()
    assert bm.num_used_blocks == 0


def test_the_same_tokens_in_another_group_or_salt_are_not_a_hit():
    bm = GroupedBlockManager(200, BS, kv_groups(GEMMA3_270M))
    tokens = list(range(100))
    _grow(bm, 1, tokens, 100, 100)
    assert len(bm.find_cached_prefix(tokens, None)) == 99 // BS
    assert bm.find_cached_prefix(tokens, "other salt") == []
    # the groups' blocks are distinct blocks: one per group per index
    hit = bm.find_cached_prefix(tokens, None)[0]
    assert len({b.block_id for b in hit}) == 6
    bm.free(1)
    assert bm.num_used_blocks == 0


def test_fork_and_truncate_keep_every_group_consistent():
    bm = GroupedBlockManager(400, BS, kv_groups(GEMMA3_270M), max_chunk_tokens=64)
    tokens = list(range(700))
    _grow(bm, 1, tokens, 650, 64)
    bm.fork(1, 2)
    bm.check_invariants()
    assert bm.allocate(2, 660, num_computed_tokens=650)  # a private copy of the shared last block per group
    assert len(bm.take_pending_copies()) == 6
    bm.truncate(2, 651)
    bm.free(1)
    bm.free(2)
    bm.check_invariants()
    assert bm.num_used_blocks == 0


def test_release_needs_a_null_block():
    from pagedserve.kv.block_manager import BlockManager

    bm = BlockManager(8, BS)
    assert bm.allocate(1, 40)
    with pytest.raises(AssertionError):
        bm.release_leading(1, 1)
