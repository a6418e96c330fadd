"""Filling the model's parameter tree one tensor at a time, for loaders of other formats.

A loader hands each weight over already in our orientation (kernels [in, out]) and in one of
our forms: a float numpy array, a `QuantArray`, an `Int4Array`, an `Int8GroupArray` or an
`Fp8BlockArray` of numpy arrays; a mixture's experts one expert at a time, stacked here into
the layer's [E, in, out] kernel. Layers are stacked on a leading axis where each weight's
layers share a form; where a file mixes them (a Q4_K_M GGUF keeps some layers' ffn_down in
Q6_K, int8 in groups of 16, beside Q4_K ones in int4), the layers stay a list of trees, each
in its own form, and `notes` says so.
"""
from __future__ import annotations

import dataclasses
from collections import Counter

import jax
import numpy as np

from model.config import ModelConfig
from model.hf_weights import WeightsError, np_dtype
from model.transformer import abstract_params
from quant.array import QuantArray
from quant.fp8_blocks import Fp8BlockArray, expand
from quant.int4 import QUANTIZED, Int4Array
from quant.int8_groups import Int8GroupArray

Path = tuple[str, ...]


def form(value) -> str:
    """A value's form, for the log: 'float32', 'int8 per channel', 'int4 (float16 scales)',
    'int8 per group of 32 with mins (float32 scales)', 'fp8 with 128x128 block scales'."""
    if isinstance(value, Fp8BlockArray):
        return value.describe()
    if isinstance(value, Int4Array):
        return f"int4 ({np.dtype(value.scale.dtype).name} scales)"
    if isinstance(value, Int8GroupArray):
        mins = "" if value.offset is None else " with mins"
        return (f"int8 per group of {value.group}{mins} "
                f"({np.dtype(value.scale.dtype).name} scales)")
    if isinstance(value, QuantArray):
        scheme = "int8" if np.dtype(value.values.dtype) == np.int8 else "fp8"
        return f"{scheme} per {'tensor' if value.scale.shape[-2:] == (1, 1) else 'channel'}"
    return np.dtype(value.dtype).name


def kernel(value) -> str:
    """The kernel that runs a weight of this form on this backend, for the log."""
    cpu = jax.default_backend() == "cpu"
    if isinstance(value, Fp8BlockArray):
        return ("fp8_block_matmul (weight-only)" if cpu else
                f"XLA fp8 dot per {value.block[0]} inputs (fp8 activations up to 64 rows)")
    if isinstance(value, Int4Array):
        return "q4_matmul" if cpu else "XLA dot, dequantized in the program"
    if isinstance(value, Int8GroupArray):  # a kernel, or a table and so the tied head
        return "q8_0_matmul" if cpu else "XLA dot, dequantized in the program"
    if isinstance(value, QuantArray):
        per_tensor = value.scale.shape[-2:] == (1, 1)
        if np.dtype(value.values.dtype) == np.int8 and not per_tensor:
            return "q8_matmul" if cpu else "XLA dot (int8 weight-only)"
        if cpu:
            return "dense_matmul (weight-only)"
        return "XLA fp8 dot (cuBLASLt on sm89+)" if per_tensor else "XLA dot (weight-only)"
    return "dense_matmul" if cpu else "XLA dot"


def _array_fields(value) -> list[str]:
    """A quantized form's array fields, in order (not its static ones, such as a block)."""
    return [f.name for f in dataclasses.fields(value) if not f.metadata.get("static")]


def _parts(value) -> list:
    """A value's arrays: a quantized form's array fields in order (None for an absent one,
    an Int8GroupArray's offset where it has none), or the array itself."""
    if isinstance(value, QUANTIZED):
        return [getattr(value, f) for f in _array_fields(value)]
    return [value]


def _signature(value):
    return (type(value).__name__, getattr(value, "block", None)) + tuple(
        None if a is None else (a.shape, np.dtype(a.dtype).name) for a in _parts(value))


