import os
import sys
from pathlib import Path

import pytest

# Tests run on the CPU; keep JAX from grabbing a GPU if one happens to be present.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


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
def shared_server(demo_checkpoint):
    """One demo-model server (tests/server_util.py: live_server) for the test modules that
    only send it traffic and leave it clean (fuzzing, overload, security): one warm-up."""
    from tests.server_util import live_server
    with live_server(demo_checkpoint) as server:
        yield server
