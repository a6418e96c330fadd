"""The batch-invariant CPU matmul (pallas_kernels/cpu/dense_matmul.cc), for float weights and
for 8-bit codes with channel scales: its products against a float64 matmul, and a row's
result bit for bit the same whatever rows share the call."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import cpu_build, cpu_ffi
from pallas_kernels.dense_matmul_cpu import (bf16_pairs_reference, dense_matmul,
                                             kernel_available, pack_panels, unpack_panels)

pytestmark = pytest.mark.jax_cache  # tests/jax_cache.py


def test_the_kernel_builds_here():
    assert cpu_ffi.available("dense_matmul") and kernel_available()


def _weights(K, N, dtype, seed=0):
    w = np.random.default_rng(seed).standard_normal((K, N)).astype(np.float32) * 0.05
    return jnp.asarray(w, dtype)


@pytest.mark.parametrize("N", [48, 53, 5])
def test_packing_round_trips(N):
    K = 8
    w = np.asarray(_weights(K, N, jnp.float32))
    flat = np.asarray(pack_panels(w)).reshape(-1)
    full = N // 16 * 16
    for p in range(N // 16):  # whole panels: [p][k][j] = w[k][16p + j]
        np.testing.assert_array_equal(flat[p * K * 16:(p + 1) * K * 16].reshape(K, 16),
                                      w[:, 16 * p:16 * (p + 1)])
    np.testing.assert_array_equal(flat[K * full:].reshape(K, N - full), w[:, full:])  # narrow
    np.testing.assert_array_equal(np.asarray(unpack_panels(pack_panels(w))), w)


@pytest.mark.parametrize("K,N", [(8, 48), (7, 53), (1, 5), (3, 16)])
def test_bfloat16_panels_hold_k_in_pairs(K, N):
    """[i][j][t] = w[2i + t][16p + j] in each panel, then an odd K's last k alone."""
    w = _weights(K, N, jnp.bfloat16)
    flat = np.asarray(pack_panels(w).astype(jnp.float32)).reshape(-1)
    wf = np.asarray(w.astype(jnp.float32))
    at, pairs = 0, K // 2
    for p in range((N + 15) // 16):
        block = wf[:, 16 * p:16 * (p + 1)]
        width = block.shape[1]
        got = flat[at:at + 2 * pairs * width].reshape(pairs, width, 2)
        np.testing.assert_array_equal(got, block[:2 * pairs].reshape(pairs, 2, width)
                                      .transpose(0, 2, 1))
        np.testing.assert_array_equal(flat[at + 2 * pairs * width:at + K * width],
                                      block[2 * pairs:].reshape(-1))
        at += K * width
    np.testing.assert_array_equal(np.asarray(unpack_panels(pack_panels(w))), np.asarray(w))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("T,K,N", [(1, 1, 16), (3, 7, 32), (6, 64, 48), (13, 576, 960),
                                   (64, 100, 16), (5, 64, 211), (7, 9, 3)])
def test_matches_a_float64_matmul(dtype, T, K, N):
    x = np.random.default_rng(T + K).standard_normal((T, K)).astype(np.float32)
    w = _weights(K, N, dtype, seed=K)
    got = np.asarray(jax.jit(dense_matmul)(jnp.asarray(x), pack_panels(w)))
    if dtype == "bfloat16":  # rows rounded to bfloat16, products summed two k at a time
        np.testing.assert_array_equal(got, bf16_pairs_reference(x, w))
        x = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
    want = x.astype(np.float64) @ np.asarray(w.astype(jnp.float32), np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(K))
    assert "xlaserve_dense_matmul" in jax.jit(dense_matmul).lower(x, pack_panels(w)).as_text()


def test_bfloat16_weights_round_rows_to_nearest_even():
    """Rows against the identity give the rows as the kernel rounds them (ties to even,
    large and small values), in the vector part of a row (16 at a time) and its tail."""
    K = 37
    one = 1.0 + 2.0 ** -8  # halfway between two bfloat16 values: rounds down to 1.0
    row = np.array([one, 1 + 3 * 2.0 ** -8, -one, 1 + 2.0 ** -9, 1 - 2.0 ** -10, -0.0,
                    3.0e38, 1.0e-30, 0.3] * 5, np.float32)[:K]
    x = np.stack([row, row[::-1].copy()])
    got = np.asarray(dense_matmul(jnp.asarray(x), pack_panels(jnp.eye(K, dtype=jnp.bfloat16))))
    want = np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32))
    np.testing.assert_array_equal(got, want)
    assert got[0, 0] == 1.0 and got[0, 1] == 1 + 2.0 ** -6


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_a_row_does_not_depend_on_its_batch(dtype):
    """Rows alone, at every position of tiles of 1 to 6 rows and in batches of every bucket
    size, give the same bits. XLA's own dot does not (the negative control)."""
    K, N = 576, 1544  # one narrow panel
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((64, K)).astype(np.float32))
    w = _weights(K, N, dtype)
    panels = pack_panels(w)
    run = jax.jit(dense_matmul)
    full = np.asarray(run(x, panels))
    for T in (1, 2, 3, 5, 7, 16, 33):
        for start in (0, 1, 64 - T):
            part = np.asarray(run(x[start:start + T], panels))
            np.testing.assert_array_equal(part, full[start:start + T], err_msg=f"T={T}")
    xla = jax.jit(lambda a, b: a @ b.astype(jnp.float32))
    batched, alone = np.asarray(xla(x, w)), np.asarray(xla(x[:1], w))
    if dtype == "float32":
        assert (alone != batched[:1]).any(), "XLA's dot became batch invariant"



