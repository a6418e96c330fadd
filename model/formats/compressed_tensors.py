"""compressed-tensors checkpoints (llm-compressor's `...-FP8-dynamic`, `...-W8A8`,
`...-W4A16`) onto our forms.

`quantization_config = {"quant_method": "compressed-tensors", "format": ..., "ignore": [...],
"config_groups": {name: {"targets": [...], "weights": {...}, "input_activations": ...}}}`.
A linear module not in `ignore` takes the group whose targets name it (its name first, then a
"re:" regex, then its class "Linear"), stored by `format`:

- float-quantized / naive-quantized fp8: `weight` float8_e4m3fn [out, in] and `weight_scale`
  (1,) per tensor or (out, 1) per channel -> an fp8 QuantArray;
- int-quantized / naive-quantized int: `weight` int8 [out, in] holding signed codes, scales per
  tensor, channel or group, optional `weight_zero_point` -> int_groups.to_our_form (int8 per
  channel, symmetric: an int8 QuantArray);
- pack-quantized (W4A16, W8A16): `weight_packed` int32 [out, ceil(in * bits / 32)], the codes
  plus 2**(bits - 1), element j of a row at bit j * bits; `weight_shape` [out, in];
  `weight_scale` [out, groups]; an asymmetric `weight_zero_point` packed the same way down the
  output axis [ceil(out * bits / 32), groups]; act-order `weight_g_idx` [in]
  -> int_groups.to_our_form.

W = scale * (q - zero); codes and zero both offset by 2**(bits - 1) give the same difference.
Static activation scales (`input_scale`) are read and checked, never applied: our kernels
scale activations at run time, if at all.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

from model.config import ModelConfig
from model.formats.quantized_folder import (ModuleTensors, add_note, check_fields, int_form,
                                            refuse, unpack_int32)
from quant.array import QuantArray

METHOD = "compressed-tensors"
FORMATS = ("float-quantized", "int-quantized", "naive-quantized", "pack-quantized")
_TOP = {"quant_method", "format", "config_groups", "ignore", "kv_cache_scheme",
        "quantization_status", "global_compression_ratio", "version", "sparsity_config",
        "transform_config", "moe_sparsity_config"}
_GROUP = {"targets", "weights", "input_activations", "output_activations", "format"}
_ARGS = {"num_bits", "type", "symmetric", "group_size", "strategy", "block_structure",
         "dynamic", "actorder", "observer", "observer_kwargs", "scale_dtype", "zp_dtype"}
_ACT_ORDER = {None: False, False: False, "weight": False, "static": False,
              "group": True, "dynamic": True, True: True}  # -> weight_g_idx stored


@dataclass(frozen=True)
class Scheme:
    """One config group's weights, checked; `activations` is the log's line about them."""
    name: str
    targets: tuple
    bits: int
    is_float: bool
    strategy: str  # tensor | channel | group
    group_size: int | None
    symmetric: bool
    g_idx: bool
    static_input: bool
    activations: str | None


def make_reader(qc: dict, cfg: ModelConfig) -> Reader:
    check_fields(qc, METHOD, _TOP)
    fmt = qc.get("format")
    if fmt not in FORMATS:
        raise refuse(METHOD, "format", fmt, f"served: {', '.join(FORMATS)}")
    for field in ("kv_cache_scheme", "transform_config", "moe_sparsity_config"):
        if qc.get(field):
            raise refuse(METHOD, field, qc[field])
    sparsity = qc.get("sparsity_config") or {}
    if sparsity.get("format", "dense") != "dense":
        raise refuse(METHOD, "sparsity_config.format", sparsity.get("format"))
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise refuse(METHOD, "config_groups", groups, "no quantized group")
    schemes = [_scheme(name, g, fmt) for name, g in groups.items()]
    ignore = [_target(t, "ignore", for_ignore=True) for t in qc.get("ignore") or []]
    return Reader(fmt, schemes, ignore)


def _scheme(name: str, group, fmt: str) -> Scheme:
    where = f"config_groups.{name}"
    if not isinstance(group, dict):
        raise refuse(METHOD, where, group)
    check_fields(group, METHOD, _GROUP, where)
    if group.get("format") not in (None, fmt):
        raise refuse(METHOD, f"{where}.format", group["format"], "one format per checkpoint")
    if group.get("output_activations"):
        raise refuse(METHOD, f"{where}.output_activations", group["output_activations"])
    targets = group.get("targets")
    if not isinstance(targets, list) or not targets:
        raise refuse(METHOD, f"{where}.targets", targets)
    weights = _weights(group.get("weights"), f"{where}.weights", fmt)
    _, is_float, strategy = weights[:3]
    static, activations = _activations(group.get("input_activations"), where,
                                       is_float and strategy == "tensor")
    return Scheme(name, tuple(_target(t, f"{where}.targets") for t in targets), *weights,
                  static, activations)


def _weights(w, where: str, fmt: str) -> tuple:
    """-> Scheme's (bits, is_float, strategy, group_size, symmetric, g_idx), checked."""
    if not isinstance(w, dict):
        raise refuse(METHOD, where, w, "no weight quantization")
    check_fields(w, METHOD, _ARGS, where)
    kind, bits, strategy = w.get("type", "int"), w.get("num_bits", 8), _strategy(w)
    if kind not in ("int", "float"):
        raise refuse(METHOD, f"{where}.type", kind)
    if (fmt == "float-quantized") != (kind == "float") and fmt != "naive-quantized":
        raise refuse(METHOD, f"{where}.type", kind, f"format {fmt} stores the other type")
    if bits not in ((8,) if kind == "float" else (4, 8)):
        raise refuse(METHOD, f"{where}.num_bits", bits, f"{kind} weights of 4 or 8 bits "
                     "are served (8 for float)")
    if strategy not in (("tensor", "channel") if kind == "float" else
                        ("tensor", "channel", "group")):
        raise refuse(METHOD, f"{where}.strategy", strategy)
    group_size = w.get("group_size") if strategy == "group" else None
    if strategy == "group" and not (isinstance(group_size, int) and group_size > 0):
        raise refuse(METHOD, f"{where}.group_size", group_size)
    if w.get("dynamic"):
        raise refuse(METHOD, f"{where}.dynamic", w["dynamic"])
    actorder = w.get("actorder")
    if not isinstance(actorder, (str, bool, type(None))) or actorder not in _ACT_ORDER:
        raise refuse(METHOD, f"{where}.actorder", actorder)
    symmetric = w.get("symmetric", True)
    if kind == "float" and not symmetric:
        raise refuse(METHOD, f"{where}.symmetric", symmetric, "fp8 weights are symmetric")
    return (bits, kind == "float", strategy, group_size, bool(symmetric),
            _ACT_ORDER[actorder] and strategy == "group")


