"""DeepSeek-V2 / V3 (latent attention, DeepSeek's routing), a Kimi-like V3 and GLM-4.5 against
transformers: logits over the paged cache, greedy tokens through the engine with its default
buckets, the routers on their own, the absorbed attention against transformers' expanded
form, batch invariance, prefix hits and quantized latent caches."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from model.attention import latent_paged_attention
from model.batch import Batch
from model.config import ConfigError, ModelConfig
from model.kv_cache import KVCache, bytes_per_page, write_latent
from model.latent_attention import expanded_attention, per_head_matmul
from model.moe import route
from serving import LLM, SamplingParams
from tests.deepseek_tiny import VARIANTS, tiny_deepseek_model
from tests.hf_tiny import greedy_reference

PAGE = 4
LOGPROB_ATOL = 1e-4  # measured |ours - transformers| about 1e-6
OPTIONS = dict(max_num_seqs=4, max_model_len=96, max_num_batched_tokens=16, page_size=PAGE,
               progress=False)
PROMPTS = [[5], list(range(10, 17)), [(7 * i) % 200 + 3 for i in range(23)],
           [(13 * i) % 205 + 3 for i in range(60)]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory):
    """(name, transformers model, folder, engine with the default buckets): one engine a
    variant."""
    folder = tmp_path_factory.mktemp(request.param)
    model = tiny_deepseek_model(request.param, folder)
    return request.param, model, folder, LLM(str(folder), **OPTIONS)


def hf_greedy(model, prompt: list[int], n: int):
    """transformers' greedy tokens and, per step, its log-probabilities over the vocabulary."""
    ids, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1].double()
            logprobs.append(torch.log_softmax(logits, -1).numpy())
            ids.append(int(logits.argmax()))
    return ids[len(prompt):], logprobs


def test_greedy_tokens_and_logprobs_match_transformers(variant):
    """Prompts of 1 to 60 tokens batched, the long one prefilled in chunks of 16: the same
    greedy tokens, and every step's five best log-probabilities within 1e-4."""
    name, model, folder, llm = variant
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
    for prompt, result in zip(PROMPTS, llm.generate(PROMPTS, params)):
        tokens, want = hf_greedy(model, prompt, params.max_tokens)
        assert result.token_ids == tokens, name
        for step, lp in zip(want, result.logprobs):
            for token, value in lp.top:
                assert abs(value - step[token]) < LOGPROB_ATOL, (name, token, value, step[token])


def test_batched_equals_alone_and_prefix_hits_equal_cold(variant):
    """Greedy and seeded: each prompt alone equals it in a batch, and a prompt whose pages
    are cached (a hit ending inside and one ending at a page edge) equals its cold run."""
    name, model, folder, llm = variant
    seeded = [SamplingParams(temperature=0.8, seed=s, max_tokens=6, ignore_eos=True)
              for s in range(len(PROMPTS))]
    for params in (GREEDY, seeded):
        batched = [r.token_ids for r in llm.generate(PROMPTS, params)]
        per = params if isinstance(params, list) else [params] * len(PROMPTS)
        alone = [llm.generate([p], [s])[0].token_ids for p, s in zip(PROMPTS, per)]
        assert batched == alone, name
    base = PROMPTS[3]
    cold = llm.generate([base[:41] + [7, 8]], GREEDY)[0].token_ids
    again = llm.generate([base[:41] + [7, 8]], GREEDY)[0].token_ids
    assert again == cold and again == greedy_reference(model, base[:41] + [7, 8], 8)


def test_config_reads_each_variant(variant):
    name, model, folder, _ = variant
    cfg, hf = ModelConfig.from_dir(folder), model.config
    assert cfg.num_experts == hf.n_routed_experts and cfg.moe_layers == (False, True, True)
    assert cfg.shared_expert_intermediate_size == 32 * hf.n_shared_experts
    assert cfg.routed_scaling_factor == pytest.approx(hf.routed_scaling_factor)
    assert cfg.router_sigmoid == cfg.router_bias == (name != "v2_lite" and name != "v2_group")
    assert cfg.router_groups == {"v2_lite": 1, "v2_group": 4, "v3": 4, "kimi": 1,
                                 "glm4_moe": 2}[name]
    if name == "glm4_moe":
        assert not cfg.latent and cfg.rotary_dim == 8 and cfg.qk_norm and cfg.qkv_bias
        assert not cfg.o_bias
    else:
        assert cfg.latent and cfg.latent_width == 32 + 8 and cfg.num_kv_heads == 1
        assert cfg.q_lora_rank == (0 if name == "v2_lite" else 48)
        assert cfg.attn_scale == pytest.approx(model.model.layers[0].self_attn.scaling)
        assert cfg.rope_interleaved == (name != "kimi" or hf.rope_interleave)


