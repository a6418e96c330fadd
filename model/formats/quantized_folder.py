"""A Hugging Face folder whose linear layers are stored quantized (compressed-tensors, GPTQ,
AWQ, fp8 with block scales): the walk every such format shares.

Each format module supplies a `LinearReader`: given the tensors under one linear module's
prefix (`model.layers.3.self_attn.q_proj`), it returns that weight in one of our forms,
[in, out] (quant.array.QuantArray, quant.int4.Int4Array) or a float array, or None when the
module is stored as a plain `.weight` (an `ignore`d layer, the head). Norms, biases and the
embedding are read as the float loader reads them. A tensor nobody claims is an error: a
packed integer tensor must never be read as if it were a float weight.
"""
from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import numpy as np
from safetensors import safe_open

from model.config import ModelConfig
from model.formats.param_tree import ParamFiller, form
from model.hf_weights import _IGNORED, WeightsError, _target, safetensors_files

# A linear module: its prefix -> (parameter path, layer or None).
_LINEAR = re.compile(r"(?:model\.layers\.(\d+)\.(self_attn|mlp)\.([a-z]+)_proj|lm_head)")
_MODULE = {"self_attn": "attn", "mlp": "mlp"}

# (tensors under the prefix, by suffix -> array getter; the prefix) -> value or None
LinearReader = Callable[[dict[str, Callable[[], np.ndarray]], str], object]


def linear_path(prefix: str) -> tuple[tuple[str, ...], int | None] | None:
    m = _LINEAR.fullmatch(prefix)
    if not m:
        return None
    if prefix == "lm_head":
        return ("lm_head", "kernel"), None
    layer, module, proj = m.groups()
    return ("layers", _MODULE[module], f"{proj}_proj", "kernel"), int(layer)


def load_quantized_folder(folder: Path, cfg: ModelConfig, read_linear: LinearReader,
                          describe: str) -> tuple[dict, list[str]]:
    """-> (parameter tree of numpy leaves, log lines: the format and each kernel's form)."""
    files = safetensors_files(folder)
    getters: dict[str, Callable[[], np.ndarray]] = {}
    opened = []
    for file in files:
        handle = safe_open(file, "numpy")
        opened.append(handle)
        for name in handle.keys():
            if name in getters:
                raise WeightsError(f"tensor {name!r} appears in two files")
            getters[name] = (lambda h, n: lambda: h.get_tensor(n))(handle, name)
    by_module: dict[str, dict[str, Callable]] = defaultdict(dict)
    rest = []
    for name, get in getters.items():
        prefix, _, suffix = name.rpartition(".")
        if linear_path(prefix) is not None:
            by_module[prefix][suffix] = get
        else:
            rest.append(name)
    filler = ParamFiller(cfg)
    forms: dict[str, set[str]] = defaultdict(set)
    for prefix, tensors in sorted(by_module.items()):
        path, layer = linear_path(prefix)
        value = read_linear(tensors, prefix)
        if value is None:
            unknown = sorted(set(tensors) - {"weight", "bias"})
            if unknown:
                raise WeightsError(f"{prefix}: tensors {unknown} are not part of a plain "
                                   f"{describe} layer")
            if "weight" not in tensors:
                raise WeightsError(f"{prefix} has neither quantized tensors nor a weight")
            value = tensors["weight"]().T
        filler.set(path, layer, value, prefix)
        forms[path[-2] if layer is not None else path[0]].add(form(value))
        if "bias" in tensors:
            filler.set(path[:-1] + ("bias",), layer, tensors["bias"](), prefix + ".bias")
    for name in rest:
        target = _target(name, cfg)
        if target is None:
            if _IGNORED.match(name):
                continue
            raise WeightsError(f"unexpected tensor {name!r} in a {describe} checkpoint")
        path, layer, transpose = target
        value = getters[name]()
        filler.set(path, layer, value.T if transpose else value, name)
    params = filler.finish()
    log = [f"checkpoint format: {describe}"]
    log += [f"  {kind}: {', '.join(sorted(f))}" for kind, f in sorted(forms.items())]
    log += [f"  {note}" for note in filler.notes]
    del opened
    return params, log
