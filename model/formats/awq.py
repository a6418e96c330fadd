"""AWQ checkpoints in AutoAWQ's GEMM layout (`...-AWQ`) onto our forms.

Per linear module, 4-bit codes eight to an int32 along the OUTPUT axis, the fields of a word
holding outputs 0, 2, 4, 6, 1, 3, 5, 7 of its run of eight:

    qweight int32 [in, out / 8]
    qzeros  int32 [in / group_size, out / 8]   (the same packing)
    scales  fp16  [in / group_size, out]

    W[i, o] = scales[g, o] * (code[i, o] - zero[g, o]),   g = i // group_size

The GEMV layouts ("gemv", "gemv_fast") pack along the input axis in another order and are
refused, as is `zero_point` false (AutoAWQ's GEMM packer cannot write it). Modules in
`modules_to_not_convert` (matched as substrings of the module's name, as vLLM does) are plain
`.weight`s.
"""
from __future__ import annotations

import numpy as np

from model.config import ModelConfig
from model.formats.gptq import HARMLESS, first, group_size_of
from model.formats.quantized_folder import (ModuleTensors, check_fields, int_form, refuse,
                                            unpack_int32)

METHOD = "awq"
ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the output each successive 4-bit field of a word holds
_READ = {"bits", "w_bit", "group_size", "q_group_size", "zero_point", "version", "format",
         "backend", "modules_to_not_convert", "do_fuse", "fuse_max_seq_len", "modules_to_fuse",
         "desc_act"}


def make_reader(qc: dict, cfg: ModelConfig) -> Reader:
    check_fields(qc, METHOD, HARMLESS | _READ)
    bits = first(qc, "bits", "w_bit")
    if bits != 4:
        raise refuse(METHOD, "bits", bits, "AWQ is served at 4 bits")
    version = first(qc, "version", "format", default="gemm")
    if str(version).lower() != "gemm":
        raise refuse(METHOD, "version", version, f"AWQ version {version!r} is not served; use "
                     "a GEMM checkpoint")
    if qc.get("backend") == "llm-awq":
        raise refuse(METHOD, "backend", "llm-awq", "MIT llm-awq's own packing")
    if qc.get("zero_point", True) is not True:
        raise refuse(METHOD, "zero_point", qc["zero_point"], "GEMM checkpoints carry zero "
                     "points")
    if qc.get("desc_act"):
        raise refuse(METHOD, "desc_act", qc["desc_act"], "AWQ has no act-order")
    skip = qc.get("modules_to_not_convert") or []
    if not isinstance(skip, list) or not all(isinstance(s, str) for s in skip):
        raise refuse(METHOD, "modules_to_not_convert", skip, "a list of module names")
    return Reader(group_size_of(qc, METHOD), skip)


class Reader:
    """The LinearReader of one AWQ config."""

    def __init__(self, group_size: int, skip: list[str]):
        self.group_size, self.skip = group_size, skip
        self.notes: list[str] = []

    def __call__(self, module: ModuleTensors):
        skipped = any(s in module.prefix for s in self.skip)
        if "qweight" not in module:
            return None
        if skipped:
            raise module.error("stored quantized though modules_to_not_convert names it")
        module.only({"qweight", "qzeros", "scales", "bias"}, "AWQ")
        k, n = module.shape
        size = k if self.group_size == -1 else self.group_size
        if k % size or n % 8:
            raise module.error(f"{k} inputs and {n} outputs do not split into groups of "
                               f"{size} inputs and words of 8 outputs")
        codes = unpack_int32(module.get("qweight", (k, n // 8), "int32"), 4, 1, ORDER)
        zeros = unpack_int32(module.get("qzeros", (k // size, n // 8), "int32"), 4, 1, ORDER)
        scales = module.scale("scales", (k // size, n))
        return int_form(module, codes, scales, zeros, 4, np.arange(k) // size, self.notes)