@pytest.mark.jax_cache
@pytest.mark.parametrize("kind", ["v2", "v3"])
def test_router_matches_transformers(kind):
    """The routing function with DeepSeek's rules against transformers' router module on
    random scores, many tokens: the same experts, weights within float32 rounding."""
    import transformers as tf
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as v2
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as v3
    torch.manual_seed(1)
    if kind == "v2":
        cfg = tf.DeepseekV2Config(hidden_size=16, num_attention_heads=4, n_routed_experts=16, num_experts_per_tok=3,
                                  topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                  routed_scaling_factor=16.0)
        router = v2.DeepseekV2TopkRouter(cfg)
    else:
        cfg = tf.DeepseekV3Config(hidden_size=16, num_attention_heads=4, n_routed_experts=16, num_experts_per_tok=3,
                                  n_group=4, topk_group=2, routed_scaling_factor=2.5)
        router = v3.DeepseekV3TopkRouter(cfg)
        router.e_score_correction_bias.normal_(0, 0.1)
    router.weight.data.normal_(0, 1.0)
    x = torch.randn(200, 16)
    with torch.no_grad():
        logits, want_w, want_e = router(x)
    w, e = route(jnp.asarray(logits.numpy()), 3, kind == "v3", sigmoid=kind == "v3",
                 bias=(jnp.asarray(router.e_score_correction_bias.numpy())
                       if kind == "v3" else None), groups=4, topk_groups=2,
                 group_top2=kind == "v3", scale=cfg.routed_scaling_factor)
    order = np.argsort(want_e.numpy(), axis=1)
    want_e = np.take_along_axis(want_e.numpy(), order, 1)
    want_w = np.take_along_axis(want_w.numpy(), order, 1)
    mine = np.argsort(np.asarray(e), axis=1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(e), mine, 1), want_e)
    np.testing.assert_allclose(np.take_along_axis(np.asarray(w), mine, 1), want_w, rtol=1e-6)


