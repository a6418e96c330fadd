"""fp8 checkpoints of `quant_method: "fp8"` (Qwen3-FP8, DeepSeek style; transformers'
FineGrainedFP8Config) onto our forms.

Per linear module (each expert of a mixture its own module), `weight` float8_e4m3fn
[out, in] and

- with `weight_block_size` [bn, bk]: `weight_scale_inv` float32 [ceil(out / bn),
  ceil(in / bk)], one scale per block (a multiplier, whatever its name says):
  W[o, i] = weight[o, i] * scale[o // bn, i // bk]. Kept as it is, transposed: an
  Fp8BlockArray (quant/fp8_blocks.py) of the fp8 values [in, out] and the scales
  [ceil(in / bk), ceil(out / bn)], never widened (DeepSeek-V3 is 671 GB in fp8); its
  dequantization is the format's own, bit for bit. Experts are stacked [E, in, out] by the
  filler (model/formats/param_tree.py).
- without it: one scale, `weight_scale` (or `weight_scale_inv`) -> an fp8 QuantArray per
  tensor (our fp8 kernel quantizes activations per call, W8A8).

`activation_scheme` "static" adds an `input_scale` per module, read and checked; our kernels
scale activations at run time. Modules kept in the model's dtype (`modules_to_not_convert`,
the head) are plain `.weight`s: the stored dtype says which.
"""
from __future__ import annotations

import math

import numpy as np

from model.config import ModelConfig
from model.formats.quantized_folder import ModuleTensors, add_note, check_fields, refuse
from quant.array import QuantArray
from quant.fp8_blocks import Fp8BlockArray

METHOD = "fp8"
FP8 = "float8_e4m3fn"
_KNOWN = {"quant_method", "activation_scheme", "weight_block_size", "fmt", "scale_fmt",
          "modules_to_not_convert", "ignored_layers", "modules_to_convert", "dequantize",
          "expert_dtype"}


def make_reader(qc: dict, cfg: ModelConfig) -> Reader:
    check_fields(qc, METHOD, _KNOWN)
    scheme = str(qc.get("activation_scheme", "dynamic")).lower()
    if scheme not in ("dynamic", "static"):
        raise refuse(METHOD, "activation_scheme", qc["activation_scheme"])
    if qc.get("fmt", "e4m3") != "e4m3":
        raise refuse(METHOD, "fmt", qc["fmt"], "float8 e4m3 weights are served")
    if qc.get("scale_fmt", "float") != "float":
        raise refuse(METHOD, "scale_fmt", qc["scale_fmt"], "float scales are served")
    if qc.get("expert_dtype", "fp8") != "fp8":
        raise refuse(METHOD, "expert_dtype", qc["expert_dtype"])
    block = qc.get("weight_block_size")
    if block is not None and not (isinstance(block, (list, tuple)) and len(block) == 2 and all(
            isinstance(b, int) and b > 0 for b in block)):
        raise refuse(METHOD, "weight_block_size", block, "two positive sizes [out, in]")
    return Reader(tuple(block) if block else None, scheme == "static")


class Reader:
    """The LinearReader of one fp8 config."""

    def __init__(self, block: tuple[int, int] | None, static: bool):
        self.block, self.static = block, static
        self.notes: list[str] = []
        if static:
            self.notes.append("activation_scheme static: each input_scale is read and checked, "
                              "not used; activations are scaled dynamically at run time (our "
                              "fp8 kernels take no static activation scale)")

    def __call__(self, module: ModuleTensors):
        scales = [s for s in ("weight_scale_inv", "weight_scale") if s in module]
        if not scales:
            return None  # kept in the model's dtype; a float8 .weight alone is refused there
        if len(scales) > 1:
            raise module.error("both weight_scale and weight_scale_inv are stored")
        module.only({"weight", scales[0], "bias"} | ({"input_scale"} if self.static else set()),
                    "fp8")
        if self.static and module.scale("input_scale").size != 1:
            raise module.error("input_scale holds more than the one per-tensor scale")
        k, n = module.shape
        w = module.get("weight", (n, k), FP8)
        if self.block is None:
            scale = module.scale(scales[0])
            if scale.size != 1:
                raise module.error(f"{scales[0]} has shape {scale.shape}; without "
                                   "weight_block_size it is one per-tensor scale")
            add_note(self.notes, "fp8 per-tensor weights: activations are quantized to fp8 at "
                                 "run time, one dynamic scale per call")
            return QuantArray(w.T, scale.reshape(1, 1))
        return self._blocks(module, w, scales[0])

    def _blocks(self, module: ModuleTensors, w: np.ndarray, name: str) -> Fp8BlockArray:
        (bn, bk), (k, n) = self.block, module.shape
        scale = module.scale(name, (math.ceil(n / bn), math.ceil(k / bk)))
        value = Fp8BlockArray(w.T, scale.T.copy(), (bk, bn))
        add_note(self.notes, f"{value.describe()} (weight_block_size [{bn}, {bk}]): kept in "
                             "fp8, not widened")
        return value
