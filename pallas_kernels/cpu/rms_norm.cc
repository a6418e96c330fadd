// y[r] = x[r] / sqrt(mean(x[r]^2) + eps), float32 rows, each row's sum of squares in one
// fixed order (8 lanes over k, lane k % 8 taking k = l, l + 8, ...; the lanes added in a fixed
// tree; the tail after), whatever the number of rows. XLA:CPU's reduction over [T, D] sums a
// row in an order that depends on T, so a token's normalised activations changed in their
// last bits with the tokens beside it (model/layers.py applies the scale after).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

void Row(const float* x, int64_t D, float eps, float* y) {
  __m256 acc = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= D; k += 8) {
    const __m256 v = _mm256_loadu_ps(x + k);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  float sum = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
              ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
  for (; k < D; ++k) sum = std::fma(x[k], x[k], sum);
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(D) + eps);
  const __m256 s = _mm256_set1_ps(inv);
  for (k = 0; k + 8 <= D; k += 8) _mm256_storeu_ps(y + k, _mm256_mul_ps(_mm256_loadu_ps(x + k), s));
  for (; k < D; ++k) y[k] = x[k] * inv;
}

ffi::Error RmsNorm(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y,
                   float eps) {
  auto d = x.dimensions();  // [..., D]: every row of the last axis
  if (d.size() == 0 || y->element_count() != x.element_count())
    return ffi::Error::InvalidArgument("rms_norm: x [..., D] and y of the same shape");
  const int64_t D = d.back();
  const int64_t T = D == 0 ? 0 : static_cast<int64_t>(x.element_count()) / D;
  const float* xp = x.typed_data();
  float* yp = y->typed_data();
  xlaserve::ParallelFor(pool, T, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) Row(xp + r * D, D, eps, yp + r * D);
  }, /*grain=*/std::max<int64_t>(1, 16384 / std::max<int64_t>(D, 1)));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(xlaserve_rms_norm, RmsNorm,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("eps"));
