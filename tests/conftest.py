import os
import sys
from pathlib import Path

import pytest

# Tests run on the CPU; keep JAX from grabbing a GPU if one happens to be present.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests import jax_cache, lifetimes  # noqa: E402
from tests.budget import (  # noqa: E402,F401  (hooks: time and memory per module)
    pytest_addoption, pytest_runtest_logstart, pytest_sessionfinish, pytest_sessionstart,
    pytest_terminal_summary, pytest_testnodedown)


def pytest_collection_modifyitems(session, config, items):
    lifetimes.order_and_plan(items)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After a module's last test (its module fixtures torn down): free what it built."""
    try:
        return (yield)
    finally:
        if nextitem is None or lifetimes.module_of(nextitem) != lifetimes.module_of(item):
            lifetimes.release(lifetimes.module_of(item), last=nextitem is None)


@pytest.fixture(autouse=True)
def _jax_cache(request):
    """Tests marked jax_cache compile through JAX's persistent cache (tests/jax_cache.py)."""
    if request.node.get_closest_marker("jax_cache") is None:
        yield
    else:
        with jax_cache.enabled():
            yield


@pytest.fixture(scope="session")
def demo_model_dir():
    """The demo model as a Hugging Face folder (built from the GGUF once, then cached)."""
    from model import demo
    return demo.fetch_demo_model(demo.cache_dir() / "test-demo" / "SmolLM2-135M-Instruct")


@pytest.fixture(scope="session")
def demo_checkpoint(demo_model_dir):
    """The demo model converted to our checkpoint format (float32), cached like the folder."""
    from model.checkpoint import convert_hf, is_checkpoint
    out = demo_model_dir.parent / "SmolLM2-135M-Instruct-ckpt"
    if not is_checkpoint(out):
        convert_hf(demo_model_dir, out, "float32", progress=False)
    return out


@pytest.fixture(scope="session")
def demo_llm(demo_checkpoint):
    """One demo-model LLM (tests/demo_engine.py's options) for the modules that ask for it,
    closed after the last of them (tests/lifetimes.py)."""
    import contextlib

    from serving import LLM
    from tests.demo_engine import DEMO_OPTIONS
    return lifetimes.shared("demo_llm", contextlib.nullcontext(
        LLM(str(demo_checkpoint), **DEMO_OPTIONS)))


@pytest.fixture(scope="session")
def shared_server(demo_checkpoint):
    """One demo-model server (tests/server_util.py: live_server) for the test modules that
    only send it traffic and leave it clean (fuzzing, overload, security): one warm-up,
    closed after the last of them (tests/lifetimes.py)."""
    from tests.server_util import live_server
    return lifetimes.shared("shared_server", live_server(demo_checkpoint))
