"""KVTransferConfig: `--kv-transfer-config JSON` / `kv_transfer_config=`, with vLLM's keys
(its `KVTransferConfig`), so a deployment written for vLLM's P/D starts with ours after
changing the connector's name. Plain data, no JAX. A bad config is a ValueError at start-up
that names the key.

Only our connector exists: vLLM's (NixlConnector, P2pNcclConnector, ...) move KV with
libraries this server does not have, so naming one is refused rather than ignored.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field, fields
from serving.core.json_option import json_object

CONNECTOR = "JaxTransferConnector"
ROLES = ("kv_producer", "kv_consumer", "kv_both")
# vLLM's keys that mean nothing here but are harmless in a config written for vLLM
_IGNORED = ("kv_rank", "kv_parallel_size", "kv_buffer_size", "kv_buffer_device",
            "kv_connector_module_path", "kv_load_failure_policy")
# kv_connector_extra_config: our keys and their defaults
EXTRA_DEFAULTS = {
    "offer_timeout_s": 120.0,  # an offer nobody claims is freed after this long
    "pull_timeout_s": 30.0,  # a pull that has not landed by then falls back to local prefill
    "side_channel_port": None,  # the producer's claim/release port; None: kv_port + 1
    "advertise_host": None,  # the host decode instances reach; None: kv_ip
}


@dataclass(frozen=True)
class KVTransferConfig:
    kv_connector: str = CONNECTOR
    kv_role: str = "kv_both"
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579  # the transfer server's port; 0: any free port
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    kv_connector_extra_config: dict = field(default_factory=dict)

    @classmethod
    def parse(cls, value: str | dict | None) -> "KVTransferConfig | None":
        """JSON text or a dict -> the config; None (or "") -> None: P/D off."""
        if value is None or value == "":
            return None
        value = json_object(value, "--kv-transfer-config", {f.name for f in fields(cls)},
                            ignored=_IGNORED)
        config = cls(**{k: v for k, v in value.items() if v is not None})
        config.check()
        return config

    def check(self) -> None:
        if self.kv_connector != CONNECTOR:
            raise ValueError(f"--kv-transfer-config: kv_connector {self.kv_connector!r} is "
                             f"not available here; this server's connector is {CONNECTOR!r} "
                             "(jax.experimental.transfer)")
        if self.kv_role not in ROLES:
            raise ValueError(f"--kv-transfer-config: kv_role must be one of "
                             f"{', '.join(ROLES)}, got {self.kv_role!r}")
        if not (isinstance(self.kv_ip, str) and self.kv_ip):
            raise ValueError("--kv-transfer-config: kv_ip must be a host name or address")
        if not (isinstance(self.kv_port, int) and not isinstance(self.kv_port, bool)
                and 0 <= self.kv_port < 65535):
            raise ValueError(f"--kv-transfer-config: kv_port must be a port number, got "
                             f"{self.kv_port!r}")
        if not (isinstance(self.engine_id, str) and self.engine_id):
            raise ValueError("--kv-transfer-config: engine_id must be a non-empty string")
        extra = self.kv_connector_extra_config
        if not isinstance(extra, dict):
            raise ValueError("--kv-transfer-config: kv_connector_extra_config must be an object")
        unknown = sorted(set(extra) - set(EXTRA_DEFAULTS))
        if unknown:
            raise ValueError(f"--kv-transfer-config: unknown kv_connector_extra_config key(s) "
                             f"{', '.join(unknown)}; known: {', '.join(EXTRA_DEFAULTS)}")
        for name in ("offer_timeout_s", "pull_timeout_s"):
            v = extra.get(name, EXTRA_DEFAULTS[name])
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0):
                raise ValueError(f"--kv-transfer-config: {name} must be a positive number of "
                                 f"seconds, got {v!r}")
        port = extra.get("side_channel_port")
        if port is not None and not (isinstance(port, int) and not isinstance(port, bool)
                                     and 0 <= port < 65536):
            raise ValueError(f"--kv-transfer-config: side_channel_port must be a port number, "
                             f"got {port!r}")

    def extra(self, name: str):
        return self.kv_connector_extra_config.get(name, EXTRA_DEFAULTS[name])

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def side_channel_port(self) -> int:
        port = self.extra("side_channel_port")
        if port is not None:
            return port
        return self.kv_port + 1 if self.kv_port else 0
