"""Where a runner's arrays live and how its programs span devices: one device (the default,
exactly the single-device code), or a tensor-parallel mesh over the first N devices, the
step running inside `shard_map` on the "model" axis (docs/architecture.md, "Tensor
parallelism").

The runner asks its placement to prepare the weights, allocate the KV cache, put step
inputs on the device(s) and wrap its step and prompt-logprobs functions; a wrapped function
takes the whole tree and runs the model of one shard (model/sharding.py) on each device.
"""
from __future__ import annotations

import dataclasses

import logging
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from model import sharding
from model.config import ModelConfig
from model.kv_cache import KVCache, kv_storage_dtype
from model.runtime_params import prepare_params

log = logging.getLogger("xlaserve")


class SingleDevice:
    """One device: the default one (every method is what the runner did before meshes
    existed), or a data-parallel replica's own (`device`)."""
    size = 1
    mesh = None

    @property
    def devices(self) -> list:
        return [self.device] if self.device is not None else jax.devices()[:1]

    def __init__(self, cfg: ModelConfig, device=None):
        self.cfg = cfg
        self.model_cfg = cfg  # what each device's program computes
        self.axis = None
        self.device = device
        # A linear-attention hybrid's state slots (the null slot included) and the delta
        # rule state's dtype (None: the config's), set by the engine before the cache is.
        self.state_slots, self.ssm_dtype = 0, None

    def prepare(self, params, free_stacked: bool = False):
        return prepare_params(params, free_stacked=free_stacked)


    def zeros_cache(self, num_pages: int, page_size: int, dtype,
                    window_pages: int = 0) -> KVCache:
        return KVCache.zeros(self.cfg, num_pages, page_size, dtype, window_pages,
                             self.state_slots, self.ssm_dtype)

    def abstract_cache(self, num_pages: int, page_size: int, dtype,
                       window_pages: int = 0) -> KVCache:
        return jax.eval_shape(lambda: self.zeros_cache(num_pages, page_size, dtype,
                                                       window_pages))

    def put(self, x):
        return jax.device_put(x, self.device)

    def send(self, x):
        """A step's host arrays, as the step program takes them: as they are, since the
        compiled program's own call copies numpy arguments to the device (a tenth of
        jax.device_put's host time for a step's few small buffers)."""
        return x

    def host(self, a) -> np.ndarray:
        return np.asarray(a)

    def wrap_step(self, step):
        return step

    def wrap_prompt(self, fn):
        return fn

    def wrap_pool(self, fn):
        return fn


class OnMesh:
    """What every placement over a mesh answers alike."""
    mesh = None

    @property
    def devices(self) -> list:
        return sharding.mesh_devices(self.mesh)

    def weight_bytes(self, params) -> int:
        """The most weight bytes one device holds."""
        return max(per_device_bytes(params).values())


