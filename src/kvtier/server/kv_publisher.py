"""The ZMQ transport of KV cache events, as vLLM's `ZmqEventPublisher`: a PUB socket sending
`[topic, seq (8 bytes, big-endian), payload]` per batch and, with a replay endpoint, a ROUTER
socket that resends the batches still buffered from a sequence number a client asks for
(`[b"", start seq]` in; one `[b"", topic, seq, payload]` per batch, then `[b"", b"", -1, b""]`
out). Its sockets live on its own thread.

One difference: the engine thread never waits. `publish` numbers a step's batches and queues them
(bounded); when the queue is full the batch is dropped and counted, and its sequence number is
spent, so a subscriber sees the gap (vllm-router then asks the replay socket, which cannot have it,
and forgets that worker's blocks) instead of silently missing blocks.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import zmq

from kvtier.kv.events import KVEvent
from kvtier.server.kv_events import KVEventEncoder, KVEventsConfig, chunks

log = logging.getLogger("kvtier.server")

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # ends a replay
_POLL_S = 0.05  # the thread's longest sleep: how late a replay request or a stop is noticed
_WARN_EVERY_S = 10.0

_Item = tuple[int, float, Sequence[KVEvent]]  # seq, ts, events
_Buffer = deque[tuple[int, bytes]]  # (seq, payload) of the last batches sent, for replay


@dataclass(frozen=True, slots=True)
class PublisherStats:
    num_batches: int  # sent on the PUB socket
    num_dropped_batches: int  # refused by a full queue (their sequence numbers are spent)
    num_dropped_events: int


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: a wildcard host, ipc:// or inproc:// binds; another tcp address connects."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """Publishes each step's events on its own thread; `start()` returns once the sockets are
    bound (or raises why not). `endpoint` / `replay_endpoint`: the addresses bound (a port 0 made
    concrete), for a client to connect to."""

    def __init__(self, config: KVEventsConfig, encoder: KVEventEncoder) -> None:
        self.config = config
        self.encoder = encoder
        self.endpoint = config.endpoint
        self.replay_endpoint = config.replay_endpoint
        self._queue: queue.Queue[_Item] = queue.Queue(maxsize=config.max_queue_size)
        self._topic = config.topic.encode()
        self._next_seq = 0  # engine thread only
        self._num_batches = 0  # publisher thread only
        self._num_dropped_batches = 0  # engine thread only
        self._num_dropped_events = 0
        self._last_warning = -_WARN_EVERY_S
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="kvtier-kv-events", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread.join()
            raise ValueError(f"--kv-events-config: {self._error}") from self._error
        # vLLM's connect-unless-wildcard rule surprises whoever writes their own host's address:
        # the line says which it did, so a router that receives nothing has its answer.
        how = (
            "bound at"
            if is_bind_endpoint(self.config.endpoint)
            else "connecting to (no wildcard host: the subscriber must bind there; tcp://*:PORT "
            "binds)"
        )
        log.info(
            "KV cache events: PUB %s %s%s, topic %r",
            how,
            self.endpoint,
            f", replay {self.replay_endpoint}" if self.replay_endpoint else "",
            self.config.topic,
        )

    def publish(self, events: Sequence[KVEvent]) -> None:
        """Queue one step's events (engine thread; never blocks). Empty: nothing is sent."""
        ts = time.time()
        for chunk in chunks(events):
            seq, self._next_seq = self._next_seq, self._next_seq + 1
            try:
                self._queue.put_nowait((seq, ts, chunk))
            except queue.Full:
                self._num_dropped_batches += 1
                self._num_dropped_events += len(chunk)
                self._warn_dropped()

    def _warn_dropped(self) -> None:
        now = time.monotonic()
        if now - self._last_warning >= _WARN_EVERY_S:
            self._last_warning = now
            log.warning(
                "KV events: the publisher's queue is full (max_queue_size %d); %d batches dropped "
                "so far, consumers see the gap in sequence numbers",
                self.config.max_queue_size,
                self._num_dropped_batches,
            )

    def stats(self) -> PublisherStats:
        return PublisherStats(
            self._num_batches, self._num_dropped_batches, self._num_dropped_events
        )

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued (within `timeout`), then close the sockets (idempotent)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ---- the publisher thread ----------------------------------------------------------------

    def _main(self) -> None:
        ctx = zmq.Context()
        sockets: list[zmq.Socket[bytes]] = []
        try:
            pub = ctx.socket(zmq.PUB)
            sockets.append(pub)
            pub.set_hwm(self.config.hwm)
            if is_bind_endpoint(self.endpoint):
                pub.bind(self.endpoint)
                self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                pub.connect(self.endpoint)
            replay: zmq.Socket[bytes] | None = None
            if self.replay_endpoint is not None:
                replay = ctx.socket(zmq.ROUTER)
                sockets.append(replay)
                replay.bind(self.replay_endpoint)
                self.replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            self._error = exc
            for s in sockets:
                s.close(linger=0)
            ctx.term()
            self._ready.set()
            return
        self._ready.set()
        buffer: _Buffer = deque(maxlen=self.config.buffer_steps)
        try:
            self._serve(pub, replay, buffer)
        except Exception:
            log.exception("the KV event publisher failed; no more events are sent")
        finally:
            for s in sockets:
                s.close(linger=0)
            ctx.term()

    def _serve(
        self, pub: zmq.Socket[bytes], replay: zmq.Socket[bytes] | None, buffer: _Buffer
    ) -> None:
        while True:
            if replay is not None and replay.poll(0):
                self._serve_replay(replay, buffer)
            try:
                seq, ts, events = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                if self._stop.is_set():
                    return
                continue
            payload = self.encoder.encode(ts, events)
            seq_bytes = seq.to_bytes(8, "big")
            pub.send_multipart((self._topic, seq_bytes, payload))
            buffer.append((seq, payload))
            self._num_batches += 1

    def _serve_replay(self, replay: zmq.Socket[bytes], buffer: _Buffer) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("KV events: ignoring a malformed replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(buffer):
            if seq >= start_seq:
                replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        replay.send_multipart((client, b"", b"", END_SEQ, b""))
