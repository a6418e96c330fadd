"""The ragged paged-attention Pallas kernel against its jnp reference.

On CPU the kernel runs in the Pallas interpreter (small shapes: the interpreter's cost grows with
grid steps x operand bytes). With XLASERVE_KERNELS_NATIVE=1 (scripts/gpu_check.sh) the same
tests run the compiled kernel on the GPU. Outputs start as NaN buffers aliased into the kernel,
so an element it never writes fails the test in both modes.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import os
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import cpu_ffi
from pallas_kernels.block_sizes import AttentionBlockSizes, attention_block_sizes
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference
from pallas_kernels.ragged_paged_attention_blocked import ragged_paged_attention_blocked
from pallas_kernels.ragged_paged_attention_cpu import ragged_paged_attention_cpu
from pallas_kernels.ragged_paged_attention_kernel import (
    max_query_blocks, query_blocks, ragged_paged_attention)
from pallas_kernels.ragged_paged_attention_pages import (page_block_sizes,
                                                        ragged_paged_attention_pages)
from pallas_kernels.testing import layout, random_case

NATIVE = os.environ.get("XLASERVE_KERNELS_NATIVE") == "1"
INTERPRET = not NATIVE
if NATIVE and jax.default_backend() != "gpu":
    raise RuntimeError("XLASERVE_KERNELS_NATIVE=1 needs a GPU as JAX's default backend "
                       "(set JAX_PLATFORMS=cuda)")

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
INT8, FP8 = jnp.int8, jnp.float8_e4m3fn
TOL = {F32: 1e-4, BF16: 2e-2, F16: 5e-3}
# The interpreter's programs are big while loops; XLA:CPU's optimiser halves their compile time
# when told not to try hard (they run in milliseconds either way).
FAST_COMPILE = {"xla_backend_optimization_level": 0} if INTERPRET else None


def _cfg(name, heads, kv_heads, head_dim, page_size, pages, reqs, tokens, dtype, kv=None,
         sizes=None):
    return pytest.param(dict(heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                             page_size=page_size, pages=pages, reqs=reqs, tokens=tokens,
                             dtype=dtype, kv=kv, sizes=sizes), id=name)


# A sampled sweep: every GQA ratio (1, 2, 3, 4, 8), page size (16..256), head dim (64, 128 and
# an odd 12), dtype, quantized KV format, one and several KV splits, tiles smaller and larger
# than a page. sizes: (block_q, block_kv, num_splits), or None for the engine's own choice.
CONFIGS = [
    _cfg("g1-d64-p16-f32-auto", 4, 4, 64, 16, 4, 4, 16, F32),
    _cfg("g2-d128-p32-f32-split4", 4, 2, 128, 32, 2, 4, 4, F32, sizes=(8, 16, 4)),
    _cfg("g4-d64-p16-f32-split3", 8, 2, 64, 16, 4, 2, 16, F32, sizes=(4, 32, 3)),
    _cfg("g8-d128-p64-bf16-split2", 8, 1, 128, 64, 2, 4, 8, BF16, sizes=(2, 32, 2)),
    _cfg("g3-d64-p16-f32-demo-auto", 9, 3, 64, 16, 4, 4, 16, F32),
    _cfg("g3-d64-p16-bf16-demo-decode-auto", 9, 3, 64, 16, 8, 8, 8, BF16),
    _cfg("g8-d64-p128-f16", 8, 1, 64, 128, 1, 2, 8, F16, sizes=(2, 64, 1)),
    _cfg("g2-d64-p256-bf16-int8-split2", 4, 2, 64, 256, 1, 2, 16, BF16, INT8, sizes=(8, 128, 2)),
    _cfg("g4-d128-p16-bf16-fp8-split2", 8, 2, 128, 16, 4, 4, 16, BF16, FP8, sizes=(4, 32, 2)),
    _cfg("g4-d128-p32-f16-fp8", 4, 1, 128, 32, 2, 2, 8, F16, FP8, sizes=(4, 16, 1)),
    _cfg("g2-d64-p16-f32-int8-auto", 4, 2, 64, 16, 4, 2, 8, F32, INT8),
    _cfg("g3-d12-p16-f32-odd-dim", 6, 2, 12, 16, 4, 2, 16, F32),
    _cfg("g2-d64-p16-f32-prefill-auto", 4, 2, 64, 16, 8, 2, 64, F32),
]


def scenarios(c, rng):
    """(q_lens, ctx_lens) steps that fit the bucket: decode at page edges, whole prompts,
    chunks of long contexts behind decodes, random ragged mixes."""
    ps, T, R = c["page_size"], c["tokens"], c["reqs"]
    max_ctx = c["pages"] * ps
    edges = [n for n in (1, ps - 1, ps, ps + 1, max_ctx, 2 * ps - 1, max_ctx - 1, 2 * ps + 1)
             if 1 <= n <= max_ctx]
    n = min(R, T)
    out = [([1] * n, [edges[i % len(edges)] for i in range(n)])]  # decode only
    prompt = min(T - (n - 1), max_ctx)  # a whole prompt next to decodes
    out.append(([prompt] + [1] * (n - 1), [prompt] + [edges[-i % len(edges)] for i in range(1, n)]))
    chunk = max(1, min(T // 2, max_ctx - 1))  # a chunk at the end of a long context
    out.append(([1, chunk][:n], [max_ctx - 3 if max_ctx > 3 else 1, max_ctx][:n]))
    if n == 1:
        out[-1] = ([chunk], [max_ctx])
    full = min(T, max_ctx)  # one request fills the step: full query blocks, no padding
    out.append(([full], [max_ctx]))
    for _ in range(2):  # random ragged mixes, with padding tokens and unused request rows
        k = int(rng.integers(1, n + 1))
        ctx = [int(x) for x in rng.integers(1, max_ctx + 1, k)]
        budget, q = T, []
        for cl in ctx:
            nq = int(rng.integers(1, min(cl, max(1, budget - (k - len(q) - 1))) + 1))
            q.append(nq)
            budget -= nq
        out.append((q, ctx))
    return out


def _sizes(c):
    if c["sizes"] is None:
        return None
    block_q, block_kv, splits = c["sizes"]
    return AttentionBlockSizes(block_q, block_kv, splits)


_compiled = {}


def _kernel_fn(c, kernel=ragged_paged_attention):
    """One compiled program per config, reused by every scenario (same shapes, new data)."""
    key = (kernel.__name__, repr(sorted((k, str(v)) for k, v in c.items())))
    if key not in _compiled:
        def f(q, k, v, layer, pos, req, pt, window, ks, vs):
            return kernel(q, k, v, layer, pos, req, pt, window, 0.3, ks, vs,
                          interpret=INTERPRET, sizes=_sizes(c), poison=True)
        _compiled[key] = jax.jit(f, compiler_options=FAST_COMPILE)
    return _compiled[key]


def _check(out, ref, dtype, what):
    out = np.asarray(out.astype(jnp.float32))
    ref = np.asarray(ref.astype(jnp.float32))
    assert np.isfinite(out).all(), f"{what}: unwritten (NaN) or non-finite outputs"
    np.testing.assert_allclose(out, ref, atol=TOL[dtype], rtol=TOL[dtype], err_msg=what)


def _cases(c, rng):
    """(q_lens, description, reference arguments) for every scenario, without and with a
    sliding window."""
    for q_lens, ctx_lens in scenarios(c, rng):
        case = random_case(rng, q_lens=q_lens, ctx_lens=ctx_lens, num_tokens=c["tokens"],
                           num_reqs=c["reqs"], pages_per_req=c["pages"],
                           num_heads=c["heads"], num_kv_heads=c["kv_heads"],
                           head_dim=c["head_dim"], page_size=c["page_size"], dtype=c["dtype"],
                           kv_dtype=c["kv"])
        for window in (0, int(rng.integers(1, 2 * c["page_size"] + 2))):
            yield (q_lens, f"q_lens={q_lens} ctx={ctx_lens} window={window}",
                   case.args(jnp.int32(window), 0.3))


def _matches_reference(c, kernel):
    seed = zlib.crc32(repr(sorted((k, str(v)) for k, v in c.items())).encode())
    rng = np.random.default_rng(seed)
    fn = _kernel_fn(c, kernel)
    ref_fn = jax.jit(ragged_paged_attention_reference, static_argnums=(8,))
    for q_lens, what, args in _cases(c, rng):
        args = (*args[:3], jnp.int32(args[3]), *args[4:])
        _check(fn(*args[:8], *args[9:]), ref_fn(*args), c["dtype"], what)


@pytest.mark.jax_cache
@pytest.mark.parametrize("c", CONFIGS)
def test_kernel_matches_reference(c):
    _matches_reference(c, ragged_paged_attention)


# The page-block variant: whole pages per tile (block_kv = 1, 2 or 4 pages), several splits,
# GQA 1 / 3 / 4 / 8, an odd head dim, quantized K/V, a sliding window (every scenario), the
# engine's own tiles; small grids (the interpreter's cost is grid steps x operand bytes).
PAGES_CONFIGS = [
    _cfg("pages-g4-d64-p16-f32-auto", 8, 2, 64, 16, 4, 2, 16, F32),
    _cfg("pages-g3-d64-p16-bf16-decode-auto", 9, 3, 64, 16, 4, 4, 4, BF16),
    _cfg("pages-g2-d128-p16-f32-2pages-split2", 4, 2, 128, 16, 4, 2, 8, F32, sizes=(4, 32, 2)),
    _cfg("pages-g8-d64-p32-bf16-int8-split3", 8, 1, 64, 32, 3, 2, 8, BF16, INT8,
         sizes=(2, 32, 3)),
    _cfg("pages-g1-d64-p16-f16-fp8-4pages", 2, 2, 64, 16, 4, 2, 8, F16, FP8, sizes=(8, 64, 1)),
    _cfg("pages-g3-d12-p16-f32-odd-dim", 6, 2, 12, 16, 2, 2, 8, F32),
]


@pytest.mark.jax_cache
@pytest.mark.parametrize("c", PAGES_CONFIGS)
def test_page_block_kernel_matches_reference(c):
    _matches_reference(c, ragged_paged_attention_pages)


def test_page_block_tiles_are_whole_pages():
    for page_size in (16, 32, 64, 256):
        sizes = page_block_sizes((8, 32, 128), 8, (8, 64), page_size)
        assert sizes.block_kv % page_size == 0 and sizes.block_kv >= page_size
        assert sizes.num_splits <= -(-64 * page_size // sizes.block_kv)
    with pytest.raises(ValueError, match="whole pages"):
        q = jnp.zeros((4, 4, 64), F32)
        kv = jnp.zeros((1, 4, 16, 2, 64), F32)
        ragged_paged_attention_pages(q, kv, kv, 0, jnp.zeros(4, jnp.int32),
                                     jnp.zeros(4, jnp.int32), jnp.zeros((2, 2), jnp.int32), 0,
                                     0.1, interpret=True,
                                     sizes=AttentionBlockSizes(4, 24, 1))


# The blocked XLA form: every kernel config (mostly more tokens than rows: the looped form),
# plus decode-sized ones (tokens <= rows: the per-token form).
BLOCKED_CONFIGS = CONFIGS + [
    _cfg("g3-d64-p16-f32-decode-form", 9, 3, 64, 16, 4, 8, 8, F32),
    _cfg("g2-d64-p16-bf16-int8-decode-form", 4, 2, 64, 16, 3, 4, 4, BF16, INT8),
    _cfg("g4-d128-p32-f32-fp8-decode-form", 8, 2, 128, 32, 2, 16, 16, F32, FP8),
    # head dims that leave 8 and 4 columns past the C++ kernel's 16-wide passes
    _cfg("g3-d28-p16-f16-odd-dim", 6, 2, 28, 16, 4, 4, 16, F16),
    _cfg("g2-d20-p16-bf16-int8-odd-dim", 4, 2, 20, 16, 4, 4, 8, BF16, INT8),
]


@pytest.mark.jax_cache
@pytest.mark.skipif(NATIVE, reason="a CPU path; the GPU run checks the kernel")
@pytest.mark.parametrize("c", BLOCKED_CONFIGS)
def test_blocked_matches_reference(c):
    rng = np.random.default_rng(zlib.crc32(c["dtype"].__name__.encode() + bytes(c["tokens"])))
    fn = jax.jit(ragged_paged_attention_blocked, static_argnums=(8,))
    ref_fn = jax.jit(ragged_paged_attention_reference, static_argnums=(8,))
    for q_lens, what, args in _cases(c, rng):
        n = sum(q_lens)  # padding tokens attend to garbage in both: compare the real ones
        _check(fn(*args)[:n], ref_fn(*args)[:n], c["dtype"], what)


# The C++ kernel (attention backend "cpu") on the blocked form's configs. The engine's padding
# tokens sit at position 0 of the last request row, where the reference is defined too, so
# every row is compared.
def _cpu_fn():
    assert cpu_ffi.available("paged_attention"), "the C++ kernel must build here (g++, AVX2)"
    return jax.jit(ragged_paged_attention_cpu, static_argnums=(8,))


@pytest.mark.jax_cache
@pytest.mark.skipif(NATIVE, reason="a CPU path; the GPU run checks the kernel")
@pytest.mark.parametrize("c", BLOCKED_CONFIGS)
def test_cpu_kernel_matches_reference(c):
    rng = np.random.default_rng(zlib.crc32(c["dtype"].__name__.encode() + bytes(c["tokens"])))
    fn = _cpu_fn()
    ref_fn = jax.jit(ragged_paged_attention_reference, static_argnums=(8,))
    lowered = fn.lower(*next(_cases(c, np.random.default_rng(0)))[2]).as_text()
    assert "xlaserve_paged_attention" in lowered  # the FFI call, not the blocked fallback
    for q_lens, what, args in _cases(c, rng):
        _check(fn(*args), ref_fn(*args), c["dtype"], what)


@pytest.mark.jax_cache
@pytest.mark.skipif(NATIVE, reason="a CPU path")
def test_cpu_kernel_layer_traced_or_static_and_out_of_range_indices():
    """`layer` as a Python int or a traced scalar; positions past the table, request rows past
    the table and page ids past the cache are clamped as XLA's gathers clamp them, and a token
    with no visible key gets zeros (the reference: NaN)."""
    rng = np.random.default_rng(3)
    case = random_case(rng, q_lens=[3, 1, 1, 1], ctx_lens=[40, 17, 9, 30], num_tokens=8,
                       num_reqs=4, pages_per_req=4, num_heads=8, num_kv_heads=2, head_dim=64,
                       page_size=16, num_layers=3, layer=1)
    args = list(case.args(jnp.int32(0), 0.3))
    ref = ragged_paged_attention_reference(*args)
    fn = _cpu_fn()
    _check(fn(*args), ref, F32, "static layer")
    traced = jax.jit(lambda layer, *a: ragged_paged_attention_cpu(*a[:3], layer, *a[3:], 0.3))
    _check(traced(jnp.int32(1), *args[:3], *args[4:8]), ref, F32, "traced layer")

    num_pages = case.k_cache.shape[1]
    args[4] = case.positions.at[3].set(1000)  # past the 64 keys a row holds
    args[5] = case.req_indices.at[4].set(99)  # past the 4 rows
    args[6] = case.page_table.at[1, 1].set(num_pages + 5)  # request 1's second page
    args[4] = args[4].at[5].set(-1)  # no visible key
    out, ref = fn(*args), ragged_paged_attention_reference(*args)
    keep = np.arange(8) != 5
    _check(out[keep], ref[keep], F32, "clamped indices")
    assert (np.asarray(out[5]) == 0).all()


@pytest.mark.jax_cache
@pytest.mark.skipif(NATIVE, reason="a CPU path")
def test_cpu_kernel_token_does_not_depend_on_its_tile_with_a_sliding_window():
    """The same query tokens, tiled from another first token (as another chunking of the
    prompt lays them out), give the same bits: with a sliding window a tile's first visible
    key moves with its first token, and the kernel's key chunks must not move with it."""
    rng = np.random.default_rng(4)
    case = random_case(rng, q_lens=[8], ctx_lens=[200], num_tokens=8, num_reqs=1,
                       pages_per_req=13, num_heads=6, num_kv_heads=2, head_dim=64,
                       page_size=16)
    fn = _cpu_fn()
    for window in (50, 77):
        args = list(case.args(jnp.int32(window), 0.3))
        whole = np.asarray(fn(*args))
        for skip in (1, 2, 3):  # tiles start at the 2nd, 3rd, 4th token instead
            part = list(args)
            part[0], part[4], part[5] = args[0][skip:], args[4][skip:], args[5][skip:]
            np.testing.assert_array_equal(np.asarray(fn(*part)), whole[skip:],
                                          err_msg=f"window={window} skip={skip}")


