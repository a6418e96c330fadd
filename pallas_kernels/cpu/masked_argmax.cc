// tokens[r] = argmax over the allowed v of logits[r, v], where token v is allowed when bit
// v % 32 of bitmask[r, v / 32] is set: the index jnp.argmax gives for
// where(allowed, logits, -inf) (the first of the maximum, a NaN counts as the maximum, a row
// with nothing allowed gives 0), without writing the masked logits.
//
// This is the greedy step of a request under a grammar (serving/engine/token_bitmask.py).
// XLA:CPU materialises the masked [R, V] logits before the argmax kernel can read them, and
// inside the sampler's conditionals that costs milliseconds at 64 rows; here the bitmask
// (1/32 of the logits' size) is read alongside them, and a word with no allowed token skips
// its 32 logits.
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Lane k of the result is all ones where bit k of `bits` (8 bits) is set.
inline __m256 LaneMask(uint32_t bits) {
  const __m256i sel = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i b = _mm256_and_si256(_mm256_set1_epi32(static_cast<int>(bits)), sel);
  return _mm256_castsi256_ps(_mm256_cmpeq_epi32(b, sel));
}

inline bool Allowed(const int32_t* mask, int64_t j) {
  return (static_cast<uint32_t>(mask[j >> 5]) >> (j & 31)) & 1u;
}

int32_t RowMaskedArgmax(const float* x, const int32_t* mask, int64_t V) {
  const __m256 neg_inf = _mm256_set1_ps(-INFINITY);
  __m256 best_v = neg_inf;
  int64_t first_nan = -1;
  const int64_t full = V / 32 * 32;  // whole words; the rest bit by bit
  for (int64_t i = 0; i < full && first_nan < 0; i += 32) {
    const uint32_t w = static_cast<uint32_t>(mask[i >> 5]);
    if (w == 0) continue;
    for (int k = 0; k < 4; ++k) {
      const __m256 lanes = LaneMask((w >> (8 * k)) & 0xffu);
      const __m256 v = _mm256_blendv_ps(neg_inf, _mm256_loadu_ps(x + i + 8 * k), lanes);
      const int nan = _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      if (nan != 0) {  // rare: the first allowed NaN wins
        first_nan = i + 8 * k + __builtin_ctz(nan);
        break;
      }
      best_v = _mm256_max_ps(best_v, v);
    }
  }
  if (first_nan >= 0) return static_cast<int32_t>(first_nan);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, best_v);
  float best = -INFINITY;
  for (float l : lanes) best = l > best ? l : best;
  for (int64_t j = full; j < V; ++j) {
    if (!Allowed(mask, j)) continue;
    if (std::isnan(x[j])) return static_cast<int32_t>(j);  // none before: checked above
    best = x[j] > best ? x[j] : best;
  }
  if (best == -INFINITY) return 0;  // nothing above -inf: index 0, as jnp.argmax
  // The first allowed index holding the maximum, from cache.
  const __m256 target = _mm256_set1_ps(best);
  for (int64_t i = 0; i < full; i += 32) {
    const uint32_t w = static_cast<uint32_t>(mask[i >> 5]);
    if (w == 0) continue;
    for (int k = 0; k < 4; ++k) {
      const __m256 eq = _mm256_cmp_ps(_mm256_loadu_ps(x + i + 8 * k), target, _CMP_EQ_OQ);
      const int hit = _mm256_movemask_ps(_mm256_and_ps(eq, LaneMask((w >> (8 * k)) & 0xffu)));
      if (hit != 0) return static_cast<int32_t>(i + 8 * k + __builtin_ctz(hit));
    }
  }
  for (int64_t j = full; j < V; ++j)
    if (Allowed(mask, j) && x[j] == best) return static_cast<int32_t>(j);
  return 0;
}

ffi::Error MaskedArgmax(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits,
                        ffi::Buffer<ffi::S32> bitmask, ffi::ResultBuffer<ffi::S32> tokens) {
  auto d = logits.dimensions();
  auto m = bitmask.dimensions();
  if (d.size() != 2 || m.size() != 2 || m[0] != d[0] || m[1] * 32 < d[1] ||
      tokens->element_count() != static_cast<size_t>(d[0]))
    return ffi::Error::InvalidArgument(
        "masked_argmax: logits [R, V], bitmask [R, >= ceil(V / 32)] and tokens [R]");
  const int64_t R = d[0], V = d[1], W = m[1];
  if (V == 0) return ffi::Error::InvalidArgument("masked_argmax: an empty row");
  const float* x = logits.typed_data();
  const int32_t* bits = bitmask.typed_data();
  int32_t* out = tokens->typed_data();
  xlaserve::ParallelFor(pool, R, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) out[r] = RowMaskedArgmax(x + r * V, bits + r * W, V);
  }, /*grain=*/V >= 16384 ? 1 : 8);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(xlaserve_masked_argmax, MaskedArgmax,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
