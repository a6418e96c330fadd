"""Nemotron-H's tensors as our decoder takes them: the checkpoint's names
(`backbone.layers.N.mixer.*`, one mixer a block) renamed onto the common ones (attention's
`self_attn.*`, the MLP's `mlp.*`, the block's norm as `input_layernorm`), and the Mamba2
mixer's tensors onto model/linear_attention/mamba2.py's parameters, the conv's [C, 1, K]
weight as [K, C]. Data for model/hf_weights.py."""
from __future__ import annotations

import re

import numpy as np

_LAYER = r"model\.layers\.(\d+)\."
_MIXER = ("layers", "mamba")
# (HF name pattern, parameter path, transpose), as hf_weights.HF_TABLE, after `canonical`
TABLE = [
    (_LAYER + r"mixer\.(in|out)_proj\.weight", (*_MIXER, "{}_proj", "kernel"), True),
    (_LAYER + r"mixer\.(in|out)_proj\.bias", (*_MIXER, "{}_proj", "bias"), False),
    (_LAYER + r"mixer\.conv1d\.bias", (*_MIXER, "conv_bias"), False),
    (_LAYER + r"mixer\.(dt_bias|A_log|D)", (*_MIXER, "{}"), False),
    (_LAYER + r"mixer\.norm\.weight", (*_MIXER, "norm_weight"), False),
]
_RENAMES = [
    (re.compile(r"^backbone\."), "model."),
    (re.compile(r"^model\.embeddings\."), "model.embed_tokens."),
    (re.compile(r"^model\.norm_f\."), "model.norm."),
    (re.compile(r"^(model\.layers\.\d+\.)norm\."), r"\1input_layernorm."),
    (re.compile(r"^(model\.layers\.\d+\.)mixer\.([qkvo]_proj\.)"), r"\1self_attn.\2"),
    (re.compile(r"^(model\.layers\.\d+\.)mixer\.((up|down)_proj\.)"), r"\1mlp.\2"),
]
_CONV = re.compile(_LAYER + r"mixer\.conv1d\.weight")


def canonical(name: str) -> str:
    """A Nemotron-H tensor's name -> the name hf_weights' tables read."""
    for pattern, repl in _RENAMES:
        name = pattern.sub(repl, name)
    return name


def split(name: str, read):
    """-> (layer, [(path, array, transpose)]) for the conv weight, or None for another
    tensor. read: name -> the tensor."""
    m = _CONV.fullmatch(name)
    if m is None:
        return None
    w = np.asarray(read(name))
    return int(m.group(1)), [((*_MIXER, "conv_weight"), w.reshape(w.shape[0], w.shape[-1]).T,
                              False)]
