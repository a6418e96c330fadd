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
from model.checkpoint import load_model
from model.config import ConfigError, ModelConfig
from model.kv_cache import KVCache, bytes_per_page
from model.latent_attention import expanded_attention, per_head_matmul
from model.moe import route
from serving import LLM, SamplingParams
from tests.deepseek_tiny import VARIANTS, tiny_deepseek_model
from tests.hf_tiny import greedy_reference
from tests.test_model_parity import paged_logits

PAGE = 4
RTOL = 1e-4  # measured max |ours - transformers| / max |transformers| about 1e-6
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


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].numpy()


def test_logits_match_transformers(variant):
    """Prompts over several pages, prefilled in one step on scattered pages."""
    name, model, folder, _ = variant
    cfg, params = load_model(folder, progress=False)
    logits, off = paged_logits(params, cfg, PROMPTS[1:], PAGE), 0
    for p in PROMPTS[1:]:
        want = hf_logits(model, p)
        assert np.abs(logits[off:off + len(p)] - want).max() / np.abs(want).max() < RTOL, name
        off += len(p)


def test_greedy_tokens_match_transformers(variant):
    """Prompts of 1 to 60 tokens batched, the long one prefilled in chunks of 16."""
    name, model, folder, llm = variant
    ours = [r.token_ids for r in llm.generate(PROMPTS, GREEDY)]
    assert ours == [greedy_reference(model, p, GREEDY.max_tokens) for p in PROMPTS], name


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


@pytest.mark.parametrize("backend", ["reference", "blocked", "cpu", "pallas"])
def test_absorbed_attention_equals_expanded(backend):
    """One sequence of 11 tokens in a 4-token chunk after 7 cached: the absorbed form over
    the latent pages (each backend) against every latent expanded into per-head keys and
    values, float32, within 1e-5."""
    rng = np.random.default_rng(0)
    H, nope, rot, r, v, S, T = 4, 16, 8, 32, 16, 11, 4
    f = lambda *s: jnp.asarray(rng.normal(size=s).astype(np.float32))
    q_nope, q_rot, latents, k_up, v_up = f(T, H, nope), f(T, H, rot), f(S, r + rot), \
        f(H, nope, r), f(H, r, v)
    want = expanded_attention(q_nope, q_rot, latents, k_up, v_up, 0.2)
    cache = KVCache(jnp.zeros((1, 5, PAGE, 1, r + rot)).at[0, jnp.array([3, 1, 4])].set(
        jnp.pad(latents, ((0, 1), (0, 0))).reshape(3, PAGE, 1, r + rot)),
        jnp.zeros((1, 5, PAGE, 1, 0)))
    batch = Batch(jnp.zeros(T, jnp.int32), jnp.arange(S - T, S, dtype=jnp.int32),
                  jnp.zeros(T, jnp.int32), jnp.zeros(T, jnp.int32),
                  jnp.array([[3, 1, 4]], jnp.int32), jnp.zeros(1, jnp.int32))
    q = jnp.concatenate([per_head_matmul(q_nope, k_up), q_rot], axis=-1)
    out = latent_paged_attention(q, cache, 0, batch, 0.2, backend, value_dim=r)
    got = per_head_matmul(out, v_up)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
def test_quantized_latent_cache(tmp_path, kv_cache_dtype):
    """A V3 with an 8-bit latent cache (one scale a token for the latent and its rope key):
    one byte a value, a prefix hit equals its cold run, and the first tokens agree with
    transformers' (8-bit rounding may move later ones)."""
    model = tiny_deepseek_model("v3", tmp_path)
    llm = LLM(str(tmp_path), kv_cache_dtype=kv_cache_dtype, **OPTIONS)
    cache = llm.engine.runner.cache
    assert cache.k.dtype.itemsize == 1 and cache.k.shape[-2:] == (1, 40)
    assert cache.k_scale.shape == cache.k.shape[:-1] and cache.v.size == 0
    prompt = PROMPTS[3][:45]
    cold = llm.generate([prompt], GREEDY)[0].token_ids
    assert llm.generate([prompt], GREEDY)[0].token_ids == cold
    assert cold[:2] == greedy_reference(model, prompt, 2)
    cfg = ModelConfig.from_dir(tmp_path)
    assert bytes_per_page(cfg, PAGE, kv_cache_dtype) == 3 * PAGE * (40 + 4)


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
