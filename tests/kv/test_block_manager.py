"""Block manager: unit tests and hypothesis property tests of its invariants."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedserve.kv.block_manager import BlockManager


def test_blocks_are_given_one_at_a_time_as_context_grows():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.allocate(1, 1)
    assert len(bm.tables[1]) == 1
    assert bm.allocate(1, 4)
    assert len(bm.tables[1]) == 1
    assert bm.allocate(1, 5)
    assert len(bm.tables[1]) == 2
    bm.free(1)
    assert bm.num_used_blocks == 0
    bm.check_invariants()


def test_allocation_fails_cleanly_when_pool_is_full():
    bm = BlockManager(num_blocks=3, block_size=4)
    assert bm.allocate(1, 12)
    assert not bm.allocate(2, 1)
    assert 2 not in bm.tables
    bm.check_invariants()


def test_prefix_hit_takes_cached_blocks_and_leaves_last_token():
    bm = BlockManager(num_blocks=16, block_size=4)
    tokens = list(range(12))
    assert bm.allocate(1, 12)
    bm.cache_full_blocks(1, tokens, 12)
    # The whole prompt is cached, but its last token must be computed: 2 of 3 blocks hit.
    hits = bm.find_cached_prefix(tokens)
    assert [b.block_id for b in hits] == bm.block_ids(1)[:2]
    assert bm.allocate(2, 12, hits, num_computed_tokens=8)
    assert bm.block_ids(2)[:2] == bm.block_ids(1)[:2]
    assert bm.tables[2][0].ref_count == 2
    bm.free(1)
    bm.free(2)
    bm.check_invariants()
    # Freed but still cached: a new request with the same opening hits it.
    assert len(bm.find_cached_prefix(tokens + [99])) == 3


def test_hit_compares_token_ids_and_salt():
    bm = BlockManager(num_blocks=16, block_size=4)
    assert bm.allocate(1, 8)
    bm.cache_full_blocks(1, list(range(8)), 8, extra="salt-a")
    assert len(bm.find_cached_prefix(list(range(8)) + [1], extra="salt-a")) == 2
    assert bm.find_cached_prefix(list(range(8)) + [1], extra="salt-b") == []
    assert bm.find_cached_prefix([0, 1, 2, 4, 4, 5, 6, 7, 1], extra="salt-a") == []


def test_eviction_is_lru_and_tail_first():
    bm = BlockManager(num_blocks=4, block_size=2)
    assert bm.allocate(1, 6)  # blocks for 3 full blocks of tokens 0..5
    bm.cache_full_blocks(1, list(range(6)), 6)
    bm.free(1)
    # Freed tail first: the chain's last block is evicted first, the head survives longest.
    assert bm.allocate(2, 2)  # takes the never-used block first (LRU head)
    assert bm.allocate(3, 2)  # now evicts the tail of the cached chain
    assert len(bm.find_cached_prefix(list(range(6)) + [7])) == 2
    assert bm.allocate(4, 2)
    assert len(bm.find_cached_prefix(list(range(6)) + [7])) == 1


def tokens_in_use_by_block(bm, sequences) -> int:
    """The definition, block by block: each block as full as the fullest table holding it fills it."""
    filled: dict[int, int] = {}
    for seq_id, computed in sequences:
        for i, block_id in enumerate(bm.block_ids(seq_id)):
            n = min(bm.block_size, max(0, computed - i * bm.block_size))
            filled[block_id] = max(filled.get(block_id, 0), n)
    return sum(filled.values())


def test_tokens_in_use_counts_a_shared_block_once_at_its_fullest():
    bm = BlockManager(num_blocks=32, block_size=4)
    tokens = list(range(10))
    assert bm.allocate(1, 10)  # two full blocks and one holding 2 tokens
    bm.cache_full_blocks(1, tokens, 10)
    hits = bm.find_cached_prefix(tokens + [50, 51])
    assert len(hits) == 2 and bm.allocate(2, 12, hits, num_computed_tokens=8)  # shares the two full ones
    bm.fork(1, 3)  # shares all three, the part-full one too
    assert bm.allocate(4, 16)  # allocated ahead of what it computed
    sequences = [(1, 10), (2, 11), (3, 10), (4, 5)]
    assert bm.tokens_in_use(sequences) == tokens_in_use_by_block(bm, sequences) == 8 + 2 + 3 + 5
    assert bm.tokens_in_use([]) == 0 and bm.tokens_in_use([(99, 7)]) == 0  # no table: nothing held


@pytest.mark.parametrize("seed", range(12))
def test_tokens_in_use_matches_the_block_by_block_count(seed):
    import random

    rng = random.Random(seed)
    bm = BlockManager(num_blocks=64, block_size=4)
    computed: dict[int, int] = {}
    prompts = [[rng.randrange(5) for _ in range(12)] for _ in range(3)]  # few distinct: prefix hits
    for seq_id in range(1, 40):
        op = rng.random()
        if op < 0.5 or not computed:  # a new sequence, maybe hitting the cache, computing some tokens
            prompt = rng.choice(prompts) + [rng.randrange(5) for _ in range(rng.randrange(8))]
            hits = bm.find_cached_prefix(prompt)
            done = len(hits) * 4
            if bm.allocate(seq_id, len(prompt), hits, num_computed_tokens=done):
                computed[seq_id] = rng.randint(done, len(prompt))
                bm.cache_full_blocks(seq_id, prompt, computed[seq_id])
        elif op < 0.7:
            parent = rng.choice(list(computed))
            bm.fork(parent, seq_id)
            computed[seq_id] = computed[parent]
        else:
            gone = rng.choice(list(computed))
            bm.free(gone)
            del computed[gone]
        assert bm.tokens_in_use(computed.items()) == tokens_in_use_by_block(bm, computed.items())
    bm.check_invariants()


def test_evicted_parent_makes_children_unreachable():
    bm = BlockManager(num_blocks=3, block_size=2)
    assert bm.allocate(1, 4)
    bm.cache_full_blocks(1, [1, 2, 3, 4], 4)
    bm.free(1)  # frees block of [3, 4] first, then [1, 2]
    # Take all three blocks: both cached blocks are evicted.
    assert bm.allocate(2, 6)
    bm.free(2)
    assert bm.find_cached_prefix([1, 2, 3, 4, 5]) == []
    bm.check_invariants()


def test_fork_shares_and_copy_on_write_gives_private_tail():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.allocate(1, 6)  # one full block + a partial one holding 2 tokens
    bm.fork(1, 2)
    assert bm.tables[2] == bm.tables[1]
    assert all(b.ref_count == 2 for b in bm.tables[1])
    # Seq 2 writes token 6 into the shared partial block: it gets its own copy.
    assert bm.allocate(2, 7, num_computed_tokens=6)
    assert bm.tables[2][0] is bm.tables[1][0]
    assert bm.tables[2][1] is not bm.tables[1][1]
    assert bm.take_pending_copies() == [(bm.tables[1][1].block_id, bm.tables[2][1].block_id)]
    # Seq 1 is now the only holder of the original tail: no copy needed.
    assert bm.allocate(1, 7, num_computed_tokens=6)
    assert bm.take_pending_copies() == []
    bm.free(1)
    bm.free(2)
    bm.check_invariants()
    assert bm.num_used_blocks == 0


def test_duplicate_content_stays_private_but_chain_continues():
    bm = BlockManager(num_blocks=8, block_size=2)
    tokens = [5, 6, 7, 8]
    assert bm.allocate(1, 4) and bm.allocate(2, 4)  # computed in parallel, no hit for either
    bm.cache_full_blocks(1, tokens, 4)
    bm.cache_full_blocks(2, tokens, 4)
    bm.free(1)
    assert len(bm.find_cached_prefix(tokens + [9])) == 2
    bm.free(2)
    bm.check_invariants()


class BlockManagerMachine(RuleBasedStateMachine):
    """Random add / grow / fork / cache / free sequences; invariants checked after every rule."""

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(num_blocks=12, block_size=2)
        self.seqs: dict[int, dict] = {}  # seq_id -> {"tokens": [...], "computed": int}
        self.next_id = 0

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=10))
    def add(self, tokens):
        hits = self.bm.find_cached_prefix(tokens)
        computed = len(hits) * self.bm.block_size
        sid = self.next_id
        if self.bm.allocate(sid, len(tokens), hits, num_computed_tokens=computed):
            self.next_id += 1
            self.seqs[sid] = {"tokens": list(tokens), "computed": computed}
            for h, b in zip(hits, self.bm.tables[sid]):
                assert h is b

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), token=st.integers(0, 2))
    def grow(self, data, token):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        s = self.seqs[sid]
        s["computed"] = len(s["tokens"])  # everything so far now has KV
        self.bm.cache_full_blocks(sid, s["tokens"], s["computed"])
        if self.bm.allocate(sid, len(s["tokens"]) + 1, num_computed_tokens=s["computed"]):
            s["tokens"].append(token)
        self.bm.take_pending_copies()

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        child = self.next_id
        self.next_id += 1
        self.bm.fork(sid, child)
        self.seqs[child] = {"tokens": list(self.seqs[sid]["tokens"]), "computed": self.seqs[sid]["computed"]}

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        self.bm.free(sid)
        del self.seqs[sid]

    @invariant()
    def invariants_hold(self):
        self.bm.check_invariants()
        # Tables cover each sequence's tokens and nothing is shared that is still being written.
        for sid, s in self.seqs.items():
            assert len(self.bm.tables[sid]) * self.bm.block_size >= len(s["tokens"])

    def teardown(self):
        for sid in list(self.seqs):
            self.bm.free(sid)
        self.bm.check_invariants()
        assert self.bm.num_used_blocks == 0


TestBlockManagerProperties = BlockManagerMachine.TestCase
TestBlockManagerProperties.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_num_blocks_for(block_size):
    bm = BlockManager(num_blocks=4, block_size=block_size)
    assert bm.num_blocks_for(0) == 0
    assert bm.num_blocks_for(block_size) == 1
    assert bm.num_blocks_for(block_size + 1) == 2
