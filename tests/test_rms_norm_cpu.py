"""The RMS-normalisation CPU kernel (pallas_kernels/cpu/rms_norm.cc): close to the XLA form,
and a row's result bit for bit the same whatever rows share the call (XLA's is not)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import cpu_ffi, rms_norm_cpu


def test_the_kernel_builds_here():
    assert cpu_ffi.available("rms_norm")
    text = jax.jit(lambda x: rms_norm_cpu.normalize(x, 1e-5)).lower(jnp.ones((2, 8))).as_text()
    assert "xlaserve_rms_norm" in text


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (5, 72), (16, 576), (2, 3, 20)])
def test_matches_the_xla_form(shape):
    x = jnp.asarray(np.random.default_rng(len(shape)).standard_normal(shape).astype(np.float32))
    got = np.asarray(jax.jit(lambda x: rms_norm_cpu.normalize(x, 1e-6))(x))
    want = np.asarray(rms_norm_cpu.normalize_reference(x, 1e-6))
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7)


def test_under_vmap_as_the_per_head_norms_call_it():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 6, 20)).astype(np.float32))
    got = np.asarray(jax.jit(jax.vmap(lambda r: rms_norm_cpu.normalize(r, 1e-6)))(x))
    np.testing.assert_array_equal(got, np.asarray(jax.jit(
        lambda x: rms_norm_cpu.normalize(x, 1e-6))(x)))


def test_a_row_does_not_depend_on_its_batch():
    x = jnp.asarray(np.random.default_rng(1).standard_normal((64, 72)).astype(np.float32))
    norm = jax.jit(lambda x: rms_norm_cpu.normalize(x, 1e-5))
    full = np.asarray(norm(x))
    for T in (1, 2, 3, 4, 8, 16, 32):
        np.testing.assert_array_equal(np.asarray(norm(x[:T])), full[:T], err_msg=f"T={T}")
    xla = jax.jit(lambda x: rms_norm_cpu.normalize_reference(x, 1e-5))
    ref = np.asarray(xla(x))
    assert any((np.asarray(xla(x[:T])) != ref[:T]).any() for T in (4, 8, 16, 32)), \
        "XLA's row reduction became batch invariant"


def test_programs_for_other_platforms_keep_the_xla_form():
    lowered = jax.jit(lambda x: rms_norm_cpu.normalize(x, 1e-5)).trace(
        jax.ShapeDtypeStruct((4, 8), jnp.float32)).lower(lowering_platforms=("cuda",))
    assert "xlaserve_rms_norm" not in lowered.as_text()
