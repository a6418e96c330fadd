// Ragged paged attention on CPUs: the contract of `ragged_paged_attention_reference`
// (pallas_kernels/ragged_paged_attention.py).
//
// Tasks are (token, KV head) pairs, with up to kTile consecutive tokens of one request (a
// prefill chunk) in one task so that each block of keys is read once for all of them. A task
// streams its request's keys straight out of the pages in blocks of kBlock with an online
// softmax: O(D) memory per query head, each key/value row read once for the G query heads
// sharing it. XLA:CPU instead gathers every token's pages into [T, S, K, D].
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlock = 16;  // keys per online-softmax step: amortises the rescale of acc
constexpr int64_t kTile = 4;    // query tokens of one request sharing each block of keys

// float8_e4m3fn: bias 7, no infinities, S.1111.111 is NaN.
struct Fp8Table {
  float v[256];
  Fp8Table() {
    for (int b = 0; b < 256; ++b) {
      int e = (b >> 3) & 15, m = b & 7;
      float x = e == 0 ? std::ldexp(m / 8.0f, -6) : std::ldexp(1.0f + m / 8.0f, e - 7);
      if (e == 15 && m == 7) x = std::numeric_limits<float>::quiet_NaN();
      v[b] = (b & 128) ? -x : x;
    }
  }
};
const Fp8Table kFp8;

// 8 elements of type dt at src, as float32.
template <ffi::DataType dt>
inline __m256 Load8(const char* src) {
  if constexpr (dt == ffi::DataType::F32) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(src));
  } else if constexpr (dt == ffi::DataType::BF16) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)src));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  } else if constexpr (dt == ffi::DataType::F16) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)src));
  } else if constexpr (dt == ffi::DataType::S8) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)src)));
  } else {  // F8E4M3FN
    __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)src));
    return _mm256_i32gather_ps(kFp8.v, bytes, 4);
  }
}

template <ffi::DataType dt>
void ConvertAs(const char* src, int64_t n, float scale, float* dst) {
  constexpr size_t width = ffi::ByteWidth(dt);
  const __m256 sc = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_mul_ps(Load8<dt>(src + i * width), sc));
  if (i < n) {  // through a zeroed buffer: Load8 reads 8 elements
    char tail[32] = {};
    alignas(32) float f[8];
    std::memcpy(tail, src + i * width, (n - i) * width);
    _mm256_storeu_ps(f, _mm256_mul_ps(Load8<dt>(tail), sc));
    std::memcpy(dst + i, f, (n - i) * 4);
  }
}

// dst[0..n) = the n elements of type dt at src, as float32, times scale.
float* Convert(ffi::DataType dt, const char* src, int64_t n, float scale, float* dst) {
  switch (dt) {
    case ffi::DataType::F32: ConvertAs<ffi::DataType::F32>(src, n, scale, dst); break;
    case ffi::DataType::BF16: ConvertAs<ffi::DataType::BF16>(src, n, scale, dst); break;
    case ffi::DataType::F16: ConvertAs<ffi::DataType::F16>(src, n, scale, dst); break;
    case ffi::DataType::S8: ConvertAs<ffi::DataType::S8>(src, n, scale, dst); break;
    default: ConvertAs<ffi::DataType::F8E4M3FN>(src, n, scale, dst);  // the handler checked
  }
  return dst;
}

// Convert, but unscaled float32 is returned in place: the common cache type is never copied.
inline const float* ToF32(ffi::DataType dt, const char* src, int64_t n, float scale,
                          float* dst) {
  if (dt == ffi::DataType::F32 && scale == 1.0f) return reinterpret_cast<const float*>(src);
  return Convert(dt, src, n, scale, dst);
}

