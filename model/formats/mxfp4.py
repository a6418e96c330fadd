"""MXFP4 expert weights (gpt-oss's checkpoints, `quant_method: mxfp4`), dequantized at load.

Each expert projection is stored as `<name>_blocks` uint8[E, out, G, 16] (two FP4 E2M1 codes
a byte, the low nibble first) and `<name>_scales` uint8[E, out, G] (an E8M0 exponent per 32
inputs, biased by 127). Dequantized, a tensor is float[E, in, out], the layout of the float
checkpoint's `gate_up_proj` / `down_proj`, so it goes on as a float tensor: into the model's
dtype, or into int8 / int4 / fp8 by a recipe (`--quantize`). Every other tensor is stored in
float (`modules_to_not_convert`).
"""
from __future__ import annotations

import numpy as np

from model.config import ModelConfig

# E2M1: sign, two exponent bits, one mantissa bit
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
SCALE_BIAS = 127
GROUP = 32


def check(qc: dict, cfg: ModelConfig, folder) -> None:
    from model.formats import FormatError
    if not (cfg.num_experts and cfg.moe_family.biases):
        raise FormatError(f"{folder}: MXFP4 weights are read for gpt-oss experts only, not "
                          f"for {cfg.architecture}")


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks uint8[E, out, G, 16], scales uint8[E, out, G] -> float32[E, in = G * 32, out]."""
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype} and "
                         f"{scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != GROUP // 2:
        raise ValueError(f"MXFP4 blocks {blocks.shape} do not fit scales {scales.shape}")
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1)  # low nibble first
    values = FP4_VALUES[codes].reshape(*scales.shape, GROUP)
    values = np.ldexp(values, scales.astype(np.int32)[..., None] - SCALE_BIAS)
    e, out, groups = scales.shape
    return values.reshape(e, out, groups * GROUP).transpose(0, 2, 1)
