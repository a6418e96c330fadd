"""int8-weight matmul on CPUs: `x @ (values * scale)` by our C++ kernel (cpu/q8_matmul.cc).

The weight is packed once, at load, in panels of 16 output channels (`pack_panels`); the
kernel widens the int8 values in registers, so a decode step reads a quarter of the bytes
of a float32 weight. `q8_matmul_reference` is the same product in plain jnp.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import cpu_ffi

PANEL = 16  # output channels per panel: what the kernel's tiles are written for


def pack_panels(values):
    """int8[K, N] -> int8[K, N] holding the panels: flat[p, k, j] = values[k, PANEL * p + j].

    The result keeps the [in, out] shape (Flax checks a weight's shape against its
    declaration); only the order of the bytes differs."""
    K, N = values.shape
    return jnp.asarray(values).reshape(K, N // PANEL, PANEL).transpose(1, 0, 2).reshape(K, N)


def unpack_panels(panels):
    """The inverse of `pack_panels`."""
    K, N = panels.shape
    return panels.reshape(N // PANEL, K, PANEL).transpose(1, 0, 2).reshape(K, N)


def q8_matmul(x, panels, scale):
    """x: float[..., K] @ weight int8[K, N] (packed) * scale float32[N] -> [..., N] in x's
    dtype, accumulated in float32."""
    if not cpu_ffi.available("q8_matmul"):
        raise RuntimeError("the CPU kernels are not available (no C++ compiler or no AVX2)")
    K, N = panels.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K).astype(jnp.float32)
    call = jax.ffi.ffi_call("xlaserve_q8_matmul",
                            jax.ShapeDtypeStruct((x2.shape[0], N), jnp.float32))
    y = call(x2, panels, scale.reshape(N).astype(jnp.float32))
    return y.reshape(*lead, N).astype(x.dtype)


def q8_matmul_reference(x, values, scale):
    """The same product from the unpacked int8[K, N] values."""
    y = jnp.matmul(x.astype(jnp.float32), values.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)
    return (y * scale.reshape(-1)).astype(x.dtype)
