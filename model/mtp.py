"""Multi-token prediction (DeepSeek-V3 / R1 / V3.1, GLM-4.5): the checkpoint's next-n layer,
stored after the main stack (`model.layers.{N}.*`), as a drafter.

At position i, with h_i the main model's final-normed hidden state and t_{i+1} the token that
follows i, the layer computes (transformers' MtpLayer)

    h'_i = Block(eh_proj([enorm(embed(t_{i+1})) ; hnorm(h_i)])),
    logits = head(head_norm(h'_i)),

its guess for t_{i+2}. Block is one decoder layer of the model's own kind (latent attention
and a mixture of experts) with a cache of its own; the embedding and the head are the main
model's. Positions are i's: rotary embeddings are relative, so the scores are those of
transformers' shifted positions.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from model import hf_weights, latent_weights
from model.batch import Batch
from model.config import ModelConfig
from model.kv_cache import KVCache
from model.layers import Linear, embed, norm
from model.runtime_params import prepare_params
from model.transformer import DecoderLayer, compute_logits, final_norm

# The layer's own tensors (besides its decoder block); shared_head.head and embed_tokens are
# copies of the main model's head and embedding.
_OWN = {"enorm.weight": ("enorm", "scale"), "hnorm.weight": ("hnorm", "scale"),
        "shared_head.norm.weight": ("head_norm", "scale")}
_SHARED = ("shared_head.head.weight", "embed_tokens.weight")


def mtp_config(cfg: ModelConfig) -> ModelConfig:
    """The next-n layer as a one-layer model of the main model's last layer kind."""
    return replace(cfg, num_layers=1, moe_layers=cfg.moe_layers[-1:] if cfg.moe_layers else (),
                   sliding_windows=(), num_mtp_layers=0)


class MtpBlock(nn.Module):
    cfg: ModelConfig  # mtp_config's
    backend: str

    @nn.compact
    def __call__(self, embeds, hidden, cache: KVCache, batch: Batch):
        """embeds, hidden [T, hidden_size] -> (h' [T, hidden_size], cache)."""
        cfg = self.cfg
        x = jnp.concatenate([norm(cfg, "enorm")(embeds), norm(cfg, "hnorm")(hidden)], axis=-1)
        x = Linear(cfg.hidden_size, False, cfg.dtype, name="eh_proj")(x)
        return DecoderLayer(cfg, self.backend, name="layer")(x, cache, 0, jnp.int32(0), batch, 0)


def mtp_hidden(params, mtp, cache: KVCache, batch: Batch, hidden, next_ids, cfg: ModelConfig,
               backend: str = "reference"):
    """The main model's step hidden states [T, hidden_size] (before its final norm) and each
    token's next token int32[T] -> (h' [T, hidden_size], the layer's cache)."""
    return mtp_apply(params, mtp, cache, batch, final_norm(params, hidden, cfg), next_ids, cfg,
                     backend)


def mtp_apply(params, mtp, cache: KVCache, batch: Batch, normed, next_ids, cfg: ModelConfig,
              backend: str = "reference"):
    """The layer over normed states [T, hidden_size]: the main model's after its final norm,
    or, chained, the layer's own output after its head norm (mtp_chain_state)."""
    e = embed(params["embed"], next_ids, cfg.dtype)
    variables = {"params": {k: v for k, v in mtp.items() if k != "head_norm"}}
    return MtpBlock(mtp_config(cfg), backend).apply(variables, e, normed, cache, batch)


def mtp_chain_state(mtp, rows, cfg: ModelConfig):
    """h' rows -> the state a chained step starts from: the rows after the layer's head
    norm, as transformers' MtpLayer passes its post-normed output to the next depth."""
    return final_norm({"final_norm": mtp["head_norm"]}, rows, cfg)


def mtp_logits(params, mtp, rows, cfg: ModelConfig):
    """h' rows [N, hidden_size] -> float32[N, V] through the layer's norm and the main head."""
    return compute_logits({**params, "final_norm": mtp["head_norm"]}, rows, cfg)


def abstract_mtp(cfg: ModelConfig):
    mcfg = mtp_config(cfg)
    T = 1
    batch = Batch(*(jnp.zeros((T,), jnp.int32) for _ in range(4)),
                  jnp.zeros((1, 1), jnp.int32), jnp.zeros((1,), jnp.int32))
    x = jnp.zeros((T, cfg.hidden_size), cfg.dtype)

    def init():
        params = MtpBlock(mcfg, "reference").init(jax.random.PRNGKey(0), x, x,
                                                  KVCache.zeros(mcfg, 1, 1), batch)["params"]
        return {**params, "head_norm": {"scale": jnp.ones((cfg.hidden_size,), cfg.dtype)}}
    return jax.eval_shape(init)


