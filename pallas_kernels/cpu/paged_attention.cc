// Ragged paged attention on CPUs: the contract of `ragged_paged_attention_reference`
// (pallas_kernels/ragged_paged_attention.py).
//
// A task is up to kTile consecutive tokens of one request (a prefill chunk's tokens share
// each key read) against all KV heads, or one KV head when there are too few tokens to keep
// the threads busy. It streams its request's keys straight out of the pages, kChunk at a
// time, with an online softmax: scores for the chunk, one rescale, then the values; O(D)
// memory per query head. K/V rows are read in the cache's own dtype and converted inside the
// dot products, so a 16-bit cache moves half the bytes of a float32 one; values are summed
// for kRows query rows at a time, so each value vector loaded feeds kRows rows. XLA:CPU
// instead gathers every token's pages into [T, S, K, D].
//
// Two variants of the scores, as the reference defines them: soft-capping (cap * tanh(s /
// cap) after the scale, before the mask) and sinks (one logit per query head added to the
// softmax's denominator only, at the end, as a key whose value is zero).
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "parallel.h"
#include "prefetch.h"
#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using xlaserve::Convert;
using xlaserve::FromF32;
using xlaserve::Load1;
using xlaserve::Load8;

namespace {

constexpr int64_t kChunk = 32;  // keys per online-softmax step, a multiple of 8
constexpr int64_t kTile = 4;    // query tokens of one request sharing each chunk of keys
constexpr int kRows = 3;        // query rows (token, head) per register block

// One chunk of keys s0..s0+n-1 for one KV head: its K and V rows in the cache, and their
// scales (1 for unquantized caches). Entries past n repeat the last row: padding whose scores
// are masked and whose values are never summed.
struct Chunk {
  int64_t s0, n;
  const char* k[kChunk];
  const char* v[kChunk];
  float ks[kChunk], vs[kChunk];
};

using Prefetcher = xlaserve::Prefetcher<2 * kChunk>;  // K slots, then V slots

// s[j] = dot(q, k[j]) for the chunk's keys, 8 at a time (each row of K feeds one query row:
// holding several query rows' sums for 8 keys would spill registers).
template <ffi::DataType dt>
void Scores(const float* q, int64_t D, const Chunk& c, float* s, Prefetcher& pf) {
  constexpr size_t w = ffi::ByteWidth(dt);
  const int64_t D8 = D & ~int64_t{7};
  for (int64_t j = 0; j < c.n; j += 8) {
    pf.Step(4);
    __m256 a[8];
    for (int y = 0; y < 8; ++y) a[y] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D8; d += 8) {
      const __m256 qv = _mm256_loadu_ps(q + d);
      for (int y = 0; y < 8; ++y) a[y] = _mm256_fmadd_ps(Load8<dt>(c.k[j + y] + d * w), qv, a[y]);
    }
    _mm256_storeu_ps(s + j, xlaserve::HSum8(a));
    for (int64_t d = D8; d < D; ++d)
      for (int y = 0; y < 8; ++y) s[j + y] += q[d] * Load1<dt>(c.k[j + y] + d * w);
  }
}

// cap * tanh(x / cap), as 1 - 2 / (1 + e^(2x / cap)): Exp8 saturates for large |x|, which
// gives exactly +-cap.
inline __m256 SoftCap8(__m256 x, float cap) {
  const __m256 e = xlaserve::Exp8(_mm256_mul_ps(x, _mm256_set1_ps(2.0f / cap)));
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 t = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(one, e)));
  return _mm256_mul_ps(t, _mm256_set1_ps(cap));
}