@pytest.mark.jax_cache
@pytest.mark.parametrize("kv_cache_dtype", [None, "int8", "fp8"])
@pytest.mark.parametrize("backend", ["reference", "blocked", "cpu", "pallas"])
def test_absorbed_attention_equals_expanded(backend, kv_cache_dtype):
    """One sequence of 11 tokens, a 4-token chunk after 7 cached, its latents written into
    scattered pages (8-bit with one scale a token, or float): the absorbed form over the
    latent pages (each backend) against every latent, as the cache holds it, expanded into
    per-head keys and values; float32, within 1e-5."""
    rng = np.random.default_rng(0)
    H, nope, rot, r, v, S, T = 4, 16, 8, 32, 16, 11, 4
    f = lambda *s: jnp.asarray(rng.normal(size=s).astype(np.float32))
    q_nope, q_rot, latents, k_up, v_up = f(T, H, nope), f(T, H, rot), f(S, 1, r + rot), \
        f(H, nope, r), f(H, r, v)
    cfg = ModelConfig("DeepseekV3ForCausalLM", 64, 64, 64, 1, H, 1, rot, kv_lora_rank=r)
    table = jnp.array([[3, 1, 4]], jnp.int32)
    slots = table[0, jnp.arange(S) // PAGE] * PAGE + jnp.arange(S) % PAGE
    cache = write_latent(KVCache.zeros(cfg, 5, PAGE, kv_cache_dtype), 0, latents, slots)
    stored = cache.k[0, slots // PAGE, slots % PAGE, 0].astype(jnp.float32)
    if cache.k_scale is not None:
        stored = stored * cache.k_scale[0, slots // PAGE, slots % PAGE]
    want = expanded_attention(q_nope, q_rot, stored, k_up, v_up, 0.2)
    batch = Batch(jnp.zeros(T, jnp.int32), jnp.arange(S - T, S, dtype=jnp.int32),
                  jnp.zeros(T, jnp.int32), jnp.zeros(T, jnp.int32), table,
                  jnp.zeros(1, jnp.int32))
    q = jnp.concatenate([per_head_matmul(q_nope, k_up), q_rot], axis=-1)
    out = latent_paged_attention(q, cache, 0, batch, 0.2, backend, value_dim=r)
    got = per_head_matmul(out, v_up)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


def test_fp8_latent_cache_serves(tmp_path):
    """A V3 with an fp8 latent cache (one scale a token for the latent and its rope key):
    one byte a value, a prefix hit equals its cold run (the path 8-bit caches broke
    elsewhere), and the first tokens agree with transformers' (8-bit rounding may move
    later ones)."""
    model = tiny_deepseek_model("v3", tmp_path)
    llm = LLM(str(tmp_path), kv_cache_dtype="fp8", **OPTIONS)
    cache = llm.engine.runner.cache
    assert cache.k.dtype == jnp.float8_e4m3fn and cache.k.shape[-2:] == (1, 40)
    assert cache.k_scale.shape == cache.k.shape[:-1] and cache.v.size == 0
    prompt = PROMPTS[3][:45]
    cold = llm.generate([prompt], GREEDY)[0].token_ids
    assert llm.generate([prompt], GREEDY)[0].token_ids == cold
    assert cold[:2] == greedy_reference(model, prompt, 2)
    cfg = ModelConfig.from_dir(tmp_path)
    assert bytes_per_page(cfg, PAGE, "fp8") == 3 * PAGE * (40 + 4)


def _v3_config(**fields):
    hf = {"architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 129280,
          "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
          "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
          "n_routed_experts": 256, "num_experts_per_tok": 8,
          "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings":
                           4096, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                           "mscale_all_dim": 1.0}, "torch_dtype": "bfloat16"}
    return {**hf, **fields}


def test_v3_latent_cache_bytes_and_scale():
    """DeepSeek-V3's own config: 576 values a token and layer (68.6 KiB a token in
    bfloat16), and the softmax scale 192 ** -0.5 * mscale(40) ** 2."""
    cfg = ModelConfig.from_hf(_v3_config())
    assert cfg.latent_width == 576 and cfg.moe_layers[:4] == (False, False, False, True)
    assert bytes_per_page(cfg, 1) == 61 * 576 * 2 == 70272
    assert cfg.attn_scale == pytest.approx(0.135234, abs=1e-6)


@pytest.mark.parametrize("fields, named", [
    ({"index_topk": 2048}, "index_topk"),
    ({"n_group": 3}, "n_group"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_unsupported_fields_are_refused_naming_them(fields, named):
    with pytest.raises(ConfigError, match=named):
        ModelConfig.from_hf(_v3_config(**fields))


def test_lora_is_refused_naming_why(tmp_path):
    tiny_deepseek_model("v2_lite", tmp_path)
    with pytest.raises(ValueError, match="latent attention"):
        LLM(str(tmp_path), enable_lora=True, **OPTIONS)


def test_fp8_block_checkpoint_serves_without_widening(tmp_path):
    """DeepSeek-V3's own format (every projection fp8 with 128x128 block scales, the router
    float): served with its weights fp8 on the device (kv_b_proj alone dequantized, into the
    per-head absorbed projections), its greedy tokens transformers' on the format's own
    dequantization of the same file."""
    import transformers as tf

    from quant import packed, packed_experts
    from tests.quantized_tiny import dequantized_folder, write_fp8_from_folder
    tiny_deepseek_model("v3", tmp_path / "hf")
    folder, expected = write_fp8_from_folder(tmp_path / "hf", tmp_path / "fp8")
    llm = LLM(str(folder), **OPTIONS)
    layers = llm.engine.runner.params["layers"]
    for i, layer in enumerate(layers):
        attn = layer["attn"]
        for name in ("q_a_proj", "q_b_proj", "kv_a_proj", "o_proj"):
            assert isinstance(attn[name]["kernel"], packed.PackedFp8Blocks), (i, name)
        assert len(attn["k_up"]) == 4 and attn["k_up"][0]["kernel"].dtype != jnp.float8_e4m3fn
    assert layers[1]["moe"]["gate_up_proj"]["kernel"].kind == "fp8_blocks"
    assert isinstance(layers[1]["moe"]["gate_up_proj"]["kernel"], packed_experts.PackedExperts)
    model = tf.DeepseekV3ForCausalLM.from_pretrained(
        dequantized_folder(tmp_path / "hf", tmp_path / "dq", expected),
        attn_implementation="eager", experts_implementation="eager").float().eval()
    ours = [r.token_ids for r in llm.generate(PROMPTS[1:3], GREEDY)]
    assert ours == [greedy_reference(model, p, GREEDY.max_tokens) for p in PROMPTS[1:3]]