CODES = ["int8", "float8_e4m3fn", "float8_e5m2"]


def _codes(K, N, dtype, seed=0):
    """8-bit codes covering the format's range (every int8 value; fp8 codes from normal
    draws, so subnormals and large magnitudes occur) and positive channel scales."""
    rng = np.random.default_rng(seed)
    if dtype == "int8":
        codes = jnp.asarray(rng.integers(-128, 128, (K, N)).astype(np.int8))
    else:
        codes = jnp.asarray((rng.standard_normal((K, N)) * 40).astype(np.float32)).astype(dtype)
    return codes, jnp.asarray(rng.uniform(0.001, 0.01, N).astype(np.float32))


@pytest.mark.parametrize("dtype", CODES)
@pytest.mark.parametrize("T,K,N", [(1, 1, 16), (6, 64, 48), (13, 576, 960), (5, 64, 211),
                                   (7, 9, 3)])
def test_codes_with_channel_scales_match_a_float64_matmul(dtype, T, K, N):
    x = np.random.default_rng(T + K).standard_normal((T, K)).astype(np.float32)
    codes, scale = _codes(K, N, dtype, seed=K)
    got = np.asarray(jax.jit(dense_matmul)(jnp.asarray(x), pack_panels(codes), scale))
    real = np.asarray(codes.astype(jnp.float32), np.float64) * np.asarray(scale, np.float64)
    np.testing.assert_allclose(got, x.astype(np.float64) @ real, rtol=1e-5,
                               atol=1e-5 * np.sqrt(K) * float(np.abs(real).max()))


def test_every_fp8_code_decodes_as_jax_does():
    """All 256 codes of each fp8 format, one per output channel (K = 1), and again in the
    narrow panel (N = 256 + 5): y[0, n] = code_n."""
    for dtype in CODES[1:]:
        raw = np.concatenate([np.arange(256), np.arange(251, 256)]).astype(np.uint8)
        codes = jnp.asarray(raw).view(dtype).reshape(1, -1)
        got = np.asarray(dense_matmul(jnp.ones((1, 1), jnp.float32), pack_panels(codes),
                                      jnp.ones((codes.shape[1],), jnp.float32)))
        want = np.asarray(codes.astype(jnp.float32))
        if dtype == "float8_e4m3fn":  # its NaN codes decode as +-480 (never quantized to)
            want = np.where(np.isnan(want), np.where(raw < 128, 480, -480),
                            want)
        np.testing.assert_array_equal(got, want, err_msg=dtype)


