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

from model import latent_weights, linear_weights, mamba_weights
from model.config import ModelConfig
from model.transformer import abstract_params
from model.vlm_text import text_tensor

# (HF name pattern, parameter path, transpose). "{}" in a path takes the pattern's last group;
# a pattern with an `experts.E.` part fills expert E's slot of a kernel [E, in, out].
_LAYER = r"model\.layers\.(\d+)\."
_EXPERT = r"experts\.(\d+)\."
_MOE = ("layers", "moe")
EXPERT_KERNELS = ("gate_proj", "up_proj", "down_proj")  # of "moe": one slot per expert
HF_TABLE = [
    (r"model\.embed_tokens\.weight", ("embed",), False),
    (r"model\.norm\.weight", ("final_norm", "scale"), False),
    (r"lm_head\.weight", ("lm_head", "kernel"), True),
    (_LAYER + r"input_layernorm\.weight", ("layers", "input_norm", "scale"), False),
    (_LAYER + r"post_attention_layernorm\.weight", ("layers", "post_norm", "scale"), False),
    # Gemma's sandwich norms around the MLP
    (_LAYER + r"pre_feedforward_layernorm\.weight", ("layers", "pre_mlp_norm", "scale"), False),
    (_LAYER + r"post_feedforward_layernorm\.weight", ("layers", "post_mlp_norm", "scale"),
     False),
    (_LAYER + r"self_attn\.([qkvo])_proj\.weight", ("layers", "attn", "{}_proj", "kernel"), True),
    (_LAYER + r"self_attn\.([qkvo])_proj\.bias", ("layers", "attn", "{}_proj", "bias"), False),
    (_LAYER + r"self_attn\.([qk])_norm\.weight", ("layers", "attn", "{}_norm", "scale"), False),
    (_LAYER + r"mlp\.(gate|up|down)_proj\.weight", ("layers", "mlp", "{}_proj", "kernel"), True),
    (_LAYER + r"mlp\.(gate|up|down)_proj\.bias", ("layers", "mlp", "{}_proj", "bias"), False),
    # Mixtral: w1 gate, w3 up, w2 down
    (_LAYER + r"block_sparse_moe\.gate\.weight", (*_MOE, "router", "kernel"), True),
    (_LAYER + r"block_sparse_moe\." + _EXPERT + r"w1\.weight", (*_MOE, "gate_proj", "kernel"),
     True),
    (_LAYER + r"block_sparse_moe\." + _EXPERT + r"w3\.weight", (*_MOE, "up_proj", "kernel"),
     True),
    (_LAYER + r"block_sparse_moe\." + _EXPERT + r"w2\.weight", (*_MOE, "down_proj", "kernel"),
     True),
    # Qwen2-MoE, Qwen3-MoE, OLMoE
    (_LAYER + r"mlp\.gate\.weight", (*_MOE, "router", "kernel"), True),
    (_LAYER + r"mlp\." + _EXPERT + r"(gate|up|down)_proj\.weight", (*_MOE, "{}_proj", "kernel"),
     True),
    (_LAYER + r"mlp\.shared_expert\.(gate|up|down)_proj\.weight",
     (*_MOE, "shared_expert", "{}_proj", "kernel"), True),
    (_LAYER + r"mlp\.shared_expert_gate\.weight", (*_MOE, "shared_expert_gate", "kernel"), True),
    # gpt-oss: sinks, a router with a bias, every expert's weights in one tensor [E, in, out]
    (_LAYER + r"self_attn\.sinks", ("layers", "attn", "sinks"), False),
    (_LAYER + r"mlp\.router\.weight", (*_MOE, "router", "kernel"), True),
    (_LAYER + r"mlp\.router\.bias", (*_MOE, "router", "bias"), False),
    (_LAYER + r"mlp\.experts\.down_proj", (*_MOE, "down_proj", "kernel"), False),
    (_LAYER + r"mlp\.experts\.down_proj_bias", (*_MOE, "down_proj", "bias"), False),
    # DeepSeek's latent attention, expert bias and shared experts
    *latent_weights.TABLE,
    # Gated DeltaNet mixers (Qwen3-Next, Qwen3.5)
    *linear_weights.TABLE,
    # Mamba2 mixers (Nemotron-H, its names made canonical first)
    *mamba_weights.TABLE,
]
# gpt-oss's gate and up projections interleaved on the last axis (gate first): tensor ->
# (gate's path, up's path).
INTERLEAVED = [
    (_LAYER + r"mlp\.experts\.gate_up_proj", "kernel"),
    (_LAYER + r"mlp\.experts\.gate_up_proj_bias", "bias"),
]
# Qwen3-Next's and Qwen3.5's next-token prediction layers (mtp.*), which transformers
# ignores too.
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$|mtp\..*")


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


