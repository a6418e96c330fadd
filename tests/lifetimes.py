"""What a test module builds lives no longer than the modules that use it, so the suite's
memory is bounded by its largest module, not by its sum (docs/architecture.md, "Test
layers").

- Shared engines: a session fixture whose value is costly (an engine, a server) is built
  through `shared(name, context_manager)` on first use and closed after the last module
  that asks for the fixture `name`. Modules are ordered so that the users of each shared
  fixture run one after another (within that, in their usual order), so each is built once.
- After every module: JAX's compilation and tracing caches are cleared (jitted helpers at a
  module's top level and the programs under them), and so is aiohttp's cache of built
  middleware chains (keyed by handler and application, up to 1024 of them: it keeps every
  test server's application, and through it its engine, alive); then the garbage is
  collected and memory the allocator holds free handed back to the operating system.
"""
from __future__ import annotations

import contextlib
import ctypes
import gc
import os

# Session fixtures built through shared(), in the order their users run.
SHARED = ("demo_llm", "shared_server")

_live: dict[str, contextlib.ExitStack] = {}
_still_needed: dict[str, set[str]] = {}  # module -> shared fixtures the modules after it use


def shared(name: str, manager):
    """Enters `manager` (a context manager) and keeps it open until no module left needs
    the fixture `name`. Then it is closed and its value emptied (pytest still holds the
    session fixture's value: emptied, it holds no engine, and a use after release fails)."""
    assert name in SHARED, f"{name} is not in tests/lifetimes.py SHARED"
    stack = contextlib.ExitStack()
    value = stack.enter_context(manager)
    if hasattr(value, "__dict__"):
        stack.callback(value.__dict__.clear)
    _live[name] = stack
    return value


def module_of(item) -> str:
    return item.nodeid.split("::")[0]


def _shared_of(item) -> set[str]:
    return set(getattr(item, "fixturenames", ())) & set(SHARED)


def order_and_plan(items: list) -> None:
    """Groups the users of each shared fixture together (stable otherwise) and records,
    for every module, which shared fixtures a later module still needs."""
    modules: dict[str, list] = {}
    for item in items:
        modules.setdefault(module_of(item), []).append(item)
    uses = {m: set().union(*map(_shared_of, its)) for m, its in modules.items()}

    def key(m):
        idx = [SHARED.index(n) for n in uses[m]]
        return (min(idx), max(idx)) if idx else (-1, -1)
    order = sorted(modules, key=key)  # stable: the usual order within a group
    items[:] = [item for m in order for item in modules[m]]
    later: set[str] = set()
    for m in reversed(order):
        _still_needed[m] = set(later)
        later |= uses[m]


def release(module: str, last: bool = False) -> None:
    """After `module`'s last test: close the shared fixtures no later module uses (all of
    them after the run's `last` test), then free what JAX and the allocator still hold."""
    needed = set() if last else _still_needed.get(module, set())
    if not last and os.environ.get("PYTEST_XDIST_WORKER"):  # a pytest-xdist worker is handed
        needed = set(_live)  # modules as it goes: its shared fixtures live as long as it does
    for name in [n for n in _live if n not in needed]:
        _live.pop(name).close()
    free_memory()


def free_memory() -> None:
    import sys
    if "jax" in sys.modules:
        sys.modules["jax"].clear_caches()
    web_app = sys.modules.get("aiohttp.web_app")
    if web_app is not None and hasattr(web_app, "_cached_build_middleware"):
        web_app._cached_build_middleware.cache_clear()
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
