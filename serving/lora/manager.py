"""LoRAManager: adapters by name, parsed ones in a host LRU, and which device slot holds which
adapter from step to step. No JAX: the device write is a callback (serving/engine/lora_slots.py).

- Named adapters (`--lora-modules`, `/v1/load_lora_adapter`) are LoRARequests by name; the
  OpenAI `model` field picks one.
- Parsed adapters are kept by lora_int_id, at most max_cpu_loras (least recently used goes
  first). A request holds its own parsed adapter, so eviction never takes one from under it.
- Slots are assigned per step: the scheduler runs at most max_loras distinct adapters at
  once (serving/core/scheduler.py), a step's adapters keep the slots they have, and a new one
  takes a free slot or the least recently used one no request of this step needs.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable

from serving.lora.peft import Adapter, load_adapter
from serving.lora.request import LoRAConfig, LoRAError, LoRARequest


class LoRAManager:
    def __init__(self, config: LoRAConfig, available: list[set[str]],
                 write: Callable[[int, Adapter], None]):
        """available: per base layer, the HF projections an adapter may adapt. write(slot,
        adapter): puts an adapter's weights into a device slot."""
        self.config = config
        self.available = available
        self._write = write
        self.named: dict[str, LoRARequest] = {}  # served adapters, by name
        self._digests: dict[str, str] = {}  # served name -> its adapter's digest
        self._parsed: OrderedDict[int, tuple[str, Adapter]] = OrderedDict()  # id -> (path, ..)
        self._slots: OrderedDict[str, int] = OrderedDict()  # digest -> slot, LRU first
        self.num_slot_writes = 0
        self._next_id = 1
        # names and parsed adapters change from the server's threads, slots on the engine's
        self._lock = threading.RLock()

    # -- names --------------------------------------------------------------------------

    def register(self, name: str, path: str, base_model_name: str | None = None
                 ) -> LoRARequest:
        """Serves an adapter under `name` (parsed now: a bad folder fails here)."""
        with self._lock:
            if name in self.named:
                raise LoRAError(f"The lora adapter '{name}' has already been loaded.")
            request = LoRARequest(name, self._new_id(), path, base_model_name)
            self._digests[name] = self.resolve(request).digest
            self.named[name] = request
            return request

    def unregister(self, name: str) -> str:
        """Stops serving `name`; -> the digest of its adapter (requests still running with
        it keep their parsed copy)."""
        with self._lock:
            request = self.named.pop(name, None)
            if request is None:
                raise KeyError(name)
            self._parsed.pop(request.lora_int_id, None)
            return self._digests.pop(name)

    def _new_id(self) -> int:
        while any(r.lora_int_id == self._next_id for r in self.named.values()):
            self._next_id += 1
        self._next_id += 1
        return self._next_id - 1

    # -- parsed adapters ----------------------------------------------------------------

    def resolve(self, request: LoRARequest) -> Adapter:
        """The parsed adapter of a request (from the LRU, or read now)."""
        if not isinstance(request, LoRARequest):
            raise LoRAError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
        with self._lock:
            hit = self._parsed.get(request.lora_int_id)
            if hit is not None and hit[0] == request.lora_path:
                self._parsed.move_to_end(request.lora_int_id)
                return hit[1]
            adapter = load_adapter(request.lora_path, self.available, self.config.max_lora_rank)
            adapter.name = request.lora_name
            self._parsed[request.lora_int_id] = (request.lora_path, adapter)
            while len(self._parsed) > self.config.cpu_capacity:
                self._parsed.popitem(last=False)
            return adapter

    # -- device slots -------------------------------------------------------------------

    def step_slots(self, adapters: list[Adapter | None]) -> list[int]:
        """Each scheduled request's slot (-1: the base model), writing the adapters not yet
        on the device into slots this step does not need."""
        wanted = {a.digest: a for a in adapters if a is not None}
        if len(wanted) > self.config.max_loras:
            raise RuntimeError(f"{len(wanted)} adapters in one step, more than max_loras "
                               f"{self.config.max_loras}")
        for digest in wanted:
            if digest in self._slots:
                self._slots.move_to_end(digest)
        for digest, adapter in wanted.items():
            if digest not in self._slots:
                self._slots[digest] = self._free_slot(wanted)
                self._write(self._slots[digest], adapter)
                self.num_slot_writes += 1
        return [-1 if a is None else self._slots[a.digest] for a in adapters]

    def _free_slot(self, wanted: dict) -> int:
        used = set(self._slots.values())
        for slot in range(self.config.max_loras):
            if slot not in used:
                return slot
        for digest in self._slots:  # least recently used first
            if digest not in wanted:
                return self._slots.pop(digest)
        raise RuntimeError("no LoRA slot is free")  # unreachable: len(wanted) <= max_loras
