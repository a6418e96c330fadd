"""Our C++ CPU kernels (`pallas_kernels/cpu/*.cc`), built on first use (cpu_build.py) and
called through the XLA FFI.

XLA:CPU has no fast kernel for int8 weights on AVX2 machines and runs paged decode attention
as gathers plus small batched dots. The kernels here fill those two gaps on CPUs; GPUs run
the Pallas kernels. Each is built into `~/.cache/xlaserve/cpu-kernels` (or
`$XLASERVE_CPU_KERNEL_DIR`) once per source, flags, jaxlib and CPU, so a second process loads
the library at once. The first kernel asked for builds every missing library, a compiler per
core; a server starts building the ones every CPU server asks for before it imports JAX
(`cpu_build.start_building`) and waits for each alone.

`available(kernel)` is False where there is no compiler or no x86-64 AVX2/FMA CPU; callers
then keep the plain-XLA path. `XLASERVE_CPU_KERNELS=0` turns the kernels off.
"""
from __future__ import annotations

import ctypes
import functools

import jax
import jax.numpy as jnp

from pallas_kernels import cpu_build
from pallas_kernels.cpu_build import KERNELS

_registered: set[str] = set()
_grouped: set[str] = set()  # kernels whose library exports xlaserve_<kernel>_grouped


@functools.cache
def _load(kernel: str) -> bool:
    if kernel not in KERNELS:
        raise ValueError(f"unknown CPU kernel {kernel!r}; there are {', '.join(KERNELS)}")
    compiler = cpu_build.compiler()
    if compiler is None:
        return False
    lib = ctypes.cdll.LoadLibrary(str(cpu_build.ensure_built(compiler, kernel)))
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


def matmul(kernel: str, x, n: int, *operands, **attrs):
    """x: float[..., K] through the matmul kernel `kernel` (its rows as float32[rows, K],
    then `operands`; `attrs` its FFI attributes) -> [..., n] in x's dtype."""
    if not available(kernel):
        raise RuntimeError("the CPU kernels are not available (no C++ compiler or no AVX2)")
    x2 = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    call = jax.ffi.ffi_call(f"xlaserve_{kernel}",
                            jax.ShapeDtypeStruct((x2.shape[0], n), jnp.float32))
    return call(x2, *operands, **attrs).reshape(*x.shape[:-1], n).astype(x.dtype)


def grouped_matmul(kernel: str, x, group_sizes, n: int, *operands, **attrs):
    """x: float[M, K], rows sorted by group, through the grouped form of the matmul kernel
    `kernel`: group_sizes int32[E], group e's rows against expert e's weight (`operands`
    are the kernel's own, each with a leading axis of E; `attrs` its FFI attributes) ->
    [M, n] in x's dtype. Rows past
    sum(group_sizes) come out zero; a negative size or a sum past M fails the call."""
    if not grouped_available(kernel):
        raise RuntimeError(f"no grouped CPU kernel {kernel!r} here (no C++ compiler or no AVX2)")
    call = jax.ffi.ffi_call(f"xlaserve_{kernel}_grouped",
                            jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))
    y = call(x.astype(jnp.float32), jnp.asarray(group_sizes).astype(jnp.int32), *operands,
             **attrs)
    return y.astype(x.dtype)
