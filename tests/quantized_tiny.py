"""Tiny pre-quantized Hugging Face folders written from tiny transformers models, laid out as
the tools that make them lay them out: compressed-tensors by the compressed-tensors package's
own quantization parameters and compressors, GPTQ (v1 / v2, act-order) and AWQ GEMM by
round-to-nearest and numpy packing, fp8 with block scales through ml_dtypes (also from a saved
float folder, a mixture's experts included, as DeepSeek-V3 lays them out).

    folder, expected = write_gptq(model, tmp / "gptq", bits=4, group_size=32)

`expected` maps each quantized weight's Hugging Face name to the float32 values the format
dequantizes to ([out, in], as transformers holds it): for GPTQ and AWQ from the codes, scales
and zero points before they were packed, for compressed-tensors from the package's own
decompressor (its float32 arithmetic), for fp8 from the fp8 values times their block's scale.
None of it goes through model/formats.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import ml_dtypes
import numpy as np
import torch
from safetensors.torch import save_file

LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.[a-z]+_proj\.weight")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the output each successive 4-bit field holds


def linear_weights(model) -> dict[str, np.ndarray]:
    """The decoder's linear weights by HF name, [out, in] float32."""
    return {n: t.detach().float().numpy() for n, t in model.state_dict().items()
            if LINEAR.fullmatch(n)}


