"""RMS normalisation whose rows do not depend on their batch, on CPUs: `x / sqrt(mean(x^2) +
eps)` by our C++ kernel (cpu/rms_norm.cc), each row's sum of squares in one fixed order.
XLA:CPU's reduction over [T, D] sums a row in an order that depends on T."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import cpu_ffi


def normalize_reference(x32, eps: float):
    """float32[..., D] -> x / sqrt(mean(x^2) + eps) in plain XLA."""
    return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + eps)


def _kernel(x32, eps: float):
    # Any leading axes are rows (the kernel reads [..., D]), so vmap may batch it as it is.
    call = jax.ffi.ffi_call("xlaserve_rms_norm", jax.ShapeDtypeStruct(x32.shape, jnp.float32),
                            vmap_method="broadcast_all")
    return call(x32, eps=np.float32(eps))


def normalize(x32, eps: float):
    """float32[..., D] -> normalised rows: by the kernel in programs lowered for a CPU (where
    it builds), by `normalize_reference` in programs lowered for anything else."""
    if not cpu_ffi.available("rms_norm"):
        return normalize_reference(x32, eps)
    return jax.lax.platform_dependent(x32, cpu=lambda x: _kernel(x, eps),
                                      default=lambda x: normalize_reference(x, eps))
