"""Checks on a :class:`~pagedserve.kv.groups.GroupedBlockManager` that only tests make."""

from __future__ import annotations

from pagedserve.kv.groups import GroupedBlockManager


def group_blocks_in_use(bm: GroupedBlockManager, window: bool) -> int:
    """Blocks held by the window groups' tables (``window``) or the full groups' (null excluded)."""
    null = bm.inner.null_block
    return len({b.block_id for _, g, table in bm.group_tables() if (bm.groups[g].window is not None) == window
                for b in table if b is not null})