def test_auto_backend_is_the_cpu_kernel_here():
    from model.attention import resolve_backend
    assert resolve_backend("auto") == ("pallas" if jax.default_backend() == "gpu" else "cpu")


@pytest.mark.jax_cache
def test_check_catches_a_wrong_element_and_a_wrong_page():
    """Negative controls: the comparison fails on one corrupted element, and the data is such
    that reading the wrong page changes the answer."""
    c = CONFIGS[2].values[0]
    rng = np.random.default_rng(1)
    case = random_case(rng, q_lens=[1, 5], ctx_lens=[20, 40], num_tokens=16, num_reqs=2,
                       pages_per_req=4, num_heads=8, num_kv_heads=2, head_dim=64, page_size=16)
    args = case.args(jnp.int32(0), 0.3)
    args = (*args[:3], jnp.int32(args[3]), *args[4:])
    out = _kernel_fn(c)(*args[:8], *args[9:])
    ref = ragged_paged_attention_reference(*args)
    _check(out, ref, F32, "control")
    with pytest.raises(AssertionError):
        _check(out.at[3, 5, 7].add(0.01), ref, F32, "one corrupted element")
    with pytest.raises(AssertionError):
        _check(out.at[15, 0, 0].set(jnp.nan), ref, F32, "one unwritten padding element")
    swapped = case.page_table.at[1, 0].set(case.page_table[1, 1])
    wrong = ragged_paged_attention_reference(*args[:6], swapped, *args[7:])
    with pytest.raises(AssertionError):
        _check(wrong, ref, F32, "wrong page")


