"""GGUF files served as they are (model/formats/gguf_file.py, gguf_tensors.py): each block type
read exactly as llama.cpp reads it, onto the int4 and 8-bit group kernels where it maps (Q6_K
and Q3_K in 8-bit groups of 16, IQ4_NL and IQ4_XS's levels in groups of 32; Q5_1, Q5_K and
Q2_K with an offset per group), tiny models of each
family token for token against transformers on the same (dequantized) weights, the demo's
own file, and clear errors for damaged files."""
from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from model.checkpoint import load_model
from model.formats.gguf_file import GGUFError, gguf_folder
from model.formats.gguf_tensors import embedding, tensor_form, unpermute_order
from model.formats.param_tree import dequantize_np
from model.hf_weights import _target
from quant.int4 import Int4Array
from quant.int8_groups import Int8GroupArray
from quant.recipe import describe as describe_quantization
from serving import LLM, SamplingParams
from tests.gguf_tiny import LLAMA3_ROPE, own_cache, permute_for_llama_cpp, write_gguf
from tests.hf_tiny import greedy_reference, tiny_hf_model

SIZES = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, head_dim=16,
             initializer_range=0.1)  # 0.02 leaves tokens blind to a misread tensor
OPTIONS = dict(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=16, page_size=4,
               token_buckets=(4, 16), request_buckets=(4,), page_buckets=(16,), progress=False)
# Each family with a mix of block types: the int4 kernel's (Q4_0, Q4_1), the 8-bit group
# kernel's (Q8_0, Q5_0 in groups of 32, Q6_K in groups of 16; with mins Q5_1 and Q5_K in
# groups of 32, Q2_K in groups of 16), F16, one no kernel takes (TQ2_0, dequantized at load)
# and float32. llama's attn_k, attn_v, ffn_down and ffn_up differ between layers and its head
# is Q6_K, as a Q4_K_M file's are (its sizes are multiples of the K-quants' 256).
MIXES = {"llama": {"attn_q": T.Q4_0, "blk.1.attn_q": T.IQ4_XS, "attn_k": T.Q4_1,
                   "blk.1.attn_k": T.Q2_K, "attn_v": T.Q8_0, "blk.1.attn_v": T.Q6_K,
                   "ffn_down": T.Q4_0, "blk.0.ffn_down": T.Q6_K, "blk.1.ffn_down": T.Q5_1,
                   "ffn_gate": T.Q4_1, "blk.1.ffn_gate": T.Q3_K, "ffn_up": T.F16,
                   "blk.0.ffn_up": T.TQ2_0, "blk.1.ffn_up": T.Q5_K, "output": T.Q6_K,
                   "token_embd": T.Q8_0},
         "qwen2": {"attn_q": T.Q4_1, "attn_output": T.Q4_0, "ffn_up": T.Q4_0,
                   "token_embd": T.Q4_1},
         "qwen3": {"attn_k": T.Q4_0, "ffn_down": T.Q4_1, "ffn_gate": T.Q8_0,
                   "attn_v": T.Q5_0, "ffn_up": T.IQ4_NL, "token_embd": T.Q5_0}}
PROMPTS = [[1, 17, 33, 5, 90], [1, 200, 3, 3, 3, 150, 42, 7, 9]]


@pytest.fixture(scope="module")
def gguf_cache(tmp_path_factory):
    yield from own_cache(tmp_path_factory)


@pytest.fixture(scope="module", params=sorted(MIXES))
def tiny_gguf(request, tmp_path_factory, gguf_cache):
    family = request.param
    out = tmp_path_factory.mktemp(f"gguf-{family}")
    overrides = dict(SIZES, tie_word_embeddings=family != "llama")
    if family == "qwen2":  # its tiny config has 3 KV heads
        overrides.pop("head_dim")
        overrides["num_key_value_heads"] = 2
    if family == "llama":  # Llama 3's rope scaling, written as llama.cpp's rope_freqs
        overrides["rope_parameters"] = LLAMA3_ROPE
        overrides.update(hidden_size=256, intermediate_size=256)  # Q6_K's super-blocks
    model = tiny_hf_model(family, out / "hf", seed=5, **overrides)
    path, expected = write_gguf(model, family, out / f"{family}.gguf", MIXES[family])
    return family, model, path, expected


