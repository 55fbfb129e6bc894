r"""The page allocator: fixed-size KV blocks, per-sequence block tables, automatic prefix caching.

Ownership of one sequence's cache (``n = 2`` samples of one prompt, prefix shared with an
earlier request)::

    logical block:      0          1          2            3
    seq A table:   [ blk 7 ]  [ blk 3 ]  [ blk 12 ]   [ blk 20 ]   <- A's own tail (written by A)
    seq B table:   [ blk 7 ]  [ blk 3 ]  [ blk 12 ]   [ blk 21 ]   <- B's copy, made on first write
                   \______ shared, full, read-only ______/
                    cached by content: (parent content id, 16 token ids, extra key)

Full blocks are immutable and may be shared by any number of tables (reference counted).
The last, partially filled block is private to its writer; when two sequences fork from one
prompt it is shared until one of them writes into it, and that writer gets its own copy
(copy-on-write: the copy is reported to the runner, which performs it before the step).

Prefix caching keys a full block by ``(parent_content_id, token_ids, extra)``: the dict compares
the whole key, token ids included, so a hash collision can never hand out someone else's cache.
``content_id`` is a fresh integer each time a block is registered and is never reused, so when a
parent is evicted its children become unreachable instead of silently matching a new parent.
``extra`` (on the first block only) carries what else changes the KV or must isolate tenants:
the KV dtype and the request's ``cache_salt``.

Free blocks sit in an intrusive doubly linked list in LRU order: allocation takes the head
(evicting its cached content), a cache hit unlinks a block from the middle in O(1), and a
finished sequence returns its blocks tail first so a prefix chain is evicted from its end.

With a :class:`~pagedserve.kv.events.KVEventLog` (``--kv-events-endpoint``), every block entering or
leaving the prefix cache is recorded there under its content hash, for routers; without one
nothing is hashed or recorded.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Sequence as Seq

from pagedserve.kv.events import KVEventLog, block_hash

ROOT_CONTENT_ID = 0


class KVBlock:
    """One physical block of ``block_size`` token slots in every layer's KV tensors."""

    __slots__ = ("block_id", "ref_count", "cache_key", "content_id", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.cache_key: tuple | None = None  # set while the block's content is in the prefix cache
        self.content_id = ROOT_CONTENT_ID
        self.block_hash: int | None = None  # content hash for KV events (only when they are on)
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref={self.ref_count}, cached={self.cache_key is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks, least recently freed at the head. All operations O(1).

    The blocks never handed out yet are not objects but one run of ids, held in the list by a single
    marker node, each built into a :class:`KVBlock` only when popped: a pool of a few hundred
    thousand blocks costs nothing to set up (building them all took the engine's start-up over a
    second). Blocks come out in exactly the order they would if all had been built and queued in id
    order at the start (frees append behind the marker, which hands out its ids lowest first).
    """

    def __init__(self, num_blocks: int):
        self._head = KVBlock(-1)  # sentinels keep the link code branch-free
        self._tail = KVBlock(-2)
        self._fresh = KVBlock(-3)  # the marker standing for the never-used blocks
        self.blocks: list[KVBlock] = []  # every block built so far, by id (ids 0..len-1)
        self._num_blocks = num_blocks
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free = 0
        if num_blocks > 0:
            self._link_after(self._head, self._fresh)
            self.num_free = num_blocks

    @property
    def num_unbuilt(self) -> int:
        """Blocks never handed out, not built yet (all free, all empty)."""
        return self._num_blocks - len(self.blocks)

    def append(self, block: KVBlock) -> None:
        self._link_after(self._tail.prev_free, block)

    def appendleft(self, block: KVBlock) -> None:
        """Put a block with nothing worth keeping at the head: the next allocation takes it first."""
        self._link_after(self._head, block)

    def _link_after(self, prev: KVBlock | None, block: KVBlock) -> None:
        nxt = prev.next_free
        assert nxt is not None
        prev.next_free, nxt.prev_free = block, block
        block.prev_free, block.next_free = prev, nxt
        self.num_free += 1

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._fresh:
            return self._build_next()
        if block is None or block is self._tail:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def _build_next(self) -> KVBlock:
        """The lowest never-used block, built now; the marker leaves the list with the last one."""
        block = KVBlock(len(self.blocks))
        self.blocks.append(block)
        self.num_free -= 1
        if len(self.blocks) == self._num_blocks:
            self._unlink(self._fresh)
        return block

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free  # _unlink, inlined: this is the allocation hot path
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def _unlink(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None

    def build_all(self) -> list[KVBlock]:
        """Every block, built (the never-used ones take the marker's place in the queue, in id order)."""
        if self.num_unbuilt:
            self.num_free -= self.num_unbuilt  # counted through the marker until now, one by one below
            prev = self._fresh
            for block_id in range(len(self.blocks), self._num_blocks):
                self.blocks.append(KVBlock(block_id))
                self._link_after(prev, self.blocks[-1])
                prev = self.blocks[-1]
            self._unlink(self._fresh)
        return self.blocks

    def __iter__(self):
        """The free blocks that were built, in queue order (the never-used ones hold no content)."""
        block = self._head.next_free
        while block is not None and block is not self._tail:
            if block is not self._fresh:
                yield block
            block = block.next_free


class BlockManager:
    """Hands out KV blocks to sequences (keyed by an integer ``seq_id``) and owns their tables.

    The scheduler calls :meth:`find_cached_prefix` then :meth:`allocate` before a sequence runs,
    :meth:`cache_full_blocks` after its tokens' KV has been written, and :meth:`free` when it
    ends or is preempted. It never sees tensors; the runner reads :meth:`block_ids`.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 events: KVEventLog | None = None, null_block: bool = False):
        """``null_block``: reserve block 0 to stand in tables for blocks given back early
        (:meth:`release_leading`, sliding-window layers); it is never written and, as every
        backend masks what it covers, never read into a result."""
        if num_blocks < 1 + null_block:
            raise ValueError("the KV pool needs at least one block (two with a null block)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.free_queue = FreeBlockQueue(num_blocks)  # builds each block on its first hand-out
        self.tables: dict[int, list[KVBlock]] = {}
        # Content ids of each sequence's full blocks, in order: the chain a child block hangs from.
        self.chains: dict[int, list[int]] = {}
        self._cache: dict[tuple, KVBlock] = {}
        self._next_content_id = ROOT_CONTENT_ID + 1
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) block ids for the runner
        # Free blocks whose cached content a prefix hit could still reuse (kept as a count: O(1)).
        self.num_cached_free_blocks = 0
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0
        self.events = events
        # With events: each sequence's full blocks' content hashes, in step with ``chains``.
        self._hash_chains: dict[int, list[int]] = {}
        self.num_evictions = 0  # cached blocks whose content was dropped to reuse the block
        # Held by the manager itself (ref_count 1 + one per table entry standing in for a released block).
        self.null_block = self._take_free() if null_block else None
        # Told the ids of blocks no table holds any more (int4 KV frees their tail slots: kv/int4.py).
        self.on_release: Callable[[list[int]], None] | None = None

    # ---- queries -------------------------------------------------------------------------
    @property
    def blocks(self) -> list[KVBlock]:
        """Every block of the pool, by id (builds the never-used ones: for checks and tests, O(num_blocks))."""
        return self.free_queue.build_all()

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no reference (some may still hold reusable cached content)."""
        return self.free_queue.num_free

    @property
    def num_used_blocks(self) -> int:
        """Blocks some sequence holds (the null block is not counted: nobody's)."""
        return self.num_blocks - self.free_queue.num_free - (self.null_block is not None)

    def block_ids(self, seq_id: int) -> list[int]:
        return [b.block_id for b in self.tables.get(seq_id, ())]

    def tokens_in_use(self, sequences: Iterable[tuple[int, int]]) -> int:
        """Token slots holding computed K/V, over ``(seq_id, computed tokens)`` pairs: a block several
        tables share counted once, as full as the fullest of them fills it. Only a table's block at
        its computed count can be part full, so the rest are gathered by whole slices (the engine's
        stats snapshot walked every block in Python: 0.41 ms at 64 running sequences of W1)."""
        bs = self.block_size
        full: set[KVBlock] = set()
        part: dict[KVBlock, int] = {}
        for seq_id, computed in sequences:
            table = self.tables.get(seq_id, ())
            whole = min(computed // bs, len(table))
            full.update(table[:whole])
            if whole < len(table) and (n := computed - whole * bs) > part.get(table[whole], 0):
                part[table[whole]] = n
        return len(full) * bs + sum(n for block, n in part.items() if block not in full)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def cached_block_hashes(self) -> frozenset[int]:
        """The content hashes of every block in the prefix cache, held or free (KV events on only):
        what a subscriber that applied every event holds."""
        if self.events is None:
            raise RuntimeError("block hashes are kept only with KV events on")
        return self.events.hashes()

    def cached_blocks(self) -> Iterable[KVBlock]:
        """Every block whose content is in the prefix cache, referenced or free (for the block map)."""
        return self._cache.values()

    # ---- prefix cache --------------------------------------------------------------------
    def _key(self, parent: int, tokens: Seq[int], index: int, extra: Hashable) -> tuple:
        return (parent, tuple(tokens), extra if index == 0 else None)

    def find_cached_prefix(self, token_ids: Seq[int], extra: Hashable = None) -> list[KVBlock]:
        """Leading full blocks of ``token_ids`` whose KV is already cached (no references taken).

        At least one token is always left to compute: the step that finishes a prompt must run
        its last token to get logits, so a fully cached prompt gives back its last block.
        """
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        hits: list[KVBlock] = []
        parent = ROOT_CONTENT_ID
        for i in range((len(token_ids) - 1) // bs):
            block = self._cache.get(self._key(parent, token_ids[i * bs:(i + 1) * bs], i, extra))
            if block is None:
                break
            hits.append(block)
            parent = block.content_id
        return hits

    def record_prefix_lookup(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted sequence's lookup (the scheduler calls this once per admission)."""
        self.prefix_queried_tokens += num_queried_tokens
        self.prefix_hit_tokens += num_hit_tokens

    def cache_full_blocks(self, seq_id: int, token_ids: Seq[int], num_computed_tokens: int,
                          extra: Hashable = None) -> None:
        """Register the sequence's blocks that are now full of computed KV in the prefix cache.

        A block whose content is already cached (computed twice in parallel) stays private to
        this sequence; the chain continues from the cached copy's content id.
        """
        if not self.enable_prefix_caching:
            return
        table, chain = self.tables[seq_id], self.chains[seq_id]
        hashes = self._hash_chains.setdefault(seq_id, []) if self.events is not None else None
        bs = self.block_size
        for i in range(len(chain), num_computed_tokens // bs):
            block = table[i]
            if block.cache_key is None:  # not a shared full block (e.g. a prefix hit)
                tokens = token_ids[i * bs:(i + 1) * bs]
                key = self._key(chain[i - 1] if i else ROOT_CONTENT_ID, tokens, i, extra)
                if key in self._cache:
                    block = self._cache[key]  # the chain goes on from the cached copy; this block stays private
                else:
                    block.cache_key, block.content_id = key, self._next_content_id
                    self._next_content_id += 1
                    self._cache[key] = block
                    if hashes is not None:
                        parent_hash = hashes[i - 1] if i else None
                        block.block_hash = block_hash(parent_hash, tokens, extra if i == 0 else None)
                        self.events.stored(block.block_hash, parent_hash, tokens)
            chain.append(block.content_id)
            if hashes is not None:
                hashes.append(block.block_hash)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block that no sequence holds (used by benchmarks for cold runs)."""
        for block in self.free_queue:
            self._evict(block)
        self.num_cached_free_blocks = 0
        if self.events is not None and not self._cache:
            self.events.cleared()  # nothing held stays cached: say so in one event, as vLLM does

    def _evict(self, block: KVBlock) -> None:
        if block.cache_key is not None:
            del self._cache[block.cache_key]
            block.cache_key, block.content_id = None, ROOT_CONTENT_ID
            if self.events is not None:
                self.events.removed(block.block_hash)
                block.block_hash = None

    # ---- allocation ----------------------------------------------------------------------
    def _take_free(self) -> KVBlock:
        block = self.free_queue.popleft()
        if block.cache_key is not None:
            self.num_cached_free_blocks -= 1
            self.num_evictions += 1
        self._evict(block)
        block.ref_count = 1
        return block

    def _ref(self, block: KVBlock) -> None:
        if block.ref_count == 0:
            self.free_queue.remove(block)
            self.num_cached_free_blocks -= block.cache_key is not None
        block.ref_count += 1

    def allocate(self, seq_id: int, num_tokens: int, cached_prefix: Seq[KVBlock] = (),
                 num_computed_tokens: int = 0, reserve: int = 0) -> bool:
        """Make ``seq_id``'s table cover ``num_tokens`` token slots; False (nothing changed) if
        the pool can't.

        ``cached_prefix`` (from :meth:`find_cached_prefix`) is taken by reference for a sequence
        that has no table yet. If the sequence's last block is shared and the next token to
        compute falls into it, it gets a private copy first (copy-on-write). ``reserve`` blocks
        must stay free afterwards (a watermark that keeps room for running sequences to grow).
        """
        if self.blocks_needed(seq_id, num_tokens, cached_prefix, num_computed_tokens) + reserve > self.num_free_blocks:
            return False
        table = self.tables.get(seq_id)
        if table is None:  # a new table shares nothing yet: no copy
            table = self.tables[seq_id] = list(cached_prefix)
            self.chains[seq_id] = []
            for block in cached_prefix:
                self._ref(block)
        elif self._needs_copy(table, num_computed_tokens):  # copy-on-write: the block written next, private
            index = num_computed_tokens // self.block_size
            shared, table[index] = table[index], self._take_free()
            self.pending_copies.append((shared.block_id, table[index].block_id))
            shared.ref_count -= 1  # still > 0: the other writers keep it
        table.extend(self._take_free() for _ in range(self.num_blocks_for(num_tokens) - len(table)))
        return True

    def blocks_needed(self, seq_id: int, num_tokens: int, cached_prefix: Seq[KVBlock] = (),
                      num_computed_tokens: int = 0) -> int:
        """Free blocks :meth:`allocate` would take: new ones, a copy-on-write copy, and hit blocks
        that sit in the free queue (taken out of it)."""
        table = self.tables.get(seq_id)
        if table is None:  # a new table: the hits, then new blocks (no copy)
            hits_in_queue = sum(b.ref_count == 0 for b in cached_prefix)
            return max(0, self.num_blocks_for(num_tokens) - len(cached_prefix)) + hits_in_queue
        return max(0, self.num_blocks_for(num_tokens) - len(table)) + self._needs_copy(table, num_computed_tokens)

    def release_leading(self, seq_id: int, num_blocks: int) -> int:
        """Give back the sequence's first ``num_blocks`` blocks (those a sliding-window layer will
        never read again), each replaced in its table by the null block so positions keep their
        index. Blocks still in the prefix cache stay there, free, until evicted. Returns how many
        were given back now."""
        null = self.null_block
        assert null is not None, "release_leading needs a manager built with null_block=True"
        table = self.tables.get(seq_id, [])
        leading = table[:num_blocks]
        released = [block for block in leading if block is not null]
        table[:len(leading)] = [null] * len(leading)
        null.ref_count += len(released)
        self._unref(released)
        return len(released)

    def _unref(self, blocks: Iterable[KVBlock], front: bool = False) -> None:
        """Drop one reference to each block; those no one holds go back to the free queue (``front``:
        to be reused first, for blocks with no cached content)."""
        freed = []
        for block in blocks:
            block.ref_count -= 1
            if block.ref_count == 0:
                freed.append(block.block_id)
                if front and block.cache_key is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)
                    self.num_cached_free_blocks += block.cache_key is not None
        if freed and self.on_release is not None:
            self.on_release(freed)

    def _needs_copy(self, table: list[KVBlock], num_computed_tokens: int) -> bool:
        index = num_computed_tokens // self.block_size
        return num_computed_tokens % self.block_size != 0 and index < len(table) and table[index].ref_count > 1

    def fork(self, parent_id: int, child_id: int) -> None:
        """Give ``child_id`` the same blocks as ``parent_id`` (shared by reference count)."""
        table = self.tables[parent_id]
        for block in table:
            block.ref_count += 1
        self.tables[child_id] = list(table)
        self.chains[child_id] = list(self.chains[parent_id])
        if parent_id in self._hash_chains:
            self._hash_chains[child_id] = list(self._hash_chains[parent_id])

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def free(self, seq_id: int) -> None:
        """Drop the sequence's references, tail first, so its prefix chain is evicted from the end."""
        self.chains.pop(seq_id, None)
        self._hash_chains.pop(seq_id, None)
        self._unref(reversed(self.tables.pop(seq_id, [])))

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Shrink ``seq_id``'s table to the blocks ``num_tokens`` slots need, dropping the tail
        (speculative decoding's rollback: the blocks that held only rejected drafts).

        The dropped blocks were allocated for the drafts and never registered in the prefix cache
        (only full blocks of accepted tokens are), so they return to the free queue with no content.
        """
        table = self.tables.get(seq_id)
        if table is None:
            return
        keep = self.num_blocks_for(num_tokens)
        assert keep >= len(self.chains[seq_id]), "truncating into the sequence's cached full blocks"
        dropped = table[keep:]
        del table[keep:]
        self._unref(reversed(dropped), front=True)  # empty ones: reused before any cached block

    # ---- checking ------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Assert the allocator's invariants (used by property tests; O(num_blocks))."""
        refs = Counter(block.block_id for table in self.tables.values() for block in table)
        if self.null_block is not None:
            refs[self.null_block.block_id] += 1  # the manager's own reference
        queue = self.free_queue
        built = queue.blocks  # not build_all(): the never-used blocks stay unbuilt, as in service
        assert all(b.block_id == i for i, b in enumerate(built)), "built blocks out of id order"
        assert max(refs, default=-1) < len(built), "a table holds a block that was never handed out"
        free_ids = {b.block_id for b in queue}
        assert len(free_ids) + queue.num_unbuilt == queue.num_free, "free queue count drifted"
        for block in built:
            assert block.ref_count == refs[block.block_id], f"{block}: refcount != tables holding it"
            assert (block.ref_count == 0) == (block.block_id in free_ids), f"{block}: free xor referenced"
        for key, block in self._cache.items():
            assert block.cache_key == key, f"{block}: cache key mismatch"
        cached_free = sum(1 for b in self.free_queue if b.cache_key is not None)
        assert cached_free == self.num_cached_free_blocks, "cached-free count drifted"
        if self.events is not None:
            assert self.events.hashes() == {b.block_hash for b in self._cache.values()}, "event hashes drifted"
