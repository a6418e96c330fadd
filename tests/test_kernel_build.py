"""Every C++ kernel (pallas_kernels/cpu/*.cc) compiles for an AVX-512 VNNI CPU
(-march=icelake-server) and for a plain AVX2 one (-march=haswell).

cpu_build builds with -march=native, so a machine only ever compiles the paths its own CPU
takes: without this, a VNNI tile broken on an AVX2 test machine would first fail to build on
a server. Compiling is as far as a machine without AVX-512 can go: -c, not -fsyntax-only (an
intrinsic used outside its target is an error only when GCC inlines it), at -O0 (the errors
a target can cause come before optimization, and -O3 takes twice as long). A compile that
passed is remembered by the hash of everything it read (compiler, flags, the source and every
header beside it), so an unchanged kernel is not compiled again on the next run."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import jax
import pytest

from pallas_kernels import cpu_build
from serving.core.config import default_cache_root

SOURCES = sorted(cpu_build.SOURCE_DIR.glob("*.cc"))
TARGETS = ("icelake-server", "haswell")


def flags(target: str) -> list[str]:
    """cpu_build's flags for `target` instead of the CPU running the test, at -O0."""
    swap = {"-march=native": f"-march={target}", "-O3": "-O0"}
    return [swap.get(f, f) for f in cpu_build.FLAGS]


@pytest.fixture(scope="module")
def compiler() -> str:
    found = shutil.which("g++")
    if found is None:
        pytest.skip("no g++ on PATH: the kernels cannot be compiled here")
    return found


@pytest.fixture(scope="module")
def builds(compiler) -> dict[tuple[str, str], subprocess.CompletedProcess]:
    """(source name, target) -> the finished compile, all of them run side by side."""
    passed = default_cache_root() / "kernel-build-checks"
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    headers = b"".join(h.read_bytes() for h in sorted(cpu_build.SOURCE_DIR.glob("*.h")))

    def build(job):
        source, target = job
        cmd = [compiler, *flags(target), f"-I{jax.ffi.include_dir()}", "-c", str(source),
               "-o", os.devnull]
        # what the compile reads, not where the clone is
        what = [version, jax.__version__, *flags(target), source.name]
        key = hashlib.sha256("\0".join(what).encode() + headers
                             + source.read_bytes()).hexdigest()[:32]
        if (passed / key).exists():
            return subprocess.CompletedProcess(cmd, 0, "", "")
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode == 0:
            passed.mkdir(parents=True, exist_ok=True)
            (passed / key).touch()
        return done

    jobs = [(s, t) for t in TARGETS for s in SOURCES]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        done = list(pool.map(build, jobs))
    return {(s.name, t): d for (s, t), d in zip(jobs, done)}


def test_every_kernel_is_a_source():
    assert {s.stem for s in SOURCES} == set(cpu_build.KERNELS)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("source", [s.name for s in SOURCES])
def test_kernel_compiles(builds, source, target):
    done = builds[source, target]
    assert done.returncode == 0, f"{' '.join(done.args)}\n{done.stderr[-4000:]}"


@pytest.mark.parametrize("target,vnni", [("icelake-server", True), ("haswell", False)])
def test_targets_take_the_paths_they_stand_for(compiler, target, vnni):
    """The kernels choose their AVX-512 tiles on __AVX512VNNI__ and __AVX512BW__."""
    done = subprocess.run([compiler, *flags(target), "-dM", "-E", "-x", "c++", os.devnull],
                          capture_output=True, text=True, check=True)
    macros = {line.split()[1] for line in done.stdout.splitlines() if line.startswith("#define")}
    assert {"__AVX2__", "__FMA__", "__F16C__"} <= macros
    assert ({"__AVX512VNNI__", "__AVX512BW__"} <= macros) == vnni
