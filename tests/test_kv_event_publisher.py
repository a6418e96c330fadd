"""The KV event publisher (docs/architecture.md, "KV cache events"): endpoints per
data-parallel rank, frames and seq numbers, drops on a full queue, replay, and one demo
engine publishing the pages its prompts fill to a subscriber."""
import logging
import threading
import time

import pytest
import zmq

from serving.core.kv_events import AllBlocksCleared, BlockRemoved, encode_batch
from serving.core.kv_events_config import KVEventsConfig
from serving.engine import kv_event_publisher
from serving.engine.kv_event_publisher import END_SEQ, ZmqEventPublisher, offset_endpoint
from tests.test_kv_events import VLLM, decode


# -- the sockets --------------------------------------------------------------------------

def recv_all(sock: zmq.Socket, count: int, timeout_s: float = 10.0) -> list[list[bytes]]:
    """count multipart messages, polling up to a deadline."""
    got, deadline = [], time.monotonic() + timeout_s
    while len(got) < count and time.monotonic() < deadline:
        if sock.poll(50):
            got.append(sock.recv_multipart())
    return got


def request_replay(endpoint: str, start: int) -> list[tuple[int, bytes]]:
    """vLLM's replay: an 8-byte start seq (REQ's envelope), (seq, payload)s up to seq -1."""
    ctx = zmq.Context.instance()
    with ctx.socket(zmq.DEALER) as sock:
        sock.connect(endpoint)
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            (frames,) = recv_all(sock, 1)
            assert frames[0] == b""
            if frames[1] == END_SEQ:
                assert frames[2] == b""
                return out
            out.append((int.from_bytes(frames[1], "big"), frames[2]))


def subscriber(endpoint: str, bind: bool) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sock.bind(endpoint) if bind else sock.connect(endpoint)
    return sock


def joined(pub: ZmqEventPublisher, sub: zmq.Socket) -> int:
    """Publishes probes until the subscriber gets one (a subscription takes a moment to
    reach a PUB socket), then takes the rest; returns the next batch's seq."""
    sent, deadline = 0, time.monotonic() + 10
    while not sub.poll(20):
        assert time.monotonic() < deadline, "the subscriber never joined"
        pub.publish([AllBlocksCleared()])
        sent += 1
    while int.from_bytes(sub.recv_multipart()[1], "big") != sent - 1:
        assert sub.poll(10_000)
    return sent


def test_endpoints_per_data_parallel_rank():
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://*:5557", 3) == "tcp://*:5560"
    assert offset_endpoint("tcp://[::1]:5557", 1) == "tcp://[::1]:5558"
    assert offset_endpoint("inproc://cache", 2) == "inproc://cache_dp2"
    assert offset_endpoint("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"
    assert offset_endpoint(None, 1) is None
    with pytest.raises(ValueError, match="data-parallel rank 1"):
        offset_endpoint("tcp://host", 1)


def test_a_full_queue_drops_a_batch_and_leaves_a_gap_in_seq(monkeypatch, caplog):
    armed, entered, release = threading.Event(), threading.Event(), threading.Event()

    def slow_encode(batch, encoding):
        if armed.is_set():
            entered.set()
            release.wait(10)
        return encode_batch(batch, encoding)
    monkeypatch.setattr(kv_event_publisher, "encode_batch", slow_encode)
    sub = subscriber("tcp://127.0.0.1:*", bind=True)  # the publisher dials it (no "*")
    port = int(sub.getsockopt(zmq.LAST_ENDPOINT).decode().rpartition(":")[2])
    pub = ZmqEventPublisher(KVEventsConfig(  # rank 1: port + 1
        enable_kv_cache_events=True, endpoint=f"tcp://127.0.0.1:{port - 1}",
        max_queue_size=1, topic="kv@x@m"), 1)
    try:
        assert pub.endpoint == f"tcp://127.0.0.1:{port}"
        s = joined(pub, sub)
        armed.set()
        pub.publish([AllBlocksCleared()])  # seq s: the thread takes it and waits
        assert entered.wait(10)
        with caplog.at_level(logging.WARNING, logger="xlaserve"):
            for _ in range(3):  # s + 1 queued; s + 2 and s + 3 dropped, logged once
                pub.publish([AllBlocksCleared()])
        assert pub.num_dropped == 2
        assert sum("dropping" in r.message for r in caplog.records) == 1
        release.set()
        got = recv_all(sub, 2)
        pub.publish([BlockRemoved([5], "GPU", 0)])  # s + 4, the queue empty again
        got += recv_all(sub, 1)
        assert [int.from_bytes(f[1], "big") - s for f in got] == [0, 1, 4]
        assert all(f[0] == b"kv@x@m" for f in got)
        assert decode(got[2][2]).data_parallel_rank == 1
    finally:
        release.set()
        pub.close()
        sub.close(linger=0)
    pub.publish([AllBlocksCleared()])  # closed: ignored


def test_a_taken_port_is_a_clear_error():
    with zmq.Context.instance().socket(zmq.PUB) as taken:
        port = taken.bind_to_random_port("tcp://*")
        with pytest.raises(ValueError, match=f"cannot bind tcp://\\*:{port}"):
            ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True,
                                             endpoint=f"tcp://*:{port}"))


