// y[T, N] = x[T, K] @ W[K, N] with W int8 in groups of WG = 32 or 16 along k (the `group`
// attribute): for k in group h, W[k][n] = d[h][n] * c[k][n] (+ m[h][n]), codes c in
// -128..127 and one scale d per group and column, float16 or float32, and optionally an
// offset m (a group's min) of d's type. In groups of 32 this is GGUF's Q8_0 (whose codes
// stop at -127), in groups of 16 its Q6_K (codes q - 32, d the float32 product of a
// super-block's float16 scale and a sub-block's int8 one); with offsets Q5_1, Q5_K (groups of
// 32, codes 0..31) and Q2_K (groups of 16, codes 0..3), so each checkpoint runs on its own
// weights.
//
// Each row of x is rounded to int16 per group of 32 (whatever WG), as q4_matmul.cc rounds
// it (x ~ dx[r][g] * xq[r][k], |xq| <= 32767; group_quant.h), so a weight group's WG
// products are one exact integer sum s = sum_k xq[r][k] * c[k][n] (at most
// 32 * 128 * 32767 < 2^31), summed by vpmaddwd on the codes widened to int16 in registers.
// Then, weight group by weight group in ascending order (in groups of 16, the two halves of
// an activation group one after the other) and with one rounding per FMA,
//   y += float(s) * (d[h][n] * dx[r][h * WG / 32])
// and, with offsets, right after it (as q4_matmul.cc adds its offsets)
//   y += m[h][n] * (dx[r][h * WG / 32] * float(sum of xq[r][k] over group h))
// A row's result depends only on the row: not on the rows beside it, the tile or the
// threads.
//
// W comes packed in panels of 16 columns with pairs of k side by side, as q8_matmul.cc
// takes it: panel[p][k / 2][j][k % 2] = c[k][16p + j], so the 32 codes of a pair of k are
// one contiguous load, and vpmaddwd multiplies them by a broadcast pair (xq[k], xq[k + 1]).
// d and m are [panel][weight group][16]. Within a panel, tiles of up to 6 rows keep their
// integer sums in registers for a weight group and add them into y (in memory, where they
// stay in L1) at its end.
// There is no AVX-512 variant: on such a CPU the same AVX2 code runs.
//
// Functions templated on S take the scales' storage: uint16_t (float16 bits) or float; on WG
// the weights' group; on M whether there are offsets (without, the code is as it was).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "group_quant.h"
#include "groups.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kNR = 16;  // columns per panel: two AVX2 registers of int32
constexpr int64_t kGroup = xlaserve::kQuantGroup;  // values of k per activation scale
constexpr int64_t kMaxTile = 6;  // rows per tile: 12 sums, 2 codes, 1 broadcast, 1 product

// Rows [r0, r1) of x [T, K] rounded per group into the layout the tiles read: for the tile
// of n rows starting at t0 (the tiles Panel cuts T into), xq as int32 pairs of int16 (the
// lower k in the low half), pair-major (xt[t0 * K / 2 + (k / 2) * n + r - t0]), so a tile
// reads its broadcasts at fixed offsets from one pointer, and dx at t0 * G + g * n + r - t0.
// Where xs is given, per weight group h of wg values (H = K / wg of them) dx times the
// group's integer sum of xq, at t0 * H + h * n + r - t0: the offsets' factor.
// A row holding an inf or a NaN gets dx = NaN, so its outputs are NaN as a float product's
// would be; a group of zeros gets dx = 0.
void QuantizeRows(const float* x, int64_t r0, int64_t r1, int64_t T, int64_t K, int32_t* xt,
                  float* dx, float* xs, int64_t wg) {
  const int64_t G = K / kGroup, H = K / wg;
  xlaserve::EvenTiles(T, kMaxTile, [&](int64_t t0, int64_t n) {
    for (int64_t r = std::max(r0, t0); r < std::min(r1, t0 + n); ++r) {
      const float* xr = x + r * K;
      const bool finite = xlaserve::RowFinite(xr, K);
      int32_t* pairs = xt + t0 * (K / 2) + (r - t0);
      for (int64_t g = 0; g < G; ++g) {
        __m256i q[4];
        const float amax = xlaserve::QuantizeGroup(xr + g * kGroup, finite, q);
        int16_t q16[kGroup];  // in order of k: (k, k + 1) is the int32 of a pair
        for (int i = 0; i < 2; ++i) {  // packs works within 128-bit lanes: put them in order
          const __m256i p = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2 * i], q[2 * i + 1]),
                                                     0xD8);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(q16 + 16 * i), p);
        }
        for (int64_t i = 0; i < kGroup / 2; ++i)
          std::memcpy(pairs + (g * kGroup / 2 + i) * n, q16 + 2 * i, sizeof(int32_t));
        const float d = xlaserve::GroupScale(amax, finite);
        dx[t0 * G + g * n + (r - t0)] = d;
        if (xs == nullptr) continue;
        for (int64_t h = g * kGroup / wg; h < (g + 1) * kGroup / wg; ++h) {
          int32_t sum = 0;  // |sum| <= 32 * 32767: exact as a float
          for (int64_t k = h * wg - g * kGroup; k < (h + 1) * wg - g * kGroup; ++k) sum += q16[k];
          xs[t0 * H + h * n + (r - t0)] = d * static_cast<float>(sum);
        }
      }
    }
  });
}