def prepare_mtp(mtp) -> dict:
    """The stored layer as a step wants it (model/runtime_params.py), its own norms beside."""
    tree = {"layers": [mtp["layer"]], "eh_proj": mtp["eh_proj"], "lm_head": None}
    ready = prepare_params(tree)
    return {**mtp, "layer": ready["layers"][0], "eh_proj": ready["eh_proj"]}


class MtpWeightsError(ValueError):
    pass


def load_mtp_params(hf_dir: str | Path, cfg: ModelConfig) -> dict:
    """The first next-n layer's tensors (`model.layers.{num_layers}.*`) of a Hugging Face
    folder -> a numpy tree of abstract_mtp's shape, transformed as the main layers are
    (rope rows, kv_b_proj split, experts)."""
    hf_dir = Path(hf_dir)
    abstract = abstract_mtp(cfg)
    tree = {"layers": [abstract["layer"]], **{k: v for k, v in abstract.items()
                                               if k != "layer"}}
    params = jax.tree.map(lambda a: np.empty(a.shape, hf_weights.np_dtype(str(a.dtype))), tree)
    prefix = f"model.layers.{cfg.num_layers}."
    try:
        files = hf_weights.safetensors_files(hf_dir)
    except hf_weights.WeightsError:
        files = []  # a converted checkpoint keeps the main layers alone
    from model.formats.quantized_folder import file_tensors  # reads fp8 tensors too
    found = {n: get for f in files for n, get in file_tensors(f).items()
             if n.startswith(prefix)}
    if not found:
        raise MtpWeightsError(f"{hf_dir} holds no next-n prediction layer ({prefix}*): "
                              "speculative method mtp needs the checkpoint's MTP weights (a "
                              "converted checkpoint keeps the main layers alone: serve the "
                              "Hugging Face folder)")
    block = _fp8_block(hf_dir)
    filled = set()
    mcfg = replace(cfg, num_layers=cfg.num_layers + 1)  # the stored layer index, for rope rows
    for name, get in found.items():
        rest = name[len(prefix):]
        if rest in _SHARED or rest.endswith(_SCALE):
            continue
        value = get()
        if name + _SCALE in found:  # fp8 with block scales: the layer is kept in float
            value = _dequantize_blocks(value, found[name + _SCALE](), block)
        main_name = "model.layers.0." + rest
        value = latent_weights.deinterleave_rope(main_name, value, mcfg)
        if rest in _OWN:
            params[_OWN[rest][0]][_OWN[rest][1]][...] = value
            filled.add(_OWN[rest])
            continue
        if rest == "eh_proj.weight":
            params["eh_proj"]["kernel"][...] = value.T
            filled.add(("eh_proj",))
            continue
        kv_b = latent_weights.split_kv_b(main_name, value, cfg) if cfg.latent else None
        parts = kv_b[1] if kv_b else None
        if parts is None:
            found_at = hf_weights._locate(main_name)
            if found_at is None:
                raise MtpWeightsError(f"unexpected tensor {name!r} in {hf_dir}")
            path, _, expert, transpose = found_at
            parts = [(path, value.T if transpose else value, transpose)]
        else:
            expert = None
        for path, part, transpose in parts:
            hf_weights._store(params, path, 0, expert, part, None, name, mcfg, transpose)
            filled.add(path)
    missing = [k for k in (*_OWN.values(),) if k not in filled] + \
        ([] if ("eh_proj",) in filled else ["eh_proj"])
    if missing:
        raise MtpWeightsError(f"{hf_dir}: the next-n layer lacks {missing}")
    layer = params.pop("layers")[0]
    return {**params, "layer": layer}


_SCALE = "_scale_inv"


def _fp8_block(hf_dir: Path) -> tuple[int, int]:
    import json
    config = json.loads((hf_dir / "config.json").read_text())
    qc = config.get("quantization_config") or {}
    return tuple(qc.get("weight_block_size") or (128, 128))


def _dequantize_blocks(values, scales, block: tuple[int, int]):
    """fp8 [out, in] with float32 scales per [bn, bk] block -> float32, as the format's
    own dequantization computes it."""
    bn, bk = block
    out, inn = values.shape
    full = np.repeat(np.repeat(np.asarray(scales, np.float32), bn, 0), bk, 1)[:out, :inn]
    return np.asarray(values).astype(np.float32) * full


def is_mtp_method(method: str) -> bool:
    return method in ("mtp", "deepseek_mtp")
