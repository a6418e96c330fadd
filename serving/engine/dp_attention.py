"""Data-parallel attention with expert parallelism (vLLM's `-dp N --enable-expert-parallel`,
SGLang's `--enable-dp-attention`): N ranks, one device each, that step together in one SPMD
program. Each rank has its own requests, rows and KV cache; every weight is whole on every
device except a mixture's routed experts, split whole over all N devices. Inside the
program each device runs attention on its own tokens, and each MoE block gathers every
rank's tokens, runs this device's experts on them and scatters the sums back
(model/moe.py, `moe_token_axis`). A rank with nothing to run steps on padding.

`DataParallelAttention` is the runner's placement (as mesh.SingleDevice and
mesh.TensorParallel are): weights, KV cache and step inputs carry a leading rank axis sharded
over the mesh. `StackedRunner` runs a `StackedStep` (one StepArrays per rank, all of one
bucket shape) and splits the result back per rank. The ranks' host side is
serving/engine/lockstep.py.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from model import sharding
from model.config import ModelConfig
from model.kv_cache import KVCache
from model.runtime_params import prepare_params
from serving.core.config import EngineConfig
from serving.engine.input_prep import StepArrays, history_shape
from serving.engine.mesh import OnMesh
from serving.engine.runner import ModelRunner, StepResult
from serving.engine.step_buffers import pack

AXIS = "data"


def check(ec: EngineConfig, model_dir, task: str, speculative_config) -> None:
    """What the ranks of one program do not run (yet), and the model and devices they need,
    refused before the weights load."""
    refused = [name for name, on in (
        ("--tensor-parallel-size > 1", ec.tensor_parallel_size > 1),
        ("--speculative-config", speculative_config), ("--enable-lora", ec.enable_lora),
        ("--task embed", task == "embed")) if on]
    if refused:
        raise ValueError("--data-parallel-size with --enable-expert-parallel does not take "
                         + ", ".join(refused))
    check_model(ModelConfig.from_dir(model_dir), ec.data_parallel_size, len(jax.devices()),
                ec.enable_expert_parallel, ec.num_processes)


def check_model(cfg: ModelConfig, n: int, num_devices: int, expert_parallel: bool = True,
                num_processes: int = 1) -> None:
    """n ranks on n devices (every device, over several processes); expert parallel, a
    mixture whose experts split n ways."""
    if num_processes > 1 and n != num_devices:
        raise ValueError(f"over several processes every device is a rank: "
                         f"--data-parallel-size must be {num_devices}, got {n}")
    if cfg.latent:
        raise ValueError(f"--data-parallel-size with --enable-expert-parallel does not run "
                         f"latent attention ({cfg.architecture}) yet; use "
                         f"--tensor-parallel-size {n} --enable-expert-parallel, or "
                         f"--data-parallel-size {n} alone for replicas")
    if expert_parallel and not cfg.num_experts:
        raise ValueError(f"--enable-expert-parallel is for mixture-of-experts models; "
                         f"{cfg.architecture} has no experts")
    if expert_parallel and cfg.num_experts % n:
        raise ValueError(f"--data-parallel-size {n} with --enable-expert-parallel splits the "
                         f"experts over {n} devices; {cfg.num_experts} experts do not split "
                         f"{n} ways")
    if n > num_devices:
        raise ValueError(f"--data-parallel-size {n} needs {n} devices; there are "
                         f"{num_devices}")


class DataParallelAttention(OnMesh):
    """The placement of N ranks over the first N devices (see the module docstring)."""
    data_parallel = True  # one placement spans every rank (engine_setup's memory split)

    def __init__(self, cfg: ModelConfig, n: int):
        self.size = n
        self.cfg = dataclasses.replace(cfg, expert_shards=n)
        self.model_cfg = dataclasses.replace(self.cfg, moe_token_axis=AXIS)
        self.axis = None  # no tensor-parallel axis inside a rank
        self.mesh = Mesh(np.array(jax.devices()[:n]), (AXIS,))
        self._sharded = NamedSharding(self.mesh, P(AXIS))

    def prepare(self, params, free_stacked: bool = False):
        """Each process prepares the blocks of its own devices."""
        blocks = {}
        for shard, device in enumerate(self.devices):
            if device.process_index != jax.process_index():
                continue
            stored = jax.device_put(sharding.shard_experts(params, self.cfg, self.size, shard),
                                    device)
            blocks[device] = prepare_params(stored)
            del stored
        return sharding.stack_blocks(blocks, self.mesh, AXIS)

    def _one_rank_cache(self, num_pages, page_size, dtype, window_pages):
        return KVCache.zeros(self.cfg, num_pages, page_size, dtype, window_pages)

    def zeros_cache(self, num_pages: int, page_size: int, dtype,
                    window_pages: int = 0) -> KVCache:
        """Every rank's cache, stacked on the rank axis."""
        def make():
            one = self._one_rank_cache(num_pages, page_size, dtype, window_pages)
            return jax.tree.map(lambda a: jnp.broadcast_to(a, (self.size, *a.shape)), one)
        return jax.jit(make, out_shardings=self._sharded)()

    def abstract_cache(self, num_pages: int, page_size: int, dtype,
                       window_pages: int = 0) -> KVCache:
        one = jax.eval_shape(partial(self._one_rank_cache, num_pages, page_size, dtype,
                                     window_pages))
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct((self.size, *a.shape), a.dtype,
                                                           sharding=self._sharded), one)

    def put(self, x):
        """One rank's host arrays -> the same on every rank."""
        return self.send(jax.tree.map(
            lambda a: np.broadcast_to(np.asarray(a), (self.size, *np.shape(a))), x))

    def send(self, x):
        """Host arrays stacked by rank (the same in every process) -> each device its
        rank's block."""
        return jax.tree.map(lambda a: jax.make_array_from_callback(
            a.shape, self._sharded, lambda index: a[index]), x)

    def host(self, a) -> np.ndarray:
        """A step's output, gathered on every device: this process's copy."""
        return np.asarray(a.addressable_data(0))

    def wrap_step(self, step):
        return partial(_rank_step, step, self.mesh)

    def wrap_prompt(self, fn):
        return _refused("prompt logprobs")

    def wrap_pool(self, fn):
        return _refused("pooling")


