"""What a model folder gives the engine: its weights (loaded, or dummy ones of its config),
its tokenizer, its EOS ids, and the key that names the weights in prefix-cache page hashes."""
from __future__ import annotations

import json
import logging
from pathlib import Path

from model.checkpoint import load_model
from model.config import ModelConfig
from model.transformer import init_params
from quant.recipe import quantize_params
from serving.core.config import EngineConfig
from serving.engine import weights_cache

log = logging.getLogger("xlaserve")


def model_key(model_dir: Path, ec: EngineConfig) -> str:
    """Names the weights in prefix-cache page hashes: K/V of the same tokens differ under
    other weights, another dtype or another cache format."""
    seed = ec.seed if ec.load_format == "dummy" else None
    return (f"{Path(model_dir).resolve()}|{ec.load_format}|{seed}|{ec.dtype}|{ec.quantize}|"
            f"{ec.kv_cache_dtype}")


def load_weights(model_dir: Path, ec: EngineConfig, dtype: str | None = None):
    if ec.load_format == "dummy":
        cfg = ModelConfig.from_dir(model_dir, dtype)
        params = init_params(cfg, ec.seed)
        return cfg, quantize_params(params, ec.quantize) if ec.quantize else params
    if ec.load_format != "auto":
        raise ValueError(f"unknown load_format {ec.load_format!r}; choose auto or dummy")
    if not (ec.compilation_cache_dir and weights_cache.cacheable(model_dir, ec.quantize)):
        return load_model(model_dir, dtype, progress=ec.progress, quantize=ec.quantize)
    # Quantized at load: read back what an earlier start saved (serving/engine/weights_cache.py)
    path = weights_cache.slot(Path(ec.compilation_cache_dir) / "weights", model_dir,
                              ec.quantize, dtype)
    made_from = weights_cache.identity(model_dir, ec.quantize, dtype)
    saved = weights_cache.load(path, made_from)
    if saved is not None:
        log.info("weights: %s quantized as saved in %s", ec.quantize, path)
        return saved
    cfg, params = load_model(model_dir, dtype, progress=ec.progress, quantize=ec.quantize)
    if weights_cache.save(path, made_from, cfg, params):
        log.info("weights: %s quantized, saved to %s for the next start", ec.quantize, path)
    return cfg, params


def load_tokenizer(model_dir: Path):
    """The folder's tokenizer; None for a bare config folder (dummy weights): outputs then
    carry token ids and no text."""
    model_dir = Path(model_dir)
    if (model_dir / "tokenizer.json").is_file():
        # The fast tokenizer class directly: AutoTokenizer would import torch (seconds).
        from transformers import PreTrainedTokenizerFast
        return PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    if not any((model_dir / f).is_file() for f in ("tokenizer.model", "vocab.json")):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(model_dir))


def eos_token_ids(model_dir: Path, tokenizer) -> frozenset[int]:
    ids = set()
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def request_vocab_size(embedded: int, tokenizer) -> int:
    """Ids a request may use and the model may emit: embedding rows the tokenizer knows.
    Padded rows (a table larger than the tokenizer) are never sampled; a tokenizer that
    knows more ids than the table has rows works too, its extra ids never generated."""
    if tokenizer is None:
        return embedded
    known = len(tokenizer)
    if known > embedded:
        log.warning("the tokenizer knows %d token ids but the model embeds %d: ids %d and up "
                    "are never generated, and a prompt holding one is refused", known, embedded,
                    embedded)
    return min(embedded, known)
