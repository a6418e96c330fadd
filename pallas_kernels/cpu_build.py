"""Building our C++ CPU kernels (`pallas_kernels/cpu/*.cc`) into shared libraries, without
importing JAX, so a server can start the builds before it imports JAX and reads its weights.

Each kernel is its own library, compiled with the system C++ compiler (`-O3 -march=native`)
into `~/.cache/xlaserve/cpu-kernels` (or `$XLASERVE_CPU_KERNEL_DIR`) and keyed by the
sources, the flags, the jaxlib version and the CPU, so a second process finds it built.
Missing libraries are built together, a compiler a core. `cpu_ffi` loads
them and registers their FFI handlers.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import Future
from pathlib import Path

SOURCE_DIR = Path(__file__).parent / "cpu"
FLAGS = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC"]
# kernel name: the source `cpu/<name>.cc`, built into its own library, exporting the FFI
# handler `xlaserve_<name>` (and the matmuls `xlaserve_<name>_grouped`, see grouped_matmul).
KERNELS = ("q8_matmul", "q4_matmul", "q8_0_matmul", "paged_attention", "argmax", "masked_argmax",
           "dense_matmul", "dense_argmax", "rms_norm", "fp8_block_matmul")
# What a server builds ahead of time (`start_building`), longest first: the kernels every
# CPU server asks for (attention, norm, argmaxes; the dense and int8 matmuls are checked
# while the weights load) and the demo's int4 layers. The greedy head of float32 models
# (dense_argmax), GGUF's Q8_0 (q8_0_matmul) and fp8 weights with block scales
# (fp8_block_matmul) are built when first asked for.
AHEAD = ("paged_attention", "dense_matmul", "q4_matmul", "q8_matmul", "rms_norm",
         "masked_argmax", "argmax")


def cpu_signature() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    lines = [l for l in text.splitlines() if l.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def cpu_supported() -> bool:
    if platform.machine() not in ("x86_64", "AMD64"):
        return False
    flags = cpu_signature()
    return " avx2" in flags and " fma" in flags


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "xlaserve" / "cpu-kernels"
    return Path(os.environ.get("XLASERVE_CPU_KERNEL_DIR", default))


def compiler() -> str | None:
    """The C++ compiler to build with, or None where the kernels are off, the CPU lacks
    AVX2/FMA or there is no compiler."""
    if os.environ.get("XLASERVE_CPU_KERNELS", "1") == "0" or not cpu_supported():
        return None
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def _jaxlib_dir() -> Path:
    return Path(importlib.util.find_spec("jaxlib").submodule_search_locations[0])


def include_dir() -> Path:
    """jaxlib's headers (what `jax.ffi.include_dir()` returns), found without importing JAX."""
    return _jaxlib_dir() / "include"


def library_path(compiler: str, kernel: str) -> Path:
    source = SOURCE_DIR / f"{kernel}.cc"
    h = hashlib.sha256()
    for src in [source, *sorted(SOURCE_DIR.glob("*.h"))]:
        h.update(src.name.encode() + src.read_bytes())
    version = importlib.metadata.version("jaxlib")
    h.update(" ".join([compiler, *FLAGS, version, cpu_signature()]).encode())
    return cache_dir() / f"{kernel}_{h.hexdigest()[:16]}.so"


def _build(compiler: str, kernel: str, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    source = SOURCE_DIR / f"{kernel}.cc"
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_out = Path(tmp) / out.name
        cmd = [compiler, *FLAGS, f"-I{include_dir()}", str(source), "-o", str(tmp_out)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"building the CPU kernel {source.name} failed:\n"
                               f"{' '.join(cmd)}\n{done.stderr[-4000:]}")
        os.replace(tmp_out, out)  # atomic: a concurrent builder sees all of it or nothing


# library path -> its build, started by this process (done or not)
_started: dict[Path, Future] = {}
_ahead = False  # start_building was called: a kernel outside AHEAD is built alone
_lock = threading.Lock()


def _gpu_plugin_installed() -> bool:
    """A JAX plugin (CUDA, ROCm, TPU) is installed: JAX will likely not run on the CPU."""
    return bool(importlib.metadata.entry_points(group="jax_plugins"))


def _start(compiler: str, kernels) -> list[Future]:
    """Starts building those of `kernels` neither built nor under way, each build a Future
    in `_started`, on daemon threads a compiler a core (a server that stops during start-up
    does not wait for them); returns the builds it started."""
    with _lock:
        todo = [(k, path) for k in kernels
                if not (path := library_path(compiler, k)).exists() and path not in _started]
        for _, path in todo:
            _started[path] = Future()
    queue = iter(todo)  # shared by the workers; next() on it holds the GIL
    for _ in range(min(len(todo), os.cpu_count() or 1)):
        threading.Thread(target=_worker, args=(compiler, queue), daemon=True,
                         name="cpu-kernel-build").start()
    return [_started[path] for _, path in todo]


def _worker(compiler: str, queue) -> None:
    for kernel, path in queue:
        try:
            _build(compiler, kernel, path)
            _started[path].set_result(path)
        except Exception as e:  # noqa: BLE001 - ensure_built raises it for its kernel
            _started[path].set_exception(e)


def start_building() -> bool:
    """Starts building the missing libraries of AHEAD, for a process about to need them (a
    server on a CPU) to do its own start-up meanwhile; `ensure_built` waits for the one it
    is asked for and raises its failure. False (nothing started) without a compiler or AVX2,
    with a GPU plugin installed, or with nothing missing."""
    global _ahead
    found = compiler()
    if found is None or _gpu_plugin_installed():
        return False
    _ahead = True
    return bool(_start(found, AHEAD))


def ensure_built(compiler: str, kernel: str) -> Path:
    """The library of `kernel`, waiting for its build. One not built nor under way is built
    now: alone in a process that called `start_building` (the others are under way or not
    needed), else with every other missing one (a first start needs most of them, and one
    at a time they took ~30 s of it). A failed build raises."""
    path = library_path(compiler, kernel)
    if not path.exists():
        for build in _start(compiler, [kernel] if _ahead else KERNELS):
            build.exception()  # waits: a process leaves with every build it began finished
    with _lock:
        started = _started.get(path)
    if started is not None:
        error = started.exception()  # waits for it
        if error is not None and not path.exists():
            raise error
    return path
