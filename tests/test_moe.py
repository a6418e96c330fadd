"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, gpt-oss) against transformers:
logits over the paged cache, greedy tokens through the engine, routing forced to corner cases,
dummy weights, conversion, and the config fields we refuse."""
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from model.checkpoint import convert_hf, load_model
from model.config import ConfigError, ModelConfig
from model.hf_weights import WeightsError
from model.moe import MoE, dispatch, route
from serving import LLM, SamplingParams
from tests.hf_tiny import greedy_reference, tiny_hf_model
from tests.test_model_parity import paged_logits

PAGE = 4
# Measured max |ours - transformers| / max |transformers| is about 1e-6 in float32.
RTOL = 1e-4
# name -> (family, overrides)
VARIANTS = {"mixtral": ("mixtral", {}), "qwen2_moe": ("qwen2_moe", {}),
            "qwen3_moe": ("qwen3_moe", {}),
            "qwen3_moe-unnormalized": ("qwen3_moe", {"norm_topk_prob": False}),
            "olmoe": ("olmoe", {}), "gpt_oss": ("gpt_oss", {})}
# One token bucket: one step program per engine, shared by every engine of a config
# through the executable cache.
OPTIONS = dict(max_num_seqs=4, max_model_len=96, max_num_batched_tokens=16, page_size=PAGE,
               token_buckets=(16,), request_buckets=(4,), page_buckets=(24,), progress=False)
DEFAULT_BUCKETS = {k: v for k, v in OPTIONS.items() if not k.endswith("_buckets")}
PROMPTS = [[5], list(range(10, 17)), [(7 * i) % 200 + 3 for i in range(23)],
           [(13 * i) % 205 + 3 for i in range(60)]]
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory):
    family, overrides = VARIANTS[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    model = tiny_hf_model(family, folder, **overrides)
    return request.param, model, folder


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory):
    """Dense and MoE layers mixed, a shared expert: the layers stored as a list."""
    folder = tmp_path_factory.mktemp("qwen2_moe_engine")
    model = tiny_hf_model("qwen2_moe", folder)
    llm = LLM(str(folder), **OPTIONS)
    tokens = [r.token_ids for r in llm.generate(PROMPTS, GREEDY)]
    return model, folder, tokens


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].numpy()


@pytest.mark.jax_cache
def test_logits_match_transformers(variant):
    name, model, folder = variant
    cfg, params = load_model(folder, progress=False)
    assert cfg.num_experts == 4 and any(cfg.moe_layers)
    prompts = PROMPTS[1:]
    logits, off = paged_logits(params, cfg, prompts, PAGE), 0
    for p in prompts:
        want = hf_logits(model, p)
        err = np.abs(logits[off:off + len(p)] - want).max() / np.abs(want).max()
        assert err < RTOL, (name, err)
        off += len(p)


def test_greedy_tokens_match_transformers(variant):
    """Prompts of 1 to 60 tokens, batched, prefilled in chunks of at most 16 tokens, with the
    default buckets (every token count a step may have)."""
    name, model, folder = variant
    llm = LLM(str(folder), **DEFAULT_BUCKETS)
    ours = [r.token_ids for r in llm.generate(PROMPTS, GREEDY)]
    assert ours == [greedy_reference(model, p, MAX_TOKENS) for p in PROMPTS]


@pytest.mark.jax_cache
def test_config_reads_each_family(variant):
    name, model, folder = variant
    cfg = ModelConfig.from_dir(folder)
    hf = model.config
    gpt_oss = name == "gpt_oss"
    assert cfg.num_experts_per_tok == 2
    assert cfg.norm_topk_prob == (name == "mixtral" or bool(getattr(hf, "norm_topk_prob", 0)))
    assert cfg.moe_layers == ((True, False, True) if name == "qwen2_moe" else (True,) * 3)
    assert cfg.shared_expert_intermediate_size == (56 if name == "qwen2_moe" else 0)
    assert cfg.qkv_bias == (name in ("qwen2_moe", "gpt_oss")) and cfg.o_bias == gpt_oss
    assert (cfg.qk_norm, cfg.qk_norm_full) == (name.startswith("qwen3"), name == "olmoe")
    assert cfg.clip_qkv == (1.5 if name == "olmoe" else 0.0)
    assert cfg.attn_sinks == gpt_oss and cfg.moe_family.biases == gpt_oss
    assert (cfg.swiglu_limit, cfg.swiglu_alpha) == ((7.0, 1.702) if gpt_oss else (0.0, 0.0))
    assert cfg.sliding_windows == ((8, 0, 8) if gpt_oss else (0, 0, 0))
    assert cfg.rope_scaling_dict.get("rope_type") == ("yarn" if gpt_oss else None)


def test_dummy_weights_run(qwen2_moe):
    _, folder, _ = qwen2_moe
    llm = LLM(str(folder), load_format="dummy", **OPTIONS)
    out = llm.generate(PROMPTS[:2], GREEDY)
    assert [len(r.token_ids) for r in out] == [MAX_TOKENS] * 2


def test_converted_checkpoint_gives_the_same_tokens(qwen2_moe, tmp_path):
    model, folder, tokens = qwen2_moe
    convert_hf(folder, tmp_path / "ckpt", progress=False)
    cfg, params = load_model(tmp_path / "ckpt", progress=False)
    assert isinstance(params["layers"], list) and cfg == ModelConfig.from_dir(folder)
    llm = LLM(str(tmp_path / "ckpt"), **OPTIONS)
    assert [r.token_ids for r in llm.generate(PROMPTS, GREEDY)] == tokens


def _moe_params(params, layer: int):
    layers = params["layers"]
    tree = layers[layer] if isinstance(layers, list) else jax.tree.map(lambda a: a[layer], layers)
    return tree["moe"]


def _forced_router(kind: str, hidden: int, rng):
    """Router weights [E=4, H] for inputs with every entry positive. "pair": every token
    picks experts 0 and 1, the others none. "one": every token picks expert 2 (its logit 0
    is second best either way), with 0 or 1 by the sign of x . v, and expert 3 never."""
    ones, v = np.ones(hidden), rng.choice([-1.0, 1.0], hidden)
    rows = {"pair": [ones, 0.5 * ones, -ones, -0.5 * ones],
            "one": [v, -v, 0 * ones, -100 * ones]}[kind]
    return np.stack(rows).astype(np.float32)


@pytest.mark.parametrize("kind", ["pair", "one"])
def test_forced_routing_matches_transformers(qwen2_moe, kind):
    """Through the routed experts and the shared one: an expert with every token, experts
    with none; the group sizes say the routing was what was forced."""
    model, folder, _ = qwen2_moe
    cfg, params = load_model(folder, progress=False)
    rng = np.random.default_rng(0)
    x = np.abs(rng.normal(size=(37, cfg.hidden_size))).astype(np.float32)
    router = _forced_router(kind, cfg.hidden_size, rng)
    block = model.model.layers[0].mlp
    kept = block.gate.weight.detach().clone()
    with torch.no_grad():
        block.gate.weight.copy_(torch.from_numpy(router))
        want = block(torch.from_numpy(x)[None])[0].numpy()
        block.gate.weight.copy_(kept)
    moe = dict(_moe_params(params, 0), router={"kernel": jnp.asarray(router.T)})
    got = np.asarray(MoE(cfg).apply({"params": moe}, jnp.asarray(x)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    _, experts = route(jnp.asarray(x @ router.T), 2, False)
    sizes = np.asarray(dispatch(experts, 4)[2]).tolist()
    if kind == "pair":
        assert sizes == [37, 37, 0, 0]
    else:
        assert sizes[2:] == [37, 0] and 0 < sizes[0] < 37 and sizes[0] + sizes[1] == 37


@pytest.mark.jax_cache
def test_joined_gate_up_gives_the_same_output(variant):
    """gate_up_proj [E, H, 2I], as the weights may be joined at load, computes what the
    separate gate_proj and up_proj do."""
    name, _, folder = variant
    cfg, params = load_model(folder, progress=False)
    moe = dict(_moe_params(params, 0))
    gate, up = moe.pop("gate_proj"), moe.pop("up_proj")
    joined = dict(moe, gate_up_proj={p: jnp.concatenate([gate[p], up[p]], axis=-1)
                                     for p in gate})  # kernels, and biases where they are
    x = jnp.asarray(np.random.default_rng(1).normal(size=(9, cfg.hidden_size)), jnp.float32)
    apart = MoE(cfg).apply({"params": _moe_params(params, 0)}, x)
    np.testing.assert_allclose(MoE(cfg).apply({"params": joined}, x), apart, rtol=1e-6,
                               atol=1e-6)


@pytest.mark.jax_cache
def test_routing_of_a_row_does_not_depend_on_its_batch():
    logits = jnp.asarray(np.random.default_rng(2).normal(size=(64, 60)), jnp.float32)
    weights, experts = route(logits, 4, True)
    for n in (1, 3, 17):
        w, e = route(logits[:n], 4, True)
        assert np.array_equal(np.asarray(w), np.asarray(weights[:n]))
        assert np.array_equal(np.asarray(e), np.asarray(experts[:n]))
    np.testing.assert_allclose(np.asarray(weights).sum(-1), 1.0, rtol=1e-6)


@pytest.mark.jax_cache
def test_dispatch_is_a_stable_sort_with_its_inverse():
    experts = jnp.asarray([[2, 0], [2, 1], [0, 2]], jnp.int32)
    order, inverse, sizes = dispatch(experts, 4)
    assert np.asarray(order).tolist() == [1, 4, 3, 0, 2, 5]  # flat: 2 0 2 1 0 2
    assert np.asarray(sizes).tolist() == [2, 1, 3, 0]
    assert np.asarray(order[inverse]).tolist() == list(range(6))


def _hf_config(**fields):
    base = dict(architectures=["Qwen2MoeForCausalLM"], vocab_size=32, hidden_size=16,
                intermediate_size=24, num_hidden_layers=6, num_attention_heads=2,
                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                shared_expert_intermediate_size=8)
    return {**base, **fields}


def test_qwen_moe_layer_rule():
    cfg = ModelConfig.from_hf(_hf_config(decoder_sparse_step=2, mlp_only_layers=[3]))
    assert cfg.moe_layers == (False, True, False, False, False, True)
    assert not ModelConfig.from_hf(_hf_config(num_experts=0)).moe_layers[0]
    old = {k: v for k, v in cfg.to_dict().items() if k not in (
        "num_experts", "num_experts_per_tok", "moe_intermediate_size", "moe_layers",
        "shared_expert_intermediate_size", "norm_topk_prob", "qk_norm_full", "clip_qkv")}
    assert not ModelConfig.from_dict(old).moe_layers  # a checkpoint from before MoE


@pytest.mark.parametrize("field, value", [("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"),
                                          ("n_group", 8), ("routed_scaling_factor", 2.5),
                                          ("hidden_act", "gelu")])
def test_unsupported_router_fields_are_refused(field, value):
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_hf(_hf_config(**{field: value}))
    ModelConfig.from_hf(_hf_config(router_aux_loss_coef=0.5, router_jitter_noise=0.1))


def test_refused_in_a_folder_and_missing_experts_named(qwen2_moe, tmp_path):
    _, folder, _ = qwen2_moe
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "scoring_func": "sigmoid"}))
    with pytest.raises(ConfigError, match="scoring_func"):
        load_model(bad, progress=False)
    (bad / "config.json").write_text(json.dumps(config))
    tensors = load_file(bad / "model.safetensors")
    del tensors["model.layers.2.mlp.experts.3.up_proj.weight"]
    save_file(tensors, bad / "model.safetensors")
    with pytest.raises(WeightsError, match=r"moe/up_proj/kernel \(layers \[2\], experts \[3\]\)"):
        load_model(bad, progress=False)


@pytest.mark.jax_cache
@pytest.mark.parametrize("recipe", ["int8", "int4", "fp8"])
def test_quantized_experts_have_scales_of_their_own(tmp_path, recipe):
    """--quantize quantizes every expert as if it were a layer's weight alone (its own
    per-channel, per-tensor or per-group scales); the router and the shared expert's gate
    stay float."""
    from quant.recipe import quantize_params
    folder = tmp_path / "moe"
    tiny_hf_model("qwen2_moe", folder, moe_intermediate_size=64,
                  shared_expert_intermediate_size=64)
    _, floats = load_model(folder, progress=False)
    _, params = load_model(folder, progress=False, quantize=recipe)
    moe, float_moe = _moe_params(params, 0), _moe_params(floats, 0)
    for name in ("router", "shared_expert_gate"):
        assert np.asarray(moe[name]["kernel"]).dtype == np.float32
    for proj in ("gate_proj", "down_proj"):
        stacked = jax.tree.map(np.asarray, moe[proj]["kernel"])
        for e in range(4):
            alone = quantize_params({"layers": {"x": {"kernel": float_moe[proj]["kernel"][e]}}},
                                    recipe)["layers"]["x"]["kernel"]
            for got, want in zip(jax.tree.leaves(jax.tree.map(lambda a: a[e], stacked)),
                                 jax.tree.leaves(alone)):
                np.testing.assert_array_equal(got, np.asarray(want), err_msg=f"{proj} {e}")


def test_gpt_oss_tensor_parallel_is_refused_naming_why(tmp_path):
    """Sinks and expert biases are not split over devices yet: refused before any weight
    loads, never served with sinks summed N times."""
    from model.sharding import TensorParallelError, check_size
    tiny_hf_model("gpt_oss", tmp_path)
    cfg = ModelConfig.from_dir(tmp_path)
    check_size(cfg, 1)
    with pytest.raises(TensorParallelError, match="attention sinks and expert biases"):
        check_size(cfg, 2)
