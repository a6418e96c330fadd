"""Mamba2 hybrids (Nemotron-H, Granite 4.0-H with experts and dense, Falcon-H1) against
transformers:
the config fields each family reads (Nemotron-H's block list in each form config.json writes
it), logits over the paged cache and the recurrent state (one step, and a prefill
split over steps), greedy tokens through the engine with chunked prefill, default buckets
and preemption, batched equal to alone, the state slots all given back, and conversion."""
import json

import numpy as np
import pytest

from model.config import ConfigError, ModelConfig
from quant.array import QuantArray
from serving import LLM
from tests.hf_tiny import MAMBA_FAMILIES, tiny_hf_model
from tests.hybrid_checks import (ENGINE, check_batched_equals_alone, check_conversion,
                                 check_greedy, check_logits)

BLOCKS = ["linear_attention", "mlp", "full_attention", "linear_attention", "moe",
          "linear_attention"]


@pytest.fixture(scope="module", params=MAMBA_FAMILIES)
def family(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, tiny_hf_model(request.param, folder), folder


@pytest.fixture(scope="module")
def llm(family):
    # ENGINE's KV budget is one attention layer's: Falcon-H1 attends in every layer.
    layers = ModelConfig.from_hf(_hf(family[2])).num_kv_layers
    return LLM(str(family[2]), **{**ENGINE, "kv_cache_memory": ENGINE["kv_cache_memory"] * layers})


def _hf(folder) -> dict:
    return json.loads((folder / "config.json").read_text())


def test_config_reads_each_family(family):
    name, model, folder = family
    hf = _hf(folder)
    cfg = ModelConfig.from_hf(hf)
    assert (cfg.ssm_head_dim, cfg.ssm_state_size, cfg.ssm_groups, cfg.ssm_chunk,
            cfg.linear_conv_kernel) == (16, 16, 2, 8, 4)
    assert cfg.ssm_conv_bias and not cfg.ssm_proj_bias and cfg.ssm_dt_limit == (0, np.inf)
    if name == "falcon_h1":
        assert cfg.mixers == ("hybrid",) * 3 and cfg.ssm_heads == 6
        assert (cfg.num_kv_layers, cfg.num_linear_layers) == (3, 3) and cfg.use_rope
        assert cfg.ssm_norm == "none" and cfg.embedding_multiplier == 2.0
        assert dict(cfg.multipliers) == {
            "ssm_z": 0.5, "ssm_x": 1.5, "ssm_b": 0.8, "ssm_c": 1.1, "ssm_dt": 0.7,
            "ssm_in": 1.3, "ssm_out": 0.6, "attn_in": 1.2, "attn_out": 0.9, "key": 0.8,
            "mlp_gate": 1.5, "mlp_down": 0.75, "lm_head": 0.5}
        for norm, before, want in ((True, True, "norm_first"), (True, False, "gate_first")):
            assert ModelConfig.from_hf({**hf, "mamba_rms_norm": norm,
                                        "mamba_norm_before_gate": before}).ssm_norm == want
        return
    if name.startswith("granite"):
        assert cfg.mixers == ("mamba2", "mamba2", "attention", "mamba2")
        assert (cfg.num_kv_layers, cfg.num_linear_layers) == (1, 3) and not cfg.blocks
        assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.logits_scaling,
                cfg.attn_scale) == (3.0, 0.5, 4.0, 0.2)
        if name == "granite_h":
            assert not cfg.use_rope and cfg.moe_layers == (True,) * 4
            assert (cfg.num_experts, cfg.moe_intermediate_size,
                    cfg.shared_expert_intermediate_size) == (4, 32, 48)
        else:  # the shared MLP is the MLP
            assert cfg.use_rope and not cfg.num_experts and cfg.intermediate_size == 48
        return
    assert "num_hidden_layers" not in hf  # the block list gives the count
    assert cfg.mixers == ("mamba2", "none", "attention", "mamba2", "none", "mamba2")
    assert (cfg.num_layers, cfg.num_kv_layers, cfg.num_linear_layers) == (6, 1, 3)
    assert cfg.blocks and not cfg.mlp_gated and not cfg.use_rope and cfg.norm_weight_f32
    assert cfg.hidden_act == "relu2" and cfg.rms_norm_eps == 1e-5
    assert cfg.moe_layers == (False,) * 4 + (True, False)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
            cfg.shared_expert_intermediate_size) == (8, 2, 32, 40)
    assert (cfg.router_sigmoid, cfg.router_bias, cfg.router_groups, cfg.router_topk_groups,
            cfg.router_group_top2, cfg.routed_scaling_factor, cfg.norm_topk_prob) == (
        True, True, 2, 1, True, 2.5, True)
    # without a block of experts the model is dense
    dense = ModelConfig.from_hf({**hf, "layers_block_type": BLOCKS[:4] + ["mlp", BLOCKS[5]]})
    assert not dense.num_experts and not dense.moe_layers
    # the older forms: the pattern string, and the legacy block names
    del hf["layers_block_type"]
    assert ModelConfig.from_hf({**hf, "hybrid_override_pattern": "M-*MEM"}) == cfg
    legacy = [{"linear_attention": "mamba", "full_attention": "attention"}.get(t, t)
              for t in BLOCKS]
    assert ModelConfig.from_hf({**hf, "layers_block_type": legacy}) == cfg
    assert ModelConfig.from_hf({**hf, "layers_block_type": BLOCKS,
                                "time_step_limit": [0.0, 8.0]}).ssm_dt_limit == (0.0, 8.0)


