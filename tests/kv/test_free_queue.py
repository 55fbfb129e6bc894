"""The free queue builds blocks lazily yet hands them out in the order an eagerly built queue would."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.kv.block_manager import FreeBlockQueue

# An operation on the queue: pop the head, put a held block back at the tail or the head, or
# take a held-back block out of the middle (a prefix-cache hit on a free block).
OPS = st.lists(st.tuples(st.sampled_from(["pop", "append", "appendleft", "park", "unpark"]), st.integers(0, 10**6)),
               max_size=80)


@settings(max_examples=200, deadline=None)
@given(num_blocks=st.integers(1, 12), ops=OPS)
def test_lazy_queue_matches_a_list_of_all_blocks_in_id_order(num_blocks, ops):
    queue = FreeBlockQueue(num_blocks)
    model = list(range(num_blocks))  # the eager queue: every block, in id order
    held, parked = [], []  # blocks out of the queue; blocks in it that a test may remove from the middle
    for op, pick in ops:
        if op == "pop":
            if not model:
                continue
            block = queue.popleft()
            assert block.block_id == model.pop(0)
            held.append(block)
        elif op in ("append", "appendleft", "park") and held:
            block = held.pop(pick % len(held))
            if op == "appendleft":
                queue.appendleft(block)
                model.insert(0, block.block_id)
            else:
                queue.append(block)
                model.append(block.block_id)
                if op == "park":
                    parked.append(block)
        elif op == "unpark" and parked:
            block = parked.pop(pick % len(parked))
            if block.block_id in model and block.prev_free is not None:
                queue.remove(block)
                model.remove(block.block_id)
                held.append(block)
        parked = [b for b in parked if b.prev_free is not None]  # popped since: no longer in the queue
        assert queue.num_free == len(model)
        built = {b.block_id for b in queue}
        assert built == {i for i in model if i < len(queue.blocks)}  # the rest are not built yet...
        assert sorted(i for i in model if i >= len(queue.blocks)) == list(range(len(queue.blocks), num_blocks))
    assert [b.block_id for b in queue.build_all()] == list(range(num_blocks))
    assert [b.block_id for b in queue] == model  # building them all keeps the order
