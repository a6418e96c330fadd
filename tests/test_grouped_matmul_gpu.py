"""The Pallas grouped matmul for GPUs (pallas_kernels/grouped_matmul_gpu.py): in interpret
mode it gives jax.lax.ragged_dot's result for any mix of group sizes (empty groups, one
group with every row, rows past the groups), and it lowers for CUDA through Triton."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.grouped_matmul_gpu import grouped_matmul, tile_visits
from tests.test_kernel_lowering import lower_for_cuda

SDS = jax.ShapeDtypeStruct
SIZES = [[10, 0, 20, 5], [37, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1], [0, 16, 16, 0],
         [3, 0, 0, 30]]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_matches_ragged_dot_in_the_interpreter(dtype):
    rng = np.random.default_rng(0)
    M, K, N, E = 37, 64, 32, 4
    x = jnp.asarray(rng.standard_normal((M, K)), dtype)
    w = jnp.asarray(rng.standard_normal((E, K, N)), dtype)
    tol = 1e-5 if dtype == "float32" else 2e-2
    for sizes in SIZES:
        gs = jnp.asarray(sizes, jnp.int32)
        got = grouped_matmul(x, w, gs, block_m=16, block_n=16, block_k=16, interpret=True)
        want = jax.lax.ragged_dot(x, w, gs, preferred_element_type=jnp.float32).astype(dtype)
        assert got.dtype == x.dtype and got.shape == (M, N)
        scale = float(jnp.abs(want.astype(jnp.float32)).max()) or 1.0
        err = float(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32)).max())
        assert err <= tol * scale, (sizes, err)
        past = sum(sizes)
        assert not np.asarray(got[past:].astype(jnp.float32)).any(), sizes  # zeros past


def test_tile_visits_cover_each_group_once():
    """A tile that straddles groups is visited once per group; empty visits cover nothing."""
    meta = np.asarray(tile_visits(jnp.asarray([10, 0, 20, 5], jnp.int32), 48, 16))
    visits = [tuple(meta[:, v]) for v in range(meta.shape[1])]
    assert visits[:5] == [(0, 0, 0, 10), (2, 0, 10, 30), (2, 1, 10, 30), (3, 1, 30, 35),
                          (3, 2, 30, 35)]
    assert all(lo == hi == 0 for _, _, lo, hi in visits[5:])
    covered = sorted(r for e, t, lo, hi in visits for r in range(16 * t, 16 * t + 16)
                     if lo <= r < hi)
    assert covered == list(range(35))


def test_lowers_for_cuda_at_a_qwen3_moe_shape():
    """Qwen3-30B-A3B's gate/up (2048 -> 2 x 768) over 128 experts, 64 tokens x top-8, bf16:
    one Triton kernel, no dense dot over the experts."""
    x, w = SDS((512, 2048), jnp.bfloat16), SDS((128, 2048, 1536), jnp.bfloat16)
    gs = SDS((128,), jnp.int32)
    text = lower_for_cuda(lambda a, b, c: grouped_matmul(a, b, c), x, w, gs).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert "ragged_dot" not in text and "stablehlo.dot_general" not in text
