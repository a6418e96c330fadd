"""gpt-oss checkpoints with MXFP4 experts (model/formats/mxfp4.py): the dequantization
against transformers' own, and a tiny gpt-oss folder stored as the Hub's are (experts as
`_blocks` / `_scales`, a quantization_config) giving transformers' greedy tokens, in the
model's dtype and quantized again by a recipe."""
import json

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from model.formats import mxfp4
from model.hf_weights import WeightsError
from serving import LLM, SamplingParams
from tests.hf_tiny import greedy_reference, tiny_hf_model

PROMPTS = [[5], [(7 * i) % 200 + 3 for i in range(23)]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
OPTIONS = dict(max_num_seqs=2, max_model_len=64, page_size=4, progress=False)


def encode(w: np.ndarray):
    """float[E, in, out] -> (blocks, scales) of the nearest MXFP4 values: per 32 inputs the
    smallest power of two that brings their largest magnitude within 6."""
    e, n_in, out = w.shape
    groups = w.transpose(0, 2, 1).reshape(e, out, n_in // 32, 32)
    amax = np.abs(groups).max(axis=-1)
    exp = np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)).astype(np.int32)
    scaled = groups / np.ldexp(1.0, exp)[..., None]
    codes = np.abs(scaled[..., None] - mxfp4.FP4_VALUES).argmin(axis=-1).astype(np.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scales = exp + mxfp4.SCALE_BIAS
    # contiguous: safetensors writes an array's buffer as it lies
    return (np.ascontiguousarray(blocks, np.uint8), np.ascontiguousarray(scales, np.uint8))


def test_dequantize_matches_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 40, 2, 16), dtype=np.uint8)
    scales = rng.integers(120, 134, (3, 40, 2), dtype=np.uint8)
    want = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                      dtype=torch.float32).numpy()
    np.testing.assert_array_equal(mxfp4.dequantize(blocks, scales), want)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="do not fit"):
        mxfp4.dequantize(np.zeros((1, 4, 2, 16), np.uint8), np.zeros((1, 4, 3), np.uint8))


@pytest.fixture(scope="module")
def mxfp4_folder(tmp_path_factory):
    """A tiny gpt-oss with hidden and expert sizes in whole groups of 32, its experts
    stored in MXFP4; the transformers model holding the same (dequantized) weights."""
    folder = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    model = tiny_hf_model("gpt_oss", folder, intermediate_size=64)
    tensors = load_file(folder / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = encode(tensors.pop(name))
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        param = model.get_parameter(name)
        with torch.no_grad():
            param.copy_(torch.from_numpy(mxfp4.dequantize(blocks, scales)))
    save_file(tensors, folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"]}
    (folder / "config.json").write_text(json.dumps(config))
    return folder, model


def test_mxfp4_folder_gives_transformers_tokens(mxfp4_folder):
    folder, model = mxfp4_folder
    llm = LLM(str(folder), **OPTIONS)
    assert llm.engine.quantization == "not quantized"  # dequantized into float32
    ours = [r.token_ids for r in llm.generate(PROMPTS, GREEDY)]
    assert ours == [greedy_reference(model, p, 8) for p in PROMPTS]


def test_mxfp4_folder_quantized_again_by_a_recipe(mxfp4_folder):
    """int8 per channel on top of the dequantized experts: it loads, says so, and runs."""
    folder, _ = mxfp4_folder
    llm = LLM(str(folder), quantize="int8", **OPTIONS)
    assert llm.engine.quantization.startswith("int8")
    out = llm.generate(PROMPTS, GREEDY)
    assert [len(r.token_ids) for r in out] == [8, 8]


def test_missing_scales_are_named(mxfp4_folder, tmp_path):
    folder, _ = mxfp4_folder
    for f in folder.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(WeightsError, match="layers.1.mlp.experts.down_proj_blocks"):
        LLM(str(tmp_path), **OPTIONS)