def _strategy(args: dict) -> str:
    """compressed-tensors' own default: from group_size when strategy is absent."""
    if args.get("strategy") is not None:
        return args["strategy"]
    size = args.get("group_size")
    return "tensor" if size is None else "channel" if size == -1 else "group"


def _activations(a, where: str, fp8_per_tensor: bool) -> tuple[bool, str | None]:
    """-> (input_scale stored, the log's line on how activations run here)."""
    if a is None:
        return False, None
    where = f"{where}.input_activations"
    if not isinstance(a, dict):
        raise refuse(METHOD, where, a)
    check_fields(a, METHOD, _ARGS, where)
    kind, strategy, dynamic = a.get("type", "int"), _strategy(a), a.get("dynamic", False)
    if a.get("num_bits", 8) != 8 or kind not in ("int", "float"):
        raise refuse(METHOD, f"{where}.num_bits", a.get("num_bits"), "8-bit activations")
    if dynamic not in (True, False) or strategy not in (
            ("tensor", "token", "group") if dynamic else ("tensor",)):
        raise refuse(METHOD, f"{where}.strategy", strategy,
                     f"with dynamic = {dynamic!r}")
    wanted = (f"{'dynamic' if dynamic else 'static'} per-{strategy} "
              f"{'fp8' if kind == 'float' else 'int8'} activations")
    if not dynamic:
        wanted += " (input_scale read and checked)"
    ours = ("activations are quantized to fp8 at run time, one dynamic scale per call (our fp8 "
            "kernels take no static activation scale)" if fp8_per_tensor else
            "activations stay in the model's dtype (the weights run weight-only)")
    return not dynamic, f"{where}: the checkpoint asks for {wanted}; {ours}"


def _target(t, where: str, for_ignore: bool = False):
    """-> (rank, matcher): rank 0 a module name, 1 a regex, 2 the class Linear."""
    if not isinstance(t, str):
        raise refuse(METHOD, where, t)
    if t.startswith("re:"):
        try:
            return 1, re.compile(t[3:])
        except re.error as e:
            raise refuse(METHOD, where, t, f"not a regex: {e}") from None
    if t == "Linear":
        return 2, None
    if not for_ignore and "." not in t and t != "lm_head" and t[:1].isupper():
        raise refuse(METHOD, where, t, "only Linear layers (by class, name or re: regex) "
                     "are served")
    return 0, t


def _matches(target, prefix: str) -> bool:
    rank, m = target
    return (rank == 2 or (rank == 1 and m.match(prefix) is not None)
            or (rank == 0 and m == prefix))


