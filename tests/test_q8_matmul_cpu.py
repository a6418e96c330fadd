"""The int8-weight CPU kernel (pallas_kernels/cpu/q8_matmul.cc) against plain jnp, and the
packed weights prepare_params makes for it."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.batch import sequences_batch
from model.config import ModelConfig
from model.kv_cache import KVCache
from model.runtime_params import prepare_params
from model.transformer import forward, init_params
from pallas_kernels import cpu_ffi
from pallas_kernels.q8_matmul_cpu import (pack_panels, q8_matmul, q8_matmul_reference,
                                          unpack_panels)
from quant.array import QuantArray, quantize
from quant.packed import PackedDense, PackedQ8, kernels_available, pack_head
from quant.recipe import quantize_params

pytestmark = pytest.mark.jax_cache  # tests/jax_cache.py


def test_the_kernel_builds_here():
    assert cpu_ffi.available("q8_matmul") and kernels_available()


@pytest.mark.parametrize("T", [1, 2, 3, 4, 5, 6, 7, 16, 33, 130])
@pytest.mark.parametrize("K,N", [(4, 16), (64, 48), (576, 960), (1540, 32)])
def test_q8_matmul_matches_reference(T, K, N):
    rng = np.random.default_rng(T * 1000 + K + N)
    values = rng.integers(-127, 128, (K, N)).astype(np.int8)
    scale = (rng.random(N) / 100).astype(np.float32)
    x = rng.standard_normal((T, K)).astype(np.float32)
    got = np.asarray(jax.jit(q8_matmul)(x, pack_panels(values), scale))
    want = np.asarray(q8_matmul_reference(x, values, scale))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
    # rounding x to int16 moves the float64 product by a few parts in 1e5 of its range
    exact = (x.astype(np.float64) @ values.astype(np.float64)) * scale
    np.testing.assert_allclose(got, exact, rtol=0, atol=2e-4 * np.abs(exact).max())


def test_a_row_does_not_depend_on_the_rows_beside_it():
    rng = np.random.default_rng(7)
    values = rng.integers(-128, 128, (1536, 64)).astype(np.int8)  # 3 blocks of k
    scale = (rng.random(64) / 100).astype(np.float32)
    x = (rng.standard_normal((40, 1536)) * rng.random((40, 1))).astype(np.float32)
    panels = pack_panels(values)
    together = np.asarray(q8_matmul(x, panels, scale))
    for rows in [slice(3, 4), slice(0, 5), slice(10, 17), slice(1, 40)]:
        np.testing.assert_array_equal(np.asarray(q8_matmul(x[rows], panels, scale)),
                                      together[rows])


def test_q8_matmul_zero_and_non_finite_rows():
    rng = np.random.default_rng(3)
    values = rng.integers(-127, 128, (64, 32)).astype(np.int8)
    scale = np.full(32, 0.01, np.float32)
    x = rng.standard_normal((9, 64)).astype(np.float32)
    x[1] = 0.0
    x[4, 5] = np.nan
    x[7, 60] = np.inf  # in the scalar tail of neither loop: 60 < 64
    got = np.asarray(q8_matmul(x, pack_panels(values), scale))
    assert (got[1] == 0).all()
    assert np.isnan(got[4]).all() and np.isnan(got[7]).all()
    ok = [0, 2, 3, 5, 6, 8]
    assert np.isfinite(got[ok]).all()
    np.testing.assert_allclose(got[ok], np.asarray(q8_matmul_reference(x[ok], values, scale)),
                               rtol=1e-6, atol=1e-6)


def test_q8_matmul_keeps_leading_axes_and_dtype():
    rng = np.random.default_rng(1)
    values = rng.integers(-127, 128, (32, 64)).astype(np.int8)
    scale = np.full(64, 0.01, np.float32)
    x = jnp.asarray(rng.standard_normal((2, 3, 32)), jnp.bfloat16)
    got = q8_matmul(x, pack_panels(values), scale)
    assert got.shape == (2, 3, 64) and got.dtype == jnp.bfloat16
    want = q8_matmul_reference(x.astype(jnp.float32), values, scale)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=2e-2,
                               atol=2e-2 * float(jnp.abs(want).max()))


def test_panels_round_trip_and_layout():
    values = np.arange(8 * 32, dtype=np.int32).reshape(8, 32).astype(np.int8)
    panels = np.asarray(pack_panels(values))
    assert panels.shape == values.shape
    np.testing.assert_array_equal(np.asarray(unpack_panels(panels)), values)
    flat = panels.reshape(2, 4, 16, 2)  # [panel, pair of k, channel in panel, k in pair]
    assert flat[1, 2, 3, 1] == values[5, 16 + 3]
    assert flat[0, 0, 7, 0] == values[0, 7]


def cfg_for(tied: bool, vocab: int) -> ModelConfig:
    return ModelConfig("LlamaForCausalLM", vocab_size=vocab, hidden_size=64,
                       intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                       head_dim=16, tie_word_embeddings=tied, sliding_windows=(0, 0))


def logits(cfg, params):
    tokens = [[5, 9, 11, 3, 40, 2, 7, 60, 1, 4, 8, 90], [3, 1, 4, 1, 5, 9, 2, 6]]
    batch = sequences_batch(tokens, np.asarray([[1, 2], [3, 4]], np.int32), 8)
    run = jax.jit(forward, static_argnames=("cfg", "backend"))
    return np.asarray(run(params, KVCache.zeros(cfg, 5, 8), batch, cfg)[0])


def packed_leaves(params):
    return [a for a in jax.tree.leaves(params, is_leaf=lambda a: isinstance(a, PackedQ8))
            if isinstance(a, PackedQ8)]


@pytest.mark.parametrize("tied,spec", [(True, "int8:lm_head"), (True, "int8"),
                                       (False, "int8:lm_head")])
def test_packed_model_equals_unpacked(tied, spec):
    cfg = cfg_for(tied, vocab=112)  # 112 = 7 panels: the head packs too
    params = quantize_params(init_params(cfg), spec)
    run = prepare_params(params)
    plain = prepare_params(params, pack=False)
    # per layer: qkv, o, gate_up, down; plus the head when it is int8
    head = spec.endswith("lm_head")
    assert len(packed_leaves(run)) == 4 * cfg.num_layers + head
    assert not packed_leaves(plain)
    # A float tied table is packed as the head too, for the dense kernel.
    assert "lm_head" in run
    assert isinstance(run["lm_head"]["kernel"], PackedQ8 if head else (PackedDense if tied
                                                                       else QuantArray))
    got, want = logits(cfg, run), logits(cfg, plain)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    # the stored tree, prepared inside the program, takes the same path
    np.testing.assert_allclose(logits(cfg, params), got, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spec", ["fp8:channel,lm_head", "fp8:lm_head", "int8:lm_head"])
def test_weights_the_kernel_cannot_take_go_to_the_dense_kernel_as_codes(spec):
    """fp8 weights, and an int8 head of 97 rows (not whole panels), are not PackedQ8: they
    run as 8-bit codes with channel scales in the dense kernel, with the logits of the
    unpacked tree."""
    table = quantize(np.ones((97, 64), np.float32), jnp.int8, axes=(-1,))
    assert pack_head(table) is None  # 97 rows: not whole panels
    cfg = cfg_for(True, vocab=97)
    params = quantize_params(init_params(cfg), spec)
    run = prepare_params(params)
    dense = [a for a in jax.tree.leaves(run, is_leaf=lambda a: isinstance(a, PackedDense))
             if isinstance(a, PackedDense)]
    int8 = spec.startswith("int8")
    assert len(packed_leaves(run)) == (4 * cfg.num_layers if int8 else 0)
    # q/k/v and gate/up joined (per-tensor scales become per-channel ones): 4 per layer
    assert len(dense) == (1 if int8 else 4 * cfg.num_layers + 1)  # + the tied head
    assert all(d.scale is not None and d.panels.dtype.itemsize == 1 for d in dense)
    assert isinstance(run["lm_head"]["kernel"], PackedDense)
    assert isinstance(run["embed"], QuantArray)  # the lookup keeps the table as it is
    # Weight-only: the model on the dequantized weights (per-tensor fp8 on XLA's path
    # quantizes the activations too).
    real = jax.tree.map(lambda a: a.dequantize() if isinstance(a, QuantArray) else a, params,
                        is_leaf=lambda a: isinstance(a, QuantArray))
    want = logits(cfg, prepare_params(real, pack=False))
    np.testing.assert_allclose(logits(cfg, run), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_no_packing_without_the_kernel(monkeypatch):
    import quant.packed
    monkeypatch.setattr(quant.packed, "kernels_available", lambda: False)
    params = quantize_params(init_params(cfg_for(True, vocab=112)), "int8:lm_head")
    assert not packed_leaves(prepare_params(params))
