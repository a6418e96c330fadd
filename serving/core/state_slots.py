"""Recurrent state slots for a linear-attention hybrid (model/linear_attention/state.py):
host-side, no JAX. A request holds one slot from admission until it finishes, aborts or is
preempted (it then recomputes from position 0, so its slot's contents never matter again).

`StateKVCacheManager` wraps the page manager so the scheduler counts slots as it counts
pages: allocation fails, and the scheduler waits or preempts, when a request needs a slot
and none is free. docs/architecture.md, "Linear attention and recurrent state".
"""
from __future__ import annotations

from serving.core.request import Request


class StateSlots:
    """Slots 1 .. num_slots (0 is the device's null slot, which padded rows use)."""

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots, 0, -1))  # popped from the end: lowest first
        self._held: dict[str, int] = {}

    def slot(self, request_id: str) -> int | None:
        return self._held.get(request_id)

    def take(self, request_id: str) -> bool:
        """A slot for the request (True if it already holds one); False if none is free."""
        if request_id in self._held:
            return True
        if not self._free:
            return False
        self._held[request_id] = self._free.pop()
        return True

    def give_back(self, request_id: str) -> None:
        slot = self._held.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_held(self) -> int:
        return len(self._held)


class StateKVCacheManager:
    """A page manager (core/kv_cache_manager.py or core/kv_hybrid.py) whose requests also
    hold a state slot; everything else is the page manager's."""

    def __init__(self, pages, slots: StateSlots):
        self.pages = pages
        self.slots = slots

    def __getattr__(self, name):
        return getattr(self.pages, name)

    def allocate_slots(self, req: Request, num_new_tokens: int, *args, **kwargs) -> bool:
        had = self.slots.slot(req.request_id) is not None
        if not self.slots.take(req.request_id):
            return False
        if self.pages.allocate_slots(req, num_new_tokens, *args, **kwargs):
            return True
        if not had:
            self.slots.give_back(req.request_id)
        return False

    def free(self, req: Request) -> None:
        self.slots.give_back(req.request_id)
        self.pages.free(req)

    def state_slot(self, request_id: str) -> int | None:
        return self.slots.slot(request_id)