class Reader:
    """The LinearReader of one compressed-tensors config."""

    def __init__(self, fmt: str, schemes: list[Scheme], ignore: list):
        self.fmt, self.schemes, self.ignore = fmt, schemes, ignore
        self.notes: list[str] = []

    def scheme_for(self, prefix: str) -> Scheme | None:
        if any(_matches(t, prefix) for t in self.ignore):
            return None
        found = [(t[0], i) for i, s in enumerate(self.schemes) for t in s.targets
                 if _matches(t, prefix)]
        return self.schemes[min(found)[1]] if found else None

    def __call__(self, module: ModuleTensors):
        scheme = self.scheme_for(module.prefix)
        if scheme is None:
            return None
        if scheme.activations:
            add_note(self.notes, scheme.activations)
        allowed = {"weight_scale", "weight_zero_point", "weight_g_idx", "bias"}
        if scheme.static_input:
            allowed |= {"input_scale", "input_zero_point"}
            self._check_input_scale(module)
        if self.fmt == "pack-quantized":
            module.only(allowed | {"weight_packed", "weight_shape"}, f"{METHOD} {self.fmt}")
            return self._packed(module, scheme)
        module.only(allowed | {"weight"}, f"{METHOD} {self.fmt}")
        return self._fp8(module, scheme) if scheme.is_float else self._ints(module, scheme)

    def _check_input_scale(self, module: ModuleTensors) -> None:
        if module.scale("input_scale").size != 1:
            raise module.error("input_scale holds more than the one per-tensor scale")
        if "input_zero_point" in module and module.get("input_zero_point").size != 1:
            raise module.error("input_zero_point holds more than one zero point")

    def _fp8(self, module: ModuleTensors, scheme: Scheme) -> QuantArray:
        k, n = module.shape
        w = module.get("weight", (n, k), "float8_e4m3fn")
        if "weight_zero_point" in module and module.get("weight_zero_point").any():
            raise module.error("fp8 weights with nonzero zero points")
        return QuantArray(w.T, self._scales(module, scheme, per_tensor=True)[0])

    def _ints(self, module: ModuleTensors, scheme: Scheme):
        k, n = module.shape
        w = module.get("weight", (n, k), "int8")
        half = 1 << (scheme.bits - 1)
        if w.size and (w.min() < -half or w.max() >= half):
            raise module.error(f"weight holds codes outside the signed {scheme.bits}-bit range")
        scale, g_idx = self._scales(module, scheme)
        zero = self._zeros(module, scheme, scale.shape[0], packed=False)
        return int_form(module, w.T.astype(np.int16) + half, scale, zero, scheme.bits, g_idx,
                        self.notes)

    def _packed(self, module: ModuleTensors, scheme: Scheme):
        k, n = module.shape
        stored = tuple(int(x) for x in module.get("weight_shape", (2,), "int"))
        if stored != (n, k):
            raise module.error(f"weight_shape {stored} is not the layer's ({n}, {k})")
        words = module.get("weight_packed", (n, math.ceil(k * scheme.bits / 32)), "int32")
        codes = unpack_int32(words, scheme.bits, axis=1)[:, :k]
        scale, g_idx = self._scales(module, scheme)
        zero = self._zeros(module, scheme, scale.shape[0], packed=True)
        return int_form(module, codes.T, scale, zero, scheme.bits, g_idx, self.notes)

    def _scales(self, module: ModuleTensors, scheme: Scheme, per_tensor: bool = False):
        """-> (float32 scales [groups, out] ([1, 1] for an fp8 tensor scale), g_idx or None)."""
        k, n = module.shape
        if scheme.strategy == "group":
            groups = math.ceil(k / scheme.group_size)
            scale = module.scale("weight_scale", (n, groups)).T
            g_idx = (module.get("weight_g_idx", (k,), "int") if scheme.g_idx
                     else np.arange(k) // scheme.group_size)
            return scale, g_idx
        scale = module.scale("weight_scale")
        want = {1} if scheme.strategy == "tensor" else {(n,), (n, 1)}
        if (scale.size if scheme.strategy == "tensor" else scale.shape) not in want:
            raise module.error(f"weight_scale has shape {scale.shape} for {scheme.strategy} "
                               f"scales of {n} outputs")
        if scheme.strategy == "tensor":
            scale = scale.reshape(1, 1)
            return (scale if per_tensor else np.broadcast_to(scale, (1, n))), None
        return scale.reshape(1, n), None

    def _zeros(self, module: ModuleTensors, scheme: Scheme, groups: int, packed: bool):
        """-> unsigned zero points [groups, out] (2**(bits-1) for symmetric weights)."""
        k, n = module.shape
        half = 1 << (scheme.bits - 1)
        if "weight_zero_point" not in module:
            if not scheme.symmetric:
                raise module.error("asymmetric weights without weight_zero_point")
            return np.full((groups, n), half, np.int32)
        if packed and scheme.strategy != "tensor":  # packed with the offset already added
            rows = math.ceil(n * scheme.bits / 32)
            words = module.get("weight_zero_point", (rows, groups), "int32")
            return unpack_int32(words, scheme.bits, axis=0)[:n].T.astype(np.int32)
        zero = module.get("weight_zero_point", None, "int").astype(np.int32)
        if zero.size not in (1, n * groups):
            raise module.error(f"weight_zero_point has shape {zero.shape} for {groups} "
                               f"group(s) of {n} outputs")
        return np.broadcast_to(zero.reshape(-1, groups).T if zero.size > 1 else zero.reshape(
            1, 1), (groups, n)) + half
