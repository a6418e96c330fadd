"""KV cache events (docs/architecture.md, "KV cache events"): the wire format decoded by
msgspec structs declared as vLLM declares them, the events the KV cache managers record on
random workloads replayed against the allocators, and the config's checks, on the command
line too (the publisher and an engine publishing: test_kv_event_publisher.py).

No `from __future__ import annotations` here: msgspec reads the annotations of the structs
declared inside _vllm_schema, which must name that function's classes, not ours."""

import random
from typing import Any

import msgspec
import pytest

from serving.core.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, EventBatch,
                                    encode_batch, external_hash)
from serving.core.kv_events_config import KVEventsConfig
from serving.core.page_hash import hash_page
from serving.core.request import Request
from serving.core.sampling_params import SamplingParams
from serving.core.scheduler import Scheduler, SchedulerConfig


# -- vLLM's declarations (vllm/distributed/kv_events.py), both generations -------------------

class VllmEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


def _vllm_schema(array_like: bool):
    """The event structs: tagged arrays up to vLLM 0.23, tagged maps from 0.24 on."""
    class KVCacheEvent(msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False,
                       tag=True):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[tuple[Any, ...] | None] | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[int]
        medium: str | None
        group_idx: int | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(VllmEventBatch):
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]

    return KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared


VLLM = {"map": _vllm_schema(False), "array": _vllm_schema(True)}


def decode(payload: bytes, encoding: str = "map"):
    return msgspec.msgpack.decode(payload, type=VLLM[encoding][0])


SAMPLE = EventBatch(1718000000.25, [
    BlockStored([2**64 - 1, 7], None, list(range(8)), 4, None, "GPU", "sql", [("sql", "s"),
                ("sql",)], 1, "sliding_window", 8),
    BlockStored([9], 7, [1, 2, 3, 4], 4, None, "GPU", None, [None], 0, "full_attention"),
    BlockRemoved([7, 9], "GPU", 0),
    AllBlocksCleared(),
], 3)


@pytest.mark.parametrize("encoding", ["map", "array"])
def test_a_batch_is_byte_for_byte_what_vllm_structs_encode(encoding):
    batch_cls, stored, removed, cleared = VLLM[encoding]
    ours = encode_batch(SAMPLE, encoding)
    theirs = msgspec.msgpack.encode(batch_cls(SAMPLE.ts, [
        stored(**{k: getattr(SAMPLE.events[0], k) for k in stored.__struct_fields__}),
        stored(**{k: getattr(SAMPLE.events[1], k) for k in stored.__struct_fields__}),
        removed([7, 9], "GPU", 0), cleared()], 3))
    assert ours == theirs
    back = decode(ours, encoding)
    assert (back.ts, back.data_parallel_rank) == (SAMPLE.ts, 3)
    assert back.events[0].extra_keys == [("sql", "s"), ("sql",)]
    assert back.events[0].block_hashes == [2**64 - 1, 7]
    assert back.events[1].kv_cache_spec_sliding_window is None
    assert isinstance(back.events[3], cleared)


def test_map_events_leave_defaults_out_and_array_events_keep_every_field():
    plain = msgspec.msgpack.decode(encode_batch(SAMPLE, "map"))
    assert plain[0] == SAMPLE.ts and plain[2] == 3  # the batch stays an array
    assert plain[1][1] == {"type": "BlockStored", "block_hashes": [9], "parent_block_hash": 7,
                           "token_ids": [1, 2, 3, 4], "block_size": 4, "lora_id": None,
                           "medium": "GPU", "lora_name": None, "extra_keys": [None],
                           "group_idx": 0, "kv_cache_spec_kind": "full_attention"}
    assert plain[1][3] == {"type": "AllBlocksCleared"}
    legacy = msgspec.msgpack.decode(encode_batch(SAMPLE, "array"))
    assert legacy[1][2] == ["BlockRemoved", [7, 9], "GPU", 0]
    assert legacy[1][1][:5] == ["BlockStored", [9], 7, [1, 2, 3, 4], 4]
    assert len(legacy[1][1]) == 12 and legacy[1][3] == ["AllBlocksCleared"]


