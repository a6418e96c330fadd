"""What names an adapter (vLLM's LoRARequest) and the engine's LoRA limits. No JAX."""
from __future__ import annotations

from dataclasses import dataclass

# vLLM's MaxLoRARanks: compiled shapes depend on the rank, so only these are offered.
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class LoRAError(ValueError):
    """An adapter that cannot be served: the message names what is wrong."""


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by name, id and PEFT folder, as vLLM's `LoRARequest`."""
    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self):
        if not (isinstance(self.lora_name, str) and self.lora_name):
            raise LoRAError("lora_name must be a non-empty string")
        if not (isinstance(self.lora_int_id, int) and self.lora_int_id > 0):
            raise LoRAError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not (isinstance(self.lora_path, str) and self.lora_path):
            raise LoRAError("lora_path must be a non-empty string")


@dataclass(frozen=True)
class LoRAConfig:
    """vLLM's flags and defaults: max_loras adapters in one step (device slots), each at most
    max_lora_rank; max_cpu_loras parsed adapters kept on the host (default: max_loras)."""
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self):
        if not (isinstance(self.max_loras, int) and self.max_loras >= 1):
            raise LoRAError(f"max_loras must be an integer >= 1, got {self.max_loras!r}")
        if self.max_lora_rank not in MAX_LORA_RANKS:
            raise LoRAError(f"max_lora_rank must be one of {', '.join(map(str, MAX_LORA_RANKS))}"
                            f", got {self.max_lora_rank!r}")
        if self.max_cpu_loras is not None and not (
                isinstance(self.max_cpu_loras, int) and self.max_cpu_loras >= self.max_loras):
            raise LoRAError(f"max_cpu_loras ({self.max_cpu_loras!r}) must be an integer >= "
                            f"max_loras ({self.max_loras})")

    @property
    def cpu_capacity(self) -> int:
        return self.max_cpu_loras or self.max_loras


@dataclass(frozen=True)
class LoRAModule:
    """One `--lora-modules` entry: `name=path`, or JSON with name, path, base_model_name."""
    name: str
    path: str
    base_model_name: str | None = None

    @classmethod
    def parse(cls, text: str) -> "LoRAModule":
        import json
        if text.lstrip().startswith("{"):
            try:
                d = json.loads(text)
            except json.JSONDecodeError as e:
                raise LoRAError(f"--lora-modules {text!r}: invalid JSON: {e}") from None
            unknown = set(d) - {"name", "path", "base_model_name"}
            if unknown or not isinstance(d.get("name"), str) or not isinstance(d.get("path"), str):
                raise LoRAError(f"--lora-modules {text!r}: JSON needs string 'name' and 'path' "
                                "(and optionally 'base_model_name'), nothing else")
            return cls(d["name"], d["path"], d.get("base_model_name"))
        name, sep, path = text.partition("=")
        if not sep or not name or not path:
            raise LoRAError(f"--lora-modules {text!r}: expected name=path or JSON")
        return cls(name, path)