// The 32 codes of one pair of k, widened to int16: columns 0-7 and 8-15, each (k, k + 1)
// adjacent.
inline void LoadPair(const int8_t* pair, __m256i& w0, __m256i& w1) {
  w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pair)));
  w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pair + 16)));
}

// a0 += pairwise products of the pair *x broadcast and w0 summed, a1 likewise with w1.
// Written out as q8_matmul.cc writes it, broadcast included: GCC, left to itself, sends
// every sum through a spare register, or loads the next row's broadcast early, and at 6
// rows (12 sums, 2 codes, a broadcast and a product: all 16 registers) spills sums.
inline void MaddAdd(const int32_t* x, __m256i w0, __m256i w1, __m256i& a0, __m256i& a1) {
  __m256i b, t;
  __asm__("vpbroadcastd %[x], %[b]\n\t"
          "vpmaddwd %[w0], %[b], %[t]\n\t"
          "vpaddd %[t], %[a0], %[a0]\n\t"
          "vpmaddwd %[w1], %[b], %[t]\n\t"
          "vpaddd %[t], %[a1], %[a1]"
          : [a0] "+x"(a0), [a1] "+x"(a1), [b] "=&x"(b), [t] "=&x"(t)
          : [x] "m"(*x), [w0] "x"(w0), [w1] "x"(w1));
}

// One row's 16 group sums into y: y = float(s) * (d * dx) + y, the first group onto 0.
// Always one FMA, so the rounding is the same in every tile, whatever GCC would contract.
inline void Emit(float* y, __m256i s0, __m256i s1, float dx, __m256 d0, __m256 d1,
                 bool first) {
  const __m256 b = _mm256_set1_ps(dx);
  const __m256 y0 = first ? _mm256_setzero_ps() : _mm256_loadu_ps(y);
  const __m256 y1 = first ? _mm256_setzero_ps() : _mm256_loadu_ps(y + 8);
  _mm256_storeu_ps(y, _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_mul_ps(d0, b), y0));
  _mm256_storeu_ps(y + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_mul_ps(d1, b), y1));
}

// Then a group's offsets into the tile's R rows of y: y = m * xs[r] + y, one FMA each, right
// after the group's Emit. Done for all rows once their sums are in y: beside the 12 live
// sums the offsets' registers would push sums to the stack in the inner loop.
template <int R, typename S>
inline void EmitMins(float* y, int64_t N, const float* xs, const S* mp) {
  const __m256 m0 = xlaserve::LoadScales8(mp);
  const __m256 m1 = xlaserve::LoadScales8(mp + 8);
  for (int r = 0; r < R; ++r) {
    const __m256 c = _mm256_set1_ps(xs[r]);
    _mm256_storeu_ps(y + r * N, _mm256_fmadd_ps(m0, c, _mm256_loadu_ps(y + r * N)));
    _mm256_storeu_ps(y + r * N + 8, _mm256_fmadd_ps(m1, c, _mm256_loadu_ps(y + r * N + 8)));
  }
}

// A decode step's few rows leave the loads too little arithmetic to hide behind: ask for
// the codes and scales of the weight group 4 KiB of codes on (kAhead groups of 32), into
// the next panel near a panel's end, which the same thread usually takes next; a prefetch
// past the weights' end is dropped, never a fault. On the demo's head (576 x 49152) at 1 to
// 6 rows this measured about 1.5x faster; at 16 rows, where later tiles find the panel in
// cache, no slower.
constexpr int64_t kAhead = 8;
template <int64_t WG, bool M, typename S>
inline void Prefetch(const int8_t* w, const S* dp, const S* mp) {
  constexpr int64_t ahead = kAhead * kGroup / WG;  // weight groups
  for (int i = 0; i < WG * kNR; i += 64)
    _mm_prefetch(reinterpret_cast<const char*>(w + ahead * WG * kNR + i), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(dp + ahead * kNR), _MM_HINT_T0);
  if constexpr (M) _mm_prefetch(reinterpret_cast<const char*>(mp + ahead * kNR), _MM_HINT_T0);
}

