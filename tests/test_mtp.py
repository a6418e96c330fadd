"""Multi-token prediction as speculative decoding (model/mtp.py, serving/engine/mtp_drafter.py)
on a tiny DeepSeek-V3 with a next-n layer: the layer's logits (and GLM-4.5's) against
transformers' MTP head, each proposal (three guesses, the layer chained on its own) against
that head's greedy guesses chained as transformers' MtpModel chains depths, outputs with
proposals equal to outputs without, and the configurations refused."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from model.batch import sequences_batch
from model.checkpoint import convert_hf, load_model
from model.kv_cache import KVCache
from model.mtp import load_mtp_params, mtp_config, mtp_hidden, mtp_logits
from model.transformer import forward_hidden
from serving import LLM, SamplingParams
from serving.engine.mtp_drafter import MtpProposer
from tests.deepseek_tiny import tiny_deepseek_model, tiny_mtp_model
from tests.hf_tiny import greedy_reference
from tests.test_model_parity import scattered_page_table

OPTIONS = dict(max_num_seqs=8, max_model_len=96, max_num_batched_tokens=16, page_size=4,
               progress=False)
MTP = {"method": "mtp", "num_speculative_tokens": 3}
PROMPTS = [[5], list(range(10, 17)), [(7 * i) % 200 + 3 for i in range(23)],
           [(13 * i) % 205 + 3 for i in range(60)]]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("v3_mtp")
    tiny_mtp_model(folder)
    return folder


def hf_models(folder, architecture="DeepseekV3ForCausalLM"):
    """transformers' main model (its next-n layer left out) and its MtpModel over it."""
    import transformers as tf
    from transformers.modeling_layers import MtpModel
    main = getattr(tf, architecture).from_pretrained(
        folder, attn_implementation="eager", experts_implementation="eager").float().eval()
    main._keys_to_ignore_on_load_unexpected = [r"model\.layers\.3\..*"]
    return main, MtpModel.from_pretrained(main).float().eval()


@pytest.fixture(scope="module")
def transformers_models(folder):
    return hf_models(folder)


@pytest.fixture(scope="module")
def llm(folder):
    return LLM(str(folder), speculative_config=MTP, **OPTIONS)


def hf_guess_logits(main, mtp, ids: list[int], next_token: int):
    """transformers' MTP head over ids (each position given the token after it, the last
    one next_token) -> its logits at every position."""
    with torch.no_grad():
        h = main(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1]
        nxt = torch.tensor([ids[1:] + [next_token]])
        out = mtp.forward_layer(0, h, torch.arange(1, len(ids) + 1)[None], None,
                                input_ids=nxt)
        return mtp._project_to_logits(out)[0].numpy(), nxt[0].numpy()


def hf_chain(main, mtp, ids: list[int], next_token: int, k: int) -> list[int]:
    """transformers' greedy guesses for the k tokens after next_token: depth d + 1 runs the
    layer once more at the next position, on depth d's (post-normed) output and guess."""
    with torch.no_grad():
        h = main(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1]
        nxt, guesses = ids[1:] + [next_token], []
        for _ in range(k):
            out = mtp.forward_layer(0, h, torch.arange(1, h.shape[1] + 1)[None], None,
                                    input_ids=torch.tensor([nxt]))
            guesses.append(int(mtp._project_to_logits(out[:, -1:])[0, -1].argmax()))
            h, nxt = torch.cat([h, out[:, -1:]], 1), nxt + [guesses[-1]]
    return guesses


