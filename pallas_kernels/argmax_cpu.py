"""Greedy token choice on CPUs: `argmax(logits, axis=-1)` by our C++ kernel (cpu/argmax.cc),
the same index jnp.argmax gives (the first of the maximum; a NaN counts as the maximum),
at memory speed instead of XLA:CPU's 3 GB/s. `masked_argmax_rows` (cpu/masked_argmax.cc)
takes the argmax over the tokens a bitmask allows, for rows under a grammar."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import cpu_ffi


def kernel_available() -> bool:
    """A CPU backend with the kernel built."""
    return jax.default_backend() == "cpu" and cpu_ffi.available("argmax")


def argmax_rows(logits):
    """float32[R, V] -> int32[R]: by the kernel where it is available, else jnp.argmax."""
    if not kernel_available():
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    call = jax.ffi.ffi_call("xlaserve_argmax",
                            jax.ShapeDtypeStruct(logits.shape[:1], jnp.int32))
    return call(logits.astype(jnp.float32))


def masked_kernel_available() -> bool:
    return jax.default_backend() == "cpu" and cpu_ffi.available("masked_argmax")


def masked_argmax_rows(logits, bitmask):
    """float32[R, V], int32[R, W >= ceil(V / 32)] -> int32[R]: the argmax over the tokens
    whose bit is set (bit t % 32 of word t // 32), as jnp.argmax of the logits with the others
    at -inf. Only where `masked_kernel_available()`; serving.engine.token_bitmask falls back."""
    call = jax.ffi.ffi_call("xlaserve_masked_argmax",
                            jax.ShapeDtypeStruct(logits.shape[:1], jnp.int32))
    return call(logits.astype(jnp.float32), bitmask.astype(jnp.int32))
