"""KVEventsConfig: `--kv-events-config JSON` / `kv_events_config=`, with vLLM's keys (its
`KVEventsConfig`), so a deployment written for vLLM works unchanged. Plain data, no JAX. A
bad config is a ValueError at start-up that names the key.

One key is ours: `event_encoding`. vLLM 0.24 changed how each event is encoded (tagged
arrays before, tagged maps since: core/kv_events.py); consumers built for either exist, so
the choice is the deployment's. The default is vLLM's current one.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from serving.core.json_option import json_object

PUBLISHERS = ("zmq", "null")
ENCODINGS = ("map", "array")  # vLLM >= 0.24, vLLM <= 0.23


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False  # off: nothing is recorded or published
    publisher: str | None = None  # "zmq" or "null" (events dropped); None: zmq when enabled
    endpoint: str = "tcp://*:5557"  # PUB socket; bound or connected (engine/kv_event_publisher.py)
    replay_endpoint: str | None = None  # ROUTER socket serving past batches; None: no replay
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark (messages queued per subscriber)
    max_queue_size: int = 100_000  # batches waiting for the sender thread; more are dropped
    topic: str = ""  # the first frame of every message (llm-d: kv@<pod-ip>@<model>)
    event_encoding: str = "map"  # ours: "map" (vLLM >= 0.24) or "array" (vLLM <= 0.23)

    @classmethod
    def parse(cls, value) -> "KVEventsConfig":
        """A JSON object (text or a dict); None or "" is the default (events off)."""
        if isinstance(value, KVEventsConfig):
            return value
        if value is None or value == "":
            return cls()
        return cls(**json_object(value, "kv_events_config", {f.name for f in fields(cls)}))

    def __post_init__(self):
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError("kv_events_config: enable_kv_cache_events must be true or false, "
                             f"got {self.enable_kv_cache_events!r}")
        if self.publisher is not None and self.publisher not in PUBLISHERS:
            raise ValueError(f"kv_events_config: unknown publisher {self.publisher!r}; choose "
                             f"one of {', '.join(PUBLISHERS)}")
        for key in ("endpoint", "topic"):
            if not isinstance(getattr(self, key), str):
                raise ValueError(f"kv_events_config: {key} must be a string, got "
                                 f"{getattr(self, key)!r}")
        if not self.endpoint:
            raise ValueError("kv_events_config: endpoint must not be empty")
        if self.replay_endpoint is not None and not (
                isinstance(self.replay_endpoint, str) and self.replay_endpoint):
            raise ValueError("kv_events_config: replay_endpoint must be a non-empty string or "
                             f"null, got {self.replay_endpoint!r}")
        for key in ("buffer_steps", "hwm", "max_queue_size"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"kv_events_config: {key} must be a positive integer, "
                                 f"got {v!r}")
        if self.event_encoding not in ENCODINGS:
            raise ValueError(f"kv_events_config: unknown event_encoding "
                             f"{self.event_encoding!r}; choose map (vLLM >= 0.24) or array "
                             "(vLLM <= 0.23)")

    @property
    def publishes(self) -> bool:
        """Whether events are recorded and sent: enabled, and not to the null publisher."""
        return self.enable_kv_cache_events and (self.publisher or "zmq") == "zmq"