@pytest.mark.parametrize("block_q", [1, 2, 4, 16])
def test_query_blocks_cover_every_token_once(block_q):
    T, R = 32, 8
    nb = max_query_blocks(T, R, block_q)
    blocks = jax.jit(lambda req: query_blocks(req, R, block_q, nb))
    rng = np.random.default_rng(block_q)
    for _ in range(20):
        k = int(rng.integers(1, R + 1))  # real requests; rows k..R-1 unused
        q_lens = [int(x) + 1 for x in rng.multinomial(int(rng.integers(k, T + 1)) - k,
                                                      [1 / k] * k)]
        pos, req = layout(q_lens, [max(q_lens)] * k, T, R)
        meta = np.asarray(blocks(jnp.asarray(req)))
        owner = np.full(T, -1)
        for t0, n, r in meta.T:
            assert 0 <= n <= block_q
            for t in range(t0, t0 + n):
                assert owner[t] == -1 and req[t] == r, (t, meta.T)
                owner[t] = r
        assert (owner >= 0).all()


def test_block_sizes_decode_splits_and_prefill_tiles():
    kw = dict(num_kv_heads=8, group=4, head_dim=128)
    batch1 = attention_block_sizes(num_tokens=8, num_reqs=8, max_context=4096, **kw)
    assert batch1.num_splits > 1 and batch1.block_q * 4 == 16  # flash-decoding, 16-row tiles
    big = attention_block_sizes(num_tokens=256, num_reqs=256, max_context=4096, **kw)
    assert big.num_splits == 1  # 256 x 8 programs already fill the GPU
    short = attention_block_sizes(num_tokens=8, num_reqs=8, max_context=32, **kw)
    assert short.num_splits == 1 and short.block_kv == 32  # never more splits than tiles
    prefill = attention_block_sizes(num_tokens=512, num_reqs=64, max_context=4096, **kw)
    assert prefill.num_splits == 1 and prefill.block_q * 4 == 64


