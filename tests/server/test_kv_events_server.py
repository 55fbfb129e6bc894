"""The shared server publishes KV block events (--kv-events-endpoint) from its engine core process,
connecting to a subscriber that binds, as llm-d's does; the events name the prompt's blocks."""

from __future__ import annotations

import secrets
import socket
import time

import httpx
import msgspec
import zmq
import zmq.utils.monitor

from tests.helpers.vllm_kv_events import DECODER, BlockStored


def _wait_connected(sub: zmq.Socket, timeout_s: float) -> None:
    monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    try:
        assert monitor.poll(int(timeout_s * 1000)), "the server's publisher never connected"
        zmq.utils.monitor.recv_monitor_message(monitor)
    finally:
        sub.disable_monitor()
        monitor.close(linger=0)


def test_server_publishes_the_prompts_blocks(server_url: str, kv_events_port: int,
                                            kv_events_port_reservation: socket.socket) -> None:
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        kv_events_port_reservation.close()  # the port was held for this bind (see the fixture)
        sub.bind(f"tcp://127.0.0.1:{kv_events_port}")
        _wait_connected(sub, 10)
        last_seq = None
        # The subscription reaches the publisher a moment after the handshake: a request sent before
        # that publishes to nobody, so retry with a fresh prompt until its blocks are seen.
        for attempt in range(10):
            prompt = " ".join(secrets.token_hex(3) for _ in range(24))
            ids = httpx.post(f"{server_url}/tokenize", json={"prompt": prompt}, timeout=10).json()["tokens"]
            assert len(ids) >= 32
            r = httpx.post(f"{server_url}/v1/completions", json={"prompt": prompt, "max_tokens": 2}, timeout=60)
            assert r.status_code == 200, r.text
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline and sub.poll(100):
                topic, seq, payload = sub.recv_multipart()
                assert topic == b"" and len(seq) == 8
                seq_no = int.from_bytes(seq, "big")
                assert last_seq is None or seq_no > last_seq
                last_seq = seq_no
                batch = DECODER.decode(payload)
                assert batch.data_parallel_rank == 0 and batch.ts > 1e9
                raw = msgspec.msgpack.decode(payload)  # [ts, [[tag, ...], ...], rank]: array-like, tagged
                assert isinstance(raw, list) and all(isinstance(e, list) and isinstance(e[0], str) for e in raw[1])
                for ev in batch.events:
                    if isinstance(ev, BlockStored) and ev.parent_block_hash is None and \
                            ev.token_ids[:32] == ids[:32]:
                        assert ev.block_size == 16 and len(ev.block_hashes) >= 2
                        return
        raise AssertionError("no BlockStored event for the prompt's first blocks")
    finally:
        sub.close(linger=0)
        ctx.term()
