"""Weights quantized at load are saved beside the compiled programs and read back on the next
start (serving/engine/weights_cache.py): bit for bit the weights quantizing gives, the same
tokens; a checkpoint rewritten, a damaged file or a model over the size cap quantizes again,
never a crash or stale weights; nothing is saved without a cache folder or a recipe."""
from __future__ import annotations

import logging
import os

import jax
import numpy as np
import pytest

from model.checkpoint import METADATA, convert_hf, load_model
from serving import LLM, SamplingParams
from serving.core.config import EngineConfig
from serving.engine import weights_cache
from serving.engine.model_files import load_weights
from tests.hf_tiny import tiny_hf_model

# int4 takes inputs in groups of 32: sizes in whole groups
SIZES = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, head_dim=16,
             vocab_size=224)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights-cache")
    tiny_hf_model("llama", root / "hf", seed=4, **SIZES)
    convert_hf(root / "hf", root / "ckpt", "float32", progress=False)
    return root / "ckpt"


def bits(params) -> list:
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    return [treedef] + [(path, str(a.dtype), a.shape, np.asarray(a).tobytes())
                        for path, a in leaves]


def config(checkpoint, cache, quantize="int4:lm_head"):
    return EngineConfig(model=str(checkpoint), quantize=quantize, progress=False,
                        compilation_cache_dir=str(cache) if cache is not None else None)


def test_second_load_reads_back_what_quantizing_gives(checkpoint, tmp_path, caplog):
    want_cfg, want = load_model(checkpoint, progress=False, quantize="int4:lm_head")
    ec = config(checkpoint, tmp_path)
    with caplog.at_level(logging.INFO, logger="xlaserve"):
        first = load_weights(checkpoint, ec)
        assert "saved to" in caplog.text and "as saved in" not in caplog.text
        caplog.clear()
        cfg, params = load_weights(checkpoint, ec)
        assert "int4:lm_head quantized as saved in" in caplog.text
    assert [p.suffix for p in (tmp_path / "weights").iterdir()] == [".xlw"]
    assert cfg == want_cfg == first[0]
    assert bits(params) == bits(want) == bits(first[1])
    # Another recipe or dtype is a file of its own.
    load_weights(checkpoint, config(checkpoint, tmp_path, "int8"))
    assert len(list((tmp_path / "weights").iterdir())) == 2


def test_engines_over_saved_weights_give_the_same_tokens(checkpoint, tmp_path, caplog):
    options = dict(quantize="int4:lm_head", compilation_cache_dir=str(tmp_path),
                   progress=False, max_num_seqs=4, max_model_len=64,
                   max_num_batched_tokens=16)
    prompts = [[5, 9, 13, 17, 21], [30, 31, 32]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    first = [r.token_ids for r in LLM(str(checkpoint), **options).generate(prompts, params)]
    with caplog.at_level(logging.INFO, logger="xlaserve"):
        llm = LLM(str(checkpoint), **options)
    assert "quantized as saved in" in caplog.text
    assert [r.token_ids for r in llm.generate(prompts, params)] == first
    assert len(set(first[0] + first[1])) > 2


def test_a_rewritten_checkpoint_or_a_damaged_file_quantizes_again(checkpoint, tmp_path,
                                                                   caplog):
    ec = config(checkpoint, tmp_path)
    load_weights(checkpoint, ec)
    [saved] = (tmp_path / "weights").iterdir()
    # the checkpoint's files changed (here: a modification time)
    meta = checkpoint / METADATA
    stat = meta.stat()
    os.utime(meta, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    with caplog.at_level(logging.INFO, logger="xlaserve"):
        load_weights(checkpoint, ec)
    assert "was made from other files or code: quantizing again" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="xlaserve"):
        load_weights(checkpoint, ec)
    assert "as saved in" in caplog.text  # rewritten for the new files
    # a damaged file: cut short
    saved.write_bytes(saved.read_bytes()[: saved.stat().st_size // 2])
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="xlaserve"):
        cfg, params = load_weights(checkpoint, ec)
    assert "unreadable" in caplog.text
    assert bits(params) == bits(load_model(checkpoint, progress=False,
                                           quantize="int4:lm_head")[1])
    # not a weights file at all
    saved.write_bytes(b"junk")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="xlaserve"):
        load_weights(checkpoint, ec)
    assert "not a weights file" in caplog.text


def test_nothing_saved_without_a_folder_a_recipe_or_room(checkpoint, tmp_path, monkeypatch,
                                                         caplog):
    load_weights(checkpoint, config(checkpoint, None))
    load_weights(checkpoint, config(checkpoint, tmp_path / "a", None))
    assert not (tmp_path / "a").exists()
    monkeypatch.setattr(weights_cache, "MAX_BYTES", 1000)
    with caplog.at_level(logging.INFO, logger="xlaserve"):
        load_weights(checkpoint, config(checkpoint, tmp_path / "b"))
    assert "not saved" in caplog.text
    assert not list((tmp_path / "b").rglob("*.xlw"))


def test_the_folder_keeps_the_most_recently_used_files_under_the_cap(checkpoint, tmp_path,
                                                                     monkeypatch):
    folder = tmp_path / "weights"
    files = {}
    for recipe in ("int8", "int4:lm_head", "fp8"):
        load_weights(checkpoint, config(checkpoint, tmp_path, recipe))
        files[recipe] = weights_cache.slot(folder, checkpoint, recipe, None)
    os.utime(files["int4:lm_head"], (100, 100))
    os.utime(files["int8"], (50, 50))
    load_weights(checkpoint, config(checkpoint, tmp_path, "int8"))  # read: now the newest
    room = files["int8"].stat().st_size + files["fp8"].stat().st_size
    monkeypatch.setattr(weights_cache, "MAX_BYTES", room + 1)
    files["fp8"].unlink()
    load_weights(checkpoint, config(checkpoint, tmp_path, "fp8"))  # saved again: one must go
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        (files["int8"].name, files["fp8"].name))


def test_a_quantized_checkpoint_is_not_cached(checkpoint, tmp_path):
    stored = tmp_path / "int8-ckpt"
    convert_hf(checkpoint.parent / "hf", stored, "float32", progress=False, quantize="int8")
    assert not weights_cache.cacheable(stored, "int8")
    assert weights_cache.cacheable(checkpoint, "int8")
    assert not weights_cache.cacheable(checkpoint.parent / "hf", "int8")  # a HF folder