def test_refusals(family):
    name, model, folder = family
    hf = _hf(folder)
    with pytest.raises(ConfigError, match="n_groups"):
        ModelConfig.from_hf({**hf, "n_groups": 5, "mamba_n_groups": 5})
    with pytest.raises(ConfigError, match="mamba_hidden_act"):
        ModelConfig.from_hf({**hf, "mamba_hidden_act": "gelu"})
    with pytest.raises(ValueError, match="speculative"):
        LLM(str(folder), **ENGINE, speculative_config={"method": "ngram",
                                                       "num_speculative_tokens": 2,
                                                       "prompt_lookup_max": 2})
    if name == "falcon_h1":
        with pytest.raises(ConfigError, match="mamba_d_head"):
            ModelConfig.from_hf({**hf, "mamba_d_head": 12})
        with pytest.raises(ConfigError, match="ssm_multipliers"):
            ModelConfig.from_hf({**hf, "ssm_multipliers": [1.0] * 4})
        return
    if name.startswith("granite"):
        with pytest.raises(ConfigError, match="mamba_d_head"):
            ModelConfig.from_hf({**hf, "mamba_d_head": 12})
        with pytest.raises(ConfigError, match="layer_types"):
            ModelConfig.from_hf({**hf, "layer_types": ["mamba", "mlp", "attention", "mamba"]})
        return
    hf = {**hf, "layers_block_type": BLOCKS}
    with pytest.raises(ConfigError, match="n_group"):  # the experts' groups checked
        ModelConfig.from_hf({**hf, "n_group": 3})
    with pytest.raises(ConfigError, match="no attention layer"):
        ModelConfig.from_hf({**{k: v for k, v in hf.items() if k != "layers_block_type"},
                             "hybrid_override_pattern": "M-M"})
    with pytest.raises(ConfigError, match="hybrid_override_pattern characters"):
        ModelConfig.from_hf({**{k: v for k, v in hf.items() if k != "layers_block_type"},
                             "hybrid_override_pattern": "M-*X"})


@pytest.mark.jax_cache
def test_logits_match_transformers(family):
    """One step, then split at 5 (fewer new tokens than the conv's window in a row) and at
    100."""
    name, model, folder = family
    check_logits(name, model, folder, cuts=(5, 100))


@pytest.mark.jax_cache
@pytest.mark.parametrize("before_gate", [True, False])
def test_falcon_h1_gated_norms_match_transformers(tmp_path, before_gate):
    """Falcon-H1 with its optional gated norm (mamba_rms_norm), normed before the gate or
    after it, and out_proj's own bias."""
    import torch
    model = tiny_hf_model("falcon_h1", tmp_path, mamba_rms_norm=True,
                          mamba_norm_before_gate=before_gate, projectors_bias=True)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("out_proj.bias"):
                p.normal_(0, 0.1)
    model.save_pretrained(tmp_path)
    cfg = ModelConfig.from_dir(tmp_path)
    assert cfg.ssm_norm == ("norm_first" if before_gate else "gate_first") and cfg.ssm_out_bias
    check_logits("falcon_h1 norm", model, tmp_path, cuts=(5,))


@pytest.mark.jax_cache
def test_latent_experts_match_transformers(tmp_path):
    """Nemotron-H's experts on a latent width (moe_latent_size): tokens projected in before
    the experts and their weighted sum projected out."""
    model = tiny_hf_model("nemotron_h", tmp_path, moe_latent_size=24)
    assert ModelConfig.from_dir(tmp_path).moe_latent_size == 24
    check_logits("nemotron_h latent", model, tmp_path, cuts=(5,))


def test_greedy_tokens_match_transformers(family, llm):
    check_greedy(family[1], llm)


def test_batched_equals_alone(family, llm):
    check_batched_equals_alone(llm)


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_converted_checkpoint_loads_the_same(family, tmp_path, quantize):
    """Quantized, the projections are int8 and the conv, gates and norms stay float."""
    name, folder = family[0], family[2]
    direct = check_conversion(folder, tmp_path / "ckpt", quantize)
    is_q = lambda a: isinstance(a, QuantArray)
    layers = direct["layers"]  # stacked where every layer is alike (Falcon-H1)
    layer = lambda i: layers[i] if isinstance(layers, list) else layers
    mixer = layer(0)["mamba"]
    assert is_q(mixer["in_proj"]["kernel"]) == (quantize == "int8")
    mlp = layer(1)
    mlp = mlp["moe"]["shared_expert"] if "moe" in mlp else mlp["mlp"]
    assert is_q(mlp["up_proj"]["kernel"]) == (quantize == "int8")
    if name == "nemotron_h":  # the block of experts: ungated experts, the router float32
        moe = direct["layers"][4]["moe"]
        assert "gate_proj" not in moe and is_q(moe["up_proj"]["kernel"]) == (quantize == "int8")
        assert not is_q(moe["router"]["kernel"]) and not is_q(moe["router_bias"])
    assert not any(is_q(mixer[k]) for k in ("conv_weight", "conv_bias", "dt_bias", "A_log", "D",
                                             "norm_weight") if k in mixer)