@pytest.mark.parametrize("dtype", CODES)
def test_codes_rows_do_not_depend_on_their_batch(dtype):
    K, N = 576, 1544
    x = jnp.asarray(np.random.default_rng(2).standard_normal((64, K)).astype(np.float32))
    codes, scale = _codes(K, N, dtype)
    panels, run = pack_panels(codes), jax.jit(dense_matmul)
    full = np.asarray(run(x, panels, scale))
    for T in (1, 3, 7, 16, 33):
        for start in (0, 64 - T):
            np.testing.assert_array_equal(np.asarray(run(x[start:start + T], panels, scale)),
                                          full[start:start + T], err_msg=f"T={T}")


def test_scale_goes_with_codes_only():
    codes, scale = _codes(8, 16, "int8")
    with pytest.raises(ValueError, match="need a scale"):
        dense_matmul(jnp.ones((1, 8)), pack_panels(codes))
    with pytest.raises(ValueError, match="take no scale"):
        dense_matmul(jnp.ones((1, 8)), pack_panels(_weights(8, 16, "float32")), scale)


BUILDS = {"avx2": ["-mno-avx512f"], "avx512 without bf16": ["-mno-avx512bf16"]}


@pytest.mark.skipif("avx512f" not in cpu_build.cpu_signature(), reason="needs an AVX-512 CPU to "
                    "run both builds; tests/test_kernel_build.py compiles both anywhere")
@pytest.mark.parametrize("build", BUILDS)
def test_the_avx2_and_avx512_tiles_give_the_same_bits(tmp_path, build):
    """The kernel built without AVX-512 (6-row tiles of two registers), and without
    AVX512-BF16 (bfloat16 pairs as two FMAs), against the one this CPU loads (12-row tiles
    of one register, `vdpbf16ps` where the CPU has it): every output is the same chain of
    rounded sums, so the same bits, for every weight form, a narrow panel, an odd K and
    tile remainders."""
    if build == "avx512 without bf16" and "avx512_bf16" not in cpu_build.cpu_signature():
        pytest.skip("this CPU has no AVX512-BF16: the build it loads is that one")
    import ctypes
    import shutil
    import subprocess
    source = cpu_build.SOURCE_DIR / "dense_matmul.cc"
    out = tmp_path / "dense_matmul_other.so"
    subprocess.run([shutil.which("g++") or "g++", *cpu_build.FLAGS, *BUILDS[build],
                    f"-I{jax.ffi.include_dir()}", str(source), "-o", str(out)], check=True,
                   capture_output=True)
    lib = ctypes.cdll.LoadLibrary(str(out))
    name = f"test_dense_matmul_{build.replace(' ', '_')}"
    jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(lib.xlaserve_dense_matmul),
                                platform="cpu")
    rng = np.random.default_rng(5)
    for dtype in ["float32", "bfloat16", "float16", "int8", "float8_e4m3fn", "float8_e5m2"]:
        for T, K, N in [(1, 64, 4096), (37, 576, 1544), (256, 64, 4099), (13, 65, 37)]:
            x = jnp.asarray(rng.standard_normal((T, K)).astype(np.float32))
            if dtype in ("float32", "bfloat16", "float16"):
                w, scale = _weights(K, N, dtype, seed=T), None
            else:
                w, scale = _codes(K, N, dtype, seed=T)
            panels = pack_panels(w)
            got = np.asarray(dense_matmul(x, panels, scale))
            other = jax.ffi.ffi_call(name, jax.ShapeDtypeStruct((T, N), jnp.float32))(
                x, panels, jnp.zeros((0,), jnp.float32) if scale is None else scale)
            np.testing.assert_array_equal(got.view(np.uint32),
                                          np.asarray(other).view(np.uint32),
                                          err_msg=f"{dtype} {T}x{K}x{N}")
