"""KV block events: a subscriber that applies them holds exactly the engine's cached-block set.

Payloads are decoded with the test's own copy of vLLM's msgspec structs (vllm/distributed/kv_events.py,
the array_like tagged union), not pagedserve's, so the wire layout is what vLLM's subscribers read.
"""

from __future__ import annotations

import random
import time

import msgspec
import pytest
import zmq

from pagedserve.config import EngineConfig, KVEventsConfig
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.kv.block_manager import BlockManager
from pagedserve.kv.events import KVEventLog, block_hash
from tests.conftest import assert_no_leaks
from tests.helpers.vllm_kv_events import (
    DECODER,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)


class Subscriber:
    """What a router keeps: the set of block hashes a replica has cached, and each one's parent."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.cached: set[int] = set()
        self.parent: dict[int, int | None] = {}
        self.counts = {"BlockStored": 0, "BlockRemoved": 0, "AllBlocksCleared": 0}

    def apply(self, payload: bytes) -> KVEventBatch:
        batch = DECODER.decode(payload)
        for ev in batch.events:
            self.counts[type(ev).__name__] += 1
            if isinstance(ev, BlockStored):
                assert ev.block_size == self.block_size and ev.medium == "GPU" and ev.lora_id is None
                assert len(ev.token_ids) == len(ev.block_hashes) * self.block_size
                # A chain hangs from a block the subscriber already has (or from the root).
                assert ev.parent_block_hash is None or ev.parent_block_hash in self.cached
                parent = ev.parent_block_hash
                for h in ev.block_hashes:
                    assert h not in self.cached, "stored twice without a removal"
                    self.cached.add(h)
                    self.parent[h] = parent
                    parent = h
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    self.cached.remove(h)  # KeyError: removed something never stored
            else:
                self.cached.clear()
        return batch


def test_wire_layout_is_vllms_array_like_tagged_union() -> None:
    from pagedserve.kv import events as ev

    batch = ev.KVEventBatch(ts=1.5, events=[ev.BlockStored([7, 8], None, list(range(32)), 16, None, "GPU", None),
                                            ev.BlockRemoved([7], "GPU"), ev.AllBlocksCleared()],
                            data_parallel_rank=0)
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(batch))
    assert raw == [1.5, [["BlockStored", [7, 8], None, list(range(32)), 16, None, "GPU", None],
                         ["BlockRemoved", [7], "GPU"], ["AllBlocksCleared"]], 0]
    decoded = DECODER.decode(msgspec.msgpack.encode(batch))  # vLLM's own struct definitions read it
    assert decoded.events[0].block_hashes == [7, 8] and isinstance(decoded.events[2], AllBlocksCleared)


def test_block_hashes_are_content_hashes() -> None:
    a = block_hash(None, range(16), ("bfloat16", None))
    assert a == block_hash(None, list(range(16)), ("bfloat16", None))  # deterministic
    assert 0 <= a < 2**64
    assert a != block_hash(None, range(16), ("bfloat16", "tenant-a"))  # the cache salt isolates
    assert block_hash(a, range(16, 32), None) != block_hash(None, range(16, 32), None)  # the parent counts


def test_random_workload_subscriber_view_equals_the_block_manager() -> None:
    # Sequences with shared prefixes, a pool too small to keep everything (evictions), frees mid-way
    # (aborts and preemptions look the same to the block manager), resets; after every operation the
    # subscriber, fed the msgpack-encoded events, holds exactly the cache's hashes.
    rng = random.Random(7)
    bs, log = 4, KVEventLog(4)
    bm = BlockManager(24, bs, events=log)
    sub = Subscriber(bs)
    prefixes = [[rng.randrange(50) for _ in range(rng.choice((4, 8, 12)))] for _ in range(4)]
    live: dict[int, list[int]] = {}
    next_id = 0

    def flush() -> None:
        events = log.take()
        if events:
            from pagedserve.kv import events as ev

            sub.apply(msgspec.msgpack.encode(ev.KVEventBatch(time.time(), events, 0)))
        assert sub.cached == set(bm.cached_block_hashes())
        bm.check_invariants()

    for step in range(400):
        op = rng.random()
        if op < 0.45:  # admit a new sequence: a shared prefix (or none) plus its own tokens, computed at once
            tokens = list(rng.choice(prefixes + [[]])) + [rng.randrange(50) for _ in range(rng.randrange(1, 14))]
            extra = rng.choice((None, "salt"))
            hits = bm.find_cached_prefix(tokens, extra)
            if bm.allocate(next_id, len(tokens), hits, num_computed_tokens=len(hits) * bs):
                bm.cache_full_blocks(next_id, tokens, len(tokens), extra)
                live[next_id] = tokens
            next_id += 1
        elif op < 0.8 and live:  # grow one by a few tokens (decode)
            sid = rng.choice(list(live))
            tokens = live[sid] + [rng.randrange(50) for _ in range(rng.randrange(1, 6))]
            if bm.allocate(sid, len(tokens), num_computed_tokens=len(live[sid])):
                live[sid] = tokens
                bm.cache_full_blocks(sid, tokens, len(tokens))
        elif op < 0.97 and live:  # finish, abort or preempt one
            sid = rng.choice(list(live))
            del live[sid]
            bm.free(sid)
        else:
            bm.reset_prefix_cache()
        flush()
    assert sub.counts["BlockStored"] > 20 and sub.counts["BlockRemoved"] > 20, sub.counts
    for sid in list(live):
        bm.free(sid)
    bm.reset_prefix_cache()
    flush()
    assert sub.counts["AllBlocksCleared"] >= 1 and not sub.cached


def test_events_off_hash_nothing() -> None:
    bm = BlockManager(8, 4)
    assert bm.allocate(0, 8)
    bm.cache_full_blocks(0, list(range(8)), 8)
    assert all(b.block_hash is None for b in bm.blocks)
    with pytest.raises(RuntimeError):
        bm.cached_block_hashes()


def test_config_is_validated() -> None:
    for bad in ('{"endpoint": "http://x:1"}', '{"hwm": -1}', '{"publisher": "kafka"}', '{"nope": 1}', "[1]",
                "{not json", '{"max_queue_size": 0}'):
        with pytest.raises(ValueError):
            KVEventsConfig.from_json(bad)
    cfg = KVEventsConfig.from_json('{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "topic": "kv"}')
    assert cfg.enabled and cfg.topic == "kv" and cfg.buffer_steps == 10_000


def _drain(sock: zmq.Socket, got: dict[int, bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and sock.poll(50):
        topic, seq, payload = sock.recv_multipart()
        assert topic == b"kv"
        got[int.from_bytes(seq, "big")] = payload


def test_engine_run_with_hits_evictions_and_aborts(tiny_model_dir, tmp_path) -> None:
    # The real engine, publishing over ZMQ (ipc, bound); the subscriber connects, catches up on the
    # batches it missed before its subscription took through the replay socket, applies them in
    # sequence order, and must end with the engine's cached set. A 24-block pool forces evictions.
    from pagedserve.engine.frontend.engine import Engine

    endpoint, replay = f"ipc://{tmp_path}/kv", f"ipc://{tmp_path}/replay"
    config = EngineConfig(model=str(tiny_model_dir), num_kv_blocks=24, max_model_len=256, max_num_seqs=4,
                          kv_events=KVEventsConfig(enable_kv_cache_events=True, endpoint=endpoint,
                                                   replay_endpoint=replay, topic="kv"))
    engine = Engine(config)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(endpoint)
    got: dict[int, bytes] = {}
    try:
        shared = "the same long system prompt that every one of these requests starts with, " * 2
        rng = random.Random(3)
        aborted = 0
        for wave in range(3):
            for i in range(4):
                words = " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "eps"]) for _ in range(12))
                prompt = (shared if i % 2 == 0 else "") + words
                engine.add_request(f"w{wave}-{i}", prompt, SamplingParams(max_tokens=10, ignore_eos=True))
            steps = 0
            while engine.has_unfinished_requests():
                engine.step()
                steps += 1
                if steps == 6:  # abort one mid-run in every wave
                    aborted += engine.abort(f"w{wave}-1")
            _drain(sub, got, 0.0)
        engine.core.publish_kv_events()
        publisher = engine.core.kv_event_publisher
        assert publisher is not None and publisher.dropped == 0
        last = publisher.published - 1
        deadline = time.monotonic() + 10
        while last not in got and time.monotonic() < deadline:
            _drain(sub, got, 0.2)
        assert last in got, "the last batch never arrived"
        missing = min((s for s in range(last + 1) if s not in got), default=None)
        if missing is not None:  # the slow joiner's first batches: ask the replay socket
            # A DEALER, so one request can take the stream of replies (frames as a REQ would send them).
            req = ctx.socket(zmq.DEALER)
            req.connect(replay)
            req.send_multipart((b"", missing.to_bytes(8, "big")))
            while True:
                assert req.poll(5000), "no replay answer"
                _, seq_bytes, payload = req.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq == -1:
                    break
                got[seq] = payload
            req.close(linger=0)
        assert sorted(got) == list(range(last + 1)), "gaps left after the replay"
        view = Subscriber(config.block_size)
        for seq in sorted(got):
            assert view.apply(got[seq]).data_parallel_rank == 0
        bm = engine.core.block_manager
        assert view.cached == set(bm.cached_block_hashes())
        assert view.counts["BlockRemoved"] > 0, "the run evicted nothing: the pool is not small enough"
        assert bm.prefix_hit_tokens > 0 and aborted == 3
        assert_no_leaks(engine)
    finally:
        engine.close()
        sub.close(linger=0)
        ctx.term()


def test_cli_flags_reach_the_config() -> None:
    import argparse

    from pagedserve.engine.args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args(["--model", "m"])).kv_events is None  # off by default
    cfg = engine_config_from_args(parser.parse_args(["--model", "m", "--kv-events-endpoint",
                                                     "tcp://127.0.0.1:5557"])).kv_events
    assert cfg is not None and cfg.enabled and cfg.endpoint == "tcp://127.0.0.1:5557" and cfg.topic == ""
    cfg = engine_config_from_args(parser.parse_args(
        ["--model", "m", "--kv-events-config", '{"enable_kv_cache_events": true, "topic": "kv", "hwm": 10}',
         "--kv-events-endpoint", "ipc:///tmp/x"])).kv_events
    assert cfg is not None and cfg.enabled and (cfg.topic, cfg.hwm, cfg.endpoint) == ("kv", 10, "ipc:///tmp/x")
    disabled = engine_config_from_args(parser.parse_args(["--model", "m", "--kv-events-config", "{}"])).kv_events
    assert disabled is not None and not disabled.enabled  # vLLM's default: events off until enabled
    with pytest.raises(ValueError, match="unknown keys"):
        engine_config_from_args(parser.parse_args(["--model", "m", "--kv-events-config", '{"port": 1}']))


def test_a_taken_port_fails_the_start_with_its_reason() -> None:
    from pagedserve.engine.core.kv_events import ZmqEventPublisher

    first = ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:*"))
    try:
        # A wildcard port binds wherever is free; bind a second publisher on the port it got.
        port = first._pub.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1]
        with pytest.raises(OSError, match="cannot open"):
            ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{port}"))
    finally:
        first.shutdown()