// The online-softmax update of one query row for the chunk: its scores sr (keys outside
// [jb, je) masked, soft-capped first where cap > 0) become probabilities, times the value
// scales; m and l move to the new running max and sum, and acc is rescaled to match.
void Softmax(float* sr, const Chunk& c, int64_t jb, int64_t je, float cap, float& m, float& l,
             float* acc, int64_t D) {
  const int64_t n8 = (c.n + 7) & ~int64_t{7};
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i lo = _mm256_set1_epi32(int32_t(jb) - 1), hi = _mm256_set1_epi32(int32_t(je));
  __m256 mx = ninf;
  for (int64_t j = 0; j < n8; j += 8) {
    const __m256i idx = _mm256_add_epi32(_mm256_set1_epi32(int32_t(j)), lanes);
    const __m256i in = _mm256_and_si256(_mm256_cmpgt_epi32(idx, lo), _mm256_cmpgt_epi32(hi, idx));
    __m256 v = _mm256_mul_ps(_mm256_loadu_ps(sr + j), _mm256_loadu_ps(c.ks + j));
    if (cap > 0.0f) v = SoftCap8(v, cap);
    v = _mm256_blendv_ps(ninf, v, _mm256_castsi256_ps(in));
    _mm256_storeu_ps(sr + j, v);
    mx = _mm256_max_ps(mx, v);
  }
  const float m_new = std::max(m, xlaserve::HMax(mx));
  const float corr = std::exp(m - m_new);  // 0 on the first chunk (m = -inf)
  const __m256 mv = _mm256_set1_ps(m_new);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t j = 0; j < n8; j += 8) {
    const __m256 e = xlaserve::Exp8(_mm256_sub_ps(_mm256_loadu_ps(sr + j), mv));  // masked: 0
    sum = _mm256_add_ps(sum, e);
    _mm256_storeu_ps(sr + j, _mm256_mul_ps(e, _mm256_loadu_ps(c.vs + j)));
  }
  m = m_new;
  l = l * corr + xlaserve::HSum(sum);
  if (corr != 1.0f)
    for (int64_t d = 0; d < D; ++d) acc[d] *= corr;
}

// a[x] += p[x * kChunk + j] * v[d, d + 16) for R rows: one key's value into 16 columns.
template <ffi::DataType dt, int R>
inline void AddValue(const float* p, int64_t j, const char* v, int64_t d, __m256 (&a)[R][2]) {
  constexpr size_t w = ffi::ByteWidth(dt);
  const __m256 v0 = Load8<dt>(v + d * w), v1 = Load8<dt>(v + (d + 8) * w);
  for (int x = 0; x < R; ++x) {
    const __m256 px = _mm256_set1_ps(p[x * kChunk + j]);
    a[x][0] = _mm256_fmadd_ps(px, v0, a[x][0]);
    a[x][1] = _mm256_fmadd_ps(px, v1, a[x][1]);
  }
}

// acc[x] += sum_j p[x * kChunk + j] * v[j] over keys [jb, je), for R rows; 16 columns at a
// time held in registers, so each value vector loaded feeds R rows. Even and odd keys go to
// separate sums: one FMA chain per sum would wait on the FMA's latency at every key.
template <ffi::DataType dt, int R>
void AccumulateV(const float* p, const Chunk& c, int64_t jb, int64_t je, int64_t D,
                 float* acc, Prefetcher& pf) {
  constexpr size_t w = ffi::ByteWidth(dt);
  Prefetcher::Cursor next(pf);
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    __m256 a[R][2], b[R][2];
    for (int x = 0; x < R; ++x)
      for (int y = 0; y < 2; ++y)
        a[x][y] = _mm256_loadu_ps(acc + x * D + d + 8 * y), b[x][y] = _mm256_setzero_ps();
    int64_t j = jb;
    for (; j + 2 <= je; j += 2) {
      next.Step();
      AddValue<dt, R>(p, j, c.v[j], d, a);
      AddValue<dt, R>(p, j + 1, c.v[j + 1], d, b);
    }
    if (j < je) AddValue<dt, R>(p, j, c.v[j], d, a);
    for (int x = 0; x < R; ++x)
      for (int y = 0; y < 2; ++y)
        _mm256_storeu_ps(acc + x * D + d + 8 * y, _mm256_add_ps(a[x][y], b[x][y]));
  }
  for (; d + 8 <= D; d += 8) {
    __m256 a[R];
    for (int x = 0; x < R; ++x) a[x] = _mm256_loadu_ps(acc + x * D + d);
    for (int64_t j = jb; j < je; ++j) {
      const __m256 vv = Load8<dt>(c.v[j] + d * w);
      for (int x = 0; x < R; ++x)
        a[x] = _mm256_fmadd_ps(_mm256_set1_ps(p[x * kChunk + j]), vv, a[x]);
    }
    for (int x = 0; x < R; ++x) _mm256_storeu_ps(acc + x * D + d, a[x]);
  }
  for (; d < D; ++d)
    for (int64_t j = jb; j < je; ++j) {
      const float vj = Load1<dt>(c.v[j] + d * w);
      for (int x = 0; x < R; ++x) acc[x * D + d] += p[x * kChunk + j] * vj;
    }
}

