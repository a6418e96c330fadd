"""Host-side serving modules must import without JAX, so their tests run in milliseconds."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HOST_MODULES = ["serving.core.request", "serving.core.page_allocator", "serving.core.scheduler",
                "serving.core.buckets", "serving.core.sampling_params",
                "serving.core.kv_cache_manager", "serving.core.page_hash"]

CHECK = f"""
import importlib, sys
for name in {HOST_MODULES!r}:
    importlib.import_module(name)
heavy = sorted(m for m in ("jax", "jaxlib", "flax") if m in sys.modules)
assert not heavy, f"host modules (or serving/__init__) imported {{heavy}}"
"""


def test_host_modules_do_not_import_jax():
    # A fresh interpreter: this process may already hold jax from other tests.
    proc = subprocess.run([sys.executable, "-c", CHECK], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