def _locate_interleaved(name: str):
    """-> (layer, [(path, slice of the last axis)] for gate and up), or None."""
    for pattern, leaf in INTERLEAVED:
        m = re.fullmatch(pattern, name)
        if m:
            return int(m.group(1)), [((*_MOE, f"{p}_proj", leaf), slice(i, None, 2))
                                     for i, p in enumerate(("gate", "up"))]
    return None


def _locate(name: str):
    """HF tensor name -> (path, layer or None, expert or None, transpose), or None if not
    ours."""
    for pattern, path, transpose in HF_TABLE:
        m = re.fullmatch(pattern, name)
        if m:
            groups = m.groups()
            layer = int(groups[0]) if pattern.startswith(_LAYER) else None
            expert = int(groups[1]) if _EXPERT in pattern else None
            path = tuple(p.format(groups[-1]) if "{}" in p else p for p in path)
            return path, layer, expert, transpose
    return None


def _target(name: str, cfg: ModelConfig):
    """HF tensor name -> (path, layer or None, transpose), or None if not ours: for the
    quantized formats, which read no per-expert tensors."""
    found = _locate(name)
    if found is None:
        return None
    path, layer, expert, transpose = found
    if expert is not None:
        raise WeightsError(f"tensor {name!r}: experts are read from float safetensors only")
    return path, layer, transpose


def _get(tree, path):
    for p in path:
        tree = tree[p]
    return tree


def _slot(params, path, layer, expert, name: str):
    """-> (the array a tensor goes into, its index there): a layer's slot of a stacked array
    or the layer's own array, then the expert's slot."""
    tree, index = params, ()
    if layer is not None:
        stacked = not isinstance(params["layers"], list)
        count = _get(params, path).shape[0] if stacked else len(params["layers"])
        if layer >= count:
            raise WeightsError(f"tensor {name!r}: layer {layer} but the config has "
                               f"{count} layers")
        if stacked:
            index = (layer,)
        else:
            tree, path = params["layers"][layer], path[1:]
    dest = _get(tree, path)
    if expert is not None:
        if expert >= dest.shape[len(index)]:
            raise WeightsError(f"tensor {name!r}: expert {expert} but the config has "
                               f"{dest.shape[len(index)]} experts")
        index += (expert,)
    return dest, index


def load_hf_params(hf_dir: str | Path, cfg: ModelConfig, progress: bool = True) -> dict:
    """Reads every tensor of an HF folder into a numpy parameter tree of dtype cfg.dtype
    (layers stacked, or a list of per-layer trees where layers differ)."""
    hf_dir = Path(hf_dir)
    abstract = abstract_params(cfg)
    dtype = np_dtype(cfg.dtype)
    # each weight in its declared dtype: the model's, or float32 where a family keeps one so
    # (DeepSeek's router)
    params = jax.tree.map(lambda a: np.empty(a.shape, np_dtype(str(a.dtype))), abstract)
    wanted, filled = set(_expected(abstract, cfg)), set()
    files = safetensors_files(hf_dir)
    # a vision-language checkpoint's language model alone, under the text model's names
    stored, names = {}, []
    for f in files:
        for n in _keys(f):
            if (text := text_tensor(n)) is not None:
                if cfg.blocks or "hybrid" in cfg.mixers:
                    text = mamba_weights.canonical(text)
                stored[text] = n
                names.append((f, text))
    bar = tqdm(names, desc="loading weights", unit="tensor", disable=not progress, leave=False)
    opened = {}
    where = {n: f for f, n in names}
    read = lambda n: _open(opened, where[n]).get_tensor(stored[n])
    mxfp4 = _quant_method(hf_dir) == "mxfp4"
    for file, name in bar:
        if mxfp4 and name.endswith(MXFP4_SCALES) and name[:-len(MXFP4_SCALES)] + \
                MXFP4_BLOCKS in where:
            continue  # read with its blocks
        packed = mxfp4 and name.endswith(MXFP4_BLOCKS)
        if packed:
            name = name[:-len(MXFP4_BLOCKS)]
        if latent_weights.is_mtp_layer(name, cfg):
            continue  # next-token prediction layers: not the main model's
        several = _several(name, read, cfg)
        if several is not None:
            for path, part, transpose in several[1]:
                _store(params, path, several[0], None, part, dtype, name, cfg, transpose)
                filled.update(_filled(path, several[0], None, cfg))
            continue
        split = _locate_interleaved(name)
        target = _locate(name)
        if target is None and split is None:
            if not _IGNORED.match(name):
                raise WeightsError(f"unexpected tensor {name!r} in {file.name}")
            continue
        if target is not None and target[0][0] == "lm_head" and cfg.tie_word_embeddings:
            continue  # a tied checkpoint may still store the (identical) head
        value = _read_mxfp4(name, where, read) if packed else read(name)
        value = latent_weights.deinterleave_rope(name, value, cfg)
        if split is None:
            path, layer, expert, transpose = target
            parts = [(path, value.T if transpose else value, transpose)]
        else:
            layer, expert = split[0], None
            parts = [(path, value[..., cut], False) for path, cut in split[1]]
        for path, part, transpose in parts:
            _store(params, path, layer, expert, part, dtype, name, cfg, transpose)
            filled.update(_filled(path, layer, expert, cfg))
    missing = wanted - filled
    if missing:
        described = _describe(missing)
        raise WeightsError("missing tensor(s): " + ", ".join(described[:5])
                           + (f" and {len(described) - 5} more" if len(described) > 5 else ""))
    return params