def dequantize_np(value) -> np.ndarray:
    """A value in any of our forms as float32, exactly as the kernels read it."""
    if isinstance(value, Int4Array):
        *lead, k, n = value.values.shape
        groups = value.scale.shape[-2]
        codes = value.values.astype(np.float32).reshape(*lead, groups, k // groups, n)
        w = (codes * value.scale.astype(np.float32)[..., None, :]
             + value.zero.astype(np.float32)[..., None, :])
        return w.reshape(*lead, k, n)
    if isinstance(value, Int8GroupArray):
        size, axis = value.values.shape[value.group_axis], value.group_axis
        per_weight = lambda a: expand(a.astype(np.float32), value.group, size, axis)
        w = value.values.astype(np.float32) * per_weight(value.scale)
        return w if value.offset is None else w + per_weight(value.offset)
    if isinstance(value, QuantArray):
        return value.values.astype(np.float32) * value.scale.astype(np.float32)
    if isinstance(value, Fp8BlockArray):
        (bi, bo), (k, n) = value.block, value.values.shape[-2:]
        scale = expand(expand(np.asarray(value.scale, np.float32), bo, n, -1), bi, k, -2)
        return np.asarray(value.values).astype(np.float32) * scale
    return np.asarray(value, np.float32)


class ParamFiller:
    """Collects a model's weights; `finish()` returns the stacked tree."""

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        self.abstract = abstract_params(cfg)
        self.dtype = np_dtype(cfg.dtype)
        self.top: dict[Path, object] = {}
        self.layers: dict[Path, dict[int, object]] = {}
        self.experts: dict[Path, dict[int, dict[int, object]]] = {}  # path -> layer -> expert
        self.notes: list[str] = []  # what the log should say about forms and fallbacks

    def declared(self, path: Path, layer: int | None = None) -> tuple[int, ...]:
        """The shape the model declares at `path` (layers stacked on a leading axis). Where
        layers differ (dense and MoE mixed, a list of trees), `layer`'s, or the first layer
        that has the path."""
        return tuple(self._node(path, layer).shape)

    def _node(self, path: Path, layer: int | None = None):
        layers = self.abstract["layers"]
        if path[0] == "layers" and isinstance(layers, list):
            trees = [layers[layer]] if layer is not None and 0 <= layer < len(layers) \
                else layers
            for tree in trees:
                node = _find(tree, path[1:])
                if node is not None:
                    return jax.ShapeDtypeStruct((len(layers), *node.shape), node.dtype)
        else:
            node = _find(self.abstract, path)
            if node is not None:
                return node
        raise WeightsError(f"{'/'.join(path)} does not belong in a "
                           f"{self.cfg.architecture} with this config"
                           + (f" (layer {layer})" if layer is not None else ""))

    def set(self, path: Path, layer: int | None, value, name: str,
            expert: int | None = None) -> None:
        """value: float array or one of our quantized forms, shaped as the model declares it
        (without the layer axis, and for an expert without the expert axis); name: the
        tensor's name in the file, for errors; expert: a mixture's expert, whose slot of the
        layer's [E, ...] weight this is."""
        if path[0] == "lm_head" and self.cfg.tie_word_embeddings:
            return  # a tied checkpoint may still store the (identical) head
        declared = self.declared(path, layer)
        want = declared[1:] if path[0] == "layers" else declared
        if path[0] == "layers" and (layer is None or not 0 <= layer < declared[0]):
            raise WeightsError(f"tensor {name!r}: layer {layer} but the config has "
                               f"{declared[0]} layers")
        if expert is not None:
            if not 0 <= expert < want[0]:
                raise WeightsError(f"tensor {name!r}: expert {expert} but the config has "
                                   f"{want[0]} experts")
            want = want[1:]
        shape = tuple(value.values.shape if isinstance(value, QUANTIZED) else value.shape)
        if shape != want:
            raise WeightsError(f"tensor {name!r} has shape {shape} where the model wants "
                               f"{want} (as [in, out] for a kernel)")
        if not isinstance(value, QUANTIZED):
            value = np.asarray(value)
        if expert is not None:
            self.experts.setdefault(path, {}).setdefault(layer, {})[expert] = value
        elif path[0] == "layers":
            self.layers.setdefault(path, {})[layer] = value
        else:
            self.top[path] = value

    def finish(self) -> dict:
        """The parameter tree: layers stacked on a leading axis, or, where a weight's layers
        come in different forms (a Q4_K_M GGUF keeps some layers' ffn_down in Q6_K), a list
        of per-layer trees, each weight in its own layer's form (model/runtime_params.py
        prepares either)."""
        missing = self._stack_experts()
        if isinstance(self.abstract["layers"], list):
            return self._finish_per_layer(missing)
        params = jax.tree.map(lambda a: None, self.abstract)
        num_layers = self.cfg.num_layers
        for path, a in _flatten(self.abstract):
            if path[0] == "lm_head" and self.cfg.tie_word_embeddings:
                continue
            if path[0] != "layers":
                if path not in self.top:
                    missing.append("/".join(path))
                    continue
                _put(params, path, self._float_or_keep(self.top[path], a.dtype))
                continue
            got = self.layers.get(path, {})
            absent = [i for i in range(num_layers) if i not in got]
            if absent:
                missing.append("/".join(path) + f" (layers {absent[:4]})")
        if missing:
            raise WeightsError("missing tensor(s): " + ", ".join(missing[:5])
                               + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
        per_layer = {path: [self._float_or_keep(got[i]) for i in range(num_layers)]
                     for path, got in self.layers.items()}
        mixed = {path: Counter(form(v) for v in values) for path, values in per_layer.items()
                 if len({_signature(v) for v in values}) > 1}
        if mixed:
            layers = [jax.tree.map(lambda a: None, params["layers"]) for _ in range(num_layers)]
            for path, values in per_layer.items():
                for i, value in enumerate(values):
                    _put(layers[i], path[1:], value)
            params["layers"] = layers
            self.notes += [f"{'/'.join(p[1:])}: layers in {dict(f)}, each run in its own form"
                           for p, f in mixed.items()]
        else:
            for path, values in per_layer.items():
                _put(params, path, _stack(values))
        return params

    def _stack_experts(self) -> list[str]:
        """Each layer's experts stacked into its [E, ...] weight (one form for all of them);
        -> what is missing."""
        missing = []
        for path, by_layer in self.experts.items():
            for layer, got in sorted(by_layer.items()):
                num = self.declared(path, layer)[1]
                absent = [e for e in range(num) if e not in got]
                if absent:
                    missing.append(f"{'/'.join(path)} (layer {layer}, experts {absent[:4]})")
                    continue
                values = [self._float_or_keep(got[e]) for e in range(num)]
                forms = Counter(form(v) for v in values)
                if len({_signature(v) for v in values}) > 1:
                    raise WeightsError(f"{'/'.join(path)} of layer {layer}: experts stored in "
                                       f"different forms {dict(forms)}; one form is served")
                self.layers.setdefault(path, {})[layer] = _stack(values)
        return missing

    def _finish_per_layer(self, missing: list[str]) -> dict:
        """A model whose layers differ (dense and MoE mixed): a list of per-layer trees, each
        weight in its declared dtype where it is float."""
        top = {k: v for k, v in self.abstract.items() if k != "layers"}
        params = jax.tree.map(lambda a: None, top)
        for path, a in _flatten(top):
            if path[0] == "lm_head" and self.cfg.tie_word_embeddings:
                continue
            if path not in self.top:
                missing.append("/".join(path))
                continue
            _put(params, path, self._float_or_keep(self.top[path], a.dtype))
        layers = []
        for i, tree in enumerate(self.abstract["layers"]):
            out = jax.tree.map(lambda a: None, tree)
            for sub, a in _flatten(tree):
                got = self.layers.get(("layers", *sub), {})
                if i not in got:
                    missing.append("/".join(("layers", *sub)) + f" (layer {i})")
                    continue
                _put(out, sub, self._float_or_keep(got[i], a.dtype))
            layers.append(out)
        if missing:
            raise WeightsError("missing tensor(s): " + ", ".join(missing[:5])
                               + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
        params["layers"] = layers
        return params

    def describe(self, value) -> str:
        """A kernel's form as stored (a float array in the model's dtype) and the kernel that
        runs it, for the start-up log."""
        stored = np.dtype(self.dtype).name if isinstance(value, np.ndarray) else form(value)
        return f"{stored} on {kernel(value)}"

    def _float_or_keep(self, value, dtype=None):
        """A quantized form as it is; a float array in `dtype` where the model declares
        float32 (a router), else the model's dtype."""
        if isinstance(value, QUANTIZED):
            return value
        keep32 = dtype is not None and np.dtype(dtype) == np.float32
        return value.astype(np.float32 if keep32 else self.dtype)



def _stack(values: list):
    """Layers (or experts) of one form stacked on a leading axis."""
    if isinstance(values[0], QUANTIZED):
        stacked = [None if parts[0] is None else np.stack(parts)
                   for parts in zip(*(_parts(v) for v in values))]
        return dataclasses.replace(values[0], **dict(zip(_array_fields(values[0]), stacked)))
    return np.stack(values)


def _find(tree, path: Path):
    for p in path:
        if not isinstance(tree, dict) or p not in tree:
            return None
        tree = tree[p]
    return None if isinstance(tree, dict) else tree


def _flatten(tree, prefix: Path = ()):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flatten(v, prefix + (k,))
    else:
        yield prefix, tree


def _put(tree, path: Path, value) -> None:
    for p in path[:-1]:
        tree = tree[p]
    tree[path[-1]] = value
