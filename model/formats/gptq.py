"""GPTQ checkpoints (AutoGPTQ, GPTQModel, optimum: `...-GPTQ-Int4`, `...-GPTQ-Int8`) onto our
forms.

Per linear module, for `bits` 4 or 8 (pack = 32 // bits codes to an int32):

    qweight int32 [in / pack, out]      row i's code in word i // pack at bit (i % pack) * bits
    qzeros  int32 [groups, out / pack]  zero points, packed the same way along the output axis
    scales  fp16  [groups, out]
    g_idx   int32 [in]                  each input row's group (act-order: a permutation)

    W[i, o] = scales[g, o] * (code[i, o] - zero[g, o]),   g = g_idx[i]

`checkpoint_format` "gptq" (v1, the default) stores zero - 1 in each field and the zero is the
field plus one (so 1..2**bits); "gptq_v2" stores the zero itself. Without `desc_act` the
groups are contiguous runs of `group_size` rows (-1: one group) and g_idx is not read, as
vLLM does. Modules stored with a plain `.weight` (outside `modules_in_block_to_quantize`, the
head) load as floats.
"""
from __future__ import annotations

import math

import numpy as np

from model.config import ModelConfig
from model.formats.quantized_folder import (ModuleTensors, check_fields, int_form, refuse,
                                            unpack_int32)

METHOD = "gptq"
# fields that describe calibration or the kernels a loader picks, not the stored numbers
HARMLESS = {"quant_method", "damp_percent", "damp_auto_increment", "true_sequential",
            "static_groups", "model_name_or_path", "model_file_base_name", "meta", "tokenizer",
            "dataset", "batch_size", "pad_token_id", "use_exllama", "exllama_config",
            "max_input_length", "use_cuda_fp16", "cache_block_outputs", "backend",
            "module_name_preceding_first_block", "block_name_to_quantize", "model_seqlen",
            "modules_in_block_to_quantize", "act_group_aware", "mse", "v2", "v2_alpha",
            "sym"}
_READ = {"bits", "w_bit", "group_size", "q_group_size", "desc_act", "checkpoint_format",
         "format", "is_marlin_format", "lm_head", "dynamic", "pack_dtype"}


def first(qc: dict, *names, default=None):
    """The first of a field's spellings present (AutoAWQ wrote w_bit, q_group_size)."""
    return next((qc[n] for n in names if qc.get(n) is not None), default)


def group_size_of(qc: dict, method: str) -> int:
    size = first(qc, "group_size", "q_group_size")
    if not isinstance(size, int) or isinstance(size, bool) or (size <= 0 and size != -1):
        raise refuse(method, "group_size", size, "a positive size or -1")
    return size


def make_reader(qc: dict, cfg: ModelConfig) -> Reader:
    check_fields(qc, METHOD, HARMLESS | _READ)
    bits = first(qc, "bits", "w_bit")
    if bits not in (4, 8):
        raise refuse(METHOD, "bits", bits, "4 and 8 are served")
    formats = {str(qc[f]).lower() for f in ("checkpoint_format", "format") if qc.get(f)}
    if len(formats) > 1 or not formats <= {"gptq", "gptq_v2"}:
        raise refuse(METHOD, "checkpoint_format", ", ".join(sorted(formats)),
                     "gptq and gptq_v2 are served")
    for field in ("is_marlin_format", "lm_head"):
        if qc.get(field):
            raise refuse(METHOD, field, qc[field])
    if qc.get("dynamic"):
        raise refuse(METHOD, "dynamic", qc["dynamic"], "per-module overrides")
    if qc.get("pack_dtype") not in (None, "int32"):
        raise refuse(METHOD, "pack_dtype", qc["pack_dtype"])
    desc_act = qc.get("desc_act", False)
    if not isinstance(desc_act, bool):
        raise refuse(METHOD, "desc_act", desc_act)
    return Reader(bits, group_size_of(qc, METHOD), desc_act, formats == {"gptq_v2"})


class Reader:
    """The LinearReader of one GPTQ config."""

    def __init__(self, bits: int, group_size: int, desc_act: bool, v2: bool):
        self.bits, self.group_size, self.desc_act, self.v2 = bits, group_size, desc_act, v2
        self.notes: list[str] = []

    def __call__(self, module: ModuleTensors):
        if "qweight" not in module:
            return None
        module.only({"qweight", "qzeros", "scales", "g_idx", "bias"}, "GPTQ")
        k, n = module.shape
        pack = 32 // self.bits
        if k % pack or n % pack:
            raise module.error(f"{k} inputs and {n} outputs do not pack {pack} to an int32")
        groups = 1 if self.group_size == -1 else math.ceil(k / self.group_size)
        codes = unpack_int32(module.get("qweight", (k // pack, n), "int32"), self.bits, 0)
        zeros = unpack_int32(module.get("qzeros", (groups, n // pack), "int32"), self.bits, 1)
        zeros = zeros.astype(np.int32) + (0 if self.v2 else 1)
        scales = module.scale("scales", (groups, n))
        if self.desc_act:
            g_idx = module.get("g_idx", (k,), "int")
        else:
            g_idx = np.arange(k) // (k if self.group_size == -1 else self.group_size)
        return int_form(module, codes, scales, zeros, self.bits, g_idx, self.notes)
