"""ZmqEventPublisher: the KV cache events (core/kv_events.py) on ZeroMQ sockets, as vLLM's
ZmqEventPublisher sends them, so vllm-router and llm-d subscribe to us as to vLLM.

- **PUB socket** on `endpoint`: bound when the address is ours to own (`*`, `::`, `ipc://`,
  `inproc://`: each engine listens, the indexer dials it), else connected (the indexer
  binds one address and every engine dials it). Each message is three frames: the topic,
  the batch's sequence number as 8 bytes big-endian (from 0), the msgpack batch.
- **Data-parallel ranks** each publish on their own address: a TCP port plus the rank,
  `_dp<rank>` after an ipc or inproc name (the rank is in every batch too).
- **Replay**: a ROUTER socket on `replay_endpoint`. A client sends an 8-byte big-endian
  start sequence number; it gets `(seq, payload)` for every batch still buffered from
  there on (the last `buffer_steps`), then `(-1, b"")`. A subscriber that sees a gap in
  the sequence numbers asks for what it missed.
- **Off the engine thread**: `publish` only numbers the batch and queues it; a thread
  encodes and sends. A full queue drops the batch (logged), leaving a gap subscribers see:
  the engine never waits on a slow or absent subscriber.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

try:
    import zmq
except ImportError:  # needed only when events are published: checked at start-up
    zmq = None

from serving.core import kv_events
from serving.core.kv_events import EventBatch, encode_batch
from serving.core.kv_events_config import KVEventsConfig

log = logging.getLogger("xlaserve")

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's last frame
_POLL_S = 0.05  # the thread's longest wait, so a replay request is answered that fast
_CLOSE_S = 1.0  # close(): how long queued batches may take to go out


def start_kv_events(config: KVEventsConfig, data_parallel_rank: int,
                    kv_cache_manager) -> "ZmqEventPublisher | None":
    """The engine's publisher, recording the manager's events from now on; None when the
    config publishes nothing (no events are then recorded at all)."""
    if not config.publishes:
        return None
    publisher = ZmqEventPublisher(config, data_parallel_rank)
    kv_cache_manager.record_events(publisher.pending)
    return publisher


def offset_endpoint(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """The address of one data-parallel rank: TCP port + rank, `_dp<rank>` after an ipc or
    inproc name; rank 0 keeps the address as given."""
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith(("inproc://", "ipc://")):
        return f"{endpoint}_dp{data_parallel_rank}"
    base, _, port = endpoint.rpartition(":")
    if not endpoint.startswith("tcp://") or not port.isdigit():
        raise ValueError(f"kv_events_config: cannot give data-parallel rank "
                         f"{data_parallel_rank} its own address from {endpoint!r} "
                         "(tcp://HOST:PORT, ipc:// or inproc://)")
    return f"{base}:{int(port) + data_parallel_rank}"


def _binds(endpoint: str) -> bool:
    return ("*" in endpoint or "::" in endpoint
            or endpoint.startswith(("ipc://", "inproc://")))


class ZmqEventPublisher:
    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0):
        if zmq is None or kv_events.msgspec is None:
            raise ValueError("kv_events_config: publishing KV cache events needs the pyzmq "
                             "and msgspec packages (pip install pyzmq msgspec)")
        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self.encoding = config.event_encoding
        self.endpoint = offset_endpoint(config.endpoint, data_parallel_rank)
        self.replay_endpoint = offset_endpoint(config.replay_endpoint, data_parallel_rank)
        self.pending: list = []  # the engine's events since the last publish_pending
        self.num_dropped = 0  # batches dropped on a full queue
        self._topic = config.topic.encode()
        self._next_seq = 0
        self._dropping = False  # logged once per run of drops
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._closing = threading.Event()
        # Made and bound here, so a taken port fails the start; used only by the thread
        # from then on (ZeroMQ sockets may move between threads, never be shared).
        self._ctx = zmq.Context()
        self._pub = self._socket(zmq.PUB, self.endpoint, bind=_binds(self.endpoint),
                                 hwm=config.hwm)
        self._replay = (self._socket(zmq.ROUTER, self.replay_endpoint, bind=True)
                        if self.replay_endpoint else None)
        self._thread = threading.Thread(target=self._run, name="xlaserve-kv-events",
                                        daemon=True)
        self._thread.start()
        log.info("KV cache events: publishing on %s%s (%s encoding)", self.endpoint,
                 f", replay on {self.replay_endpoint}" if self._replay else "", self.encoding)

    def _socket(self, kind: int, endpoint: str, bind: bool,
                hwm: int | None = None) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        if hwm is not None:  # before bind or connect: a pipe keeps the limit it was made with
            sock.set_hwm(hwm)
        try:
            sock.bind(endpoint) if bind else sock.connect(endpoint)
        except zmq.ZMQError as e:
            sock.close(linger=0)
            self._close_sockets()
            raise ValueError(f"kv_events_config: cannot {'bind' if bind else 'connect'} "
                             f"{endpoint}: {e}") from None
        return sock

    def publish_pending(self) -> None:
        """One batch of the events recorded since the last call, if there are any."""
        if self.pending:
            events = self.pending[:]  # the recorders keep appending to this list
            self.pending.clear()
            self.publish(events)

    def publish(self, events: list) -> None:
        """Numbers a batch of events and queues it for the sender thread; never blocks."""
        if self._closing.is_set():
            return
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        batch = EventBatch(time.time(), events, self.data_parallel_rank)
        try:
            self._queue.put_nowait((seq, batch))
        except queue.Full:
            self.num_dropped += 1
            if not self._dropping:
                log.warning("KV cache events: the send queue is full (%d batches); dropping "
                            "batches, subscribers will see a gap from seq %d",
                            self.config.max_queue_size, seq)
            self._dropping = True
        else:
            self._dropping = False

    def close(self) -> None:
        """Sends what is queued (for up to a second), then closes the sockets."""
        if self._closing.is_set():
            return
        self._closing.set()
        self._thread.join(timeout=_CLOSE_S + 1.0)
        if self._thread.is_alive():
            log.warning("KV cache events: the sender thread did not stop; leaving its "
                        "sockets open")
            return
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (getattr(self, "_pub", None), getattr(self, "_replay", None)):
            if sock is not None:
                sock.close(linger=int(_CLOSE_S * 1000))
        self._ctx.term()

    # -- the sender thread ------------------------------------------------------------------

    def _run(self) -> None:
        deadline = None  # once closing: when queued batches stop being sent
        while True:
            if self._replay is not None:
                try:
                    self._serve_replays()
                except Exception:  # noqa: BLE001 - a bad replay must not stop the stream
                    log.exception("KV cache events: answering a replay request failed")
            try:
                seq, batch = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                if self._closing.is_set():
                    return
                continue
            if self._closing.is_set():
                deadline = deadline or time.monotonic() + _CLOSE_S
                if time.monotonic() > deadline:
                    return
            try:
                payload = encode_batch(batch, self.encoding)
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
            except Exception:  # noqa: BLE001 - one bad batch must not stop the stream
                log.exception("KV cache events: sending batch %d failed", seq)

    def _serve_replays(self) -> None:
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            # [client, b"", start] from a REQ client, [client, start] from a DEALER
            if len(frames) not in (2, 3) or len(frames[-1]) != 8:
                log.warning("KV cache events: ignoring a malformed replay request")
                continue
            client, delimiter = frames[0], frames[1:-1]
            start = int.from_bytes(frames[-1], "big")
            for seq, payload in self._buffer:
                if seq >= start:
                    self._replay.send_multipart((client, *delimiter, seq.to_bytes(8, "big"),
                                                 payload))
            self._replay.send_multipart((client, *delimiter, END_SEQ, b""))