def save_folder(model, out: Path, quantized: dict[str, dict], qc: dict,
                quantize_config_file: bool = False) -> Path:
    """model's config and float tensors, the quantized modules' tensors instead of their
    weights (quantized: module prefix -> {suffix: tensor}); qc in config.json (or, as
    AutoGPTQ writes it, in quantize_config.json)."""
    out.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(out)
    tensors = {n: t.detach().contiguous() for n, t in model.state_dict().items()
               if n.rpartition(".")[0] not in quantized or not n.endswith(".weight")}
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    for prefix, parts in quantized.items():
        for suffix, t in parts.items():
            tensors[f"{prefix}.{suffix}"] = torch.as_tensor(t).contiguous()
    save_file(tensors, out / "model.safetensors")
    if quantize_config_file:
        (out / "quantize_config.json").write_text(json.dumps(qc, indent=2))
    else:
        config = json.loads((out / "config.json").read_text())
        config["quantization_config"] = qc
        (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


# -- GPTQ and AWQ: round to nearest, numpy packing ---------------------------------------------

def rtn(w: np.ndarray, bits: int, g_idx: np.ndarray, groups: int, sym: bool, min_zero: int = 0):
    """w [out, in] -> (codes [out, in], float16 scales [groups, out], zeros [groups, out])."""
    maxq = 2 ** bits - 1
    scale = np.empty((groups, w.shape[0]), np.float16)
    zero = np.empty((groups, w.shape[0]), np.int64)
    for g in range(groups):
        rows = w[:, g_idx == g]
        lo, hi = np.minimum(rows.min(1), 0), np.maximum(rows.max(1), 0)
        if sym:
            s, z = 2 * np.maximum(-lo, hi) / maxq, np.full(len(lo), (maxq + 1) // 2)
        else:
            s = (hi - lo) / maxq
            z = np.clip(np.round(-lo / np.where(s > 0, s, 1)), min_zero, maxq)
        scale[g] = np.where(s > 0, s, 1)
        zero[g] = z
    s32 = scale.astype(np.float32)
    codes = np.clip(np.round(w / s32[g_idx].T) + zero[g_idx].T, 0, maxq).astype(np.int64)
    return codes, scale, zero


def dequantize_rtn(codes, scale, zero, g_idx) -> np.ndarray:
    """W[o, i] = scale[g, o] * (code[o, i] - zero[g, o]), g = g_idx[i], in float32."""
    s = scale.astype(np.float32)[g_idx].T
    return s * (codes - zero[g_idx].T).astype(np.float32)


def pack_along_rows(codes: np.ndarray, bits: int) -> np.ndarray:
    """GPTQ's qweight: word r of a column holds rows r * pack + j at bits j * bits."""
    pack = 32 // bits
    words = np.zeros((codes.shape[0] // pack, codes.shape[1]), np.uint32)
    for j in range(pack):
        words |= codes[j::pack].astype(np.uint32) << np.uint32(bits * j)
    return words.view(np.int32)


def pack_along_cols(values: np.ndarray, bits: int, order=None) -> np.ndarray:
    """GPTQ's qzeros, AWQ's qweight and qzeros: field i of word c holds column
    c * pack + order[i]."""
    pack = 32 // bits
    order = range(pack) if order is None else order
    words = np.zeros((values.shape[0], values.shape[1] // pack), np.uint32)
    for i, col in enumerate(order):
        words |= values[:, col::pack].astype(np.uint32) << np.uint32(bits * i)
    return words.view(np.int32)


def write_gptq(model, out: Path, bits: int = 4, group_size: int = 32, sym: bool = True,
               desc_act: bool = False, v2: bool = False, seed: int = 0,
               quantize_config_file: bool = False, **extra) -> tuple[Path, dict]:
    rng = np.random.default_rng(seed)
    quantized, expected = {}, {}
    for name, w in linear_weights(model).items():
        n, k = w.shape
        size = k if group_size == -1 else group_size
        groups = math.ceil(k / size)
        g_idx = np.arange(k) // size
        if desc_act:  # act-order: rows taken in a permuted order fill the groups in turn
            g_idx = np.empty(k, np.int64)
            g_idx[rng.permutation(k)] = np.arange(k) // size
        # v1 stores zero - 1 in each field, so a zero of 0 cannot be written
        codes, scale, zero = rtn(w, bits, g_idx, groups, sym, min_zero=0 if v2 else 1)
        stored = zero if v2 else zero - 1
        quantized[name.removesuffix(".weight")] = {
            "qweight": pack_along_rows(codes.T, bits),
            "qzeros": pack_along_cols(stored, bits), "scales": scale,
            "g_idx": g_idx.astype(np.int32)}
        expected[name] = dequantize_rtn(codes, scale, zero, g_idx)
    qc = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act,
          "sym": sym, "damp_percent": 0.01, "true_sequential": True, "static_groups": False,
          "checkpoint_format": "gptq_v2" if v2 else "gptq", "lm_head": False,
          "meta": {"quantizer": ["tests.quantized_tiny"]}, **extra}
    return save_folder(model, out, quantized, qc, quantize_config_file), expected


def write_awq(model, out: Path, group_size: int = 32, skip=(), **extra) -> tuple[Path, dict]:
    """AutoAWQ's GEMM layout: asymmetric 4-bit codes packed along the output axis; modules
    whose names contain a `skip` string stay float (modules_to_not_convert)."""
    quantized, expected = {}, {}
    for name, w in linear_weights(model).items():
        if any(s in name for s in skip):
            continue
        n, k = w.shape
        g_idx = np.arange(k) // group_size
        codes, scale, zero = rtn(w, 4, g_idx, k // group_size, sym=False)
        quantized[name.removesuffix(".weight")] = {
            "qweight": pack_along_cols(codes.T, 4, AWQ_ORDER),
            "qzeros": pack_along_cols(zero, 4, AWQ_ORDER), "scales": scale}
        expected[name] = dequantize_rtn(codes, scale, zero, g_idx)
    qc = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
          "version": "gemm", "modules_to_not_convert": list(skip) or None, **extra}
    return save_folder(model, out, quantized, qc), expected


# -- fp8 with block scales ---------------------------------------------------------------------

def fp8_blocks(w: np.ndarray, bn: int, bk: int) -> tuple[np.ndarray, np.ndarray]:
    """w [out, in] float -> (float8_e4m3fn [out, in], float32 scales [ceil(out / bn),
    ceil(in / bk)]): DeepSeek's amax / 448 per block, a block of zeros scale 1."""
    n, k = w.shape
    scale = np.ones((math.ceil(n / bn), math.ceil(k / bk)), np.float32)
    for r in range(scale.shape[0]):
        for c in range(scale.shape[1]):
            amax = np.abs(w[r * bn:(r + 1) * bn, c * bk:(c + 1) * bk]).max()
            scale[r, c] = amax / np.float32(448) if amax > 0 else 1
    full = np.repeat(np.repeat(scale, bn, 0), bk, 1)[:n, :k]
    return (w / full).astype(ml_dtypes.float8_e4m3fn), scale


def write_fp8(model, out: Path, block: tuple[int, int] | None = (32, 32),
              static: bool = False, **extra) -> tuple[Path, dict]:
    """weight float8_e4m3fn [out, in] with weight_scale_inv per [bn, bk] block (float32), or
    one weight_scale per tensor when block is None."""
    quantized, expected = {}, {}
    for name, w in linear_weights(model).items():
        n, k = w.shape
        bn, bk = block or (n, k)
        q, scale = fp8_blocks(w, bn, bk)
        full = np.repeat(np.repeat(scale, bn, 0), bk, 1)[:n, :k]
        parts = {"weight": torch.from_numpy(q.view(np.uint8)).view(torch.float8_e4m3fn)}
        parts["weight_scale_inv" if block else "weight_scale"] = (
            scale if block else scale.reshape(()))
        if static:
            parts["input_scale"] = np.float32(0.02).reshape(())
        quantized[name.removesuffix(".weight")] = parts
        expected[name] = q.astype(np.float32) * full
    qc = {"quant_method": "fp8", "activation_scheme": "static" if static else "dynamic",
          "fmt": "e4m3", **({"weight_block_size": list(block)} if block else {}), **extra}
    return save_folder(model, out, quantized, qc), expected


# Every linear weight of a saved float folder, a mixture's experts included (one tensor each on
# disk, whatever transformers holds in memory); not a router (`mlp.gate`, `block_sparse_moe.gate`)
SAVED_LINEAR = re.compile(r"model\.layers\.\d+\..*\.(?:[a-z_]+_proj(?:_with_mqa)?|w[123])\.weight")


def write_fp8_from_folder(hf_dir: Path, out: Path, block=(128, 128)) -> tuple[Path, dict]:
    """A float Hugging Face folder's linear weights (experts too, as saved) in fp8 with block
    scales, DeepSeek-V3's layout -> (the fp8 folder, {HF weight name: its dequantization,
    float32 [out, in]}). `dequantized_folder` writes those back as a float folder."""
    from safetensors.numpy import load_file
    out.mkdir(parents=True, exist_ok=True)
    tensors = load_file(hf_dir / "model.safetensors")
    stored, expected = {}, {}
    for name, w in tensors.items():
        if not SAVED_LINEAR.fullmatch(name):
            stored[name] = torch.from_numpy(np.ascontiguousarray(w))
            continue
        q, scale = fp8_blocks(w.astype(np.float32), *block)
        prefix = name.removesuffix(".weight")
        stored[name] = torch.from_numpy(q.view(np.uint8)).view(torch.float8_e4m3fn)
        stored[f"{prefix}.weight_scale_inv"] = torch.from_numpy(scale)
        full = np.repeat(np.repeat(scale, block[0], 0), block[1], 1)[:w.shape[0], :w.shape[1]]
        expected[name] = q.astype(np.float32) * full
    save_file(stored, out / "model.safetensors")
    config = json.loads((hf_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "fmt": "e4m3", "weight_block_size": list(block)}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out, expected


def dequantized_folder(hf_dir: Path, out: Path, expected: dict) -> Path:
    """The float folder again with `expected`'s weights in place of its own: what serving the
    fp8 folder dequantized at load gave."""
    from safetensors.numpy import load_file
    out.mkdir(parents=True, exist_ok=True)
    tensors = {n: expected.get(n, w) for n, w in load_file(hf_dir / "model.safetensors").items()}
    save_file({n: torch.from_numpy(np.ascontiguousarray(w)) for n, w in tensors.items()},
              out / "model.safetensors")
    (out / "config.json").write_text((hf_dir / "config.json").read_text())
    return out


# -- compressed-tensors, by the package ---------------------------------------------------------

def ct_module(w: torch.Tensor, scheme, fmt: str, scale_dtype) -> tuple[dict, np.ndarray]:
    """One weight compressed by compressed-tensors' compressor for fmt -> (its tensors, the
    package's own float32 dequantization [out, in])."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization.utils import calculate_qparams
    args = scheme.weights
    if args.strategy == "group":
        parts = w.reshape(w.shape[0], -1, args.group_size)
        lo, hi = parts.amin(-1), parts.amax(-1)
    elif args.strategy == "channel":
        lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    else:
        lo, hi = w.min().reshape(1), w.max().reshape(1)
    scale, zero = calculate_qparams(lo, hi, args)
    state = {"weight": w, "weight_scale": scale.to(scale_dtype), "weight_zero_point": zero}
    compressor = BaseCompressor.get_value_from_registry(fmt)
    stored = compressor.compress(state, scheme)
    as_f32 = {**stored, "weight_scale": stored["weight_scale"].float()}
    want = compressor.decompress(as_f32, scheme)["weight"]
    return stored, want.float().numpy()


def act_order(stored: dict, want: np.ndarray, bits: int, perm: np.ndarray, group_size: int):
    """A module compressed with its input columns permuted (`perm`) put back in their own
    order with a weight_g_idx, as GPTQ with actorder "group" leaves it."""
    from compressed_tensors.compressors.pack_quantized.helpers import (pack_to_int32,
                                                                       unpack_from_int32)
    shape = tuple(stored["weight_shape"].tolist())
    codes = unpack_from_int32(stored["weight_packed"], bits, torch.Size(shape))
    inverse = np.argsort(perm)
    g_idx = np.empty(len(perm), np.int32)
    g_idx[perm] = np.arange(len(perm)) // group_size
    stored = {**stored, "weight_packed": pack_to_int32(codes[:, inverse].contiguous(), bits),
              "weight_g_idx": torch.from_numpy(g_idx)}
    return stored, want[:, inverse]


def write_compressed_tensors(model, out: Path, weights: dict, fmt: str,
                             input_activations: dict | None = None,
                             ignore=("lm_head",), scale_dtype=torch.bfloat16,
                             actorder: bool = False, seed: int = 0, **extra):
    """weights / input_activations: compressed-tensors QuantizationArgs fields; every decoder
    linear not in `ignore` (names or re: regexes) is quantized by the package."""
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig,
                                                 QuantizationScheme)
    acts = QuantizationArgs(**input_activations) if input_activations else None
    w_args = QuantizationArgs(**weights)
    scheme = QuantizationScheme(targets=["Linear"], weights=w_args, input_activations=acts)
    rng = np.random.default_rng(seed)
    quantized, expected = {}, {}
    for name, w in linear_weights(model).items():
        prefix = name.removesuffix(".weight")
        if any(re.match(i[3:], prefix) if i.startswith("re:") else i == prefix
               for i in ignore):
            continue
        perm = rng.permutation(w.shape[1]) if actorder else np.arange(w.shape[1])
        stored, want = ct_module(torch.from_numpy(w[:, perm]), scheme, fmt, scale_dtype)
        if actorder:
            stored, want = act_order(stored, want, w_args.num_bits, perm, w_args.group_size)
        if acts is not None and not acts.dynamic:
            stored["input_scale"] = torch.tensor([0.02], dtype=scale_dtype)
        quantized[prefix] = stored
        expected[name] = want
    qc = QuantizationConfig(config_groups={"group_0": scheme}, format=fmt, ignore=list(ignore),
                            quantization_status="compressed").to_dict()
    qc = json.loads(json.dumps(qc, default=str))
    if actorder:  # the package no longer writes it; checkpoints made before it did
        qc["config_groups"]["group_0"]["weights"]["actorder"] = "group"
    qc.update(extra)
    return save_folder(model, out, quantized, qc), expected


# -- what the tests compare ----------------------------------------------------------------------

# Every kernel's input a multiple of 32 and output a multiple of 16 (8 for the packings);
# weights five times transformers' default spread, so that a layer's weights decide tokens
# (at the default a misread layer can leave every greedy token as it was).
SIZES = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, num_hidden_layers=2, initializer_range=0.1)
OPTIONS = dict(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=16, page_size=4,
               token_buckets=(4, 16), request_buckets=(4,), page_buckets=(16,), progress=False)
PROMPTS = [[1, 17, 33, 5, 90], [1, 200, 3, 3, 3, 150, 42, 7, 9]]


def leaf(params, path, layer=None):
    """The leaf at `path`; with `layer`, that layer's own leaf when the layers are stored as a
    list of per-layer trees (their forms differ), else the layer-stacked leaf."""
    for p in path:
        params = params[p]
        if isinstance(params, list):
            params = params[layer]
    return params


def per_layer(params) -> bool:
    return isinstance(params["layers"], list)


def loaded(params, cfg, hf_name: str) -> np.ndarray:
    """Our weight for an HF tensor name as the kernels read it: float32, HF's [out, in]."""
    import jax

    from model.formats.param_tree import dequantize_np
    from model.hf_weights import _target
    path, layer, transpose = _target(hf_name, cfg)
    value = dequantize_np(jax.tree.map(np.asarray, leaf(params, path, layer)))
    if layer is not None and not per_layer(params):
        value = value[layer]
    return value.T if transpose else value


def kernel(params, module: str, proj: str, layer: int | None = None):
    """A kernel in its form (QuantArray, Int4Array, ...), on the host: the layer-stacked leaf,
    or with `layer` that layer's own [in, out] leaf in either stored form."""
    import jax
    value = jax.tree.map(np.asarray, leaf(params, ("layers", module, proj, "kernel"), layer))
    if layer is None or per_layer(params):
        return value
    return jax.tree.map(lambda a: a[layer], value)


def assert_weights_equal(params, cfg, expected: dict[str, np.ndarray]) -> None:
    for name, want in expected.items():
        np.testing.assert_array_equal(loaded(params, cfg, name), want, err_msg=name)


def greedy_tokens_agree(model, folder: Path, expected: dict[str, np.ndarray]) -> None:
    """Our engine on the folder and transformers on the same (dequantized) weights give the
    same greedy tokens."""
    import copy

    from serving import LLM, SamplingParams
    from tests.hf_tiny import greedy_reference
    reference = copy.deepcopy(model)
    reference.load_state_dict({n: torch.from_numpy(w) for n, w in expected.items()},
                              strict=False)
    llm = LLM(str(folder), **OPTIONS)
    ours = [r.token_ids for r in llm.generate(PROMPTS, SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True))]
    assert ours == [greedy_reference(reference, prompt, 12) for prompt in PROMPTS]


def written_once(write):
    """name -> write(name), each variant written the first time a test asks for it."""
    made = {}

    def get(name):
        if name not in made:
            made[name] = write(name)
        return made[name]
    return get


def edited_copy(folder: Path, out: Path, edit_qc=None, edit_config=None) -> Path:
    """The folder again (its weights linked) with config.json's quantization_config or the
    rest of config.json changed in place by the given functions."""
    out.mkdir(parents=True)
    for f in folder.iterdir():
        if f.suffix == ".json":
            (out / f.name).write_text(f.read_text())
        else:
            (out / f.name).symlink_to(f)
    config = json.loads((out / "config.json").read_text())
    if edit_qc:
        edit_qc(config["quantization_config"])
    if edit_config:
        edit_config(config)
    (out / "config.json").write_text(json.dumps(config))
    return out