// R <= 6 quantized rows (a tile of QuantizeRows' layout) against one panel -> R x 16 of y.
// Weight group h starts at pair h * WG / 2 of the panel's codes and of the tile's rows; its
// activation scale is that of group h * WG / 32, its offsets' factor xs[h * R + r]. The sums
// are named variables: GCC spills an array of this many to the stack.
template <int R, int64_t WG, bool M, typename S>
void Tile(const int32_t* xt, const float* dx, const float* xs, int64_t K, const int8_t* panel,
          const S* dp, const S* mp, float* y, int64_t N) {
  static_assert(R >= 1 && R <= kMaxTile);
  static_assert(WG == 16 || WG == 32);
  const int64_t H = K / WG;
  const __m256i z = _mm256_setzero_si256();
#define XLASERVE_ROW(r) \
  if constexpr (R > r) MaddAdd(xp + r, w0, w1, a##r##0, a##r##1);
#define XLASERVE_EMIT(r) \
  if constexpr (R > r) Emit(y + r * N, a##r##0, a##r##1, dx[g * R + r], d0, d1, h == 0);
  for (int64_t h = 0; h < H; ++h) {
    __m256i a00 = z, a01 = z, a10 = z, a11 = z, a20 = z, a21 = z, a30 = z, a31 = z, a40 = z,
            a41 = z, a50 = z, a51 = z;
    const int64_t g = h * WG / kGroup;
    const int8_t* w = panel + h * WG * kNR;
    const int32_t* xp = xt + h * (WG / 2) * R;
    const S* mh = M ? mp + h * kNR : nullptr;  // this group's offsets
    Prefetch<WG, M>(w, dp + h * kNR, mh);
    for (int i = 0; i < WG / 2; ++i, w += 2 * kNR, xp += R) {
      __m256i w0, w1;
      LoadPair(w, w0, w1);
      XLASERVE_ROW(0) XLASERVE_ROW(1) XLASERVE_ROW(2) XLASERVE_ROW(3) XLASERVE_ROW(4)
      XLASERVE_ROW(5)
    }
    const __m256 d0 = xlaserve::LoadScales8(dp + h * kNR);
    const __m256 d1 = xlaserve::LoadScales8(dp + h * kNR + 8);
    XLASERVE_EMIT(0) XLASERVE_EMIT(1) XLASERVE_EMIT(2) XLASERVE_EMIT(3) XLASERVE_EMIT(4)
    XLASERVE_EMIT(5)
    if constexpr (M) EmitMins<R>(y, N, xs + h * R, mh);
  }
#undef XLASERVE_ROW
#undef XLASERVE_EMIT
}

template <int R, int64_t WG, bool M, typename S>
void TileOf(int64_t rows, const int32_t* xt, const float* dx, const float* xs, int64_t K,
            const int8_t* panel, const S* dp, const S* mp, float* y, int64_t N) {
  if constexpr (R > 1) {
    if (rows < R) return TileOf<R - 1, WG, M, S>(rows, xt, dx, xs, K, panel, dp, mp, y, N);
  }
  Tile<R, WG, M, S>(xt, dx, xs, K, panel, dp, mp, y, N);
}

// Rows of x laid out as the tiles read them, in the calling thread's buffers (read by the
// pool's threads until the call returns); xs only with offsets.
struct Quantized {
  const int32_t* xt;
  const float* dx;
  const float* xs;
};

// Rows [0, T) of q (from its row 0) against one panel, in tiles of at most kMaxTile rows as
// even as can be.
template <int64_t WG, bool M, typename S>
void Panel(int64_t T, Quantized q, int64_t K, const int8_t* panel, const S* dp, const S* mp,
           float* y, int64_t N) {
  const int64_t G = K / kGroup, H = K / WG;
  xlaserve::EvenTiles(T, kMaxTile, [&](int64_t r, int64_t n) {
    TileOf<kMaxTile, WG, M, S>(n, q.xt + r * (K / 2), q.dx + r * G, M ? q.xs + r * H : nullptr,
                               K, panel, dp, mp, y + r * N, N);
  });
}

// q from row s on.
Quantized From(Quantized q, int64_t s, int64_t K, int64_t wg) {
  return {q.xt + s * (K / 2), q.dx + s * (K / kGroup), q.xs ? q.xs + s * (K / wg) : nullptr};
}

// Rows [0, bounds[E]) of x, E runs of rows end to end (run e: rows [bounds[e], bounds[e + 1]),
// one expert's in the grouped form, all T in the single one), through QuantizeRows run by
// run: run e's tiles are the ones Panel cuts it into, laid out from xt + bounds[e] * K / 2
// and dx + bounds[e] * G (and with offsets, `mins`, xs + bounds[e] * K / wg). Each row is
// rounded alone, so the same in any run.
Quantized QuantizeRuns(ffi::ThreadPool& pool, const float* x, int64_t E, const int64_t* bounds,
                       int64_t K, int64_t wg, bool mins) {
  const int64_t T = bounds[E], G = K / kGroup, H = K / wg;
  thread_local std::vector<int32_t> xt;
  thread_local std::vector<float> dx, xs;
  if (xt.size() < static_cast<size_t>(T * K / 2)) xt.resize(T * K / 2);
  if (dx.size() < static_cast<size_t>(T * G)) dx.resize(T * G);
  if (mins && xs.size() < static_cast<size_t>(T * H)) xs.resize(T * H);
  int32_t* xtp = xt.data();
  float* dxp = dx.data();
  float* xsp = mins ? xs.data() : nullptr;
  xlaserve::ParallelFor(pool, T, [&](int64_t r0, int64_t r1) {
    // the runs rows [r0, r1) meet, from the last one starting at or before r0
    for (int64_t e = std::upper_bound(bounds, bounds + E, r0) - bounds - 1;
         e < E && bounds[e] < r1; ++e) {
      const int64_t s = bounds[e];
      QuantizeRows(x + s * K, std::max(r0, s) - s, std::min(r1, bounds[e + 1]) - s,
                   bounds[e + 1] - s, K, xtp + s * (K / 2), dxp + s * G,
                   mins ? xsp + s * H : nullptr, wg);
    }
  }, /*grain=*/std::max<int64_t>(1, 8192 / K));
  return {xtp, dxp, xsp};
}

// x [T, K] (T > 0) through QuantizeRuns, then the panels split over the pool's threads;
// mp is unused without offsets (M false).
template <int64_t WG, bool M, typename S>
void Run(ffi::ThreadPool& pool, const float* xp, int64_t T, int64_t K, int64_t N,
         const int8_t* cp, const S* dp, const S* mp, float* yp) {
  const int64_t H = K / WG;
  const int64_t bounds[2] = {0, T};
  const Quantized q = QuantizeRuns(pool, xp, 1, bounds, K, WG, M);
  xlaserve::ParallelFor(pool, N / kNR, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      Panel<WG, M, S>(T, q, K, cp + p * K * kNR, dp + p * H * kNR, M ? mp + p * H * kNR : mp,
                      yp + p * kNR, N);
  }, /*grain=*/2);
}

// fn(std::integral_constant<int64_t, WG>{}, std::bool_constant<M>{}) for the weights'
// group `group` (16 or 32) and whether there are offsets; any other group is the caller's
// InvalidArgument with `message`.
template <typename F>
ffi::Error WithWeightGroup(int64_t group, bool mins, const char* message, F&& fn) {
  auto with_mins = [&](auto wg) {
    return mins ? fn(wg, std::true_type{}) : fn(wg, std::false_type{});
  };
  switch (group) {
    case 16: return with_mins(std::integral_constant<int64_t, 16>{});
    case 32: return with_mins(std::integral_constant<int64_t, 32>{});
    default: return ffi::Error::InvalidArgument(message);
  }
}

// Offsets m: none (0 values), or as many as the scales d, of d's type.
bool MinsFit(const ffi::AnyBuffer& d, const ffi::AnyBuffer& m) {
  return m.element_count() == 0 ||
         (m.element_count() == d.element_count() && m.element_type() == d.element_type());
}

ffi::Error Q80Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> codes,
                     ffi::AnyBuffer d, ffi::AnyBuffer m, ffi::ResultBuffer<ffi::F32> y,
                     int64_t group) {
  auto xd = x.dimensions();
  auto yd = y->dimensions();
  if (xd.size() != 2 || yd.size() != 2 || xd[0] != yd[0])
    return ffi::Error::InvalidArgument("q8_0_matmul: x must be [T, K] and y [T, N]");
  const int64_t T = xd[0], K = xd[1], N = yd[1];
  constexpr const char* kShapes =
      "q8_0_matmul: group 16 or 32, K % 32 == 0, N % 16 == 0, K * N int8 codes in panels of "
      "16 columns, d K / group * N float16 or float32 values, m none or as d";
  if ((group != 16 && group != 32) || N % kNR != 0 || K % kGroup != 0 ||
      static_cast<int64_t>(codes.element_count()) != K * N ||
      static_cast<int64_t>(d.element_count()) != K / group * N || !MinsFit(d, m))
    return ffi::Error::InvalidArgument(kShapes);
  return WithWeightGroup(group, m.element_count() > 0, kShapes, [&](auto wg, auto mins) {
    return xlaserve::WithScaleType(d.element_type(), kShapes, [&](auto tag) {
      using S = decltype(tag);
      if (T > 0)
        Run<decltype(wg)::value, decltype(mins)::value, S>(
            pool, x.typed_data(), T, K, N, codes.typed_data(),
            static_cast<const S*>(d.untyped_data()), static_cast<const S*>(m.untyped_data()),
            y->typed_data());
      return ffi::Error::Success();
    });
  });
}