def test_event_hashes_are_the_low_64_bits_of_the_page_hash():
    assert external_hash(bytes(24) + (5).to_bytes(8, "big")) == 5
    assert external_hash(b"\xff" * 32) == 2**64 - 1
    assert external_hash(b"\x01" + bytes(31)) == 0


# -- what the managers record ---------------------------------------------------------------

PS = 4
KEYS = ("m",)  # the scheduler's model_key below: the first page's extra key


def replay(events: list, group: int = 0, known: set[int] | None = None,
           full: dict[int, bytes] | None = None) -> set[int]:
    """The hashes a consumer holds after `events` (group `group`), each BlockStored checked
    first: its tokens fill its pages, and its hashes are the chain of page hashes its
    parent and tokens give (full: every external hash seen -> our whole hash)."""
    known = set() if known is None else known
    full = {} if full is None else full
    for e in events:
        if isinstance(e, AllBlocksCleared):
            known.clear()
        elif e.group_idx != group:
            continue
        elif isinstance(e, BlockRemoved):
            assert e.medium == "GPU" and known >= set(e.block_hashes)
            known.difference_update(e.block_hashes)
        else:
            assert len(e.token_ids) == len(e.block_hashes) * PS == len(e.extra_keys) * PS
            parent = None if e.parent_block_hash is None else full[e.parent_block_hash]
            for k, h in enumerate(e.block_hashes):
                first = parent is None
                parent = hash_page(parent, e.token_ids[k * PS:(k + 1) * PS],
                                   KEYS if first else ())
                assert external_hash(parent) == h and h not in known
                full[h] = parent
            known.update(e.block_hashes)
    return known


def cached(allocator) -> set[int]:
    return {external_hash(h) for p in range(1, allocator.num_pages)
            if (h := allocator.page_hash(p)) is not None}


def run_workload(sched: Scheduler, rng: random.Random, num_requests: int, check) -> None:
    """Requests sharing a few prefixes arrive a few at a time while others run; `check`
    runs after every step."""
    prefixes = [[rng.randrange(3, 60) for _ in range(rng.randrange(4, 20))] for _ in range(3)]
    todo = [Request(f"r{i}", rng.choice(prefixes)
                    + [rng.randrange(3, 60) for _ in range(rng.randrange(1, 12))],
                    SamplingParams(max_tokens=rng.randrange(1, 14), ignore_eos=True))
            for i in range(num_requests)]
    while todo or sched.has_unfinished:
        for _ in range(rng.randrange(0, 3)):
            if todo:
                sched.add_request(todo.pop())
        out = sched.schedule()
        sched.update(out, [rng.randrange(3, 60) if s.samples else None
                           for s in out.scheduled])
        check()


@pytest.mark.parametrize("seed,window", [(0, 0), (1, 0), (2, 8)])
def test_replaying_the_events_gives_what_the_allocator_holds(seed, window):
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16,
                                      max_model_len=64, page_size=PS, num_pages=20,
                                      model_key="m", sliding_window=window))
    kvm, events, known, full = sched.kv_cache_manager, [], set(), {}
    kvm.record_events(events)

    def check():
        replay(events, 0, known, full)
        events.clear()
        assert known == cached(kvm.allocator)
    run_workload(sched, random.Random(seed), 40, check)
    assert kvm.allocator.num_evictions > 0
    assert kvm.events.spec_kind == ("sliding_window" if window else "full_attention")
    assert kvm.reset_prefix_cache()
    assert isinstance(events[-1], AllBlocksCleared)
    assert not replay(events, 0, known, full) and not cached(kvm.allocator)


def test_a_hybrid_model_reports_its_two_groups():
    sched = Scheduler(SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=16,
                                      max_model_len=128, page_size=PS, num_pages=40,
                                      model_key="m", window_group=8, window_num_pages=16))
    kvm, events = sched.kv_cache_manager, []
    kvm.record_events(events)
    known, full = {0: set(), 1: set()}, {}

    def check():
        for group, allocator in ((0, kvm.full.allocator), (1, kvm.window.allocator)):
            replay(events, group, known[group], full)
            assert known[group] == cached(allocator)
        events.clear()
    run_workload(sched, random.Random(3), 30, check)
    assert kvm.window.allocator.num_evictions > 0
    assert kvm.reset_prefix_cache()
    assert [type(e) for e in events].count(AllBlocksCleared) == 1  # one reset, one event
    assert isinstance(events[-1], AllBlocksCleared)


