"""Serving a GGUF file (llama.cpp's, Ollama's) as it is: `xlaserve serve model.gguf`.

The engine reads a model from a folder, so a GGUF gets one of its own, made once in the cache
(`gguf_folder`): config.json and generation_config.json from the file's metadata, the
tokenizer rebuilt from its vocabulary by transformers' GGUF converter (or copied from
`--tokenizer DIR`), and `gguf.json` naming the file (all shards of a `-0000N-of-0000M`
split). The weights are read from the file itself at every load (`load_gguf_weights`), onto
our forms by model/formats/gguf_tensors.py; nothing is converted or stored twice.

Architectures: model/formats/gguf_arch.py maps each one as data (GGUF's `llama` for Llama,
Mistral, SmolLM and, with experts, Mixtral; `qwen2`, `qwen3`, `qwen2moe`, `qwen3moe`, `olmoe`,
`gemma2`, `gemma3`, `deepseek2`, `glm4moe`); this module reads a file as its architecture's
map says, and refuses one with no map by name.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np

from model import latent_weights
from model.config import ModelConfig
from model.formats import gguf_arch, gguf_index
from model.formats.gguf_tensors import (FLOAT_TYPES, embedding, permute_rows, tensor_form,
                                        unpermute_order)
from model.formats.param_tree import ParamFiller, dequantize_np, form, kernel
from model.hf_weights import WeightsError

POINTER = "gguf.json"
_VERSION = 4  # 4: a `llama` file with routers is Mixtral (folders made before said Llama)
_SHARD = re.compile(r"^(.*)-(\d{5})-of-(\d{5})\.gguf$")


class GGUFError(WeightsError):
    pass


def is_gguf_path(path: str | Path) -> bool:
    return Path(path).suffix == ".gguf"


def is_gguf_folder(folder: str | Path) -> bool:
    return (Path(folder) / POINTER).is_file()


def shard_files(path: Path) -> list[Path]:
    """A single file, or every shard of the split the named shard belongs to."""
    m = _SHARD.match(path.name)
    if not m:
        return [path]
    stem, count = m.group(1), int(m.group(3))
    files = [path.with_name(f"{stem}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise GGUFError(f"{path.name} is one of {count} shards; missing: {', '.join(missing)}")
    return files


def _readers(files: list[Path]):
    from gguf import GGUFReader
    readers = []
    for f in files:
        try:
            readers.append(GGUFReader(f))
        except Exception as e:  # the reader raises bare errors on a damaged file
            raise GGUFError(f"{f} is not a readable GGUF file ({type(e).__name__}: {e})") from e
    return readers


def metadata(reader) -> dict:
    meta = {}
    for key, field in reader.fields.items():
        if not key.startswith("GGUF."):
            value = field.contents()
            meta[key] = value.tolist() if isinstance(value, np.ndarray) else value
    return meta


def _f32(value: float) -> float:
    return float(str(np.float32(value)))  # 1e-5 is stored as 9.99999975e-06


def hf_config(meta: dict, tensors: dict, rope_freqs: np.ndarray | None = None) -> dict:
    """The config.json a GGUF's metadata stands for (tensors: name -> (type, shape);
    rope_freqs: the file's rope_freqs tensor, if it has one)."""
    arch = meta.get("general.architecture")
    spec = gguf_arch.architecture(arch, GGUFError, tensors)
    key = lambda name, default=None: meta.get(f"{arch}.{name}", default)  # noqa: E731
    heads = key("attention.head_count")
    hidden = key("embedding_length")
    scaling = key("rope.scaling.type")
    if scaling == "yarn" and spec.latent:  # the attention scale: gguf_arch.latent_config
        scaling = {"rope_type": "yarn", "factor": float(key("rope.scaling.factor")),
                   "original_max_position_embeddings": key("rope.scaling.original_context_length"),
                   "beta_fast": 32.0, "beta_slow": 1.0}
    elif scaling not in (None, "none"):
        if scaling != "linear":
            raise GGUFError(f"{arch}.rope.scaling.type {scaling!r} is not served")
        scaling = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
    else:
        scaling = None
    head_dim = key("attention.key_length", key("rope.dimension_count", hidden // heads))
    theta = _f32(key("rope.freq_base", 10000.0))
    if rope_freqs is not None:
        if scaling is not None:
            raise GGUFError("this GGUF has both a rope_freqs tensor and rope.scaling.type")
        scaling = llama3_scaling(np.asarray(rope_freqs, np.float32), theta, head_dim)
    tied = "output.weight" not in tensors
    config = {
        "architectures": [spec.hf_architecture], "model_type": spec.model_type,
        "vocab_size": int(tensors["token_embd.weight"][1][1]),
        **{field: key(name) for name, field in {**gguf_arch.COMMON_CONFIG, **spec.config}.items()
           if key(name) is not None},
        "num_key_value_heads": key("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "hidden_act": "silu", "max_position_embeddings": key("context_length", 2048),
        "rms_norm_eps": _f32(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": theta, "rope_scaling": scaling,
        "attention_bias": False, "tie_word_embeddings": tied,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": _dtype(tensors),
    }
    if spec.deepseek_moe:
        config.update(spec.deepseek_moe(key, config, tensors, GGUFError))
    config.update(gguf_arch.derived_config(spec, config, tensors))
    return config


def llama3_scaling(factors: np.ndarray, theta: float, head_dim: int) -> dict | None:
    """Llama 3's rope_scaling from the per-frequency divisors llama.cpp's converter writes
    (rope_freqs): 1 for short wavelengths, `factor` for long ones, and between them
    1 / ((1 - s) / factor + s) with s linear in 1 / wavelength. Of (low_freq_factor,
    high_freq_factor, original_max_position_embeddings) only two ratios show in the
    divisors; low_freq_factor is taken as 1, as every Llama 3 has it."""
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    factor = float(factors.max())
    if factor == 1.0 and (factors == 1.0).all():
        return None
    medium = (factors > 1.0) & (factors < factor)
    if medium.sum() < 2:
        raise GGUFError("the rope_freqs tensor has too few frequencies between its two "
                        "plateaus to recover Llama 3's rope scaling from")
    smooth = (1.0 / factors[medium] - 1.0 / factor) / (1.0 - 1.0 / factor)
    slope, offset = np.polyfit(inv[medium] / (2 * np.pi), smooth, 1)  # s = A / wavelen + B
    high = round(1.0 - 1.0 / offset, 4)
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
               "high_freq_factor": float(high),
               "original_max_position_embeddings": float(round(-slope / offset))}
    wavelen = 2 * np.pi / inv
    old = scaling["original_max_position_embeddings"]
    s = np.clip((old / wavelen - 1.0) / (high - 1.0), 0.0, 1.0)
    if not np.allclose(1.0 / ((1 - s) / factor + s), factors, rtol=1e-4):
        raise GGUFError("the rope_freqs tensor is not Llama 3's rope scaling; it is not served")
    return scaling


def _dtype(tensors: dict) -> str:
    """float32 unless every matrix is stored as bfloat16 or float16 (then that)."""
    from gguf import GGMLQuantizationType as T
    kinds = {kind for kind, shape in tensors.values() if len(shape) == 2}
    return {frozenset({T.BF16}): "bfloat16", frozenset({T.F16}): "float16"}.get(
        frozenset(kinds), "float32")


def _generation_config(meta: dict) -> dict:
    tokens = meta.get("tokenizer.ggml.tokens") or []
    eos = [meta.get("tokenizer.ggml.eos_token_id")]
    for name in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        if meta.get(name) is not None and meta[name] not in eos:
            eos.append(meta[name])
    # Chat models end their turns on an end-of-turn token the metadata may not name.
    for turn_end in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>"):
        if turn_end in tokens and tokens.index(turn_end) not in eos:
            eos.append(tokens.index(turn_end))
    eos = [e for e in eos if e is not None]
    return {"bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": eos[0] if len(eos) == 1 else eos,
            "pad_token_id": meta.get("tokenizer.ggml.padding_token_id")}


def _write_tokenizer(meta: dict, folder: Path) -> None:
    """tokenizer.json and tokenizer_config.json from the metadata (transformers' converter)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer)
    if "tokenizer.ggml.tokens" not in meta:
        return  # outputs carry token ids only, as for a bare config folder; --tokenizer DIR
    grouped = {group: {name: meta[f"tokenizer.{k}"] for k, name in renames.items()
                       if f"tokenizer.{k}" in meta}
               for group, renames in GGUF_TOKENIZER_MAPPING.items()}
    backend, _ = convert_gguf_tokenizer(meta["general.architecture"], grouped["tokenizer"])
    tokens = meta["tokenizer.ggml.tokens"]
    special = {name: tokens[meta[f"tokenizer.ggml.{key}"]]
               for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                                 ("unk_token", "unknown_token_id"),
                                 ("pad_token", "padding_token_id"))
               if meta.get(f"tokenizer.ggml.{key}") is not None}
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, **special)
    config = grouped["tokenizer_config"]
    if config.get("chat_template"):
        tok.chat_template = config["chat_template"]
    tok.save_pretrained(str(folder))
    path = folder / "tokenizer_config.json"
    saved = json.loads(path.read_text())
    saved["add_bos_token"] = bool(config.get("add_bos_token",
                                             meta["tokenizer.ggml.model"] == "llama"))
    saved["add_eos_token"] = bool(config.get("add_eos_token", False))
    path.write_text(json.dumps(saved, indent=2, ensure_ascii=False) + "\n")


def _cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "xlaserve" / "gguf"


def gguf_folder(path: str | Path, tokenizer: str | Path | None = None,
                cache: Path | None = None) -> Path:
    """The folder the engine loads for a GGUF file: made once per file (path, size, mtime)
    and tokenizer choice, under the cache."""
    path = Path(path).expanduser().resolve()
    if not path.is_file():
        raise GGUFError(f"GGUF file {path} does not exist")
    files = shard_files(path)
    stamp = [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    tok_dir = Path(tokenizer).expanduser().resolve() if tokenizer else None
    digest = hashlib.sha256(json.dumps([_VERSION, stamp, str(tok_dir)]).encode()).hexdigest()
    out = (cache or _cache_root()) / f"{files[0].stem}-{digest[:16]}"
    if is_gguf_folder(out):
        return out
    readers = _readers(files)
    meta = metadata(readers[0])
    tensors = {t.name: (t.tensor_type, tuple(int(d) for d in t.shape))
               for r in readers for t in r.tensors}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        freqs = next((t.data for r in readers for t in r.tensors
                      if t.name == "rope_freqs.weight"), None)
        _write_json(tmp / "config.json", hf_config(meta, tensors, freqs))
        _write_json(tmp / "generation_config.json", _generation_config(meta))
        if tok_dir is not None:
            from model.checkpoint import SIDE_FILES
            copied = [n for n in SIDE_FILES if n not in ("config.json", "generation_config.json")
                      and (tok_dir / n).is_file()]
            if not copied:
                raise GGUFError(f"--tokenizer {tok_dir} holds no tokenizer files")
            for name in copied:
                shutil.copy2(tok_dir / name, tmp / name)
        else:
            _write_tokenizer(meta, tmp)
        _write_json(tmp / POINTER, {"version": _VERSION, "files": [str(f) for f in files],
                                    "architecture": meta["general.architecture"],
                                    "tensors": gguf_index.index(readers)})
        try:
            tmp.rename(out)
        except OSError:
            if not is_gguf_folder(out):  # a concurrent start finishing first is fine
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def load_gguf_weights(folder: Path, cfg: ModelConfig, quantize: str | None
                      ) -> tuple[dict, list[str]]:
    """The parameter tree from the GGUF file(s) a `gguf_folder` names, and the log lines."""
    if quantize and quantize != "gguf":
        raise GGUFError(f"a GGUF file is already quantized; --quantize {quantize} does not "
                        "agree with it: leave --quantize out")
    pointer = json.loads((Path(folder) / POINTER).read_text())
    files = [Path(f) for f in pointer["files"]]
    spec = gguf_arch.architecture(pointer["architecture"], GGUFError,
                                  [entry[1] for entry in pointer["tensors"]])
    names = spec.layer_paths()
    heads = {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads}
    filler = ParamFiller(cfg)
    kinds: dict[str, set[str]] = {}
    for t in _tensors(files, pointer["tensors"]):
        if t.name == "rope_freqs.weight":  # read into config.json's rope_scaling
            continue
        block = re.match(r"blk\.(\d+)\.", t.name)
        if spec.nextn and block and int(block.group(1)) >= cfg.num_layers:
            continue  # a next-n prediction layer: not the model's own
        target = _target(t.name, names)
        if target is None:
            raise GGUFError(f"unexpected tensor {t.name!r} in {files[0].name}")
        path, layer, short = target
        kind = short.split(".")[0]
        unpermute = heads.get(kind) if spec.permuted_qk else None
        if path[-1] in ("kv_b", "k_up", "v_up"):  # a latent's up-projections, as float32
            for up_path, value in _latent_up(t, short, layer, cfg):
                filler.set(("layers",) + up_path, layer, value, t.name)
            label = t.tensor_type.name + (" (dequantized at load)"
                                          if t.tensor_type not in FLOAT_TYPES else "")
            kinds.setdefault("k_up/v_up", set()).add(label)
            continue
        if short in gguf_arch.EXPERT_STACKS:  # [E, out, in]: one expert at a time
            values = [_our_form(t, t.data[e], t.shape[:2], path, unpermute)
                      for e in range(t.shape[2])]
            for e, value in enumerate(values):
                filler.set(path, layer, value, t.name, expert=e)
        else:
            values = [_our_form(t, t.data, t.shape, path, unpermute)]
            if cfg.rope_interleaved and short in gguf_arch.LATENT_ROPE:
                values = [permute_rows(values[0], latent_weights.rope_halves_order(
                    cfg, latent=short == "attn_kv_a_mqa.weight"))]
            if spec.norm_offset and short.endswith("norm.weight"):
                values = [values[0] - np.float32(spec.norm_offset)]
            if short in gguf_arch.FLOAT_ONLY:
                values = [dequantize_np(values[0])]
            if short in gguf_arch.COLUMNS:
                values = [values[0].reshape(-1, 1)]
            filler.set(path, layer, values[0], t.name)
        value = values[0]
        dequantized = t.tensor_type not in FLOAT_TYPES and isinstance(value, np.ndarray)
        label = (f"{t.tensor_type.name} -> "
                 + (filler.describe(value) if path[-1] == "kernel" else form(value))
                 + (" (dequantized at load)" if dequantized else ""))
        if path == ("embed",) and cfg.tie_word_embeddings:
            label += f"; the tied head on {kernel(value)}"
        kinds.setdefault(_kind(path), set()).add(label)
    params = filler.finish()
    log = [f"checkpoint format: GGUF ({', '.join(f.name for f in files)})"]
    log += [f"  {k}: {', '.join(sorted(v))}" for k, v in sorted(kinds.items())]
    log += [f"  {note}" for note in filler.notes]
    return params, log


def _our_form(t, data: np.ndarray, shape: tuple[int, ...], path: tuple[str, ...],
              heads: int | None):
    """One tensor (or one expert of a stack: its data and GGUF shape) in our form and
    orientation; with `heads`, llama.cpp's Q/K row order undone."""
    try:
        value = (embedding(data, t.tensor_type, shape) if path == ("embed",)
                 else tensor_form(data, t.tensor_type, shape))
    except ValueError as e:
        raise GGUFError(f"tensor {t.name!r} ({t.tensor_type.name}, shape {t.shape}) "
                        f"cannot be read: {e}") from e
    return permute_rows(value, unpermute_order(value.shape[-1], heads)) if heads else value


def _latent_up(t, short: str, layer: int, cfg: ModelConfig) -> list:
    """[(path under the layer, float32 value)] of k_up [H, nope, r] and v_up [H, r, v]:
    from attn_kv_b (the checkpoint's kv_b_proj [H * (nope + v), r]) or from one of its
    per-head halves attn_k_b [H, r, nope] / attn_v_b [H, v, r]."""
    from gguf.quants import dequantize
    w = np.asarray(dequantize(t.data, t.tensor_type), np.float32).reshape(
        tuple(reversed(t.shape)))
    if short == "attn_kv_b.weight":
        name = f"model.layers.{layer}.self_attn.kv_b_proj.weight"
        return [(path[1:], part) for path, part, _ in latent_weights.split_kv_b(name, w, cfg)[1]]
    part = "k_up" if short == "attn_k_b.weight" else "v_up"
    return [(("attn", part), np.ascontiguousarray(w.transpose(0, 2, 1)))]


def _kind(path: tuple[str, ...]) -> str:
    """A weight's name in the start-up log: its module (a kernel's, a bias's) or its own."""
    if path[0] == "embed":
        return "embed"
    if path[-1] in ("kernel", "bias"):
        return "/".join(path[1:-1]) if path[1] == "moe" else path[-2]
    return path[-1]


def _tensors(files: list[Path], entries: list[list]):
    try:
        yield from gguf_index.tensors(files, entries)
    except (OSError, ValueError) as e:
        raise GGUFError(f"{files[0].name} cannot be read as its folder records it: {e}; "
                        "delete that folder to read the file again") from e


def _target(name: str, layer_paths: dict):
    """(our path, layer or None, the name after `blk.N.`) of a tensor, or None."""
    if name in gguf_arch.TOP:
        return gguf_arch.TOP[name], None, name
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
    if m and m.group(2) in layer_paths:
        return ("layers",) + layer_paths[m.group(2)], int(m.group(1)), m.group(2)
    return None
