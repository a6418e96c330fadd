"""Start-up defaults (docs/architecture.md, "Defaults on a CPU"): what "auto" resolves to for
the demo model and for a named one, and how the default KV cache is sized off-GPU."""
from __future__ import annotations

import logging

import pytest

from serving.core.config import EngineConfig
from serving.engine import demo_defaults, sizing


def resolved(on_gpu=False, **kwargs):
    ec = demo_defaults.resolve(EngineConfig(**kwargs), on_gpu)
    return ec.quantize, ec.kv_cache_dtype


def test_the_demo_on_a_cpu_gets_the_fast_configuration(caplog):
    with caplog.at_level(logging.INFO, logger="xlaserve"):
        assert resolved() == ("int4:lm_head", "float16")
    assert "fastest measured configuration" in caplog.text


def test_a_named_model_keeps_its_checkpoint_and_dtype():
    assert resolved(model="some/folder") == (None, "auto")
    assert resolved(on_gpu=True) == (None, "auto")  # GPUs: vLLM's defaults


@pytest.mark.parametrize("on_gpu", [False, True])
def test_a_gguf_file_gets_llama_cpps_float16_cache(on_gpu, caplog):
    with caplog.at_level(logging.INFO, logger="xlaserve"):
        assert resolved(on_gpu, model="m/q4_k_m.gguf") == (None, "float16")
    assert "llama.cpp's default" in caplog.text
    assert resolved(on_gpu, model="m/q4_k_m.gguf", kv_cache_dtype="int8") == (None, "int8")


@pytest.mark.parametrize("kwargs,want", [
    (dict(quantize="none", kv_cache_dtype="float32"), (None, "float32")),  # the exact demo
    (dict(quantize="fp8"), ("fp8", "float16")),
    (dict(kv_cache_dtype="int8"), ("int4:lm_head", "int8")),
    (dict(model="m", quantize="int8", kv_cache_dtype="bfloat16"), ("int8", "bfloat16")),
    (dict(model="m", quantize=None), (None, "auto")),
])
def test_explicit_choices_are_kept(kwargs, want):
    assert resolved(**kwargs) == want


def test_the_default_kv_cache_holds_every_sequence_within_half_the_free_memory(
        monkeypatch, caplog):
    ec = EngineConfig(max_num_seqs=8, page_size=16)
    page = 1 << 20  # 1 MiB pages: 128 per 2048-token sequence
    monkeypatch.setattr(sizing, "available_memory", lambda: 64 << 30)
    with caplog.at_level(logging.INFO, logger="xlaserve"):
        assert sizing.num_pages(ec, page, 2048, "float16") == 8 * 128 + 1  # + the sink
    assert "1.00 GiB, 1024 pages of 16 tokens (8 full sequences)" in caplog.text
    assert "max_num_seqs 8 x max_model_len 2048" in caplog.text

    caplog.clear()
    monkeypatch.setattr(sizing, "available_memory", lambda: 1 << 30)  # half: 512 pages
    with caplog.at_level(logging.INFO, logger="xlaserve"):
        assert sizing.num_pages(ec, page, 2048) == 512 + 1
    assert "capped at 50% of the 1.0 GiB available" in caplog.text

    monkeypatch.setattr(sizing, "available_memory", lambda: 100 << 20)  # not one sequence
    with pytest.raises(ValueError, match="fewer than one sequence"):
        sizing.num_pages(ec, page, 2048)


def test_an_explicit_kv_cache_memory_wins(monkeypatch):
    monkeypatch.setattr(sizing, "available_memory", lambda: 1 << 30)
    ec = EngineConfig(max_num_seqs=8, page_size=16, kv_cache_memory="3GiB")
    assert sizing.num_pages(ec, 1 << 20, 2048) == 3072 + 1


def test_available_memory_reads_the_os():
    from pathlib import Path
    if Path("/proc/meminfo").exists():
        assert 0 < sizing.available_memory() < 1 << 50


@pytest.mark.parametrize("other_server_wrote_it", [True, False])
def test_two_servers_converting_the_demo_at_once(tmp_path, monkeypatch, other_server_wrote_it):
    """Two servers started together on a fresh machine both convert the demo model; the one
    whose rename finds the other's finished checkpoint serves it, any other failure stays."""
    import errno

    import model.checkpoint
    import model.demo
    monkeypatch.setattr(sizing, "default_cache_root", lambda: tmp_path)
    monkeypatch.setattr(model.demo, "fetch_demo_model", lambda out: out)
    ckpt = tmp_path / "demo" / "SmolLM2-135M-Instruct"

    def convert_beside_another(hf_dir, out_dir, dtype):
        if other_server_wrote_it:
            out_dir.mkdir(parents=True)
            (out_dir / model.checkpoint.METADATA).write_text("{}")
        raise OSError(errno.ENOTEMPTY, "Directory not empty", str(out_dir))

    monkeypatch.setattr(model.checkpoint, "convert_hf", convert_beside_another)
    if other_server_wrote_it:
        assert sizing.resolve_model_dir(None) == ckpt
    else:
        with pytest.raises(OSError, match="Directory not empty"):
            sizing.resolve_model_dir(None)
