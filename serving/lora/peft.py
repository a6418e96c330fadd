"""PEFT LoRA folders (`adapter_config.json` + `adapter_model.safetensors`) read into numpy,
checked against what we serve. No JAX.

Each adapted projection's scale is lora_alpha / r (lora_alpha / sqrt(r) with `use_rslora`),
its alpha from `alpha_pattern` where a pattern matches the module, its r the rank its A
matrix has (which `rank_pattern` decided). What we do not serve is refused by name: a bias
other than "none", DoRA, `modules_to_save`, layer-norm or embedding adapters, a rank above
max_lora_rank, a projection the base model's layer does not have.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from safetensors import safe_open

from serving.lora.request import LoRAError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (an adapter name may sit
# before .weight in files saved by hand)
_KEY = re.compile(r"^base_model\.model\.(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\."
                  r"(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


@dataclass
class Adapter:
    """A parsed adapter: (layer, HF projection) -> (A [r, in], B [out, r], scale)."""
    path: str
    weights: dict = field(repr=False)
    rank: int  # its largest rank
    digest: str  # of its config and weights: what page hashes and slots key on
    name: str = ""  # the name it was requested by (metrics)

    @property
    def num_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b, _ in self.weights.values())


def load_adapter(path: str | Path, available: list[set[str]], max_rank: int) -> Adapter:
    """available: per base layer, the HF projections it has (model/lora.py, `sites`)."""
    folder = Path(path)
    config_file, weights_file = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    if not config_file.is_file():
        raise LoRAError(f"{folder} is not a PEFT adapter folder: no {CONFIG_FILE}")
    if not weights_file.is_file():
        hint = (" (adapter_model.bin is not read: save with safetensors)"
                if (folder / "adapter_model.bin").exists() else "")
        raise LoRAError(f"{folder} has no {WEIGHTS_FILE}{hint}")
    config_bytes = config_file.read_bytes()
    try:
        config = json.loads(config_bytes)
    except json.JSONDecodeError as e:
        raise LoRAError(f"{config_file} is not valid JSON: {e}") from None
    _check_config(config, folder)
    tensors = _read_tensors(weights_file)
    weights = _pair(tensors, config, available, max_rank, folder)
    canonical = json.dumps(config, sort_keys=True).encode()  # not its formatting
    digest = hashlib.sha256(canonical + b"\0" + weights_file.read_bytes()).hexdigest()
    return Adapter(str(folder), weights, max(a.shape[0] for a, _, _ in weights.values()),
                   digest)


def _check_config(config: dict, folder: Path) -> None:
    def refuse(what: str):
        raise LoRAError(f"adapter {folder}: {what} is not supported")
    if config.get("peft_type", "LORA") != "LORA":
        refuse(f"peft_type {config['peft_type']!r} (only LORA)")
    for key in ("r", "lora_alpha"):
        if not isinstance(config.get(key), (int, float)) or config[key] <= 0:
            raise LoRAError(f"adapter {folder}: {CONFIG_FILE} needs a positive {key!r}")
    if config.get("bias", "none") != "none":
        refuse(f"bias {config['bias']!r} (only \"none\")")
    if config.get("use_dora"):
        refuse("DoRA (use_dora)")
    if config.get("modules_to_save"):
        refuse(f"modules_to_save {config['modules_to_save']!r}")
    if config.get("fan_in_fan_out"):
        refuse("fan_in_fan_out")
    if config.get("lora_bias"):
        refuse("lora_bias")


def _read_tensors(file: Path) -> dict[str, np.ndarray]:
    try:
        with safe_open(file, "numpy") as f:
            return {name: np.asarray(f.get_tensor(name), np.float32) for name in f.keys()}
    except Exception as e:  # noqa: BLE001 - a damaged file is the adapter's fault
        raise LoRAError(f"cannot read {file}: {type(e).__name__}: {e}") from None


def _pair(tensors: dict, config: dict, available: list[set[str]], max_rank: int,
          folder: Path) -> dict:
    halves: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for name, value in tensors.items():
        m = _KEY.match(name)
        if m is None:
            raise LoRAError(f"adapter {folder}: tensor {name!r} is not a LoRA A or B matrix "
                            "of a decoder layer's projection (embedding, lm_head and norm "
                            "adapters are not supported)")
        layer, parent, proj, half = int(m[1]), m[2], m[3], m[4]
        if layer >= len(available) or proj not in available[layer]:
            raise LoRAError(f"adapter {folder}: it adapts {proj} of layer {layer}, which the "
                            f"base model does not have (expected target modules in "
                            f"{sorted(set().union(*available))})")
        halves.setdefault((layer, proj), {"parent": parent})[half] = value
    if not halves:
        raise LoRAError(f"adapter {folder}: {WEIGHTS_FILE} holds no LoRA weights")
    weights = {}
    for (layer, proj), ab in sorted(halves.items()):
        if set(ab) != {"parent", "A", "B"}:
            raise LoRAError(f"adapter {folder}: layer {layer} {proj} has lora_"
                            f"{'A' if 'A' in ab else 'B'} without its other half")
        a, b = ab["A"], ab["B"]
        r = a.shape[0]
        if a.ndim != 2 or b.ndim != 2 or b.shape[1] != r:
            raise LoRAError(f"adapter {folder}: layer {layer} {proj} has A {a.shape} and B "
                            f"{b.shape}, not [r, in] and [out, r]")
        if r > max_rank:
            raise LoRAError(f"adapter {folder}: LoRA rank {r} (layer {layer} {proj}) is "
                            f"greater than max_lora_rank {max_rank}")
        weights[(layer, proj)] = (a, b, _scale(
            config, f"model.layers.{layer}.{ab['parent']}.{proj}", r))
    return weights


def _scale(config: dict, module: str, r: int) -> float:
    alpha = config["lora_alpha"]
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):  # PEFT's get_pattern_key
            alpha = value
            break
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