def _several(name: str, read, cfg: ModelConfig):
    """A tensor stored as several of our parameters, or as one of another shape (DeepSeek's
    kv_b_proj, Qwen3-Next's fused projections, a Gated DeltaNet conv) -> (layer,
    [(path, array, transpose)]); None for the others. read: name -> the tensor, called only
    for those."""
    if cfg.latent and latent_weights.KV_B.fullmatch(name):
        return latent_weights.split_kv_b(name, read(name), cfg)
    if cfg.mixers:
        return linear_weights.split(name, read, cfg) or mamba_weights.split(name, read, cfg)
    return None


MXFP4_BLOCKS, MXFP4_SCALES = "_blocks", "_scales"


def _quant_method(hf_dir: Path) -> str | None:
    config = hf_dir / "config.json"
    qc = json.loads(config.read_text()).get("quantization_config") if config.is_file() else None
    return qc.get("quant_method") if isinstance(qc, dict) else None


def _open(opened: dict, file: Path):
    if file not in opened:
        opened[file] = safe_open(file, "numpy")
    return opened[file]


def _read_mxfp4(name: str, where: dict, read):
    """An MXFP4 tensor's blocks and scales -> float32[E, in, out] (model/formats/mxfp4.py)."""
    from model.formats import mxfp4
    if name + MXFP4_SCALES not in where:
        raise WeightsError(f"tensor {name + MXFP4_BLOCKS!r} has no {name + MXFP4_SCALES!r}")
    try:
        return mxfp4.dequantize(read(name + MXFP4_BLOCKS), read(name + MXFP4_SCALES))
    except ValueError as e:
        raise WeightsError(f"tensor {name!r}: {e}") from None


def _store(params, path, layer, expert, value, dtype, name: str, cfg: ModelConfig,
           transpose: bool) -> None:
    try:
        dest, index = _slot(params, path, layer, expert, name)
    except (KeyError, IndexError):
        raise WeightsError(f"tensor {name!r} does not belong in a {cfg.architecture} "
                           "with this config") from None
    want = dest.shape[len(index):]
    if value.shape != want:
        raise WeightsError(f"tensor {name!r} has shape {tuple(value.shape)}, expected "
                           f"{tuple(want)}" + (" (transposed)" if transpose else ""))
    dest[index] = value.astype(dest.dtype)


def _filled(path, layer, expert, cfg: ModelConfig):
    """What a tensor filled, as _expected names it: one tensor holding every expert's
    kernel fills each expert's slot."""
    if expert is None and path[:2] == _MOE and path[2] in EXPERT_KERNELS:
        return [(path, layer, e) for e in range(cfg.num_experts)]
    return [(path, layer, expert)]


def _expected(abstract, cfg: ModelConfig):
    """(path, layer, expert) of every tensor the model declares; a path names a layer's
    weight as the stacked tree does, whatever the form."""
    layers = abstract["layers"]
    per_layer = (enumerate(layers) if isinstance(layers, list)
                 else ((i, layers) for i in range(cfg.num_layers)))
    for path, _ in _leaves({k: v for k, v in abstract.items() if k != "layers"}):
        yield path, None, None
    for i, tree in per_layer:
        for path, _ in _leaves(tree):
            path = ("layers", *path)
            if path[:2] == _MOE and path[2] in EXPERT_KERNELS:
                yield from ((path, i, e) for e in range(cfg.num_experts))
            else:
                yield path, i, None


def _leaves(tree, prefix=()):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, prefix + (k,))
    else:
        yield prefix, tree


def _keys(file: Path) -> list[str]:
    with safe_open(file, "numpy") as f:
        return list(f.keys())


def _describe(missing) -> list[str]:
    """One entry per weight: its path, and the layers and experts it lacks."""
    by_path: dict[tuple, list] = {}
    for path, layer, expert in missing:
        by_path.setdefault(path, []).append((layer, expert))
    out = []
    for path, where in sorted(by_path.items()):
        name = "/".join(path)
        layers = sorted({l for l, _ in where if l is not None})
        experts = sorted({e for _, e in where if e is not None})
        if layers:
            name += f" (layers {layers[:4]}" + (f", experts {experts[:4]})" if experts else ")")
        out.append(name)
    return out
