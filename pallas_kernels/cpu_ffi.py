"""Our C++ CPU kernels (`pallas_kernels/cpu/*.cc`), built on first use and called through
the XLA FFI.

XLA:CPU has no fast kernel for int8 weights on AVX2 machines and runs paged decode attention
as gathers plus small batched dots. The kernels here fill those two gaps on CPUs; GPUs run
the Pallas kernels. They are compiled with the system C++ compiler (`-O3 -march=native`)
into `~/.cache/xlaserve/cpu-kernels` (or `$XLASERVE_CPU_KERNEL_DIR`), keyed by the sources,
the flags, the jaxlib version and the CPU, so a second process loads the library at once.
The first kernel asked for builds every missing library, a compiler per core.

`available(kernel)` is False where there is no compiler or no x86-64 AVX2/FMA CPU; callers
then keep the plain-XLA path. `XLASERVE_CPU_KERNELS=0` turns the kernels off.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib

SOURCE_DIR = Path(__file__).parent / "cpu"
FLAGS = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC"]
# kernel name: the source `cpu/<name>.cc`, built into its own library, exporting the FFI
# handler `xlaserve_<name>` (and the matmuls `xlaserve_<name>_grouped`, see grouped_matmul).
KERNELS = ("q8_matmul", "q4_matmul", "q8_0_matmul", "paged_attention", "argmax", "masked_argmax",
           "dense_matmul", "dense_argmax", "rms_norm")


def cpu_signature() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    lines = [l for l in text.splitlines() if l.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def _cpu_supported() -> bool:
    if platform.machine() not in ("x86_64", "AMD64"):
        return False
    flags = cpu_signature()
    return " avx2" in flags and " fma" in flags


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "xlaserve" / "cpu-kernels"
    return Path(os.environ.get("XLASERVE_CPU_KERNEL_DIR", default))


def _library_path(compiler: str, source: Path) -> Path:
    h = hashlib.sha256()
    for src in [source, *sorted(SOURCE_DIR.glob("*.h"))]:
        h.update(src.name.encode() + src.read_bytes())
    h.update(" ".join([compiler, *FLAGS, jaxlib.__version__, cpu_signature()]).encode())
    return cache_dir() / f"{source.stem}_{h.hexdigest()[:16]}.so"


def _build(compiler: str, source: Path, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_out = Path(tmp) / out.name
        cmd = [compiler, *FLAGS, f"-I{jax.ffi.include_dir()}", str(source), "-o", str(tmp_out)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"building the CPU kernel {source.name} failed:\n"
                               f"{' '.join(cmd)}\n{done.stderr[-4000:]}")
        os.replace(tmp_out, out)  # atomic: a concurrent builder sees all of it or nothing


def _build_missing(compiler: str) -> None:
    """Builds every kernel whose library is not in the cache, one compiler a core: a first
    start needs most of them, and one at a time they took ~30 s of a cold start."""
    sources = [SOURCE_DIR / f"{k}.cc" for k in KERNELS]
    missing = [(src, _library_path(compiler, src)) for src in sources]
    missing = [(src, out) for src, out in missing if not out.exists()]
    with ThreadPoolExecutor(max(1, min(len(missing), os.cpu_count() or 1))) as pool:
        for done in [pool.submit(_build, compiler, src, out) for src, out in missing]:
            done.result()  # a failed build raises here


def _compiler() -> str | None:
    if os.environ.get("XLASERVE_CPU_KERNELS", "1") == "0" or not _cpu_supported():
        return None
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


_registered: set[str] = set()
_grouped: set[str] = set()  # kernels whose library exports xlaserve_<kernel>_grouped


@functools.cache
def _load(kernel: str) -> bool:
    if kernel not in KERNELS:
        raise ValueError(f"unknown CPU kernel {kernel!r}; there are {', '.join(KERNELS)}")
    compiler = _compiler()
    if compiler is None:
        return False
    path = _library_path(compiler, SOURCE_DIR / f"{kernel}.cc")
    if not path.exists():
        _build_missing(compiler)
    lib = ctypes.cdll.LoadLibrary(str(path))
    name = f"xlaserve_{kernel}"
    jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, name)), platform="cpu")
    if hasattr(lib, f"{name}_grouped"):
        jax.ffi.register_ffi_target(f"{name}_grouped",
                                    jax.ffi.pycapsule(getattr(lib, f"{name}_grouped")),
                                    platform="cpu")
        _grouped.add(kernel)
    _registered.add(kernel)
    return True


def available(kernel: str) -> bool:
    """True when `kernel` (one of KERNELS) is built, building it now if needed, and
    registered as the FFI target `xlaserve_<kernel>`. A build that fails raises: a broken
    kernel must not pass for a missing compiler."""
    return _load(kernel)


def grouped_available(kernel: str) -> bool:
    """True when `kernel` is available and has a grouped form, `xlaserve_<kernel>_grouped`."""
    return _load(kernel) and kernel in _grouped


def loaded_kernels() -> tuple[str, ...]:
    """The kernels registered as FFI targets so far in this process: a program compiled now
    may call any of them, so a saved copy of it needs them registered before it loads."""
    return tuple(k for k in KERNELS if k in _registered)


def matmul(kernel: str, x, n: int, *operands):
    """x: float[..., K] through the matmul kernel `kernel` (its rows as float32[rows, K],
    then `operands`) -> [..., n] in x's dtype."""
    if not available(kernel):
        raise RuntimeError("the CPU kernels are not available (no C++ compiler or no AVX2)")
    x2 = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    call = jax.ffi.ffi_call(f"xlaserve_{kernel}",
                            jax.ShapeDtypeStruct((x2.shape[0], n), jnp.float32))
    return call(x2, *operands).reshape(*x.shape[:-1], n).astype(x.dtype)


def grouped_matmul(kernel: str, x, group_sizes, n: int, *operands):
    """x: float[M, K], rows sorted by group, through the grouped form of the matmul kernel
    `kernel`: group_sizes int32[E], group e's rows against expert e's weight (`operands`
    are the kernel's own, each with a leading axis of E) -> [M, n] in x's dtype. Rows past
    sum(group_sizes) come out zero; a negative size or a sum past M fails the call."""
    if not grouped_available(kernel):
        raise RuntimeError(f"no grouped CPU kernel {kernel!r} here (no C++ compiler or no AVX2)")
    call = jax.ffi.ffi_call(f"xlaserve_{kernel}_grouped",
                            jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))
    y = call(x.astype(jnp.float32), jnp.asarray(group_sizes).astype(jnp.int32), *operands)
    return y.astype(x.dtype)
