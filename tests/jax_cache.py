"""JAX's own persistent compilation cache, for the tests marked `jax_cache`: kernels, model
blocks and quantizers called as plain jitted functions, which compile many small programs
and build no engine. A warm run loads those programs instead of compiling them again.

Engines keep their programs in the executable cache (serving/engine/executable_cache.py),
which saves nothing while JAX's cache is on, so a test that builds an engine is not marked.
The folder is named by the hash of the sources programs are traced from, so a change to a
kernel (its C++ included) starts an empty one; the folders of other hashes are removed.
"""
from __future__ import annotations

import contextlib
import functools
import shutil

import jax


@functools.cache
def folder():
    """Made once per process, with the folders of other hashes removed."""
    from serving.core.config import default_cache_root
    from serving.engine.executable_cache import code_version
    path = default_cache_root() / "jax-tests" / code_version()
    path.mkdir(parents=True, exist_ok=True)
    for other in path.parent.glob("*"):
        if other != path:
            shutil.rmtree(other, ignore_errors=True)
    return path


@contextlib.contextmanager
def enabled():
    from jax.experimental.compilation_cache import compilation_cache
    path = folder()
    before = {name: getattr(jax.config, name) for name in (
        "jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")}
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    compilation_cache.reset_cache()  # JAX decides once whether a cache is used: ask again
    try:
        yield
    finally:
        for name, value in before.items():
            jax.config.update(name, value)
        compilation_cache.reset_cache()
