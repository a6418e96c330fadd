"""Tensor parallelism (docs/architecture.md, "Tensor parallelism") on simulated CPU devices:
every family gives TP=1's tokens and logprobs at TP=N (KV heads fewer than N, biases on
row-parallel layers, a padded vocabulary, quantized weights (int8, fp8, int4, a GGUF file's
own forms) and KV cache, the pallas kernel
in interpret mode, the demo model at TP=3, DeepSeek-V3's latent attention and routing with
and without expert parallelism, GLM-4.5); sizes that do not split a model are refused
before any weight loads.

The engines run in child processes (tests/tp_child.py) started with
--xla_force_host_platform_device_count, which must not reach this session."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from jax.sharding import PartitionSpec as P

from model.config import ModelConfig
from model.sharding import TensorParallelError, check_size, valid_sizes
from serving import LLM
from serving.cli import main
from tests.deepseek_tiny import tiny_deepseek_model
from tests.gguf_tiny import LLAMA3_ROPE, write_gguf
from tests.hf_tiny import tiny_hf_model
from tests.lora_tiny import make_adapter
from tests.tp_child import MAX_TOKENS, PROMPTS, requests

ROOT = Path(__file__).resolve().parents[1]
DEVICES = 4
# Heads 8 / KV heads 2 split 2 and 4 ways (4: each KV head on two devices); vocabulary 210
# pads to 212 at TP=4. A larger initializer than HF's makes greedy choices clear-cut.
LORA = dict(enable_lora=True, max_loras=2)
SHAPES = dict(num_attention_heads=8, num_key_value_heads=2, hidden_size=64,
              intermediate_size=96, vocab_size=210, initializer_range=0.1)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-models")
    made = {}
    for family, extra in (("llama", dict(attention_bias=True, mlp_bias=True)),
                          ("mistral", {}), ("qwen2", {}), ("qwen3", {})):
        made[family] = root / family
        base = tiny_hf_model(family, made[family], seed=1, **SHAPES, **extra)
        if family == "llama":  # two LoRA adapters over it, every projection or a few
            for i, name in enumerate(("sql", "chat")):
                made[f"lora-{name}"] = root / f"lora-{name}"
                make_adapter(base, name, made[f"lora-{name}"], seed=i, size=0.5)
    # int4 splits row-parallel inputs in whole groups of 32: 128 / 2 for o_proj and down_proj
    made["llama-int4"] = root / "llama-int4"
    model = tiny_hf_model("llama", made["llama-int4"], seed=1, rope_parameters=LLAMA3_ROPE,
                          **{**SHAPES, "intermediate_size": 128, "head_dim": 16})
    made["lora-int4"] = root / "lora-int4"
    make_adapter(model, "sql", made["lora-int4"], seed=2, size=0.5)
    # its GGUF: 4- and 8-bit groups, a Q8_0 table and head, one layer's ffn_down in a form
    # of its own (Q5_1: 8-bit groups of 32 with offsets, cut like their scales)
    made["llama-gguf"], _ = write_gguf(model, "llama", root / "llama.gguf", {
        "attn_q": Q.Q4_0, "attn_v": Q.Q8_0, "attn_output": Q.Q4_1, "ffn_down": Q.Q4_0,
        "blk.1.ffn_down": Q.Q5_1, "token_embd": Q.Q8_0, "output": Q.Q8_0})
    # mixtures of experts: 4 experts split 2 and 4 ways, or each expert's 40 (Qwen2-MoE's
    # shared expert 56) intermediate units; Qwen2-MoE mixes in a dense layer
    for family in ("qwen2_moe", "qwen3_moe"):
        made[family] = root / family
        tiny_hf_model(family, made[family], seed=1)
    # window and full layers, soft-caps, sandwich norms, a vocabulary padded at TP=4
    made["gemma2"] = root / "gemma2"
    tiny_hf_model("gemma2", made["gemma2"], seed=1, **SHAPES)
    # DeepSeek-V3 (4 heads, 8 experts in 4 groups, a dense first layer, a shared expert) and
    # GLM-4.5 (GQA: 4 heads, 2 KV heads, partial rope, q/k norms, biases)
    for variant in ("v3", "glm4_moe"):
        made[variant] = root / variant
        tiny_deepseek_model(variant, made[variant], seed=1)
    return made


def cases(models, demo_checkpoint) -> dict:
    cpu = dict(attention_backend="cpu")
    return {
        "llama-bias": dict(model=str(models["llama"]), sizes=[1, 4], restart=[4],
                           options=dict(cpu, quantize="none"), kv_heads=1),
        "mistral-pallas": dict(model=str(models["mistral"]), sizes=[1, 2],
                               options=dict(attention_backend="pallas", quantize="none"),
                               kv_heads=1),
        "qwen2-int8-head": dict(model=str(models["qwen2"]), sizes=[1, 2],
                                options=dict(cpu, quantize="int8:lm_head"), kv_heads=1),
        "qwen3-fp8-kv-int8": dict(model=str(models["qwen3"]), sizes=[1, 4],
                                  options=dict(cpu, quantize="fp8", kv_cache_dtype="int8"),
                                  kv_heads=1),
        "llama-int4": dict(model=str(models["llama-int4"]), sizes=[1, 2],
                           options=dict(cpu, quantize="int4:lm_head"), kv_heads=1),
        "llama-gguf": dict(model=str(models["llama-gguf"]), sizes=[1, 2], options=cpu,
                           kv_heads=1),
        # LoRA: B split with column-parallel projections, A with row-parallel ones; 2 KV
        # heads over 4 devices (replicated k/v columns); over an int4 base
        "llama-lora": dict(model=str(models["llama"]), sizes=[1, 4], kv_heads=1,
                           options=dict(cpu, quantize="none", **LORA),
                           loras=[str(models["lora-sql"]), None, str(models["lora-chat"])]),
        "llama-int4-lora": dict(model=str(models["llama-int4"]), sizes=[1, 2], kv_heads=1,
                                options=dict(cpu, quantize="int4:lm_head", **LORA),
                                loras=[None, str(models["lora-int4"]),
                                       str(models["lora-int4"])]),
        "qwen2-moe": dict(model=str(models["qwen2_moe"]), sizes=[1, 2, 4],
                          options=dict(cpu, quantize="none"), kv_heads=1),
        "qwen2-moe-expert-parallel": dict(
            model=str(models["qwen2_moe"]), sizes=[2, 4], kv_heads=1, tp1="qwen2-moe",
            options=dict(cpu, quantize="none", enable_expert_parallel=True)),
        "qwen3-moe-int8-expert-parallel": dict(
            model=str(models["qwen3_moe"]), sizes=[1, 2], kv_heads=1,
            options=dict(cpu, quantize="int8", enable_expert_parallel=True)),
        "gemma2": dict(model=str(models["gemma2"]), sizes=[1, 4],
                       options=dict(cpu, quantize="none"), kv_heads=1),
        # latent attention: heads split, the latent cache whole on every device; the
        # expert-parallel case compares with the plain case's TP=1 (the same engine)
        "deepseek-v3": dict(model=str(models["v3"]), sizes=[1, 2], kv_heads=1,
                            options=dict(cpu, quantize="none")),
        "deepseek-v3-expert-parallel": dict(
            model=str(models["v3"]), sizes=[2, 4], restart=[2], kv_heads=1, tp1="deepseek-v3",
            options=dict(cpu, quantize="none", enable_expert_parallel=True)),
        "glm-4.5": dict(model=str(models["glm4_moe"]), sizes=[1, 2], kv_heads=1,
                        options=dict(cpu, quantize="none")),
        # 9 heads, 3 KV heads; TP=1 is the shared demo engine (the demo_llm fixture,
        # its checkpoint as converted), which other modules reuse.
        "demo": dict(model=str(demo_checkpoint), sizes=[3], kv_heads=1, options={}),
    }


@pytest.fixture(scope="module")
def results(models, demo_checkpoint, tmp_path_factory):
    """The cases run in two child processes at once, a compile each (XLA compiles a program
    on one thread)."""
    spec = cases(models, demo_checkpoint)
    folder = tmp_path_factory.mktemp("tp-cases")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    children = []
    for i, names in enumerate((list(spec)[0::2], list(spec)[1::2])):
        path = folder / f"cases-{i}.json"
        path.write_text(json.dumps({k: {f: v for f, v in spec[k].items()
                                        if f not in ("kv_heads", "tp1")}
                                    for k in names}))
        children.append(subprocess.Popen(
            [sys.executable, "-m", "tests.tp_child", str(DEVICES), str(path)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
            env=dict(env, PYTHONPATH=str(ROOT))))
    out = {}
    for child in children:
        stdout, stderr = child.communicate(timeout=900)
        assert child.returncode == 0, stderr[-4000:]
        out.update(json.loads(stdout.strip().splitlines()[-1]))
    return spec, out


CASES = ("llama-bias", "mistral-pallas", "qwen2-int8-head", "qwen3-fp8-kv-int8", "llama-int4",
         "llama-gguf", "llama-lora", "llama-int4-lora", "qwen2-moe", "qwen2-moe-expert-parallel",
         "qwen3-moe-int8-expert-parallel", "gemma2", "deepseek-v3",
         "deepseek-v3-expert-parallel", "glm-4.5", "demo")


def tp1_result(name: str, spec: dict, out: dict, demo_llm) -> dict:
    """The TP=1 run a case compares with: its own, another case's, or the demo engine's."""
    if name == "demo":
        return demo_tp1(demo_llm)
    return out[spec[name].get("tp1", name)]["1"]


def demo_tp1(llm) -> dict:
    results = llm.generate(PROMPTS, requests(MAX_TOKENS))
    return {"tokens": [r.token_ids for r in results],
            "logprobs": [[lp.logprob for lp in r.logprobs] if r.logprobs else None
                         for r in results],
            "programs": None, "mesh": 1, "device_weight_bytes": llm.engine.weight_bytes,
            "experts_per_device": 0}


@pytest.mark.parametrize("name", CASES)
def test_tokens_and_logprobs_equal_tp1(results, name, demo_llm):
    spec, out = results
    case, by_size = spec[name], out[name]
    one = tp1_result(name, spec, out, demo_llm)
    tokens = [t for seq in one["tokens"] for t in seq]
    assert len(set(tokens)) >= 4, f"{name}: degenerate output {one['tokens']}"  # a real check
    for n in map(str, case["sizes"] if "tp1" in case else case["sizes"][1:]):
        tp = by_size[n]
        assert tp["mesh"] == int(n)
        assert tp["tokens"] == one["tokens"], name  # greedy and seeded sampling alike
        np.testing.assert_allclose(tp["logprobs"][1], one["logprobs"][1], atol=2e-3)
        if one["programs"] is not None:  # the shared demo engine has buckets of its own
            assert tp["programs"] == one["programs"]
        assert tp["kv_heads_per_device"] == case["kv_heads"]
        experts = one["experts_per_device"]
        ep = case["options"].get("enable_expert_parallel")
        assert tp["experts_per_device"] == (experts // int(n) if ep else experts)
        # Each device holds its share of the weights; norms are whole on each, and with
        # fewer KV heads than devices so are its KV heads' k/v projections.
        # (LoRA slots, small and partly replicated, apart)
        share = (one["device_weight_bytes"] - one.get("lora_bytes", 0)) / int(n)
        assert share < tp["device_weight_bytes"] - tp["lora_bytes"] < 1.6 * share
    assert one["mesh"] == 1


@pytest.mark.parametrize("name,size", [("llama-bias", "4"),
                                       ("deepseek-v3-expert-parallel", "2")])
def test_a_restarted_mesh_loads_its_programs(results, name, size):
    """A sharded engine's programs are saved for its mesh: built again (a restart), it
    loads every one of them from the executable cache and answers the same."""
    spec, out = results
    first, again = out[name][size], out[name][f"{size}-restart"]
    assert again["mesh"] == int(size)
    assert again["programs"] > 0 and again["loaded"] == again["programs"]
    assert again["tokens"] == first["tokens"]
    assert again["logprobs"] == first["logprobs"]


def test_latent_cache_is_whole_on_every_device(results):
    """Latent attention's cache has no head axis: at TP=2 and 4 each device holds all of it
    (as many bytes as the one device at TP=1), where a GQA model's devices hold their KV
    heads only."""
    spec, out = results
    whole = out["deepseek-v3"]["1"]["device_kv_bytes"]
    assert whole > 0
    assert out["deepseek-v3"]["2"]["device_kv_bytes"] == whole
    for n in ("2", "4"):
        assert out["deepseek-v3-expert-parallel"][n]["device_kv_bytes"] == whole
    glm = out["glm-4.5"]
    assert glm["2"]["device_kv_bytes"] == glm["1"]["device_kv_bytes"] // 2


def test_adapters_change_their_rows_only(results):
    """The LoRA cases' base-only rows answer as the same base without LoRA; adapted rows
    do not (so the TP = 1 comparison above compares adapted tokens)."""
    spec, out = results
    lora, plain = out["llama-lora"]["1"]["tokens"], out["llama-bias"]["1"]["tokens"]
    assert lora[1] == plain[1] and lora[0] != plain[0] and lora[2] != plain[2]
    lora, plain = out["llama-int4-lora"]["1"]["tokens"], out["llama-int4"]["1"]["tokens"]
    assert lora[0] == plain[0] and lora[1] != plain[1]


def test_sizes_that_do_not_split_the_model_are_refused_before_loading(models):
    cfg = ModelConfig.from_dir(models["llama"])
    assert valid_sizes(cfg) == [1, 2, 4, 8]
    with pytest.raises(TensorParallelError, match=r"tensor_parallel_size 3 .*8 query heads.*"
                                                  r"sizes that work: 1, 2, 4, 8"):
        LLM(str(models["llama"]), tensor_parallel_size=3, progress=False)
    with pytest.raises(TensorParallelError, match="tensor_parallel_size 2 needs 2 devices; "
                                                  "1 found"):
        LLM(str(models["llama"]), tensor_parallel_size=2, progress=False)
    with pytest.raises(TensorParallelError, match="positive integer"):
        LLM(str(models["llama"]), tensor_parallel_size=0, progress=False)


def test_serve_with_a_size_that_does_not_split_exits_with_the_sizes(models, capsys):
    assert main(["serve", str(models["qwen3"]), "--tensor-parallel-size", "5"]) == 1
    assert "sizes that work: 1, 2, 4, 8" in capsys.readouterr().err


def test_expert_counts_that_do_not_split_are_refused(models):
    """Expert parallel, N must divide the experts (and the shared expert's size); without
    it, each expert's intermediate size."""
    hf = dict(architectures=["Qwen2MoeForCausalLM"], vocab_size=64, hidden_size=64,
              intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=2, num_experts=6, num_experts_per_tok=2,
              moe_intermediate_size=64, shared_expert_intermediate_size=64)
    cfg = ModelConfig.from_hf(hf)
    assert valid_sizes(cfg) == [1, 2, 4, 8]
    ep = dataclasses.replace(cfg, expert_shards=4)
    assert valid_sizes(ep) == [1, 2]
    with pytest.raises(TensorParallelError, match=r"6 experts \(expert parallel\).*"
                                                  r"sizes that work: 1, 2$"):
        check_size(ep, 4)
    with pytest.raises(ValueError, match="--enable-expert-parallel is for mixture-of-experts"):
        LLM(str(models["llama"]), tensor_parallel_size=2, enable_expert_parallel=True,
            progress=False)
    with pytest.raises(TensorParallelError, match="sizes that work: 1, 2, 4$"):
        LLM(str(models["qwen2_moe"]), tensor_parallel_size=3, enable_expert_parallel=True,
            progress=False)


def test_demo_model_sizes():
    demo = ModelConfig(architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576,
                       intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
                       head_dim=64)
    assert valid_sizes(demo) == [1, 3]  # 9 would split the heads but not 1536


def test_latent_attention_splits_by_head():
    """DeepSeek-V3's shapes at TP=8 (abstract, no weights): q_b_proj's columns, k_up / v_up
    and o_proj's rows by head (16 of 128 each: 16 x 192 query columns, 16 x 128 output
    rows); q_a_proj, kv_a_proj and their norms whole; the cache's sharding replicated. Any
    size dividing the heads and the expert and MLP sizes splits it; the KV-head rule puts
    no bound (the latent is one "KV head", whole on every device)."""
    import jax

    from model import sharding
    from model.transformer import abstract_params
    from serving.engine.mesh import with_expert_parallel
    from serving.engine.tp_lowering import deepseek_v3, fewer_layers
    cfg = fewer_layers(deepseek_v3(), 4)
    assert valid_sizes(cfg) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert valid_sizes(with_expert_parallel(cfg, 8, True)) == [1, 2, 4, 8, 16, 32, 64, 128]
    with pytest.raises(TensorParallelError, match="128 query heads, a latent cache whole on "
                                                  "every device"):
        check_size(cfg, 3)
    block = jax.eval_shape(lambda p: sharding.shard_stored(p, cfg, 8, 3), abstract_params(cfg))
    attn = block["layers"][0]["attn"]
    assert attn["q_b_proj"]["kernel"].shape == (1536, 16 * 192)
    assert attn["k_up"].shape == (16, 128, 512) and attn["v_up"].shape == (16, 512, 128)
    assert attn["o_proj"]["kernel"].shape == (16 * 128, 7168)
    assert attn["q_a_proj"]["kernel"].shape == (7168, 1536)
    assert attn["kv_a_proj"]["kernel"].shape == (7168, 576)
    assert attn["kv_a_norm"]["scale"].shape == (512,)
    local = sharding.local_config(cfg, 8)
    assert (local.num_heads, local.num_kv_heads, local.kv_lora_rank) == (16, 1, 512)
    assert sharding.cache_config(cfg, 8) == cfg
    assert sharding.cache_specs(False, latent=True).k == sharding.LATENT_SPEC == P()
