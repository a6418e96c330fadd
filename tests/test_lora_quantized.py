"""LoRA over quantized base weights (QLoRA-style serving): the adapter adds to the int8 or
int4 matmul. Oracle: peft over a transformers model holding our dequantized weights."""
import copy

import jax
import numpy as np
import pytest
import torch

from model.checkpoint import load_model
from model.hf_weights import _locate
from quant.array import QuantArray, dequantize
from quant.int4 import Int4Array, dequantize_int4
from serving import LLM, LoRARequest, SamplingParams
from tests.hf_tiny import greedy_reference, tiny_hf_model
from tests.lora_tiny import make_adapter

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [(7 * i) % 200 + 3 for i in range(29)]]
# sizes in groups of 32 inputs, as int4 needs
SIZES = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, head_dim=16)


def dequantized_copy(model, params):
    """`model` with every weight replaced by what our quantized tree holds, dequantized."""
    def plain(a):
        if isinstance(a, Int4Array):
            return np.asarray(dequantize_int4(a))
        return np.asarray(dequantize(a)) if isinstance(a, QuantArray) else np.asarray(a)
    tree = jax.tree.map(plain, params, is_leaf=lambda a: isinstance(a, (QuantArray, Int4Array)))
    out = copy.deepcopy(model)
    state = out.state_dict()
    for name in state:
        found = _locate(name)
        if found is None:
            continue
        path, layer, _, transpose = found
        value = tree
        for key in path:
            value = value[key]
        value = value[layer] if layer is not None else value
        state[name] = torch.from_numpy(np.ascontiguousarray(value.T if transpose else value))
    out.load_state_dict(state)
    return out.eval()


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_adapter_over_a_quantized_base_matches_peft(quantize, tmp_path):
    base = tiny_hf_model("llama", tmp_path / "base", **SIZES)
    make_adapter(base, "sql", tmp_path / "sql", seed=1, size=0.3)
    _, params = load_model(tmp_path / "base", quantize=quantize, progress=False)
    plain = dequantized_copy(base, params)
    from peft import PeftModel
    tuned = PeftModel.from_pretrained(copy.deepcopy(plain), tmp_path / "sql").eval()
    want = {None: [greedy_reference(plain, p, MAX_TOKENS) for p in PROMPTS],
            "sql": [greedy_reference(tuned, p, MAX_TOKENS) for p in PROMPTS]}
    assert want["sql"] != want[None]
    llm = LLM(str(tmp_path / "base"), quantize=quantize, enable_lora=True, max_model_len=128,
              max_num_seqs=4, progress=False)
    assert quantize in llm.engine.quantization
    sql = LoRARequest("sql", 1, str(tmp_path / "sql"))
    out = llm.generate(PROMPTS * 2, GREEDY, lora_request=[sql, sql, None, None])
    assert [r.token_ids for r in out] == want["sql"] + want[None]