void FromF32(ffi::DataType dt, const float* src, int64_t n, char* dst) {
  auto* half = reinterpret_cast<uint16_t*>(dst);
  for (int64_t i = 0; i < n; ++i) {
    if (dt == ffi::DataType::F32) {
      std::memcpy(dst + 4 * i, src + i, 4);
    } else if (dt == ffi::DataType::F16) {
      half[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT);
    } else {  // BF16, rounded to nearest even as XLA's convert rounds
      uint32_t u;
      std::memcpy(&u, src + i, 4);
      half[i] = std::isnan(src[i]) ? 0x7FC0 : uint16_t((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
    }
  }
}

inline float HSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// Lane j of the result is the sum of the lanes of a[j].
inline __m256 HSum8(const __m256 a[8]) {
  __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
  __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
  __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  // s0123 = [0 1 2 3 | 0 1 2 3] halves of the 128-bit lanes; likewise s4567.
  __m256 lo = _mm256_permute2f128_ps(s0123, s4567, 0x20);
  __m256 hi = _mm256_permute2f128_ps(s0123, s4567, 0x31);
  return _mm256_add_ps(lo, hi);
}

// exp on 8 lanes (Cephes' expf: ~1 ulp); arguments of -88 and below (-inf too) give 0.
inline __m256 Exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.0f)), _mm256_set1_ps(-88.0f));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504089f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
  // 2^n through the exponent field; n = -127 makes the bits 0, i.e. exactly 0.
  __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  e = _mm256_slli_epi32(e, 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

inline float HMax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// out[j] = dot(q, k[j]) for 8 rows; D8 = D rounded down to a multiple of 8.
inline void Dot8(const float* q, const float* const k[8], int64_t D, float* out) {
  const int64_t D8 = D & ~int64_t{7};
  __m256 a[8];
  for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D8; d += 8) {
    __m256 qv = _mm256_loadu_ps(q + d);
    for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(_mm256_loadu_ps(k[j] + d), qv, a[j]);
  }
  _mm256_storeu_ps(out, HSum8(a));
  for (int64_t d = D8; d < D; ++d)
    for (int j = 0; j < 8; ++j) out[j] += q[d] * k[j][d];
}

// acc += sum_j p[j] * v[j] over n rows, 32 columns at a time held in registers.
inline void AccumulateV(const float* p, const float* const* v, int64_t n, int64_t D, float* acc) {
  int64_t d = 0;
  for (; d + 32 <= D; d += 32) {
    __m256 a0 = _mm256_loadu_ps(acc + d), a1 = _mm256_loadu_ps(acc + d + 8);
    __m256 a2 = _mm256_loadu_ps(acc + d + 16), a3 = _mm256_loadu_ps(acc + d + 24);
    for (int64_t j = 0; j < n; ++j) {
      const __m256 pj = _mm256_set1_ps(p[j]);
      const float* vj = v[j] + d;
      a0 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj), a0);
      a1 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 8), a1);
      a2 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 16), a2);
      a3 = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 24), a3);
    }
    _mm256_storeu_ps(acc + d, a0), _mm256_storeu_ps(acc + d + 8, a1);
    _mm256_storeu_ps(acc + d + 16, a2), _mm256_storeu_ps(acc + d + 24, a3);
  }
  for (; d + 8 <= D; d += 8) {
    __m256 a0 = _mm256_loadu_ps(acc + d);
    for (int64_t j = 0; j < n; ++j)
      a0 = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), _mm256_loadu_ps(v[j] + d), a0);
    _mm256_storeu_ps(acc + d, a0);
  }
  for (; d < D; ++d)
    for (int64_t j = 0; j < n; ++j) acc[d] += p[j] * v[j][d];
}

struct Problem {
  ffi::DataType q_type, kv_type;
  const char *q, *k, *v;
  const float *k_scale, *v_scale;  // null for unquantized caches
  char* out;
  const int32_t *positions, *req_indices, *page_table;
  int64_t T, H, D, K, G, P, page_size, pages_per_req, B, layer, window;
  float scale;
};

// Per-worker buffers: q, acc, m, l for the tile's query rows (token, head), one block of
// converted K and V rows.
struct Scratch {
  std::vector<float> q, acc, k, v, s, m, l;
  Scratch(const Problem& p)
      : q(kTile * p.G * p.D), acc(kTile * p.G * p.D), k(kBlock * p.D), v(kBlock * p.D),
        s(kBlock), m(kTile * p.G), l(kTile * p.G) {}
};