// The grouped form, a mixture-of-experts projection: rows sorted by expert, expert e's rows
// (bounds[e] to bounds[e + 1]) against its codes, scales and offsets (cp, dp and mp hold E
// weights, each packed as above; mp unused without offsets). Each row is rounded and goes
// through the same tiles as in the single kernel, so it gets the same bits whatever its
// group's size. Work items are (expert, panel) pairs; experts without rows are skipped.
template <int64_t WG, bool M, typename S>
void RunGrouped(ffi::ThreadPool& pool, const float* xp, int64_t E, const int64_t* bounds,
                int64_t K, int64_t N, const int8_t* cp, const S* dp, const S* mp, float* yp) {
  const int64_t H = K / WG, panels = N / kNR;
  const Quantized q = QuantizeRuns(pool, xp, E, bounds, K, WG, M);
  xlaserve::ParallelFor(pool, E * panels, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t e = i / panels, p = i % panels, s = bounds[e];
      if (bounds[e + 1] == s) continue;
      const int64_t at = e * H * N + p * H * kNR;  // this expert's panel of scales
      Panel<WG, M, S>(bounds[e + 1] - s, From(q, s, K, WG), K, cp + (e * K * N + p * K * kNR),
                      dp + at, M ? mp + at : mp, yp + s * N + p * kNR, N);
    }
  });
}

