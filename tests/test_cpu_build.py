"""Building the CPU kernels ahead of their first use (pallas_kernels/cpu_build.py): a server
starts the missing builds on threads before it imports JAX; the first kernel asked for
waits for its own build, and a build that failed there still fails loudly."""
from __future__ import annotations

import os

import pytest

from pallas_kernels import cpu_build, cpu_ffi

pytestmark = pytest.mark.skipif(cpu_build.compiler() is None,
                                reason="no C++ compiler or no AVX2 CPU: nothing is built")


def missing(compiler: str) -> set[str]:
    return {k for k in cpu_build.KERNELS if not cpu_build.library_path(compiler, k).exists()}


@pytest.fixture
def kernel_dir(tmp_path, monkeypatch):
    """A kernel folder holding links to every built library but those of argmax, rms_norm
    (both built ahead) and q8_0_matmul (built when asked for), and no build started."""
    compiler = cpu_build.compiler()
    for kernel in cpu_build.KERNELS:
        assert cpu_ffi.available(kernel)  # built in the real folder
    built = {k: cpu_build.library_path(compiler, k) for k in cpu_build.KERNELS}
    monkeypatch.setenv("XLASERVE_CPU_KERNEL_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_build, "_started", {})
    monkeypatch.setattr(cpu_build, "_ahead", False)
    monkeypatch.setattr(cpu_build, "_gpu_plugin_installed", lambda: False)
    for kernel, path in built.items():
        if kernel not in ("argmax", "rms_norm", "q8_0_matmul"):
            os.symlink(path, tmp_path / path.name)
    return compiler


def test_started_builds_are_waited_for(kernel_dir):
    assert missing(kernel_dir) == {"argmax", "rms_norm", "q8_0_matmul"}
    assert cpu_build.start_building()
    assert not cpu_build.start_building()  # both already started: nothing more
    started = {path.name.rsplit("_", 1)[0] for path in cpu_build._started}
    assert started == {"argmax", "rms_norm"}  # q8_0_matmul is not built ahead
    path = cpu_build.ensure_built(kernel_dir, "argmax")
    assert cpu_build._started[path].done()
    assert path.exists() and path.stat().st_size > 0
    cpu_build.ensure_built(kernel_dir, "rms_norm")
    assert missing(kernel_dir) == {"q8_0_matmul"}
    path = cpu_build.ensure_built(kernel_dir, "q8_0_matmul")  # asked for: built now, alone
    assert path.exists() and cpu_build._started[path].done()
    assert {p.name.rsplit("_", 1)[0] for p in cpu_build._started} == {
        "argmax", "rms_norm", "q8_0_matmul"}
    assert missing(kernel_dir) == set()


def test_failed_background_build_raises_when_the_kernel_is_asked_for(kernel_dir, monkeypatch):
    monkeypatch.setattr(cpu_build, "FLAGS", [*cpu_build.FLAGS, "-fno-such-flag"])
    assert cpu_build.start_building()
    with pytest.raises(RuntimeError, match="building the CPU kernel argmax.cc failed"):
        cpu_build.ensure_built(kernel_dir, "argmax")
