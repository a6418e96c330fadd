"""Reading Hugging Face safetensors into our parameter tree, tensor by tensor.

One table maps HF names to parameter paths; each tensor is checked against the shape the model
declares (from `jax.eval_shape` of its init) and written into a preallocated array, so the model
is never held twice in memory.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
from safetensors import safe_open
from tqdm import tqdm

from model.config import ModelConfig
from model.transformer import abstract_params

# (HF name pattern, parameter path, transpose). "{}" in a path takes the pattern's last group.
_LAYER = r"model\.layers\.(\d+)\."
HF_TABLE = [
    (r"model\.embed_tokens\.weight", ("embed",), False),
    (r"model\.norm\.weight", ("final_norm", "scale"), False),
    (r"lm_head\.weight", ("lm_head", "kernel"), True),
    (_LAYER + r"input_layernorm\.weight", ("layers", "input_norm", "scale"), False),
    (_LAYER + r"post_attention_layernorm\.weight", ("layers", "post_norm", "scale"), False),
    (_LAYER + r"self_attn\.([qkvo])_proj\.weight", ("layers", "attn", "{}_proj", "kernel"), True),
    (_LAYER + r"self_attn\.([qkvo])_proj\.bias", ("layers", "attn", "{}_proj", "bias"), False),
    (_LAYER + r"self_attn\.([qk])_norm\.weight", ("layers", "attn", "{}_norm", "scale"), False),
    (_LAYER + r"mlp\.(gate|up|down)_proj\.weight", ("layers", "mlp", "{}_proj", "kernel"), True),
    (_LAYER + r"mlp\.(gate|up|down)_proj\.bias", ("layers", "mlp", "{}_proj", "bias"), False),
]
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


class WeightsError(ValueError):
    pass


def np_dtype(name: str):
    return ml_dtypes.bfloat16 if name == "bfloat16" else np.dtype(name)


def safetensors_files(hf_dir: Path) -> list[Path]:
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [hf_dir / n for n in names]
    else:
        files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"no *.safetensors files in {hf_dir}")
    for f in files:
        if not f.is_file():
            raise WeightsError(f"missing weight file {f}")
    return files


def _target(name: str, cfg: ModelConfig):
    """HF tensor name -> (path, layer or None, transpose), or None if not ours."""
    for pattern, path, transpose in HF_TABLE:
        m = re.fullmatch(pattern, name)
        if m:
            groups = m.groups()
            layer = int(groups[0]) if pattern.startswith(_LAYER) else None
            path = tuple(p.format(groups[-1]) if "{}" in p else p for p in path)
            return path, layer, transpose
    return None


def _get(tree, path):
    for p in path:
        tree = tree[p]
    return tree


def load_hf_params(hf_dir: str | Path, cfg: ModelConfig, progress: bool = True) -> dict:
    """Reads every tensor of an HF folder into a numpy parameter tree of dtype cfg.dtype."""
    hf_dir = Path(hf_dir)
    abstract = abstract_params(cfg)
    dtype = np_dtype(cfg.dtype)
    params = jax.tree.map(lambda a: np.empty(a.shape, dtype), abstract)
    filled = jax.tree_util.tree_map_with_path(
        lambda path, a: np.zeros(a.shape[0] if path[0].key == "layers" else 1, bool), abstract)
    files = safetensors_files(hf_dir)
    names = [(f, n) for f in files for n in _keys(f)]
    bar = tqdm(names, desc="loading weights", unit="tensor", disable=not progress, leave=False)
    opened = {}
    for file, name in bar:
        target = _target(name, cfg)
        if target is None:
            if not _IGNORED.match(name):
                raise WeightsError(f"unexpected tensor {name!r} in {file.name}")
            continue
        path, layer, transpose = target
        if path[0] == "lm_head" and cfg.tie_word_embeddings:
            continue  # a tied checkpoint may still store the (identical) head
        try:
            dest = _get(params, path)
        except KeyError:
            raise WeightsError(f"tensor {name!r} does not belong in a {cfg.architecture} "
                               "with this config") from None
        if file not in opened:
            opened[file] = safe_open(file, "numpy")
        value = opened[file].get_tensor(name)
        value = value.T if transpose else value
        want = dest.shape[1:] if layer is not None else dest.shape
        if layer is not None and layer >= dest.shape[0]:
            raise WeightsError(f"tensor {name!r}: layer {layer} but the config has "
                               f"{dest.shape[0]} layers")
        if value.shape != want:
            raise WeightsError(f"tensor {name!r} has shape {tuple(value.shape)}, expected "
                               f"{tuple(want)}" + (" (transposed)" if transpose else ""))
        if layer is None:
            dest[...] = value.astype(dtype)
        else:
            dest[layer] = value.astype(dtype)
        _get(filled, path)[layer or 0] = True
    missing = [_describe(path, done) for path, done in
               jax.tree_util.tree_flatten_with_path(filled)[0] if not done.all()]
    if missing:
        raise WeightsError("missing tensor(s): " + ", ".join(missing[:5])
                           + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    return params


def _keys(file: Path) -> list[str]:
    with safe_open(file, "numpy") as f:
        return list(f.keys())


def _describe(path, done) -> str:
    name = "/".join(str(getattr(p, "key", p)) for p in path)
    if done.size > 1:
        name += f" (layers {np.flatnonzero(~done).tolist()[:4]})"
    return name