# --- the engine with attention_backend="pallas" against the reference backend ------------------

# One bucket (16 tokens, 4 requests, 4 pages): one program to compile per engine, which is most
# of these tests' time. Prompts longer than 16 tokens run as chunked prefill next to decodes.
# A fixed 16 MiB cache (on a GPU the default would take most of its memory, per engine).
ENGINE_OPTIONS = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16,
                      token_buckets=(16,), request_buckets=(4,), page_buckets=(4,),
                      page_size=16, kv_cache_memory=16 << 20,
                      progress=False, dtype="float32")  # on a GPU too: kernels compared, not dtypes


def greedy_tokens(model_dir, backend, prompts, max_tokens=8, tiles=None, **options):
    """tiles: the small_tiles(...) arguments the Pallas backends run with, if any."""
    from serving.core.config import EngineConfig
    from serving.engine.llm_engine import LLMEngine
    from serving.core.sampling_params import SamplingParams
    cache = {} if tiles is None else {"compilation_cache_dir": str(tiles_cache(tiles))}
    engine = LLMEngine(EngineConfig(model=str(model_dir), attention_backend=backend,
                                    **{**ENGINE_OPTIONS, **cache, **options}))
    assert engine.attention_backend == backend
    engine.warmup()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", list(p), params)
    done = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished:
        for out in engine.step():
            done[out.request_id] += out.new_token_ids
    return [done[f"r{i}"] for i in range(len(prompts))]