def test_hybrid_groups_carry_their_kind_and_window():
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16,
                                      max_model_len=128, page_size=PS, num_pages=40,
                                      model_key="m", window_group=8, window_num_pages=16))
    events = []
    sched.kv_cache_manager.record_events(events)
    sched.add_request(Request("a", list(range(3, 23)), SamplingParams(max_tokens=1)))
    while sched.has_unfinished:
        out = sched.schedule()
        sched.update(out, [5 if s.samples else None for s in out.scheduled])
    kinds = {(e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window)
             for e in events if isinstance(e, BlockStored)}
    assert kinds == {(0, "full_attention", None), (1, "sliding_window", 8)}


def test_a_page_another_page_already_caches_emits_nothing():
    """Two requests with one prompt, in one step, both compute it; only the first caches."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64,
                                      max_model_len=64, page_size=PS, num_pages=20,
                                      model_key="m"))
    events = []
    sched.kv_cache_manager.record_events(events)
    for rid in ("a", "b"):
        sched.add_request(Request(rid, list(range(3, 12)), SamplingParams(max_tokens=1)))
    out = sched.schedule()
    assert len(out.scheduled) == 2
    sched.update(out, [5, 5])
    assert [e.token_ids for e in events] == [list(range(3, 11))]


def test_lora_name_and_cache_salt_go_where_vllm_puts_them():
    class Adapter:
        name, digest = "sql", "d" * 64
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64,
                                      max_model_len=64, page_size=PS, num_pages=20,
                                      max_loras=1))
    events = []
    sched.kv_cache_manager.record_events(events)
    sched.add_request(Request("a", list(range(3, 12)), SamplingParams(
        max_tokens=1, cache_salt="s"), lora=Adapter()))
    sched.update(sched.schedule(), [5])
    (e,) = events
    assert (e.lora_name, e.extra_keys, e.lora_id) == ("sql", [("sql", "s"), ("sql",)], None)


def test_no_recorder_no_events():
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64,
                                      max_model_len=64, page_size=PS, num_pages=20))
    assert sched.kv_cache_manager.events is None and sched.allocator.events is None


# -- the config -----------------------------------------------------------------------------

def test_config_defaults_are_vllms_and_publish_nothing():
    c = KVEventsConfig.parse(None)
    assert (c.enable_kv_cache_events, c.endpoint, c.replay_endpoint, c.buffer_steps, c.hwm,
            c.max_queue_size, c.topic) == (False, "tcp://*:5557", None, 10_000, 100_000,
                                           100_000, "")
    assert not c.publishes
    assert KVEventsConfig.parse('{"enable_kv_cache_events": true}').publishes
    assert not KVEventsConfig.parse({"enable_kv_cache_events": True,
                                     "publisher": "null"}).publishes


@pytest.mark.parametrize("value,named", [
    ('{"enable_kv_cache_events": true, "bogus": 1}', "bogus"),
    ('{"publisher": "kafka"}', "kafka"),
    ('{"buffer_steps": 0}', "buffer_steps"),
    ('{"hwm": true}', "hwm"),
    ('{"event_encoding": "json"}', "event_encoding"),
    ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events"),
    ('{"replay_endpoint": 5558}', "replay_endpoint"),
    ("[1]", "JSON object"),
    ("{", "not valid JSON"),
])
def test_a_bad_config_names_what_is_wrong(value, named):
    with pytest.raises(ValueError, match=named):
        KVEventsConfig.parse(value)


def test_the_cli_refuses_a_bad_config_before_loading_a_model(capsys):
    from serving.cli import _engine_config, build_parser, main
    args = build_parser().parse_args(["serve", "--kv-events-config",
                                      '{"enable_kv_cache_events": true}'])
    assert _engine_config(args).kv_events_config == '{"enable_kv_cache_events": true}'
    assert main(["serve", "--kv-events-config", '{"enable_kv_cache_events": true, '
                                                '"endpont": "tcp://*:5557"}']) == 1
    assert "error: kv_events_config: unknown key(s) endpont" in capsys.readouterr().err