struct Problem {
  ffi::DataType q_type, kv_type;
  const char *q, *k, *v;
  const float *k_scale, *v_scale;  // null for unquantized caches
  const float* sinks;  // [H], or null for none
  char* out;
  const int32_t *positions, *req_indices, *page_table;
  int64_t T, H, D, K, G, P, page_size, pages_per_req, B, layer, window;
  float scale, soft_cap;  // soft_cap 0: none
};

// Per-worker buffers: q, acc, m, l for the tile's query rows, ordered (KV head, token, head
// within the group) so that one KV head's rows are adjacent; one register block's scores.
struct Scratch {
  std::vector<float> q, acc, s, m, l;
  Prefetcher pf;
  Scratch(const Problem& p)
      : q(kTile * p.H * p.D), acc(kTile * p.H * p.D), s(kRows * kChunk), m(kTile * p.H),
        l(kTile * p.H) {}
};

// Rows r0..r0+R-1 of one KV head's block of query rows (starting at row `base` of the
// scratch; local row r is token r / G) against one chunk of that head's keys.
template <ffi::DataType dt, int R>
void AttendRows(const Problem& p, const Chunk& c, int64_t base, int64_t r0, const int64_t* q_lo,
                const int64_t* q_hi, Scratch& w) {
  const int64_t D = p.D;
  float* s = w.s.data();
  for (int x = 0; x < R; ++x) Scores<dt>(&w.q[(base + r0 + x) * D], D, c, s + x * kChunk, w.pf);
  int64_t jb_all = c.n, je_all = 0;  // the keys any of the rows sees
  for (int x = 0; x < R; ++x) {
    const int64_t r = base + r0 + x, i = (r0 + x) / p.G;
    const int64_t jb = std::max<int64_t>(q_lo[i] - c.s0, 0);
    const int64_t je = std::min(q_hi[i] - c.s0 + 1, c.n);
    if (jb >= je) {
      std::fill(s + x * kChunk, s + (x + 1) * kChunk, 0.0f);
      continue;
    }
    Softmax(s + x * kChunk, c, jb, je, p.soft_cap, w.m[r], w.l[r], &w.acc[r * D], D);
    jb_all = std::min(jb_all, jb), je_all = std::max(je_all, je);
  }
  if (jb_all < je_all) AccumulateV<dt, R>(s, c, jb_all, je_all, D, &w.acc[(base + r0) * D], w.pf);
}