def small_tiles(monkeypatch, num_splits: int) -> dict:
    """16-key tiles (and optionally KV splits) so the short test contexts span several tiles.
    -> the arguments, for greedy_tokens(tiles=...)."""
    from dataclasses import replace

    from pallas_kernels import ragged_paged_attention_kernel as rpa
    real = rpa.attention_block_sizes
    monkeypatch.setattr(rpa, "attention_block_sizes", lambda **kw: replace(
        real(**kw), block_kv=16, num_splits=num_splits))
    return dict(num_splits=num_splits)


def tiles_cache(tiles: dict) -> Path:
    """A compiled-program folder of the tiling's own: no program key holds the tile sizes
    (they follow from the code and the shape), so programs built under small_tiles are kept
    apart from the usual ones, under a name that changes with small_tiles' source."""
    from serving.core.config import default_cache_root
    text = inspect.getsource(small_tiles) + json.dumps(tiles, sort_keys=True)
    return default_cache_root() / f"test-tiles-{hashlib.sha256(text.encode()).hexdigest()[:12]}"


@pytest.fixture(scope="module")
def tiny_mistral(tmp_path_factory):
    """A bare config.json for random weights (load_format="dummy", the same seed for both
    engines): Mistral with a sliding window of 7 over 6 query / 2 KV heads of dim 12."""
    import json
    folder = tmp_path_factory.mktemp("tiny-mistral")
    (folder / "config.json").write_text(json.dumps(dict(
        architectures=["MistralForCausalLM"], vocab_size=211, hidden_size=72,
        intermediate_size=100, num_hidden_layers=3, num_attention_heads=6,
        num_key_value_heads=2, sliding_window=7, max_position_embeddings=256,
        rms_norm_eps=1e-6, rope_theta=10000.0, torch_dtype="float32", eos_token_id=2)))
    return folder


