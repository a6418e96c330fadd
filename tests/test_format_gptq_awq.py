"""GPTQ and AWQ folders served as they are (model/formats/gptq.py, awq.py): the packings as
AutoGPTQ and AutoAWQ write them, v1 and v2 zero points, act-order, 4 and 8 bits, each read
exactly as the format dequantizes it and onto our forms where they map; greedy tokens against
transformers on the same weights; refusals by name and clear errors for damaged files."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from model.checkpoint import load_model
from model.formats import FormatError
from model.formats.quantized_folder import unpack_int32
from model.hf_weights import WeightsError
from quant.array import QuantArray
from quant.int4 import Int4Array
from tests.hf_tiny import tiny_hf_model
from tests.quantized_tiny import (AWQ_ORDER, SIZES, assert_weights_equal, edited_copy,
                                  greedy_tokens_agree, kernel, pack_along_cols,
                                  pack_along_rows, write_awq, write_gptq, written_once)

# name -> (writer, options, the form q_proj lands in, or None: not asserted)
VARIANTS = {
    "gptq-int4-g32": (write_gptq, dict(), "int4"),
    "gptq-int4-g32-asym": (write_gptq, dict(sym=False), "int4"),
    "gptq-v2-int4-g64-asym": (write_gptq, dict(v2=True, sym=False, group_size=64), "int4"),
    "gptq-int4-channel": (write_gptq, dict(group_size=-1), "int4"),
    "gptq-int4-desc-act": (write_gptq, dict(desc_act=True), "float32"),
    "gptq-int8-channel": (write_gptq, dict(bits=8, group_size=-1), "int8"),
    "gptq-v2-int8-g32": (write_gptq, dict(bits=8, v2=True), None),
    "gptq-quantize-config": (write_gptq, dict(quantize_config_file=True), "int4"),
    "awq-g32": (write_awq, dict(), "int4"),
    "awq-g64-skip": (write_awq, dict(group_size=64, skip=("mlp.down_proj",)), "int4"),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """qwen2 (biases) for GPTQ, qwen3 (tied head, q/k norms) for AWQ."""
    root = tmp_path_factory.mktemp("gptq-awq")
    sizes = dict(SIZES, layer_types=["full_attention"] * SIZES["num_hidden_layers"])
    return root, {"gptq": tiny_hf_model("qwen2", root / "qwen2", seed=4, **sizes),
                  "awq": tiny_hf_model("qwen3", root / "qwen3", seed=6, **sizes)}


@pytest.fixture(scope="module")
def folders(models):
    root, by_format = models

    def write(name):
        writer, options, _ = VARIANTS[name]
        return writer(by_format[name.split("-")[0]], root / name, **options)
    return written_once(write)


# -- the packings ------------------------------------------------------------------------------

def test_packings_are_the_ones_the_tools_write():
    # GPTQ: rows 0..7 of a column in one word, row j at bits 4j
    rows = pack_along_rows(np.arange(1, 9).reshape(8, 1), 4)
    assert rows.view(np.uint32)[0, 0] == 0x87654321
    # AWQ: outputs 0..7 in one word, the fields holding outputs 0, 2, 4, 6, 1, 3, 5, 7
    cols = pack_along_cols(np.arange(8).reshape(1, 8), 4, AWQ_ORDER)
    assert cols.view(np.uint32)[0, 0] == 0x75316420
    np.testing.assert_array_equal(unpack_int32(rows, 4, 0)[:, 0], np.arange(1, 9))
    np.testing.assert_array_equal(unpack_int32(cols, 4, 1, AWQ_ORDER)[0], np.arange(8))


def test_gptq_rows_pack_as_compressed_tensors_packs_them():
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    codes = np.random.default_rng(0).integers(0, 16, (64, 24))
    theirs = pack_to_int32(torch.from_numpy(codes.T - 8).to(torch.int8), 4).numpy()
    np.testing.assert_array_equal(pack_along_rows(codes, 4), theirs.T)


# -- weights -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_weights_equal_the_formats_dequantization(folders, name):
    folder, expected = folders(name)
    cfg, params = load_model(folder, progress=False)
    assert_weights_equal(params, cfg, expected)
    want = VARIANTS[name][2]
    q = kernel(params, "attn", "q_proj")
    if want == "int4":
        assert isinstance(q, Int4Array) and q.values.max() <= 15
    elif want == "int8":
        assert isinstance(q, QuantArray) and q.scheme == "int8" and not q.per_tensor
    elif want == "float32":
        assert isinstance(q, np.ndarray) and q.dtype == np.float32


def test_biases_and_modules_not_converted_load_as_floats(folders, models):
    _, by_format = models
    folder, _ = folders("gptq-int4-g32")
    cfg, params = load_model(folder, progress=False)
    bias = np.asarray(params["layers"]["attn"]["q_proj"]["bias"][1])
    np.testing.assert_array_equal(
        bias, by_format["gptq"].model.layers[1].self_attn.q_proj.bias.detach().numpy())
    folder, expected = folders("awq-g64-skip")
    assert not any("down_proj" in name for name in expected)
    cfg, params = load_model(folder, progress=False)
    down = kernel(params, "mlp", "down_proj")
    want = by_format["awq"].model.layers[0].mlp.down_proj.weight.detach().numpy()
    np.testing.assert_array_equal(down[0].T, want)


@pytest.mark.parametrize("name", ["gptq-int4-g32", "awq-g32"])
def test_greedy_tokens_equal_transformers_on_the_dequantized_weights(folders, models, name):
    folder, expected = folders(name)
    greedy_tokens_agree(models[1][name.split("-")[0]], folder, expected)


# -- refusals and damaged files ------------------------------------------------------------------

REFUSED = {
    ("gptq", "bits"): lambda qc: qc.update(bits=3),
    ("gptq", "checkpoint_format"): lambda qc: qc.update(checkpoint_format="marlin"),
    ("gptq", "lm_head"): lambda qc: qc.update(lm_head=True),
    ("gptq", "dynamic"): lambda qc: qc.update(dynamic={r"+:.*down": {"bits": 8}}),
    ("gptq", "rotation"): lambda qc: qc.update(rotation="hadamard"),
    ("awq", "bits"): lambda qc: qc.update(bits=8),
    ("awq", "zero_point"): lambda qc: qc.update(zero_point=False),
    ("awq", "version"): lambda qc: qc.update(version="gemv"),
}


@pytest.mark.parametrize("method, field", sorted(REFUSED))
def test_settings_we_do_not_serve_are_refused_by_name(folders, tmp_path, method, field):
    folder, _ = folders("gptq-int4-g32" if method == "gptq" else "awq-g32")
    bad = edited_copy(folder, tmp_path / "bad", edit_qc=REFUSED[method, field])
    with pytest.raises(FormatError, match=f"quant_method '{method}': {field} = "):
        load_model(bad, progress=False)


def test_awq_gemv_is_refused_with_the_way_out(folders, tmp_path):
    folder, _ = folders("awq-g32")
    bad = edited_copy(folder, tmp_path / "bad", edit_qc=lambda qc: qc.update(version="GEMV"))
    with pytest.raises(FormatError, match="AWQ version 'GEMV' is not served; use a GEMM "
                                          "checkpoint"):
        load_model(bad, progress=False)


def test_quantize_flag_must_agree(folders):
    folder, _ = folders("gptq-quantize-config")
    with pytest.raises(FormatError, match="already quantized.*'gptq'"):
        load_model(folder, quantize="int8", progress=False)
    load_model(folder, quantize="gptq", progress=False)


def test_a_checkpoint_format_named_for_a_float_folder_is_refused(models):
    root, _ = models
    with pytest.raises(FormatError, match="--quantize awq names a checkpoint format"):
        load_model(root / "qwen2", quantize="awq", progress=False)


def test_qweight_of_another_shape_is_a_clear_error(folders, tmp_path):
    folder, _ = folders("gptq-int4-g32")
    bad = edited_copy(folder, tmp_path / "bad",
                      edit_config=lambda c: c.update(intermediate_size=96))
    with pytest.raises(WeightsError, match=r"down_proj: qweight has shape \(16, 64\); a layer "
                                           r"of 96 inputs and 64 outputs stores it as \(12, 64\)"):
        load_model(bad, progress=False)


@pytest.mark.parametrize("damage, message", [
    (lambda data: data[: len(data) // 2], "is truncated: tensor"),
    (lambda data: data[:5], "not a readable safetensors file"),
    (lambda data: data[:8] + b"\xff" * (len(data) - 8), "not a readable safetensors file"),
])
def test_damaged_safetensors_are_a_clear_error(folders, tmp_path, damage, message):
    folder, _ = folders("awq-g32")
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in folder.iterdir():
        data = f.read_bytes()
        (bad / f.name).write_bytes(damage(data) if f.suffix == ".safetensors" else data)
    with pytest.raises(WeightsError, match=message):
        load_model(bad, progress=False)
