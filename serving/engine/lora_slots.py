"""The LoRA slots on the device (model/lora.py): made zero at start-up, written in place
when the LoRA manager (serving/lora/manager.py) places an adapter."""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from model import lora, sharding
from model.config import ModelConfig
from serving.lora.manager import LoRAManager
from serving.lora.request import LoRAConfig


class DeviceLoRA:
    """One device: slots as model/lora.py lays them out. Tensor parallel (placement a mesh):
    each leaf stacked by shard on a leading axis sharded over the mesh, like the weights;
    each shard's block cut as its projection splits (model/sharding.py)."""

    def __init__(self, cfg: ModelConfig, prepared_params, config: LoRAConfig, placement):
        self.cfg, self.config, self.placement = cfg, config, placement
        layers = prepared_params["layers"]
        self.sites = [lora.sites(cfg, layer) for layer in layers]  # the whole model's
        local = [lora.sites(placement.model_cfg, layer) for layer in layers]
        zeros = partial(lora.empty_slots, local, config.max_loras, config.max_lora_rank,
                        cfg.dtype)
        if placement.size == 1:
            self.slots = zeros()
            self._write_program = lora.write_slot
        else:
            n, shards = placement.size, NamedSharding(placement.mesh, P(sharding.AXIS))
            self.slots = jax.jit(lambda: jax.tree.map(
                lambda z: jnp.broadcast_to(z, (n, *z.shape)), zeros()), out_shardings=shards)()
            self._write_program = lora.write_slot_stacked
        # the write program compiled (and run on zeros) now, not at the first adapter
        self._write_arrays(0, lora.slot_arrays(self.sites, {}, config.max_lora_rank,
                                               cfg.dtype))

    @property
    def available(self) -> list[set[str]]:
        """Per layer, the HF projections an adapter may adapt."""
        return [{p for site in layer for p in site.parts} for layer in self.sites]

    @property
    def num_bytes(self) -> int:
        """Bytes on one device."""
        return sum(a.nbytes for a in jax.tree.leaves(self.slots)) // self.placement.size

    def write(self, slot: int, adapter) -> None:
        self._write_arrays(slot, lora.slot_arrays(self.sites, adapter.weights,
                                                  self.config.max_lora_rank, self.cfg.dtype))

    def _write_arrays(self, slot: int, one: tuple) -> None:
        if self.placement.size > 1:
            one = self._stacked_blocks(one)
        self.slots = self._write_program(self.slots, np.int32(slot), one)

    def _stacked_blocks(self, one: tuple) -> tuple:
        """One slot of the whole model -> [shards, ...] blocks, sharded over the mesh."""
        n, mesh = self.placement.size, self.placement.mesh
        layers = []
        for sites, layer in zip(self.sites, one):
            out = {}
            for site in sites:
                arrays = layer[site.module][site.name]
                blocks = [sharding.shard_lora_site(site, arrays, self.cfg, n, k)
                          for k in range(n)]
                out.setdefault(site.module, {})[site.name] = {
                    key: np.stack([b[key] for b in blocks]) for key in arrays}
            layers.append(out)
        return jax.device_put(tuple(layers), NamedSharding(mesh, P(sharding.AXIS)))


def start_lora(ec, runner, task: str) -> LoRAManager:
    """With --enable-lora: the runner's slots and the manager placing adapters in them.
    ec: the EngineConfig."""
    if task == "embed":
        raise ValueError("--enable-lora is for generation, not --task embed")
    if ec.num_processes > 1:
        raise ValueError("--enable-lora is not served over several processes yet (one "
                         "process, tensor parallel or not, serves adapters)")
    if runner.cfg.latent:
        raise ValueError(f"--enable-lora is not served for {runner.cfg.architecture}: "
                         "adapters of latent attention's projections are not supported")
    config = LoRAConfig(ec.max_loras, ec.max_lora_rank, ec.max_cpu_loras)
    runner.enable_lora(config)
    return LoRAManager(config, runner.lora.available, runner.lora.write)
