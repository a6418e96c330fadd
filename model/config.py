"""ModelConfig: the static, hashable description of a decoder model, built from HF config.json."""
from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from pathlib import Path

# architecture -> (q/k/v bias, q/k RMSNorm). Everything else is read from config.json.
FAMILIES = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
}
DTYPES = ("float32", "bfloat16", "float16")
# KV cache storage (model/kv_cache.py): "auto" is the model's dtype; a float dtype stores K/V
# rounded to it; int8 / fp8 store them quantized with a scale per (token, KV head).
KV_CACHE_DTYPES = ("auto", *DTYPES, "int8", "fp8")
# model/attention.py's backends ("auto" picks one for the device): named here, without JAX,
# for the CLI's choices.
ATTENTION_BACKENDS = ("reference", "blocked", "cpu", "pallas", "pallas_pages")


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, float], ...] | None = None  # sorted items of HF's dict
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    # One sliding window per layer, 0 where the layer attends to everything.
    sliding_windows: tuple[int, ...] = ()
    dtype: str = "float32"

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rope_scaling_dict(self) -> dict:
        return dict(self.rope_scaling or ())

    def with_dtype(self, dtype: str) -> "ModelConfig":
        if dtype not in DTYPES:
            raise ConfigError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
        return replace(self, dtype=dtype)

    @classmethod
    def from_hf(cls, hf: dict, dtype: str | None = None) -> "ModelConfig":
        archs = hf.get("architectures") or []
        arch = archs[0] if archs else hf.get("model_type", "?")
        if arch not in FAMILIES:
            raise ConfigError(f"unsupported architecture {arch!r}; supported: "
                              + ", ".join(FAMILIES))
        qkv_bias, qk_norm = FAMILIES[arch]
        heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        num_layers = hf["num_hidden_layers"]
        attention_bias = bool(hf.get("attention_bias", False))
        # transformers 5 writes `rope_parameters` (theta included); older files `rope_scaling`.
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        cfg = cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
            rope_scaling=_rope_scaling(rope),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias or attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=qk_norm,
            sliding_windows=_sliding_windows(hf, arch, num_layers),
        )
        return cfg.with_dtype(dtype or _hf_dtype(hf))

    @classmethod
    def from_dir(cls, path: str | Path, dtype: str | None = None) -> "ModelConfig":
        path = Path(path) / "config.json"
        if not path.is_file():
            raise ConfigError(f"no config.json in {path.parent}")
        return cls.from_hf(json.loads(path.read_text()), dtype)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        d = dict(d)
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = tuple((k, v) for k, v in d["rope_scaling"])
        d["sliding_windows"] = tuple(d.get("sliding_windows", ()))
        return cls(**d)


def _hf_dtype(hf: dict) -> str:
    dtype = hf.get("torch_dtype") or hf.get("dtype") or "float32"
    return dtype if dtype in DTYPES else "float32"


def _rope_scaling(rs: dict):
    kind = rs.get("rope_type", rs.get("type"))
    if kind in (None, "default"):
        return None
    if kind not in ("llama3", "linear"):
        raise ConfigError(f"unsupported rope_scaling type {kind!r}; supported: llama3, linear")
    items = {"rope_type": kind}
    for key in ("factor", "low_freq_factor", "high_freq_factor",
                "original_max_position_embeddings"):
        if key in rs:
            items[key] = float(rs[key])
    return tuple(sorted(items.items()))


def _sliding_windows(hf: dict, arch: str, num_layers: int) -> tuple[int, ...]:
    window = hf.get("sliding_window") or 0
    if arch == "MistralForCausalLM":
        return (int(window),) * num_layers
    if arch.startswith("Qwen") and hf.get("use_sliding_window") and window:
        # Qwen applies the window only from layer max_window_layers on.
        types = hf.get("layer_types")
        if types:
            return tuple(int(window) if t == "sliding_attention" else 0 for t in types)
        first = hf.get("max_window_layers", num_layers)
        return tuple(int(window) if i >= first else 0 for i in range(num_layers))
    return (0,) * num_layers