MISTRAL_PROMPTS = [np.random.default_rng(0).integers(3, 211, n).tolist() for n in (5, 20, 33)]


@pytest.fixture(scope="module")
def mistral_reference_tokens(tiny_mistral):
    return greedy_tokens(tiny_mistral, "reference", MISTRAL_PROMPTS, max_tokens=10,
                         load_format="dummy")


def test_engine_pallas_matches_reference_on_tiny_mistral(tiny_mistral, mistral_reference_tokens,
                                                         monkeypatch):
    tiles = small_tiles(monkeypatch, num_splits=2)  # + the flash-decoding combine
    got = greedy_tokens(tiny_mistral, "pallas", MISTRAL_PROMPTS, max_tokens=10,
                        load_format="dummy", tiles=tiles)
    assert got == mistral_reference_tokens


@pytest.mark.skipif(NATIVE, reason="a CPU path")
def test_engine_cpu_kernel_matches_reference_on_tiny_mistral(tiny_mistral,
                                                             mistral_reference_tokens):
    """The kernel inside the model: 3 layers of one cache array, a window of 7, head dim 12,
    prompts longer than a 16-token step."""
    got = greedy_tokens(tiny_mistral, "cpu", MISTRAL_PROMPTS, max_tokens=10, load_format="dummy")
    assert got == mistral_reference_tokens


def test_engine_page_block_kernel_matches_reference_on_tiny_mistral(tiny_mistral,
                                                                    mistral_reference_tokens):
    got = greedy_tokens(tiny_mistral, "pallas_pages", MISTRAL_PROMPTS, max_tokens=10,
                        load_format="dummy")
    assert got == mistral_reference_tokens


DEMO_PROMPTS = [[1, 4093, 28, 1476, 2041, 314], list(range(200, 237)), [504, 3458, 282]]


@pytest.fixture(scope="module")
def demo_reference_tokens(demo_checkpoint):
    return greedy_tokens(demo_checkpoint, "reference", DEMO_PROMPTS)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["pallas", "pallas_pages"])
def test_engine_pallas_matches_reference_on_demo_model(demo_checkpoint, demo_reference_tokens,
                                                       monkeypatch, backend):
    """Real weights (the demo model, read from its GGUF file: gguf is a core dependency)."""
    tiles = small_tiles(monkeypatch, num_splits=1)
    want = demo_reference_tokens
    got = greedy_tokens(demo_checkpoint, backend, DEMO_PROMPTS, tiles=tiles)
    assert got == want
