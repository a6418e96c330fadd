"""Rearranging weights for the kernels at load: a weight whole on one device is rearranged
by numpy on the host and put back on its device, since every eager jnp op costs a dispatch
and, for each new shape, a compile (a start packs every layer); traced or sharded weights
go through jnp."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def on_one_device(a) -> bool:
    """A numpy array, or a concrete jax array whole on one device."""
    if isinstance(a, jax.core.Tracer):
        return False
    return not isinstance(a, jax.Array) or len(a.sharding.device_set) == 1


def array_module(*arrays):
    """numpy where every one of `arrays` is whole on one device, else jax.numpy."""
    return np if all(on_one_device(a) for a in arrays) else jnp


def placed(x, like):
    """x as a jax array where `like` is (a tensor-parallel block stays on its own device)."""
    if isinstance(like, jax.Array) and not isinstance(like, jax.core.Tracer):
        return jax.device_put(x, like.sharding) if isinstance(x, np.ndarray) else x
    return jnp.asarray(x)