// Tokens t0..t0+nq-1 (one request, as the engine lays a chunk out) against KV heads
// k0..k1-1. A key's KV heads sit side by side in the cache, so a task of all heads reads
// whole slots of its pages: contiguous runs of memory rather than a third of each slot.
template <ffi::DataType dt>
void Attend(const Problem& p, int64_t t0, int64_t nq, int64_t k0, int64_t k1, Scratch& w) {
  const int64_t G = p.G, D = p.D, H = p.H, K = p.K, S = p.pages_per_req * p.page_size;
  const size_t q_bytes = ffi::ByteWidth(p.q_type);
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
      std::memset(p.out + (t * H + k0 * G) * D * q_bytes, 0, (k1 - k0) * G * D * q_bytes);
    }
    for (int64_t kvh = k0; kvh < k1; ++kvh)
      Convert(p.q_type, p.q + (t * H + kvh * G) * D * q_bytes, G * D, p.scale,
              &w.q[((kvh - k0) * nq + i) * G * D]);
  }
  if (hi < lo) return;
  // Chunks start at multiples of kChunk, wherever the tile's first visible key is: a row's
  // online softmax then rescales at the same keys whatever tokens share its tile (with a
  // sliding window the tile's first key depends on them), so its result does not either.
  lo = lo / kChunk * kChunk;
  const int64_t rows_q = nq * (k1 - k0) * G;
  std::fill(w.acc.begin(), w.acc.begin() + rows_q * D, 0.0f);
  std::fill(w.m.begin(), w.m.begin() + rows_q, -std::numeric_limits<float>::infinity());
  std::fill(w.l.begin(), w.l.begin() + rows_q, 0.0f);
  const int64_t req = std::clamp<int64_t>(p.req_indices[t0], 0, p.B - 1);
  const int32_t* pages = p.page_table + req * p.pages_per_req;

  // Rows (layer, page, slot, 0) of [L, P, page_size, K(, D)] for keys lo, lo+1, ...: the
  // slot steps through the page, avoiding a division per key.
  int64_t page_idx = lo / p.page_size, slot = lo % p.page_size, page_row = 0;
  auto set_page = [&] {
    const int64_t page = std::clamp<int64_t>(pages[page_idx], 0, p.P - 1);
    page_row = (p.layer * p.P + page) * p.page_size * K;
  };
  set_page();
  auto next_row = [&] {
    const int64_t row = page_row + slot * K;
    if (++slot == p.page_size && ++page_idx < p.pages_per_req) slot = 0, set_page();
    return row;
  };
  const int64_t row_bytes = D * ffi::ByteWidth(dt), slot_bytes = (k1 - k0) * row_bytes;
  struct Slots {
    int64_t s0, n, row[kChunk];  // the chunk's keys s0..s0+n-1: their rows for KV head 0
  };
  auto fill = [&](Slots& c, int64_t s0) {  // and start prefetching its slots
    c.s0 = s0, c.n = std::min(kChunk, hi - s0 + 1);
    w.pf.Reset(2 * c.n, slot_bytes);
    for (int64_t j = 0; j < c.n; ++j) {
      c.row[j] = next_row();
      w.pf.start[j] = p.k + (c.row[j] + k0) * row_bytes;
      w.pf.start[c.n + j] = p.v + (c.row[j] + k0) * row_bytes;
    }
  };
  Slots slots[2];
  Chunk c;
  fill(slots[0], lo);
  for (int64_t s0 = lo, b = 0; s0 <= hi; s0 += kChunk, b ^= 1) {
    w.pf.Finish();  // this chunk's slots
    if (s0 + kChunk <= hi) fill(slots[b ^ 1], s0 + kChunk);
    c.s0 = s0, c.n = slots[b].n;
    for (int64_t kvh = k0; kvh < k1; ++kvh) {
      for (int64_t j = 0; j < kChunk; ++j) {
        const int64_t row = slots[b].row[std::min(j, c.n - 1)] + kvh;
        c.k[j] = p.k + row * row_bytes, c.v[j] = p.v + row * row_bytes;
        c.ks[j] = p.k_scale && j < c.n ? p.k_scale[row] : 1.0f;
        c.vs[j] = p.v_scale && j < c.n ? p.v_scale[row] : 1.0f;
      }
      const int64_t base = (kvh - k0) * nq * G;
      for (int64_t r0 = 0; r0 < nq * G; r0 += kRows) {
        switch (std::min<int64_t>(kRows, nq * G - r0)) {
          case 1: AttendRows<dt, 1>(p, c, base, r0, q_lo, q_hi, w); break;
          case 2: AttendRows<dt, 2>(p, c, base, r0, q_lo, q_hi, w); break;
          default: AttendRows<dt, 3>(p, c, base, r0, q_lo, q_hi, w);
        }
      }
    }
  }
  for (int64_t r = 0; r < rows_q; ++r) {
    // A token with no key: l = 0, but it is not written. A sink joins the denominator as a
    // key of zero value: the running max moves to cover it and the sum gains its term.
    float inv = 1.0f / w.l[r];
    if (p.sinks) {
      const float sink = p.sinks[k0 * G + r / (nq * G) * G + r % G];
      const float m = std::max(w.m[r], sink), corr = std::exp(w.m[r] - m);
      inv = corr / (w.l[r] * corr + std::exp(sink - m));
    }
    for (int64_t d = 0; d < D; ++d) w.acc[r * D + d] *= inv;
  }
  for (int64_t i = 0; i < nq; ++i) {
    if (q_hi[i] < q_lo[i]) continue;
    for (int64_t kvh = k0; kvh < k1; ++kvh)
      FromF32(p.q_type, &w.acc[((kvh - k0) * nq + i) * G * D], G * D,
              p.out + ((t0 + i) * H + kvh * G) * D * q_bytes);
  }
}