class TensorParallel(OnMesh):
    """A 1-D mesh ("model"); weights and KV cache as model/sharding.py splits them, step
    inputs and outputs replicated. The mesh may be abstract (jax.sharding.AbstractMesh),
    to lower programs for devices this host does not have."""

    def __init__(self, cfg: ModelConfig, mesh, kv_cache_dtype=None):
        self.size = mesh.shape[sharding.AXIS]
        sharding.check_size(cfg, self.size)
        self.cfg = cfg
        self.model_cfg = sharding.local_config(cfg, self.size)
        self.axis = sharding.AXIS
        self.mesh = mesh
        self._quantized_kv = kv_storage_dtype(cfg, kv_cache_dtype)[1]
        self._latent = cfg.latent  # the latent cache whole on every device
        self._replicated = NamedSharding(self.mesh, P())

    def prepare(self, params, free_stacked: bool = False):
        return sharding.shard_params(params, self.cfg, self.mesh)

    def _cache_cfg(self) -> ModelConfig:
        return sharding.cache_config(self.cfg, self.size)

    def zeros_cache(self, num_pages: int, page_size: int, dtype,
                    window_pages: int = 0) -> KVCache:
        shardings = sharding.cache_shardings(self.mesh, self._quantized_kv, window_pages > 0,
                                             self._latent)
        make = partial(KVCache.zeros, self._cache_cfg(), num_pages, page_size, dtype,
                       window_pages)
        return jax.jit(make, out_shardings=shardings)()

    def abstract_cache(self, num_pages: int, page_size: int, dtype,
                       window_pages: int = 0) -> KVCache:
        shapes = jax.eval_shape(lambda: KVCache.zeros(self._cache_cfg(), num_pages, page_size,
                                                      dtype, window_pages))
        shardings = sharding.cache_shardings(self.mesh, self._quantized_kv, window_pages > 0,
                                             self._latent)
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            shapes, shardings)

    def put(self, x):
        """Host arrays (the same in every process) -> replicated over the mesh."""
        return jax.tree.map(
            lambda a: jax.make_array_from_process_local_data(self._replicated, np.asarray(a)),
            x)

    def send(self, x):
        return self.put(x)

    def host(self, a) -> np.ndarray:
        """A replicated output: this process's copy (another process's are not readable)."""
        return np.asarray(a.addressable_data(0))

    def wrap_step(self, step):
        """step(params, cache, buffers, history, bitmask, **static) of one shard -> the
        function of the whole mesh (outputs replicated, the cache sharded)."""
        return partial(_sharded_step, step, self.mesh, self._quantized_kv, self._latent)

    def wrap_prompt(self, fn):
        def local(params, hidden, targets):
            return fn(sharding.local_params(params), hidden, targets)
        return jax.shard_map(local, mesh=self.mesh, in_specs=(P(sharding.AXIS), P(), P()),
                             out_specs=P(), check_vma=False)

    def wrap_pool(self, fn):
        """fn(params, hidden) of one shard (serving/engine/pooling.py): the hidden states
        and the final norm's scale are replicated, so is the result."""
        def local(params, hidden):
            return fn(sharding.local_params(params), hidden)
        return jax.shard_map(local, mesh=self.mesh, in_specs=(P(sharding.AXIS), P()),
                             out_specs=P(), check_vma=False)


def _sharded_step(step, mesh, quantized_kv, latent, params, cache, buffers, history, bitmask,
                  last_tokens, lora_slots=None, **static):
    """lora_slots: LoRA slots stacked by shard like the weights (serving/engine/lora_slots.py).
    latent: a latent cache, replicated: every shard writes the same latents into its copy."""
    cache_spec = sharding.cache_specs(quantized_kv, cache.window is not None, latent)
    cache, empty = _without_empty(cache)
    cache_spec = dataclasses.replace(cache_spec, **dict.fromkeys(empty))

    def local(params, cache, buffers, history, bitmask, last_tokens, lora_slots):
        cache = dataclasses.replace(cache, **{f: jnp.zeros(a.shape, a.dtype)
                                              for f, a in empty.items()})
        *out, cache, next_tokens = step(sharding.local_params(params), cache, buffers, history,
                                        bitmask, last_tokens, sharding.local_params(lora_slots),
                                        **static)
        return (*out, _without_empty(cache)[0], next_tokens)
    # check_vma off: the kernels are FFI and Pallas calls with no replication rules; the
    # outputs are replicated because the hidden states are (after each psum) and the logits
    # are gathered.
    *out, cache, next_tokens = jax.shard_map(
        local, mesh=mesh, in_specs=(P(sharding.AXIS), cache_spec, P(), P(), P(), P(),
                                    P(sharding.AXIS)),
        out_specs=(P(), P(), P(), cache_spec, P()), check_vma=False)(
        params, cache, buffers, history, bitmask, last_tokens, lora_slots)
    replicated = NamedSharding(mesh, P())
    cache = dataclasses.replace(cache, **{f: jax.lax.with_sharding_constraint(
        jnp.zeros(a.shape, a.dtype), replicated) for f, a in empty.items()})
    return (*out, cache, next_tokens)