// x [M, K], group_sizes [E], codes E * K * N, d (and m, or none) E * K / group * N: group
// e's rows against expert e's weight; rows past the groups are zeros.
ffi::Error Q80MatmulGrouped(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                            ffi::Buffer<ffi::S32> group_sizes, ffi::Buffer<ffi::S8> codes,
                            ffi::AnyBuffer d, ffi::AnyBuffer m, ffi::ResultBuffer<ffi::F32> y,
                            int64_t group) {
  auto xd = x.dimensions();
  auto yd = y->dimensions();
  if (xd.size() != 2 || yd.size() != 2 || xd[0] != yd[0])
    return ffi::Error::InvalidArgument("q8_0_matmul_grouped: x must be [M, K] and y [M, N]");
  const int64_t M = xd[0], K = xd[1], N = yd[1];
  const int64_t E = static_cast<int64_t>(group_sizes.element_count());
  constexpr const char* kShapes =
      "q8_0_matmul_grouped: group 16 or 32, K % 32 == 0, N % 16 == 0, E weights of K * N "
      "int8 codes in panels of 16 columns, d E * K / group * N float16 or float32 values, m "
      "none or as d";
  if ((group != 16 && group != 32) || N % kNR != 0 || K % kGroup != 0 ||
      static_cast<int64_t>(codes.element_count()) != E * K * N ||
      static_cast<int64_t>(d.element_count()) != E * (K / group) * N || !MinsFit(d, m))
    return ffi::Error::InvalidArgument(kShapes);
  std::vector<int64_t> bounds;  // group e: rows [bounds[e], bounds[e + 1])
  if (auto error = xlaserve::GroupBounds("q8_0_matmul_grouped", group_sizes, M, bounds);
      error.failure())
    return error;
  return WithWeightGroup(group, m.element_count() > 0, kShapes, [&](auto wg, auto mins) {
    return xlaserve::WithScaleType(d.element_type(), kShapes, [&](auto tag) {
      using S = decltype(tag);
      float* yp = y->typed_data();
      xlaserve::ZeroRowsPast(yp, bounds[E], M, N);
      if (bounds[E] > 0)
        RunGrouped<decltype(wg)::value, decltype(mins)::value, S>(
            pool, x.typed_data(), E, bounds.data(), K, N, codes.typed_data(),
            static_cast<const S*>(d.untyped_data()), static_cast<const S*>(m.untyped_data()),
            yp);
      return ffi::Error::Success();
    });
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(xlaserve_q8_0_matmul, Q80Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("group"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(xlaserve_q8_0_matmul_grouped, Q80MatmulGrouped,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("group"));
