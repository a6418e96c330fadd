"""Mamba2 hybrids' tensors as our decoder takes them. Nemotron-H's names
(`backbone.layers.N.mixer.*`, one mixer a block) are renamed onto the common ones
(attention's `self_attn.*`, the MLP's `mlp.*`, the block's norm as `input_layernorm`); the
Mamba2 mixer's tensors (Nemotron-H's `mixer.*`, Granite 4.0-H's `mamba.*`) go onto
model/linear_attention/mamba2.py's parameters, the conv's [C, 1, K] weight as [K, C].
Granite's experts come fused (`input_linear`: every expert's gate rows then up rows) and its
shared MLP likewise; they are cut apart here. Data for model/hf_weights.py."""
from __future__ import annotations

import re

import numpy as np

_LAYER = r"model\.layers\.(\d+)\."
_M = _LAYER + r"(?:mixer|mamba)\."
_MIXER = ("layers", "mamba")
# (HF name pattern, parameter path, transpose), as hf_weights.HF_TABLE, after `canonical`
TABLE = [
    (_M + r"(in|out)_proj\.weight", (*_MIXER, "{}_proj", "kernel"), True),
    (_M + r"(in|out)_proj\.bias", (*_MIXER, "{}_proj", "bias"), False),
    (_M + r"conv1d\.bias", (*_MIXER, "conv_bias"), False),
    (_M + r"(dt_bias|A_log|D)", (*_MIXER, "{}"), False),
    (_M + r"norm\.weight", (*_MIXER, "norm_weight"), False),
    (_LAYER + r"block_sparse_moe\.router\.layer\.weight", ("layers", "moe", "router", "kernel"),
     True),
    # Nemotron-H's latent experts' projections in and out (after `canonical`)
    (_LAYER + r"mlp\.fc1_latent_proj\.weight", ("layers", "moe", "latent_in", "kernel"), True),
    (_LAYER + r"mlp\.fc1_latent_proj\.bias", ("layers", "moe", "latent_in", "bias"), False),
    (_LAYER + r"mlp\.fc2_latent_proj\.weight", ("layers", "moe", "latent_out", "kernel"), True),
    (_LAYER + r"mlp\.fc2_latent_proj\.bias", ("layers", "moe", "latent_out", "bias"), False),
]
_RENAMES = [
    (re.compile(r"^backbone\."), "model."),
    (re.compile(r"^model\.embeddings\."), "model.embed_tokens."),
    (re.compile(r"^model\.norm_f\."), "model.norm."),
    (re.compile(r"^(model\.layers\.\d+\.)norm\."), r"\1input_layernorm."),
    (re.compile(r"^(model\.layers\.\d+\.)mixer\.([qkvo]_proj\.)"), r"\1self_attn.\2"),
    (re.compile(r"^(model\.layers\.\d+\.)mixer\.((up|down)_proj\.)"), r"\1mlp.\2"),
    # Falcon-H1's MLP and norms
    (re.compile(r"^(model\.layers\.\d+\.)feed_forward\."), r"\1mlp."),
    (re.compile(r"^(model\.layers\.\d+\.)pre_ff_layernorm\."), r"\1post_attention_layernorm."),
    (re.compile(r"^model\.final_layernorm\."), "model.norm."),
    # a block of experts: the router, its bias, each expert and the shared expert
    (re.compile(r"^(model\.layers\.\d+\.)mixer\.(gate|experts|shared_experts|"
                r"fc[12]_latent_proj)\."), r"\1mlp.\2."),
]
_CONV = re.compile(_M + r"conv1d\.weight")
_EXPERTS = re.compile(_LAYER + r"block_sparse_moe\.(input|output)_linear\.weight")
_SHARED = re.compile(_LAYER + r"shared_mlp\.(input|output)_linear\.weight")


def canonical(name: str) -> str:
    """A Nemotron-H tensor's name -> the name hf_weights' tables read."""
    for pattern, repl in _RENAMES:
        name = pattern.sub(repl, name)
    return name


def split(name: str, read, cfg):
    """-> (layer, [(path, array, transpose)]) for the tensors that are not one parameter as
    stored, or None for another tensor. read: name -> the tensor."""
    m = _CONV.fullmatch(name)
    if m is not None:
        w = np.asarray(read(name))
        return int(m.group(1)), [((*_MIXER, "conv_weight"),
                                  w.reshape(w.shape[0], w.shape[-1]).T, False)]
    for pattern, parts in ((_EXPERTS, _experts), (_SHARED, _shared)):
        m = pattern.fullmatch(name)
        if m is not None:
            return int(m.group(1)), parts(m.group(2), np.asarray(read(name)), cfg)
    return None


def _experts(which: str, w, cfg):
    """input_linear [E, 2I, H] -> gate and up [E, H, I]; output_linear [E, H, I] -> down
    [E, I, H]."""
    path = lambda p: ("layers", "moe", f"{p}_proj", "kernel")
    if which == "output":
        return [(path("down"), w.transpose(0, 2, 1), True)]
    gate, up = np.split(w, 2, axis=1)
    return [(path("gate"), gate.transpose(0, 2, 1), True),
            (path("up"), up.transpose(0, 2, 1), True)]


def _shared(which: str, w, cfg):
    """The shared MLP: the MoE's shared expert, or the dense MLP where there are no experts;
    input_linear [2S, H] is the gate's rows then up's."""
    where = ("layers", "moe", "shared_expert") if cfg.num_experts else ("layers", "mlp")
    if which == "output":
        return [((*where, "down_proj", "kernel"), w.T, True)]
    gate, up = np.split(w, 2, axis=0)
    return [((*where, "gate_proj", "kernel"), gate.T, True),
            ((*where, "up_proj", "kernel"), up.T, True)]