def _refused(what: str):
    def call(*args, **kwargs):
        raise NotImplementedError(f"{what} is not supported with data-parallel attention")
    return call


def _rank_step(step, mesh, params, cache, buffers, history, bitmask, last_tokens,
               lora_slots=None, **static):
    """step of one rank -> the function of every rank: each argument carries a leading rank
    axis (block [0] inside), the KV cache included. The sampled tokens and which rows are
    outputs are gathered, every rank's on every device (a few bytes a row), so the process
    that schedules reads them all, whichever process holds a rank."""
    def local(params, cache, buffers, history, bitmask, last_tokens):
        first = partial(jax.tree.map, lambda a: a[0])
        sampled, emitted, blocks, cache, next_tokens = step(
            first(params), first(cache), first(buffers), history[0], bitmask[0],
            last_tokens[0], None, **static)
        gather = partial(jax.tree.map, lambda a: jax.lax.all_gather(a, AXIS))
        mine = partial(jax.tree.map, lambda a: a[None])
        return (gather(sampled), gather(emitted), mine(blocks), mine(cache),
                mine(next_tokens))
    spec = P(AXIS)
    # check_vma off: the kernels are FFI and Pallas calls with no replication rules.
    return jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 6,
                         out_specs=(P(), P(), spec, spec, spec),
                         check_vma=False)(params, cache, buffers, history, bitmask,
                                          last_tokens)


@dataclass
class StackedStep:
    """One step of every rank, all in the bucket `shape` (an idle rank's is padding)."""
    parts: list[StepArrays]
    prompt_targets = None  # refused with data-parallel attention
    pooling_rows = None

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.parts[0].shape

    @property
    def wants_logprobs(self) -> bool:
        return any(p.wants_logprobs for p in self.parts)


class StackedRunner(ModelRunner):
    """A ModelRunner over DataParallelAttention: steps are StackedSteps (a plain StepArrays,
    as warm-up compiles with, stands for every rank), results come back per rank."""
    scores_prompts = False

    def _step_args(self, arrays, cache, put: bool = False) -> tuple[tuple, tuple]:
        n = self.placement.size
        parts = arrays.parts if isinstance(arrays, StackedStep) else [arrays] * n
        packed = [pack(p) for p in parts]
        layout = packed[0][1]
        if any(other != layout for _, other in packed):
            raise RuntimeError("the ranks' steps are laid out differently")
        buffers = tuple(np.stack(group) for group in zip(*(b for b, _ in packed)))
        history = self._stacked(parts, "history",
                                history_shape(parts[0].shape, self.page_size))
        bitmask = self._stacked(parts, "bitmask", (parts[0].shape[1], self.bitmask_width))
        send = self.placement.send
        return (self.params, cache, send(buffers) if put else buffers, history, bitmask,
                self._last_tokens), layout

    def _stacked(self, parts: list[StepArrays], name: str, shape: tuple[int, int]):
        """Every rank's history (or bitmask), -1 where a rank has none; all -1 is kept on
        the device, so an unpenalised, unconstrained step sends neither."""
        if all(getattr(p, name) is None for p in parts):
            key = (name, shape)
            if key not in self._no_history:
                self._no_history[key] = self.placement.put(np.full(shape, -1, np.int32))
            return self._no_history[key]
        return self.placement.send(np.stack([
            getattr(p, name) if getattr(p, name) is not None else np.full(shape, -1, np.int32)
            for p in parts]))


def split_result(result: StepResult, n: int) -> list[StepResult]:
    """A stacked step's result -> one StepResult per rank."""
    def rank(i):
        return StepResult(*(None if a is None else a[i] for a in (
            result.tokens, result.emitted, result.logprob, result.top_ids,
            result.top_logprobs)))
    return [rank(i) for i in range(n)]
