"""The KV event publisher: one batch per engine step, sent on a ZMQ PUB socket by a thread of its own.

Wire format, as vLLM's ``ZmqEventPublisher`` sends it: a 3-frame multipart message
``[topic, seq, payload]`` — the UTF-8 topic (``""`` by default), the batch's sequence number as 8
bytes big-endian (0, 1, 2, ... per publisher), and the msgpack-encoded
:class:`~pagedserve.kv.events.KVEventBatch`. With a ``replay_endpoint``, a ROUTER socket answers a
request ``[identity, b"", start_seq (8 bytes big-endian)]`` with every kept batch from ``start_seq`` on,
each as ``[identity, b"", seq, payload]``, then ``[identity, b"", -1 (8 bytes, signed), b""]``.

The step only appends the batch to a bounded queue (never blocks, never encodes); encoding and
sending happen on the publisher's thread. A sequence number is taken when the step hands the batch
over, so a batch dropped because the queue was full shows up as a gap a subscriber can notice.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import queue
import threading
import time

import msgspec
import zmq

from pagedserve.config import KVEventsConfig
from pagedserve.kv.events import KVCacheEvent, KVEventBatch

logger = logging.getLogger(__name__)

_END_SEQ = (-1).to_bytes(8, "big", signed=True)
_STOP = object()


def binds(endpoint: str) -> bool:
    """vLLM's rule: bind an address with a wildcard, ``::``, or a local transport; connect to any other."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """Publishes :class:`KVEventBatch` es; create it in the engine, :meth:`shutdown` it when done."""

    def __init__(self, config: KVEventsConfig):
        self._topic = config.topic.encode()
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=config.buffer_steps)
        self.published = 0  # batches handed over (the next sequence number)
        self.dropped = 0
        # Sockets are made and bound here, so a taken port fails the engine's start with its
        # reason; from then on only the publisher thread touches them.
        self._ctx = zmq.Context(io_threads=1)
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay: zmq.Socket | None = None
        try:
            (self._pub.bind if binds(config.endpoint) else self._pub.connect)(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as exc:
            self._ctx.destroy(linger=100)
            raise OSError(f"KV events: cannot open {config.endpoint} / {config.replay_endpoint}: {exc}") from None
        self._thread = threading.Thread(target=self._run, name="pagedserve-kv-events", daemon=True)
        self._thread.start()
        logger.info("publishing KV events on %s (%s)%s", config.endpoint,
                    "bound" if binds(config.endpoint) else "connected",
                    f", replay on {config.replay_endpoint}" if config.replay_endpoint else "")

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Hand one step's events to the thread (non-blocking; dropped with a warning if it is behind)."""
        batch = KVEventBatch(ts=time.time(), events=events, data_parallel_rank=0)  # one engine, no data parallelism
        seq = self.published
        self.published += 1
        try:
            self._queue.put_nowait((seq, batch))
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                logger.warning("KV event queue full: %d batches dropped so far", self.dropped)

    def shutdown(self, timeout_s: float = 2.0) -> None:
        """Send what is queued (for up to ``timeout_s``), then close the sockets."""
        if self._thread.is_alive():
            with contextlib.suppress(queue.Full):  # still full after timeout_s: the thread is stuck
                self._queue.put(_STOP, timeout=timeout_s)
            self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self._ctx.destroy(linger=100)  # its sockets too

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is _STOP:
                return
            seq, batch = item
            payload = encoder.encode(batch)
            try:
                # PUB never waits for slow subscribers: past the high-water mark ZMQ drops for them.
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                logger.warning("sending KV event batch %d failed: %s", seq, exc)
            if self._buffer.maxlen:
                self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("ignoring a malformed KV event replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", _END_SEQ, b""))
