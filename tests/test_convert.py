"""scripts/convert_hf.py: sharded input, metadata, and every bad input's one-line error."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from model.checkpoint import is_checkpoint, load_model, read_metadata
from tests.hf_tiny import tiny_hf_model

ROOT = Path(__file__).resolve().parents[1]


def convert(*args):
    return subprocess.run([sys.executable, "scripts/convert_hf.py", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    tiny_hf_model("llama", d)
    return d


def copy_hf(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def assert_fails(result, out: Path, message: str):
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()  # a progress bar may come before the error
    assert lines[-1].startswith("error: ") and "Traceback" not in result.stderr, result.stderr
    assert message in lines[-1], lines[-1]
    assert not is_checkpoint(out) and not any(p.name.startswith(f".{out.name}.")
                                              for p in out.parent.iterdir())


def test_sharded_bfloat16_with_metadata(tmp_path):
    import torch
    hf = tmp_path / "sharded"
    model = tiny_hf_model("qwen2", hf.with_name("unused"))
    model.save_pretrained(hf, max_shard_size="100KB")
    assert (hf / "model.safetensors.index.json").is_file()
    out = tmp_path / "out"
    r = convert(hf, out, "--dtype", "bfloat16")
    assert r.returncode == 0, r.stderr
    meta = read_metadata(out)
    assert (meta["dtype"], meta["quantization"]) == ("bfloat16", "none")
    assert meta["source"] == str(hf.resolve())
    cfg, params = load_model(out)
    assert cfg.dtype == "bfloat16"
    embed = np.asarray(params["embed"], np.float32)
    want = model.model.embed_tokens.weight.detach().to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(embed, want)


def test_missing_folder(tmp_path):
    assert_fails(convert(tmp_path / "nope", tmp_path / "out"), tmp_path / "out", "does not exist")


def test_unsupported_architecture(hf_dir, tmp_path):
    bad = copy_hf(hf_dir, tmp_path / "bad")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    r = convert(bad, tmp_path / "out")
    assert_fails(r, tmp_path / "out", "unsupported architecture 'GPT2LMHeadModel'")
    assert "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM" in r.stderr


def test_missing_config(hf_dir, tmp_path):
    bad = copy_hf(hf_dir, tmp_path / "bad")
    (bad / "config.json").unlink()
    assert_fails(convert(bad, tmp_path / "out"), tmp_path / "out", "no config.json")


def test_missing_weights_file(hf_dir, tmp_path):
    bad = copy_hf(hf_dir, tmp_path / "bad")
    (bad / "model.safetensors").unlink()
    assert_fails(convert(bad, tmp_path / "out"), tmp_path / "out", "no *.safetensors")


def rewrite_weights(folder: Path, edit):
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def test_missing_tensor(hf_dir, tmp_path):
    bad = copy_hf(hf_dir, tmp_path / "bad")
    rewrite_weights(bad, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    assert_fails(convert(bad, tmp_path / "out"), tmp_path / "out",
                 "missing tensor(s): layers/mlp/up_proj/kernel (layers [1])")


def test_misshaped_tensor(hf_dir, tmp_path):
    bad = copy_hf(hf_dir, tmp_path / "bad")
    rewrite_weights(bad, lambda t: t.update({"model.norm.weight": np.ones(5, np.float32)}))
    assert_fails(convert(bad, tmp_path / "out"), tmp_path / "out",
                 "tensor 'model.norm.weight' has shape (5,), expected (72,)")


def test_output_folder_not_empty(hf_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    r = convert(hf_dir, out)
    assert r.returncode != 0 and "already exists and is not empty" in r.stderr
    assert (out / "keep.txt").read_text() == "mine"