// Tokens t0..t0+nq-1 (one request, as the engine lays a chunk out) against KV head kvh: each
// block of keys is read and converted once for every query row of the tile.
void Attend(const Problem& p, int64_t t0, int64_t nq, int64_t kvh, Scratch& w) {
  const int64_t G = p.G, D = p.D, S = p.pages_per_req * p.page_size;
  const size_t q_bytes = ffi::ByteWidth(p.q_type), kv_bytes = ffi::ByteWidth(p.kv_type);
  // Token i sees keys lo_i..hi_i: 0..positions[t] within the window; a position past the
  // table sees every key, as the reference's mask does; one with no visible key (a negative
  // position) gets zeros.
  int64_t q_lo[kTile], q_hi[kTile], lo = S, hi = -1;
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t t = t0 + i, pos = p.positions[t];
    q_hi[i] = std::min(pos, S - 1);
    q_lo[i] = p.window > 0 ? std::max<int64_t>(0, pos - p.window + 1) : 0;
    if (q_hi[i] >= q_lo[i]) {
      lo = std::min(lo, q_lo[i]), hi = std::max(hi, q_hi[i]);
    } else {
      std::memset(p.out + (t * p.H + kvh * G) * D * q_bytes, 0, G * D * q_bytes);
    }
    Convert(p.q_type, p.q + (t * p.H + kvh * G) * D * q_bytes, G * D, p.scale,
            &w.q[i * G * D]);
  }
  if (hi < lo) return;
  const int64_t rows_q = nq * G;
  std::fill(w.acc.begin(), w.acc.begin() + rows_q * D, 0.0f);
  std::fill(w.m.begin(), w.m.begin() + rows_q, -std::numeric_limits<float>::infinity());
  std::fill(w.l.begin(), w.l.begin() + rows_q, 0.0f);
  const int64_t req = std::clamp<int64_t>(p.req_indices[t0], 0, p.B - 1);
  const int32_t* pages = p.page_table + req * p.pages_per_req;

  // Rows (layer, page, slot, kvh) of [L, P, page_size, K(, D)] for keys lo, lo+1, ...: the
  // slot steps through the page, avoiding a division per key.
  int64_t page_idx = lo / p.page_size, slot = lo % p.page_size, page_row = 0;
  auto set_page = [&] {
    const int64_t page = std::clamp<int64_t>(pages[page_idx], 0, p.P - 1);
    page_row = (p.layer * p.P + page) * p.page_size * p.K + kvh;
  };
  set_page();
  auto next_row = [&] {
    const int64_t row = page_row + slot * p.K;
    if (++slot == p.page_size && ++page_idx < p.pages_per_req) slot = 0, set_page();
    return row;
  };
  const int64_t row_bytes = D * kv_bytes;
  auto prefetch = [&](int64_t row) {
    for (int64_t b = 0; b < row_bytes; b += 64) {
      _mm_prefetch(p.k + row * row_bytes + b, _MM_HINT_T0);
      _mm_prefetch(p.v + row * row_bytes + b, _MM_HINT_T0);
    }
  };
  // Rows come from pages scattered over the cache, which the hardware prefetcher cannot
  // follow: each block asks for the next block's rows while it computes.
  int64_t rows[kBlock], next[kBlock];
  for (int64_t j = 0; j < std::min(kBlock, hi - lo + 1); ++j) prefetch(rows[j] = next_row());
  const float *krow[kBlock], *vrow[kBlock];
  float* sg = w.s.data();
  static_assert(kBlock == 16, "the softmax below works on two vectors of scores");
  for (int64_t s0 = lo; s0 <= hi; s0 += kBlock) {
    const int64_t n = std::min(kBlock, hi - s0 + 1);
    const int64_t n_next = std::min(kBlock, hi - s0 - kBlock + 1);
    for (int64_t j = 0; j < n_next; ++j) prefetch(next[j] = next_row());
    for (int64_t j = 0; j < n; ++j) {
      krow[j] = ToF32(p.kv_type, p.k + rows[j] * row_bytes, D,
                      p.k_scale ? p.k_scale[rows[j]] : 1.0f, w.k.data() + j * D);
      vrow[j] = ToF32(p.kv_type, p.v + rows[j] * row_bytes, D,
                      p.v_scale ? p.v_scale[rows[j]] : 1.0f, w.v.data() + j * D);
    }
    for (int64_t j = n; j < kBlock; ++j) krow[j] = krow[n - 1];  // scores masked below
    for (int64_t i = 0; i < nq; ++i) {
      // This token's keys in the block: [jb, je).
      const int64_t jb = std::max<int64_t>(q_lo[i] - s0, 0), je = std::min(q_hi[i] - s0 + 1, n);
      if (jb >= je) continue;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t r = i * G + g;
        for (int64_t j = jb & ~int64_t{7}; j < je; j += 8) Dot8(&w.q[r * D], krow + j, D, sg + j);
        for (int64_t j = 0; j < kBlock; ++j)
          if (j < jb || j >= je) sg[j] = -std::numeric_limits<float>::infinity();
        __m256 s_lo = _mm256_loadu_ps(sg), s_hi = _mm256_loadu_ps(sg + 8);
        const float mx = std::max(w.m[r], HMax(_mm256_max_ps(s_lo, s_hi)));
        const float corr = std::exp(w.m[r] - mx);  // 0 on the first block (m = -inf)
        const __m256 mxv = _mm256_set1_ps(mx);
        s_lo = Exp8(_mm256_sub_ps(s_lo, mxv));  // masked keys: exactly 0
        s_hi = Exp8(_mm256_sub_ps(s_hi, mxv));
        _mm256_storeu_ps(sg, s_lo), _mm256_storeu_ps(sg + 8, s_hi);
        w.m[r] = mx;
        w.l[r] = w.l[r] * corr + HSum(_mm256_add_ps(s_lo, s_hi));
        float* acc = &w.acc[r * D];
        if (corr != 1.0f)
          for (int64_t d = 0; d < D; ++d) acc[d] *= corr;
        AccumulateV(sg + jb, vrow + jb, je - jb, D, acc);
      }
    }
    std::copy(next, next + std::max<int64_t>(n_next, 0), rows);
  }
  for (int64_t i = 0; i < nq; ++i) {
    if (q_hi[i] < q_lo[i]) continue;
    for (int64_t g = 0; g < G; ++g) {
      const float inv = 1.0f / w.l[i * G + g];
      for (int64_t d = 0; d < D; ++d) w.acc[(i * G + g) * D + d] *= inv;
    }
    FromF32(p.q_type, &w.acc[i * G * D], G * D,
            p.out + ((t0 + i) * p.H + kvh * G) * D * q_bytes);
  }
}

ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_cache,
                          ffi::AnyBuffer v_cache, ffi::AnyBuffer k_scale, ffi::AnyBuffer v_scale,
                          ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> positions,
                          ffi::Buffer<ffi::S32> req_indices, ffi::Buffer<ffi::S32> page_table,
                          ffi::Buffer<ffi::S32> sliding_window, ffi::Buffer<ffi::F32> scale,
                          ffi::Result<ffi::AnyBuffer> out) {
  auto qd = q.dimensions(), kd = k_cache.dimensions(), pd = page_table.dimensions();
  auto vd = v_cache.dimensions();
  if (qd.size() != 3 || kd.size() != 5 || pd.size() != 2 ||
      !std::equal(kd.begin(), kd.end(), vd.begin(), vd.end()))
    return ffi::Error::InvalidArgument("paged_attention: q [T,H,D], caches [L,P,ps,K,D], "
                                       "page_table [B,pages]");
  auto is_float = [](ffi::DataType t) {
    return t == ffi::DataType::F32 || t == ffi::DataType::BF16 || t == ffi::DataType::F16;
  };
  Problem p;
  p.q_type = q.element_type();
  p.kv_type = k_cache.element_type();
  const bool quantized = p.kv_type == ffi::DataType::S8 || p.kv_type == ffi::DataType::F8E4M3FN;
  if (!is_float(p.q_type) || out->element_type() != p.q_type ||
      v_cache.element_type() != p.kv_type || !(is_float(p.kv_type) || quantized))
    return ffi::Error::InvalidArgument("paged_attention: unsupported dtypes");
  p.T = qd[0], p.H = qd[1], p.D = qd[2];
  const int64_t L = kd[0];
  p.P = kd[1], p.page_size = kd[2], p.K = kd[3];
  if (kd[4] != p.D || p.K <= 0 || p.H % p.K != 0 || L <= 0 || p.P <= 0 || pd[0] <= 0 ||
      positions.element_count() != size_t(p.T) || req_indices.element_count() != size_t(p.T))
    return ffi::Error::InvalidArgument("paged_attention: inconsistent shapes");
  const size_t rows = L * p.P * p.page_size * p.K;
  const bool scaled = k_scale.element_count() > 0;
  if (scaled && (k_scale.element_type() != ffi::DataType::F32 ||
                 k_scale.element_count() != rows || v_scale.element_count() != rows))
    return ffi::Error::InvalidArgument("paged_attention: scales must be f32[L,P,ps,K]");
  p.G = p.H / p.K;
  p.B = pd[0], p.pages_per_req = pd[1];
  p.q = static_cast<const char*>(q.untyped_data());
  p.k = static_cast<const char*>(k_cache.untyped_data());
  p.v = static_cast<const char*>(v_cache.untyped_data());
  p.k_scale = scaled ? static_cast<const float*>(k_scale.untyped_data()) : nullptr;
  p.v_scale = scaled ? static_cast<const float*>(v_scale.untyped_data()) : nullptr;
  p.out = static_cast<char*>(out->untyped_data());
  p.positions = positions.typed_data();
  p.req_indices = req_indices.typed_data();
  p.page_table = page_table.typed_data();
  p.layer = std::clamp<int64_t>(layer.typed_data()[0], 0, L - 1);
  p.window = sliding_window.typed_data()[0];
  p.scale = scale.typed_data()[0];
  if (p.T == 0) return ffi::Error::Success();

  // Waking the pool's threads costs tens of microseconds, more than a few short decode
  // tokens' whole work: small steps run on the calling thread.
  const int64_t S = p.pages_per_req * p.page_size;
  int64_t keys = 0;
  for (int64_t t = 0; t < p.T; ++t) keys += std::clamp<int64_t>(p.positions[t] + 1, 0, S);
  const bool small = keys * p.K * (p.G + 1) * p.D < (int64_t{1} << 19);
  // Tiles: runs of up to kTile tokens of one request. Tasks (tile, KV head) cost up to their
  // positions: a prefill chunk's last tokens are its dearest, so workers take tasks from a
  // shared counter instead of fixed ranges.
  std::vector<int64_t> tiles;  // first token of each tile, then T
  for (int64_t t = 0; t < p.T; ++t)
    if (tiles.empty() || t - tiles.back() == kTile || p.req_indices[t] != p.req_indices[t - 1])
      tiles.push_back(t);
  tiles.push_back(p.T);
  const int64_t tasks = (int64_t(tiles.size()) - 1) * p.K;
  const int64_t workers =
      small ? 1 : std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1), tasks);
  std::atomic<int64_t> next(0);
  xlaserve::ParallelFor(pool, workers, [&](int64_t, int64_t) {
    Scratch w(p);
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < tasks;) {
      const int64_t tile = i / p.K;
      Attend(p, tiles[tile], tiles[tile + 1] - tiles[tile], i % p.K, w);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(xlaserve_paged_attention, PagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()          // q [T, H, D]
                                  .Arg<ffi::AnyBuffer>()          // k_cache [L, P, ps, K, D]
                                  .Arg<ffi::AnyBuffer>()          // v_cache
                                  .Arg<ffi::AnyBuffer>()          // k_scale [L, P, ps, K] or [0]
                                  .Arg<ffi::AnyBuffer>()          // v_scale
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()   // positions [T]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // req_indices [T]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // page_table [B, pages]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // sliding_window
                                  .Arg<ffi::Buffer<ffi::F32>>()   // scale
                                  .Ret<ffi::AnyBuffer>());        // [T, H, D], q's dtype