@pytest.mark.jax_cache
@pytest.mark.parametrize("variant", ["v3", "glm4_moe"])
def test_layer_logits_match_transformers(variant, folder, transformers_models, tmp_path):
    """DeepSeek-V3's next-n layer (latent attention) and GLM-4.5's (grouped-query attention
    with partial rotary and q/k norms)."""
    if variant == "v3":
        main, mtp_model = transformers_models
    else:
        folder = tmp_path / variant
        tiny_mtp_model(folder, variant=variant)
        main, mtp_model = hf_models(folder, "Glm4MoeForCausalLM")
    cfg, params = load_model(folder, progress=False)
    mtp = jax.tree.map(jnp.asarray, load_mtp_params(folder, cfg))
    ids = PROMPTS[3][:21]
    want, nxt = hf_guess_logits(main, mtp_model, ids, 7)
    table = scattered_page_table(1, 16)
    batch = jax.tree.map(jnp.asarray, sequences_batch([ids], table, 4))
    hidden, _ = forward_hidden(params, KVCache.zeros(cfg, 1 + table.size, 4), batch, cfg)
    x, _ = mtp_hidden(params, mtp, KVCache.zeros(mtp_config(cfg), 1 + table.size, 4), batch,
                      hidden, jnp.asarray(nxt), cfg)
    got = np.asarray(mtp_logits(params, mtp, x, cfg))
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4


def test_greedy_output_equals_plain_and_proposals_are_the_layers_guesses(
        llm, folder, transformers_models, monkeypatch):
    """Greedy through MTP proposals equals transformers' plain greedy continuation, and
    every proposal is transformers' MTP head's greedy guesses chained from that request's
    last token."""
    main, mtp_model = transformers_models
    seen = []
    real = MtpProposer.propose

    def recording(self, requests):
        real(self, requests)
        seen.extend((list(r.all_token_ids), list(r.spec_token_ids)) for r in requests)
    monkeypatch.setattr(MtpProposer, "propose", recording)
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    before = llm.engine.scheduler.spec_stats.snapshot()
    out = [r.token_ids for r in llm.generate(PROMPTS, greedy)]
    assert out == [greedy_reference(main, p, 10) for p in PROMPTS]
    proposals = [(ids, spec) for ids, spec in seen if spec]
    assert len(proposals) >= 10
    assert any(len(spec) == 3 for _, spec in proposals)
    for ids, spec in proposals[:12]:
        assert spec == hf_chain(main, mtp_model, ids[:-1], ids[-1], 3)[:len(spec)]
    stats = llm.engine.scheduler.spec_stats
    drafted = stats.num_draft_tokens - before.num_draft_tokens  # what the steps verified
    assert 0 < drafted <= sum(len(spec) for _, spec in proposals)


def test_seeded_output_equals_plain(llm):
    """Seeded sampling: each prompt alone (proposals on) equals it among six requests
    (more than disable_by_batch_size: no proposals)."""
    params = [SamplingParams(temperature=0.9, seed=s, max_tokens=8, ignore_eos=True)
              for s in range(6)]
    prompts = (PROMPTS + PROMPTS)[:6]
    crowd = [r.token_ids for r in llm.generate(prompts, params)]
    alone = [llm.generate([p], [s])[0].token_ids for p, s in zip(prompts, params)]
    assert alone == crowd


def test_refused_configurations(folder, tmp_path):
    plain = tmp_path / "plain"
    tiny_deepseek_model("v2_lite", plain)
    with pytest.raises(ValueError, match="next-n prediction layers"):
        LLM(str(plain), speculative_config=MTP, **OPTIONS)
    converted = tmp_path / "converted"
    convert_hf(folder, converted, "float32", progress=False)
    with pytest.raises(ValueError, match="holds no next-n prediction layer"):
        LLM(str(converted), speculative_config={"method": "deepseek_mtp",
                                                "num_speculative_tokens": 1}, **OPTIONS)


@pytest.mark.jax_cache
def test_the_layer_of_an_fp8_block_checkpoint_is_read_dequantized(folder, tmp_path):
    """DeepSeek-V3 ships its next-n layer in fp8 with block scales like the rest: read into
    float as the format's own dequantization gives it (the same numbers as the dequantized
    float folder's)."""
    from model.config import ModelConfig
    from tests.quantized_tiny import dequantized_folder, write_fp8_from_folder
    fp8, expected = write_fp8_from_folder(folder, tmp_path / "fp8")
    assert any(name.startswith("model.layers.3.") for name in expected)
    cfg = ModelConfig.from_dir(fp8)
    got = load_mtp_params(fp8, cfg)
    want = load_mtp_params(dequantized_folder(folder, tmp_path / "dq", expected), cfg)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(a, b)