using AttendFn = void (*)(const Problem&, int64_t, int64_t, int64_t, int64_t, Scratch&);

AttendFn AttendFor(ffi::DataType kv_type) {
  switch (kv_type) {
    case ffi::DataType::F32: return Attend<ffi::DataType::F32>;
    case ffi::DataType::BF16: return Attend<ffi::DataType::BF16>;
    case ffi::DataType::F16: return Attend<ffi::DataType::F16>;
    case ffi::DataType::S8: return Attend<ffi::DataType::S8>;
    default: return Attend<ffi::DataType::F8E4M3FN>;  // the handler checked
  }
}

ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_cache,
                          ffi::AnyBuffer v_cache, ffi::AnyBuffer k_scale, ffi::AnyBuffer v_scale,
                          ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> positions,
                          ffi::Buffer<ffi::S32> req_indices, ffi::Buffer<ffi::S32> page_table,
                          ffi::Buffer<ffi::S32> sliding_window, ffi::Buffer<ffi::F32> scale,
                          ffi::Buffer<ffi::F32> sinks, ffi::Buffer<ffi::F32> soft_cap,
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
  if (sinks.element_count() != 0 && sinks.element_count() != size_t(p.H))
    return ffi::Error::InvalidArgument("paged_attention: sinks must be f32[H] or empty");
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
  p.sinks = sinks.element_count() ? sinks.typed_data() : nullptr;
  p.soft_cap = soft_cap.typed_data()[0];
  if (p.T == 0) return ffi::Error::Success();

  // Waking the pool's threads costs tens of microseconds, more than a few short decode
  // tokens' whole work: small steps run on the calling thread.
  const int64_t S = p.pages_per_req * p.page_size;
  int64_t keys = 0;
  for (int64_t t = 0; t < p.T; ++t) keys += std::clamp<int64_t>(p.positions[t] + 1, 0, S);
  const bool small = keys * p.K * (p.G + 1) * p.D < (int64_t{1} << 19);
  // Tiles: runs of up to kTile tokens of one request. A task is a tile against all KV heads,
  // or against one when there are too few tiles to keep every thread busy. Tasks cost up to
  // their positions: a prefill chunk's last tokens are its dearest, so workers take tasks
  // from a shared counter instead of fixed ranges.
  std::vector<int64_t> tiles;  // first token of each tile, then T
  for (int64_t t = 0; t < p.T; ++t)
    if (tiles.empty() || t - tiles.back() == kTile || p.req_indices[t] != p.req_indices[t - 1])
      tiles.push_back(t);
  tiles.push_back(p.T);
  const int64_t threads = small ? 1 : std::max<int64_t>(pool.num_threads(), 1);
  const int64_t n_tiles = int64_t(tiles.size()) - 1;
  const int64_t heads = n_tiles >= 4 * threads ? p.K : 1;  // KV heads per task
  const int64_t per_tile = p.K / heads, tasks = n_tiles * per_tile;
  std::atomic<int64_t> next(0);
  const AttendFn attend = AttendFor(p.kv_type);
  xlaserve::ParallelFor(pool, std::min(threads, tasks), [&](int64_t, int64_t) {
    Scratch w(p);
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < tasks;) {
      const int64_t tile = i / per_tile, k0 = i % per_tile * heads;
      attend(p, tiles[tile], tiles[tile + 1] - tiles[tile], k0, k0 + heads, w);
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
                                  .Arg<ffi::Buffer<ffi::F32>>()   // sinks [H] or [0]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // soft_cap
                                  .Ret<ffi::AnyBuffer>());        // [T, H, D], q's dtype