# -- each block type ---------------------------------------------------------------------------

@pytest.mark.parametrize("kind", [T.Q4_0, T.Q4_1, T.Q8_0, T.F16, T.BF16, T.Q5_0, T.Q5_1])
def test_block_types_read_as_the_format_dequantizes_them(kind):
    w = np.random.default_rng(int(kind)).standard_normal((48, 256)).astype(np.float32)
    data = quantize(w, kind)
    value = tensor_form(data, kind, (256, 48))
    want = np.asarray(dequantize(data, kind), np.float32).reshape(48, 256).T
    np.testing.assert_array_equal(dequantize_np(value), want)
    assert isinstance(value, Int4Array) == (kind in (T.Q4_0, T.Q4_1))
    assert isinstance(value, Int8GroupArray) == (kind in (T.Q8_0, T.Q5_0, T.Q5_1))
    if isinstance(value, Int4Array):
        assert value.scale.dtype == np.float16 and value.values.max() <= 15
    if isinstance(value, Int8GroupArray):  # a kernel [in, out], a float16 scale per 32 inputs
        assert value.scale.shape == (256 // 32, 48) and value.scale.dtype == np.float16
        assert (value.offset is not None) == (kind == T.Q5_1)  # and Q5_1's float16 min


def random_q4_k(rows: int, cols: int, seed: int) -> np.ndarray:
    """Q4_K blocks of random codes, scales and mins (the gguf package only dequantizes K-quants)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // 256, 144), dtype=np.uint8)
    d = (rng.random((rows, cols // 256, 2)) * 0.01).astype(np.float16)
    raw[..., 0:4] = d.view(np.uint8).reshape(rows, cols // 256, 4)
    return raw.reshape(rows, -1)


def test_q4_k_runs_on_the_int4_form_exactly():
    data = random_q4_k(32, 512, seed=1)
    value = tensor_form(data, T.Q4_K, (512, 32))
    assert isinstance(value, Int4Array)
    want = np.asarray(dequantize(data, T.Q4_K), np.float32).reshape(32, 512).T
    np.testing.assert_array_equal(dequantize_np(value), want)


# block type -> (values, bytes, where its float16 d is, float16s there: d, or d and dmin)
BLOCKS = {T.Q6_K: (256, 210, 208, 1), T.Q3_K: (256, 110, 108, 1), T.IQ4_NL: (32, 18, 0, 1),
          T.IQ4_XS: (256, 136, 0, 1), T.Q5_K: (256, 176, 0, 2), T.Q2_K: (256, 84, 80, 2)}


def random_blocks(kind: T, rows: int, cols: int, seed: int) -> np.ndarray:
    """Blocks of random bytes (every code, scale, min and high bit) and a small float16 d
    (and dmin)."""
    values, size, at, halves = BLOCKS[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // values, size), dtype=np.uint8)
    d = (rng.random((rows, cols // values, halves)) * 0.01).astype(np.float16)
    raw[..., at:at + 2 * halves] = d.view(np.uint8)
    return raw.reshape(rows, -1)



def test_q6_k_runs_on_8_bit_groups_of_16_exactly():
    """A kernel and an embedding table: codes q - 32, float32 scales d * sc per 16 values,
    equal to the gguf package's dequantization bit for bit."""
    data = random_blocks(T.Q6_K, 48, 512, seed=2)
    want = np.asarray(dequantize(data, T.Q6_K), np.float32).reshape(48, 512)
    kernel = tensor_form(data, T.Q6_K, (512, 48))
    table = embedding(data, T.Q6_K, (512, 48))
    for value, shape, dense in ((kernel, (512 // 16, 48), want.T), (table, (48, 512 // 16), want)):
        assert isinstance(value, Int8GroupArray) and value.group == 16
        assert value.scale.shape == shape and value.scale.dtype == np.float32
        assert value.values.min() == -32 and value.values.max() == 31
        np.testing.assert_array_equal(dequantize_np(value), dense)
        np.testing.assert_array_equal(np.asarray(value.dequantize()), dense)
    assert kernel.group_axis == -2 and table.group_axis == -1


@pytest.mark.parametrize("kind,group,codes", [(T.Q3_K, 16, (-4, 3)),
                                              (T.IQ4_NL, 32, (-127, 113)),
                                              (T.IQ4_XS, 32, (-127, 113)),
                                              (T.Q5_K, 32, (0, 31)), (T.Q2_K, 16, (0, 3)),
                                              (T.Q5_1, 32, (0, 31))])
def test_k_iq4_and_min_blocks_run_on_8_bit_groups_exactly(kind, group, codes):
    """Q3_K's codes -4 .. 3 with float32 scales d * (sc - 32) per 16; IQ4's non-linear
    levels as codes, with the block's d (IQ4_NL) or float32 d * (ls - 32) per 32 (IQ4_XS);
    with mins as offsets, Q5_K's and Q2_K's codes with float32 scales d * sc and offsets
    -(dmin * mn) per 32 or 16, Q5_1's with the block's float16 d and m: a kernel and a table
    equal to the gguf package's dequantization bit for bit, in numpy and in jnp."""
    if kind == T.Q5_1:  # the package writes it
        data = quantize(np.random.default_rng(5).standard_normal((48, 512), np.float32), kind)
    else:
        data = random_blocks(kind, 48, 512, seed=int(kind))
    want = np.asarray(dequantize(data, kind), np.float32).reshape(48, 512)
    kernel = tensor_form(data, kind, (512, 48))
    table = embedding(data, kind, (512, 48))
    mins = kind in (T.Q5_K, T.Q2_K, T.Q5_1)
    for value, dense in ((kernel, want.T), (table, want)):
        assert isinstance(value, Int8GroupArray) and value.group == group
        assert (value.values.min(), value.values.max()) == codes
        assert (value.offset is not None) == mins
        np.testing.assert_array_equal(dequantize_np(value), dense)
        np.testing.assert_array_equal(np.asarray(value.dequantize()), dense)
    float16 = kind in (T.IQ4_NL, T.Q5_1)
    assert kernel.scale.dtype == (np.float16 if float16 else np.float32)
    assert not mins or kernel.offset.dtype == kernel.scale.dtype


def test_q6_k_experts_stack_on_their_codes():
    """A stack of experts (ffn_*_exps: [E, out, in] in the file) read expert by expert."""
    data = random_blocks(T.Q6_K, 3 * 32, 256, seed=3).reshape(3, 32, -1)
    want = np.asarray(dequantize(data, T.Q6_K), np.float32).reshape(3, 32, 256)
    for e in range(3):
        value = tensor_form(data[e], T.Q6_K, (256, 32))
        assert isinstance(value, Int8GroupArray) and value.group == 16
        np.testing.assert_array_equal(dequantize_np(value), want[e].T)


def test_unpermute_undoes_llama_cpp_rotary_order():
    w = np.arange(4 * 16 * 3, dtype=np.float32).reshape(64, 3)
    np.testing.assert_array_equal(permute_for_llama_cpp(w, 4)[unpermute_order(64, 4)], w)


# -- whole files -------------------------------------------------------------------------------

def test_weights_equal_the_files_dequantization(tiny_gguf, caplog):
    family, model, path, expected = tiny_gguf
    with caplog.at_level("INFO", logger="xlaserve"):
        cfg, params = load_model(gguf_folder(path))
    per_layer = isinstance(params["layers"], list)  # where a weight's layers differ in form
    assert per_layer == (family == "llama")
    for hf_name, want in expected.items():
        tpath, layer, transpose = _target(hf_name, cfg)
        got = dequantize_np(_host(_leaf(params, tpath, layer)))
        got = got[layer] if layer is not None and not per_layer else got
        np.testing.assert_array_equal(got, want.T if transpose else want, err_msg=hf_name)
    # the int4 kernel's types stay on their codes (layer 0's)
    mix = MIXES[family]
    for kind, path in {"attn_q": ("attn", "q_proj"), "ffn_down": ("mlp", "down_proj"),
                       "attn_k": ("attn", "k_proj")}.items():
        if kind in mix:
            kernel = _leaf(params, ("layers", *path, "kernel"), 0)
            kind_type = mix.get(f"blk.0.{kind}", mix[kind])
            assert isinstance(kernel, Int4Array) == (kind_type in (T.Q4_0, T.Q4_1)), kind
    if mix.get("attn_v") in (T.Q8_0, T.Q5_0):  # the 8-bit group kernel's
        assert isinstance(_leaf(params, ("layers", "attn", "v_proj", "kernel"), 0),
                          Int8GroupArray)
    if per_layer:
        # Q6_K in groups of 16: layer 0's ffn_down, layer 1's attn_v (beside layer 0's Q8_0
        # in groups of 32) and the head; with layer 1's Q3_K ffn_gate (16) and IQ4_XS attn_q
        # (32); with mins, layer 1's Q5_1 ffn_down and Q5_K ffn_up (32) and Q2_K attn_k (16)
        for path, layer, group, mins in (
                (("mlp", "down_proj"), 0, 16, False), (("attn", "v_proj"), 1, 16, False),
                (("attn", "v_proj"), 0, 32, False), (("mlp", "gate_proj"), 1, 16, False),
                (("attn", "q_proj"), 1, 32, False), (("mlp", "down_proj"), 1, 32, True),
                (("mlp", "up_proj"), 1, 32, True), (("attn", "k_proj"), 1, 16, True)):
            kernel = _leaf(params, ("layers", *path, "kernel"), layer)
            assert isinstance(kernel, Int8GroupArray) and kernel.group == group, (path, layer)
            assert (kernel.offset is not None) == mins, (path, layer)
        head = params["lm_head"]["kernel"]
        assert isinstance(head, Int8GroupArray) and head.group == 16
        assert "int8 per group of 16" in describe_quantization(params)
        assert "Q6_K -> int8 per group of 16 (float32 scales) on q8_0_matmul" in caplog.text
        assert "Q3_K -> int8 per group of 16 (float32 scales) on q8_0_matmul" in caplog.text
        assert "IQ4_XS -> int8 per group of 32 (float32 scales) on q8_0_matmul" in caplog.text
        for name in ("Q5_1 -> int8 per group of 32 with mins (float16 scales)",
                     "Q5_K -> int8 per group of 32 with mins (float32 scales)",
                     "Q2_K -> int8 per group of 16 with mins (float32 scales)"):
            assert f"{name} on q8_0_matmul" in caplog.text
        # layer 0's TQ2_0 ffn_up, which no kernel takes, is float in the model's dtype and
        # the log says it was dequantized at load (layer 2's F16 one is float as stored)
        up = _leaf(params, ("layers", "mlp", "up_proj", "kernel"), 0)
        assert isinstance(up, jax.Array) and up.dtype == np.float32
        assert ("up_proj: F16 -> float32 on dense_matmul, Q5_K -> int8 per group of 32 with "
                "mins (float32 scales) on q8_0_matmul, TQ2_0 -> float32 on dense_matmul "
                "(dequantized at load)\n") in caplog.text
    if family == "qwen3":  # IQ4_NL's levels on the 8-bit group kernel
        up = _leaf(params, ("layers", "mlp", "up_proj", "kernel"), 0)
        assert isinstance(up, Int8GroupArray) and up.group == 32
        assert "IQ4_NL -> int8 per group of 32 (float16 scales) on q8_0_matmul" in caplog.text


def _leaf(params, path, layer):
    """params at path; a layer's own tree where the layers are a list."""
    if path[0] == "layers" and isinstance(params["layers"], list):
        params, path = params["layers"][layer], path[1:]
    for p in path:
        params = params[p]
    return params


def _host(leaf):
    """A leaf of any form with numpy arrays in it."""
    return jax.tree.map(np.asarray, leaf)


def test_greedy_tokens_equal_transformers_on_the_dequantized_weights(tiny_gguf):
    family, model, path, expected = tiny_gguf
    model.load_state_dict({n: torch.from_numpy(w) for n, w in expected.items()}, strict=False)
    llm = LLM(str(path), **OPTIONS)
    ours = [r.token_ids for r in llm.generate(PROMPTS, SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True))]
    assert ours == [greedy_reference(model, prompt, 12) for prompt in PROMPTS]


def test_folder_made_once_with_config_and_pointer(tiny_gguf, tmp_path):
    family, model, path, _ = tiny_gguf
    folder = gguf_folder(path, cache=tmp_path)
    assert gguf_folder(path, cache=tmp_path) == folder
    config = json.loads((folder / "config.json").read_text())
    assert config["num_hidden_layers"] == model.config.num_hidden_layers
    assert config["tie_word_embeddings"] == model.config.tie_word_embeddings
    assert json.loads((folder / "gguf.json").read_text())["files"] == [str(path.resolve())]


# -- errors ------------------------------------------------------------------------------------

def test_truncated_file_is_a_clear_error(tiny_gguf, tmp_path):
    _, _, path, _ = tiny_gguf
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(GGUFError, match="not a readable GGUF"):
        gguf_folder(cut, cache=tmp_path)


def test_tensors_load_from_the_folders_index_and_a_wrong_one_is_a_clear_error(tiny_gguf,
                                                                              tmp_path):
    """Loads map the tensors from the byte ranges gguf.json recorded (no metadata parsed);
    a range past the file's end is an error naming the folder's record."""
    _, _, path, _ = tiny_gguf
    folder = gguf_folder(path, cache=tmp_path)
    pointer = json.loads((folder / "gguf.json").read_text())
    assert {t[1] for t in pointer["tensors"]} >= {"token_embd.weight", "blk.0.attn_q.weight"}
    pointer["tensors"][-1][4] = path.stat().st_size  # the last tensor's offset: the end
    (folder / "gguf.json").write_text(json.dumps(pointer))
    with pytest.raises(GGUFError, match="cannot be read as its folder records it"):
        load_model(folder)


def test_missing_shard_is_a_clear_error(tiny_gguf, tmp_path):
    _, _, path, _ = tiny_gguf
    first = tmp_path / "m-00001-of-00002.gguf"
    first.write_bytes(path.read_bytes())
    with pytest.raises(GGUFError, match="missing: m-00002-of-00002.gguf"):
        gguf_folder(first, cache=tmp_path)


def test_quantize_flag_must_agree(tiny_gguf):
    _, _, path, _ = tiny_gguf
    with pytest.raises(GGUFError, match="already quantized"):
        load_model(gguf_folder(path), quantize="int8")


def test_unknown_architecture_is_refused(tmp_path):
    from gguf import GGUFWriter
    path = tmp_path / "x.gguf"
    writer = GGUFWriter(str(path), "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match="architecture 'mamba' is not served"):
        gguf_folder(path, cache=tmp_path)


# -- the demo's own file -----------------------------------------------------------------------

def test_the_demos_own_gguf_answers_as_the_demo(demo_model_dir, caplog):
    """SmolLM2's Q4_1 file served as it is (layers on their own codes, the Q8_0 table as the
    tied head's weight) answers the questions token for token as the demo folder (the same
    file dequantized at conversion) does with int4 layers and as converted."""
    from model.demo import demo_gguf_path
    questions = json.loads((Path(__file__).parent / "data" / "answer_questions.json")
                           .read_text())[:6]
    gguf = _chat_answers(demo_gguf_path(), questions)
    assert gguf == _chat_answers(demo_model_dir, questions, quantize="int4")
    assert gguf == _chat_answers(demo_model_dir, questions, quantize="none",
                                 kv_cache_dtype="float32")
    with caplog.at_level("INFO", logger="xlaserve"):
        cfg, params = load_model(gguf_folder(demo_gguf_path()))
    assert isinstance(params["embed"], Int8GroupArray)  # the file's Q8_0 table
    assert isinstance(params["layers"]["mlp"]["down_proj"]["kernel"], Int4Array)
    log = caplog.text  # the format, and each tensor kind's form and kernel
    assert "checkpoint format: GGUF (SmolLM2-135M-Instruct.Q4_1.gguf)" in log
    assert "down_proj: Q4_1 -> int4 (float16 scales) on q4_matmul" in log
    assert "embed: Q8_0 -> int8 per group of 32 (float16 scales); the tied head on q8_0_matmul" \
        in log


def _chat_answers(model, questions: list[str], **options) -> list[list[int]]:
    llm = LLM(str(model), progress=False, max_model_len=256, max_num_seqs=8,
              max_num_batched_tokens=64, token_buckets=(8, 64), request_buckets=(8,),
              page_buckets=(16,), **options)
    tok = llm.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}],
                                                  tokenize=False, add_generation_prompt=True),
                          add_special_tokens=False) for q in questions]
    return [r.token_ids for r in llm.generate(prompts, SamplingParams(temperature=0,
                                                                      max_tokens=24))]
