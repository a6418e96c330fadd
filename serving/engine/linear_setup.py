"""What the engine sets up for a linear-attention hybrid (Qwen3-Next, Qwen3.5: model/
linear_attention/): the features it does not take yet, refused by name; the recurrent
state's slots, one per request max_num_seqs allows plus the null slot, sized and checked
against memory at start-up (a --max-num-seqs whose states do not fit is refused with the
numbers, as vLLM refuses one its Mamba blocks cannot hold).
docs/architecture.md, "Linear attention and recurrent state"."""
from __future__ import annotations

import logging
from dataclasses import replace

from model.config import ModelConfig
from model.linear_attention.state import slot_bytes
from serving.core.config import EngineConfig

log = logging.getLogger("xlaserve")
GIB = 1 << 30


def check(ec: EngineConfig, cfg: ModelConfig, speculative) -> EngineConfig:
    """-> the engine config to run with (prefix caching off, said in the log); raises for
    what a hybrid does not take yet."""
    if not cfg.num_linear_layers:
        return ec
    what = f"{cfg.architecture} is a linear-attention hybrid"
    refused = [(speculative, "--speculative-config (speculative decoding)"),
               (ec.enable_lora, "--enable-lora"),
               (ec.kv_transfer_config, "--kv-transfer-config"),
               (ec.data_parallel_size > 1 and ec.enable_expert_parallel,
                "--data-parallel-size with --enable-expert-parallel")]
    for given, flag in refused:
        if given:
            raise ValueError(f"{flag} is not served for this model yet: {what}, whose "
                             "recurrent state the feature does not keep")
    if ec.enable_prefix_caching:
        log.warning("prefix caching is off: %s and its state keeps no checkpoints to resume "
                    "a prefix from", what)
        ec = replace(ec, enable_prefix_caching=False)
    return ec


def ssm_dtype(ec: EngineConfig, cfg: ModelConfig) -> str:
    return cfg.ssm_state_dtype if ec.mamba_ssm_cache_dtype == "auto" else ec.mamba_ssm_cache_dtype


def room(ec: EngineConfig, placement, weight_bytes: int) -> int | None:
    """Bytes the state and the KV cache may share: on a GPU what gpu_memory_utilization
    leaves after the weights, elsewhere the share of free memory a CPU's KV cache may take."""
    from serving.engine import mesh, sizing
    limit = mesh.gpu_memory_limit(placement)
    if limit:
        return int(limit * ec.gpu_memory_utilization) - weight_bytes
    free = sizing.available_memory()
    return int(free * sizing.CPU_KV_MEMORY_FRACTION) if free else None


def place_state(ec: EngineConfig, cfg: ModelConfig, placement, room: int | None) -> int:
    """Gives the placement its state slots; -> the state's bytes (0 without linear layers).
    room: the bytes the state and the KV cache may share (None: unknown); a state that
    leaves no room for one page of KV is refused."""
    if not cfg.num_linear_layers:
        return 0
    dtype = ssm_dtype(ec, cfg)
    per = slot_bytes(cfg, dtype)
    slots = ec.max_num_seqs + 1
    total = slots * per
    if room is not None and total >= room:
        most = max((room - 1) // per - 1, 0)  # (most + 1) slots leave a byte for the KV cache
        raise ValueError(
            f"max_num_seqs {ec.max_num_seqs}: each request holds {per / 2**20:.1f} MiB of "
            f"recurrent state ({cfg.num_linear_layers} linear layers, {dtype}), "
            f"{total / GIB:.2f} GiB for {slots} slots (the null one included), but "
            f"{room / GIB:.2f} GiB is left for the state and the KV cache; lower "
            f"--max-num-seqs to at most {most}, or "
            "--mamba-ssm-cache-dtype to a smaller dtype")
    placement.state_slots, placement.ssm_dtype = slots, dtype
    log.info("recurrent state of the %d linear layers: %d slots (max_num_seqs %d and the "
             "null slot) x %.2f MiB = %.2f GiB (%s)", cfg.num_linear_layers, slots,
             ec.max_num_seqs, per / 2**20, total / GIB, dtype)
    return total