# -- one engine publishing ------------------------------------------------------------------

TOPIC = b"kv@127.0.0.1@demo"


@pytest.fixture(scope="module")
def publishing(demo_checkpoint, tmp_path_factory):
    """(LLM publishing its events on a socket it binds, a subscriber, its replay endpoint).
    The subscriber connects while the engine warms up, long before the first batch."""
    from serving import LLM
    from tests.demo_engine import DEMO_OPTIONS
    folder = tmp_path_factory.mktemp("kv-events")
    endpoint, replay_endpoint = f"ipc://{folder}/events", f"ipc://{folder}/replay"
    config = {"enable_kv_cache_events": True, "endpoint": endpoint,
              "replay_endpoint": replay_endpoint, "topic": TOPIC.decode()}
    llm = LLM(str(demo_checkpoint), warmup=False, **DEMO_OPTIONS, kv_events_config=config)
    sub = subscriber(endpoint, bind=False)
    llm.engine.warmup()
    yield llm, sub, replay_endpoint
    llm.engine.close()
    sub.close(linger=0)


def test_an_engine_publishes_the_pages_its_prompts_fill(publishing):
    from tests.demo_engine import greedy
    llm, sub, replay_endpoint = publishing
    ps = llm.engine.config.page_size
    prefix = list(range(100, 100 + ps + 4))  # one full page shared, then 4 tokens
    prompts = [prefix + list(range(1000 * i, 1000 * i + 20)) for i in range(1, 5)]
    llm.generate(prompts[:3], greedy(2))  # two full pages each: 40 + 2 tokens
    llm.generate(prompts[3:], greedy(2))  # finds the first page cached
    assert llm.engine.reset_prefix_cache()  # published at once: the last batch
    got = []
    while not got or not isinstance(decode(got[-1][2]).events[-1], VLLM["map"][3]):
        (frames,) = recv_all(sub, 1)
        got.append(frames)
    assert all(f[0] == TOPIC for f in got)
    assert [int.from_bytes(f[1], "big") for f in got] == list(range(len(got)))
    batches = [decode(f[2]) for f in got]
    assert {b.data_parallel_rank for b in batches} == {0}
    stored = [e for b in batches for e in b.events if type(e).__name__ == "BlockStored"]
    chunks = [tuple(e.token_ids[k:k + ps]) for e in stored
              for k in range(0, len(e.token_ids), ps)]
    pages = {tuple(p[k:k + ps]) for p in prompts for k in (0, ps)}
    assert sorted(chunks) == sorted(pages)  # each page once: the same page twice is cached once
    first = next(e for e in stored if e.parent_block_hash is None)
    assert first.token_ids[:ps] == prefix[:ps]
    assert all(e.parent_block_hash in (None, first.block_hashes[0]) for e in stored)
    assert {(e.block_size, e.medium, e.group_idx) for e in stored} == {(ps, "GPU", 0)}
    removed = {h for e in batches[-1].events if type(e).__name__ == "BlockRemoved"
               for h in e.block_hashes}
    assert removed == {h for e in stored for h in e.block_hashes}
    assert request_replay(replay_endpoint, 0) == [(int.from_bytes(f[1], "big"), f[2])
                                                  for f in got]
    assert [seq for seq, _ in request_replay(replay_endpoint, len(got) - 1)] == [len(got) - 1]
