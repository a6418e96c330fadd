"""fp8 folders of `quant_method: "fp8"` served as they are (model/formats/fp8_blocks.py): block
scales kept with their fp8 values (an Fp8BlockArray, never widened; its dequantization the
format's own, bit for bit, partial last blocks included), a per-tensor scale onto the fp8
kernel, static activation scales read and checked; greedy tokens against transformers on the
same weights; refusals by name. tests/test_fp8_block_weights.py serves them."""
from __future__ import annotations

import numpy as np
import pytest

from model.checkpoint import load_model
from model.config import ModelConfig
from model.formats import FormatError, load_prequantized, quantization_config
from model.hf_weights import WeightsError
from quant.array import QuantArray
from quant.fp8_blocks import Fp8BlockArray
from tests.hf_tiny import tiny_hf_model
from tests.quantized_tiny import (SIZES, assert_weights_equal, edited_copy,
                                  greedy_tokens_agree, kernel, write_fp8, written_once)

# name -> (write_fp8 options, the form q_proj lands in)
VARIANTS = {
    "block-32": (dict(block=(32, 32)), "fp8 blocks"),
    "block-48-ragged": (dict(block=(48, 48)), "fp8 blocks"),
    "block-128": (dict(block=(128, 128)), "fp8 blocks"),
    "block-64x32": (dict(block=(64, 32)), "fp8 blocks"),
    "tensor-static": (dict(block=None, static=True), "fp8 per tensor"),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    return root, tiny_hf_model("mistral", root / "hf", seed=8, **SIZES)


@pytest.fixture(scope="module")
def folders(tiny):
    root, model = tiny
    return written_once(lambda name: write_fp8(model, root / name, **VARIANTS[name][0]))


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_weights_equal_the_formats_dequantization(folders, name):
    folder, expected = folders(name)
    cfg, params = load_model(folder, progress=False)
    assert_weights_equal(params, cfg, expected)
    q = kernel(params, "attn", "q_proj")
    options, want = VARIANTS[name]
    if want == "fp8 blocks":  # never widened: the file's fp8 values, [in, out]
        bn, bk = options["block"]
        assert isinstance(q, Fp8BlockArray) and q.values.dtype == np.dtype("float8_e4m3fn")
        assert q.block == (bk, bn) and q.scale.dtype == np.float32
        assert q.scale.shape == (cfg.num_layers, -(-q.shape[-2] // bk), -(-q.shape[-1] // bn))
    else:
        assert isinstance(q, QuantArray) and q.scheme == "fp8"
        assert q.per_tensor == (want == "fp8 per tensor")


def test_log_says_what_became_of_the_scales(folders):
    folder, _ = folders("block-32")
    cfg = ModelConfig.from_dir(folder)
    _, log = load_prequantized(folder, cfg, quantization_config(folder))
    assert any("fp8 with 32x32 block scales (weight_block_size [32, 32]): kept in fp8" in line
               for line in log)
    assert any(line.strip().startswith("q_proj: fp8 with 32x32 block scales on ")
               for line in log), log
    folder, _ = folders("tensor-static")
    _, log = load_prequantized(folder, cfg, quantization_config(folder))
    assert any("input_scale is read and checked" in line for line in log)


def test_greedy_tokens_equal_transformers_on_the_dequantized_weights(folders, tiny):
    folder, expected = folders("block-32")
    greedy_tokens_agree(tiny[1], folder, expected)


REFUSED = {
    "fmt": lambda qc: qc.update(fmt="e5m2"),
    "scale_fmt": lambda qc: qc.update(scale_fmt="ue8m0"),
    "weight_block_size": lambda qc: qc.update(weight_block_size=[128]),
    "activation_scheme": lambda qc: qc.update(activation_scheme="per_token"),
    "kv_cache_quant_method": lambda qc: qc.update(kv_cache_quant_method="fp8"),
}


@pytest.mark.parametrize("field", sorted(REFUSED))
def test_settings_we_do_not_serve_are_refused_by_name(folders, tmp_path, field):
    folder, _ = folders("block-32")
    bad = edited_copy(folder, tmp_path / "bad", edit_qc=REFUSED[field])
    with pytest.raises(FormatError, match=f"quant_method 'fp8': {field} = "):
        load_model(bad, progress=False)


def test_block_scales_of_another_shape_are_a_clear_error(folders, tmp_path):
    folder, _ = folders("block-32")
    bad = edited_copy(folder, tmp_path / "bad",
                      edit_qc=lambda qc: qc.update(weight_block_size=[64, 64]))
    with pytest.raises(WeightsError, match=r"down_proj: weight_scale_inv has shape \(2, 4\); a "
                                           r"layer of 128 inputs and 64 outputs stores it as "
                                           r"\(1, 2\)"):
        load_model(bad, progress=False)


def test_quantize_flag_must_agree(folders):
    folder, _ = folders("tensor-static")
    with pytest.raises(FormatError, match="already quantized"):
        load_model(folder, quantize="fp8:channel", progress=False)
