"""Embedding requests: `PoolingParams` (one request's options, vLLM's names), `PoolerConfig`
(`--pooler-config`: how a prompt's hidden states become one vector) and `EmbeddingSpec`
(what the served model allows), with the rules each must pass. Plain data, no JAX.

vLLM serves a decoder model as an embedding model with `--task embed` (newer: `--runner
pooling`); so does this engine. The default pooling comes from the model folder's
sentence-transformers files (modules.json -> the Pooling module's config.json, a Normalize
module), else LAST with normalize, vLLM's default for decoder embedding models.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from serving.core.request_checks import RequestRefused
from serving.core.json_option import json_object

TASKS = ("generate", "embed")
RUNNERS = {"generate": "generate", "pooling": "embed"}  # vLLM's --runner -> our task
POOLING_TYPES = ("LAST", "MEAN", "CLS")
# sentence-transformers' Pooling config key -> our pooling type, in the order we look.
_ST_MODES = (("pooling_mode_lasttoken", "LAST"), ("pooling_mode_mean_tokens", "MEAN"),
             ("pooling_mode_cls_token", "CLS"))
_ST_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                   "pooling_mode_weightedmean_tokens")


@dataclass(frozen=True)
class PoolingParams:
    """One embedding request's options. dimensions: keep the first n (Matryoshka); normalize:
    None means the pooler config's."""
    dimensions: int | None = None
    normalize: bool | None = None
    n: int = 1  # one result per request (streams count samples the same way)


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str = "LAST"
    normalize: bool = True

    @classmethod
    def parse(cls, value: str | dict | None, model_dir: str | Path | None = None
              ) -> "PoolerConfig":
        """--pooler-config (JSON text or a dict; vLLM's keys) over the model folder's
        default. Raises ValueError naming what is wrong."""
        base = default_pooler_config(model_dir) if model_dir is not None else cls()
        if value is None or value == "":
            return base
        value = json_object(value, "--pooler-config", {"pooling_type", "seq_pooling_type",
                                                       "normalize", "use_activation"})
        # vLLM's newer names: seq_pooling_type for pooling_type, use_activation for normalize
        kind = _one_of(value, "pooling_type", "seq_pooling_type", base.pooling_type)
        normalize = _one_of(value, "normalize", "use_activation", base.normalize)
        if not isinstance(kind, str) or kind.upper() not in POOLING_TYPES:
            raise ValueError(f"--pooler-config: pooling_type must be one of "
                             f"{', '.join(POOLING_TYPES)}, got {kind!r}")
        if not isinstance(normalize, bool):
            raise ValueError(f"--pooler-config: normalize must be true or false, got "
                             f"{normalize!r}")
        return cls(kind.upper(), normalize)


def _one_of(value: dict, name: str, alias: str, default):
    if value.get(name) is not None and value.get(alias) is not None \
            and value[name] != value[alias]:
        raise ValueError(f"--pooler-config: {name} and {alias} disagree")
    for key in (name, alias):
        if value.get(key) is not None:
            return value[key]
    return default


def default_pooler_config(model_dir: str | Path) -> PoolerConfig:
    """From sentence-transformers' modules.json where the folder has one, else LAST with
    normalize."""
    model_dir = Path(model_dir)
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return PoolerConfig()
    modules = json.loads(modules_file.read_text())
    normalize = any(str(m.get("type", "")).endswith(".Normalize") for m in modules)
    pooling = next((m for m in modules if str(m.get("type", "")).endswith(".Pooling")), None)
    if pooling is None:
        return PoolerConfig("LAST", normalize)
    config_file = model_dir / pooling.get("path", "") / "config.json"
    mode = json.loads(config_file.read_text()) if config_file.is_file() else {}
    for key, kind in _ST_MODES:
        if mode.get(key):
            return PoolerConfig(kind, normalize)
    if any(mode.get(key) for key in _ST_UNSUPPORTED):
        raise ValueError(f"{config_file}: this pooling mode is not supported (LAST, MEAN and "
                         "CLS are); choose one with --pooler-config")
    return PoolerConfig("LAST", normalize)


def resolve_task(task: str, runner: str | None) -> str:
    """--task and vLLM's newer --runner (pooling = embed) -> the task."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
    if runner is None:
        return task
    if runner not in RUNNERS:
        raise ValueError(f"unknown runner {runner!r}; choose one of {', '.join(RUNNERS)}")
    if task != "generate" and RUNNERS[runner] != task:
        raise ValueError(f"--runner {runner} and --task {task} disagree")
    return RUNNERS[runner]


@dataclass(frozen=True)
class EmbeddingSpec:
    """What the served model allows: its vector size, its Matryoshka sizes (config.json's
    matryoshka_dimensions / is_matryoshka, as vLLM reads them) and its pooler."""
    model: str  # for messages
    hidden_size: int
    pooler: PoolerConfig
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None

    @classmethod
    def from_dir(cls, model_dir: str | Path, hidden_size: int,
                 pooler: PoolerConfig) -> "EmbeddingSpec":
        path = Path(model_dir) / "config.json"
        config = json.loads(path.read_text()) if path.is_file() else {}
        dims = config.get("matryoshka_dimensions")
        return cls(Path(model_dir).name, hidden_size, pooler,
                   bool(dims) or bool(config.get("is_matryoshka", False)),
                   tuple(dims) if dims else None)

    def resolve(self, params: PoolingParams) -> PoolingParams:
        """params checked against the model, normalize filled in from the pooler. Raises
        RequestRefused (param "dimensions") as vLLM refuses them."""
        d = params.dimensions
        if d is not None:
            if not self.is_matryoshka:
                raise RequestRefused(
                    f"model '{self.model}' does not support Matryoshka representation; "
                    "changing the output dimensions would lead to poor results",
                    param="dimensions")
            if self.matryoshka_dimensions is not None and d not in self.matryoshka_dimensions:
                raise RequestRefused(
                    f"model '{self.model}' supports only the Matryoshka dimensions "
                    f"{list(self.matryoshka_dimensions)}, got {d}", param="dimensions")
            if not 1 <= d <= self.hidden_size:
                raise RequestRefused(f"dimensions must be in [1, {self.hidden_size}] (the "
                                     f"model's embedding size), got {d}", param="dimensions")
        normalize = self.pooler.normalize if params.normalize is None else params.normalize
        return PoolingParams(d, normalize)
