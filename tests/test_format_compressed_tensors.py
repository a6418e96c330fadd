"""compressed-tensors folders served as they are (model/formats/compressed_tensors.py): each
format and strategy llm-compressor writes, made by the compressed-tensors package itself, read
exactly as its own decompressor reads it, onto our forms where they map; greedy tokens against
transformers on the same weights; settings we do not serve refused by name."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from model.checkpoint import load_model
from model.config import ModelConfig
from model.formats import FormatError, load_prequantized, quantization_config
from model.formats.compressed_tensors import make_reader
from model.hf_weights import WeightsError
from quant.array import QuantArray
from quant.int4 import Int4Array
from tests.hf_tiny import tiny_hf_model
from tests.quantized_tiny import (SIZES, assert_weights_equal, edited_copy,
                                  greedy_tokens_agree, kernel, per_layer,
                                  write_compressed_tensors,
                                  written_once)

FP8 = dict(num_bits=8, type="float")
INT8 = dict(num_bits=8, type="int")
INT4 = dict(num_bits=4, type="int")
# name -> (write_compressed_tensors options, the form q_proj lands in, or None: not asserted)
VARIANTS = {
    "fp8-dynamic": (dict(weights=dict(FP8, strategy="channel"), fmt="float-quantized",
                         input_activations=dict(FP8, strategy="token", dynamic=True)),
                    "fp8 per channel"),
    "fp8-static": (dict(weights=dict(FP8, strategy="tensor"), fmt="float-quantized",
                        input_activations=dict(FP8, strategy="tensor")), "fp8 per tensor"),
    "w8a8": (dict(weights=dict(INT8, strategy="channel"), fmt="int-quantized",
                  input_activations=dict(INT8, strategy="token", dynamic=True)),
             "int8 per channel"),
    "naive-fp8-weight-only": (dict(weights=dict(FP8, strategy="channel"),
                                   fmt="naive-quantized", scale_dtype=torch.float32),
                              "fp8 per channel"),
    "naive-int8-tensor": (dict(weights=dict(INT8, strategy="tensor"), fmt="naive-quantized",
                               scale_dtype=torch.float16), "int8 per channel"),
    "w4a16-g32": (dict(weights=dict(INT4, strategy="group", group_size=32),
                       fmt="pack-quantized",
                       ignore=("lm_head", r"re:.*layers\.1\.mlp\.down_proj")), "int4"),
    "w4a16-asym-g64": (dict(weights=dict(INT4, strategy="group", group_size=64,
                                         symmetric=False), fmt="pack-quantized",
                            scale_dtype=torch.float16), "int4"),
    "w4a16-actorder": (dict(weights=dict(INT4, strategy="group", group_size=32),
                            fmt="pack-quantized", actorder=True), "float32"),
    "w8a16-channel": (dict(weights=dict(INT8, strategy="channel"), fmt="pack-quantized"),
                      "int8 per channel"),
    "w8a16-g32-asym": (dict(weights=dict(INT8, strategy="group", group_size=32,
                                         symmetric=False), fmt="pack-quantized"), None),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("ct")
    return root, tiny_hf_model("llama", root / "hf", seed=3, **SIZES)


@pytest.fixture(scope="module")
def folders(tiny):
    """name -> (folder, expected), each variant written once, when first asked for."""
    root, model = tiny

    def write(name):
        options = dict(VARIANTS[name][0])
        return write_compressed_tensors(model, root / name, options.pop("weights"),
                                        options.pop("fmt"), **options)
    return written_once(write)


# -- weights -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_weights_equal_the_packages_dequantization(folders, name):
    folder, expected = folders(name)
    cfg, params = load_model(folder, progress=False)
    assert_weights_equal(params, cfg, expected)
    want = VARIANTS[name][1]
    for layer in range(cfg.num_layers):
        assert_form(kernel(params, "attn", "q_proj", layer), want)


def assert_form(q, want):
    if want == "int4":
        assert isinstance(q, Int4Array) and q.values.max() <= 15
    elif want == "float32":
        assert isinstance(q, np.ndarray) and q.dtype == np.float32
    elif want is not None:
        kind, per = want.split(" per ")
        assert isinstance(q, QuantArray) and q.scheme == kind
        assert q.per_tensor == (per == "tensor")


def test_ignored_layers_are_the_float_weights(folders, tiny):
    folder, expected = folders("w4a16-g32")
    assert "model.layers.1.mlp.down_proj.weight" not in expected
    cfg, params = load_model(folder, progress=False)
    # Layer 1's down_proj is float while layer 0's stays on the int4 kernel: forms differ,
    # so the layers are kept per layer (docs/architecture.md, model/formats/param_tree.py).
    assert per_layer(params)
    assert isinstance(kernel(params, "mlp", "down_proj", 0), Int4Array)
    down = kernel(params, "mlp", "down_proj", 1)
    assert isinstance(down, np.ndarray) and down.dtype == np.float32
    want = tiny[1].model.layers[1].mlp.down_proj.weight.detach().numpy()
    np.testing.assert_array_equal(down.T, want)


def test_log_says_how_activations_run(folders):
    folder, _ = folders("fp8-static")
    cfg = ModelConfig.from_dir(folder)
    _, log = load_prequantized(folder, cfg, quantization_config(folder))
    text = "\n".join(log)
    assert "checkpoint format: compressed-tensors" in text
    assert "input_scale read and checked" in text and "fp8 at run time" in text
    folder, _ = folders("w4a16-actorder")
    _, log = load_prequantized(folder, cfg, quantization_config(folder))
    assert any("dequantized at load" in line for line in log)


@pytest.mark.parametrize("name", ["w4a16-g32", "fp8-dynamic"])
def test_greedy_tokens_equal_transformers_on_the_dequantized_weights(folders, tiny, name):
    folder, expected = folders(name)
    greedy_tokens_agree(tiny[1], folder, expected)


def test_a_module_takes_the_group_that_names_it_most_closely():
    four = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32}
    eight = {"num_bits": 8, "type": "int", "strategy": "channel"}
    reader = make_reader({
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "ignore": ["lm_head", r"re:.*\.1\.mlp\.gate_proj$"],
        "config_groups": {"by_class": {"targets": ["Linear"], "weights": four},
                          "by_regex": {"targets": [r"re:.*mlp\.\w+_proj$"], "weights": eight},
                          "by_name": {"targets": ["model.layers.0.mlp.up_proj"],
                                      "weights": four}}}, None)
    layer = "model.layers.{}.{}"
    assert reader.scheme_for(layer.format(0, "self_attn.q_proj")).name == "by_class"
    assert reader.scheme_for(layer.format(0, "mlp.down_proj")).name == "by_regex"
    assert reader.scheme_for(layer.format(0, "mlp.up_proj")).name == "by_name"
    assert reader.scheme_for(layer.format(1, "mlp.gate_proj")) is None
    assert reader.scheme_for("lm_head") is None


# -- refusals ----------------------------------------------------------------------------------

def _weights(qc):
    return qc["config_groups"]["group_0"]["weights"]


REFUSED = {
    "kv_cache_scheme": lambda qc: qc.update(kv_cache_scheme={"num_bits": 8, "type": "float"}),
    "format": lambda qc: qc.update(format="marlin-24"),
    "mixed-precision": lambda qc: qc.update(format="mixed-precision"),
    "nvfp4-pack-quantized": lambda qc: qc.update(format="nvfp4-pack-quantized"),
    "strategy": lambda qc: _weights(qc).update(strategy="block", block_structure=[128, 128]),
    "num_bits": lambda qc: _weights(qc).update(num_bits=3),
    "actorder": lambda qc: _weights(qc).update(actorder="sideways"),
    "type": lambda qc: _weights(qc).update(type="fp4"),
    "targets": lambda qc: qc["config_groups"]["group_0"].update(targets=["Embedding"]),
    "output_activations": lambda qc: qc["config_groups"]["group_0"].update(
        output_activations={"num_bits": 8}),
    "rotation": lambda qc: _weights(qc).update(rotation="hadamard"),
}


@pytest.mark.parametrize("field", sorted(REFUSED))
def test_settings_we_do_not_serve_are_refused_by_name(folders, tmp_path, field):
    folder, _ = folders("w4a16-g32")
    bad = edited_copy(folder, tmp_path / "bad", edit_qc=REFUSED[field])
    with pytest.raises(FormatError, match=f"'compressed-tensors'.*{field}"):
        load_model(bad, progress=False)


def test_unknown_quant_method_is_refused(folders, tmp_path):
    folder, _ = folders("w4a16-g32")
    bad = edited_copy(folder, tmp_path / "bad",
                      edit_qc=lambda qc: qc.update(quant_method="bitsandbytes"))
    with pytest.raises(FormatError, match="quant_method 'bitsandbytes'"):
        load_model(bad, progress=False)


def test_quantize_flag_must_agree(folders):
    folder, _ = folders("w8a8")
    with pytest.raises(FormatError, match="already quantized"):
        load_model(folder, quantize="int8", progress=False)


def test_packed_weights_of_another_shape_are_a_clear_error(folders, tmp_path):
    folder, _ = folders("w4a16-g32")
    bad = edited_copy(folder, tmp_path / "bad",
                      edit_config=lambda c: c.update(intermediate_size=96))
    with pytest.raises(WeightsError, match=r"down_proj: weight_shape \(64, 128\) is not the "
                                           r"layer's \(64, 96\)"):
        load_model(bad, progress=False)
