"""The LoRA slots on the device (model/lora.py): made zero at start-up, written in place
when the LoRA manager (serving/lora/manager.py) places an adapter."""
from __future__ import annotations

import numpy as np

from model import lora
from model.config import ModelConfig
from serving.lora.manager import LoRAManager
from serving.lora.request import LoRAConfig


class DeviceLoRA:
    def __init__(self, cfg: ModelConfig, prepared_params, config: LoRAConfig):
        self.cfg, self.config = cfg, config
        self.sites = [lora.sites(cfg, layer) for layer in prepared_params["layers"]]
        self.slots = lora.empty_slots(self.sites, config.max_loras, config.max_lora_rank,
                                      cfg.dtype)
        # the write program compiled (and run on zeros) now, not at the first adapter
        self.slots = lora.write_slot(self.slots, np.int32(0), self._zero_slot())

    @property
    def available(self) -> list[set[str]]:
        """Per layer, the HF projections an adapter may adapt."""
        return [{p for site in layer for p in site.parts} for layer in self.sites]

    @property
    def num_bytes(self) -> int:
        return sum(a.nbytes for layer in self.slots for m in layer.values()
                   for ab in m.values() for a in ab.values())

    def write(self, slot: int, adapter) -> None:
        one = lora.slot_arrays(self.sites, adapter.weights, self.config.max_lora_rank,
                               self.cfg.dtype)
        self.slots = lora.write_slot(self.slots, np.int32(slot), one)

    def _zero_slot(self):
        return lora.slot_arrays(self.sites, {}, self.config.max_lora_rank, self.cfg.dtype)


def start_lora(ec, runner, task: str) -> LoRAManager:
    """With --enable-lora: the runner's slots and the manager placing adapters in them.
    ec: the EngineConfig."""
    if task == "embed":
        raise ValueError("--enable-lora is for generation, not --task embed")
    config = LoRAConfig(ec.max_loras, ec.max_lora_rank, ec.max_cpu_loras)
    runner.enable_lora(config)
    return LoRAManager(config, runner.lora.available, runner.lora.write)