def _without_empty(cache: KVCache) -> tuple[KVCache, dict]:
    """-> (the cache with its zero-size arrays, a latent cache's `v` and `v_scale`, as None;
    those arrays by field). They stay out of the shard_map: XLA:CPU crashes running a
    multi-device shard_map with a zero-size operand beside others (JAX 0.11.2), and they
    hold nothing to move."""
    empty = {f: getattr(cache, f) for f in ("v", "v_scale")
             if getattr(cache, f) is not None and getattr(cache, f).size == 0}
    return dataclasses.replace(cache, **dict.fromkeys(empty)), empty


def placement(cfg: ModelConfig, tensor_parallel_size: int = 1, kv_cache_dtype=None,
              first_device: int = 0):
    """SingleDevice for 1, else a TensorParallel mesh over N devices: the first N, or from
    first_device on (a data-parallel replica's group, serving/engine/data_parallel.py)."""
    devices = jax.devices()
    if tensor_parallel_size == 1:
        return SingleDevice(cfg, devices[first_device] if first_device else None)
    if cfg.num_linear_layers:
        raise ValueError(f"tensor_parallel_size {tensor_parallel_size}: a linear-attention "
                         f"hybrid ({cfg.architecture}) is served on one device per replica "
                         "for now (tensor_parallel_size 1)")
    sharding.check_size(cfg, tensor_parallel_size, len(devices) - first_device)
    group = devices[first_device:first_device + tensor_parallel_size]
    return TensorParallel(cfg, Mesh(np.array(group), (sharding.AXIS,)), kv_cache_dtype)


def per_device_bytes(tree) -> dict:
    """device -> bytes of the tree's arrays held there (this process's devices)."""
    out: dict = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
    return out


def gpu_memory_limit(where) -> int | None:
    """The smallest allocator limit of the placement's GPUs (each holds the same share; what
    the memory plan divides); None off-GPU, where host memory is shared with everything else
    and the KV cache has a fixed size."""
    if jax.default_backend() != "gpu":
        return None
    limits = [(d.memory_stats() or {}).get("bytes_limit") for d in where.devices]
    return None if None in limits else min(limits)


def log_devices(where, params, cache) -> None:
    """One line per device: its weights, its KV cache and the KV heads it holds (a latent
    cache: all of it, on every device)."""
    weights, kv = per_device_bytes(params), per_device_bytes(cache)
    cfg = where.model_cfg
    held = ("the whole latent cache" if cfg.latent else f"{cfg.num_kv_heads} KV heads")
    for i, device in enumerate(where.devices):
        if device in weights:
            log.info("tensor parallel %d/%d on %s: weights %.1f MiB, KV cache %.1f MiB "
                     "(%s, %d query heads)", i, where.size, device,
                     weights[device] / 2**20, kv.get(device, 0) / 2**20, held,
                     cfg.num_heads)


def with_expert_parallel(cfg: ModelConfig, n: int, enabled: bool) -> ModelConfig:
    """--enable-expert-parallel: the config whose experts split whole over the n devices."""
    if not enabled:
        return cfg
    if not cfg.num_experts:
        raise ValueError(f"--enable-expert-parallel is for mixture-of-experts models; "
                         f"{cfg.architecture} has no experts")
    return dataclasses.replace(cfg, expert_shards=n)


def check_tensor_parallel_size(model_dir, n: int, every_device: bool = False,
                               expert_parallel: bool = False) -> None:
    """Before any weight loads: a size the model does not split into, or more devices than
    there are, is an error naming the sizes that work. every_device: several processes,
    whose devices all hold a part of the model."""
    if every_device and n != jax.device_count():
        raise sharding.TensorParallelError(
            f"with several processes the model is split over all {jax.device_count()} "
            f"devices ({jax.local_device_count()} in this process): tensor_parallel_size "
            f"must be {jax.device_count()}, got {n}")
    cfg = with_expert_parallel(ModelConfig.from_dir(model_dir), n, expert_parallel)
    if n == 1:
        return
    sharding.check_size(cfg, n, len(jax.devices()))
