// The greedy head: tokens[r] = argmax over n < columns of (x[T, K] @ W[K, N])[r, n], the
// index argmax.cc gives on dense_matmul.cc's result (the first index of the maximum, a NaN
// counting as the maximum), without writing the [T, N] logits. Each output is the same
// float32 the matmul kernel writes (dense_panels.h, the same tiles and FMA order), so the
// token is too, whatever T is.
//
// With a small hidden size and a large vocabulary (K = 64, N = 49152), writing the logits
// and reading them back costs more than computing them: 256 rows of logits are 50 MB. Here
// the panels go in chunks; a chunk's outputs for every row land in a buffer of the thread
// that computes it (at most 1024 columns a row), each row's best in the chunk is kept, and
// the chunks' bests are merged in column order, which keeps the first index of the maximum.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "dense_panels.h"
#include "parallel.h"
#include "row_argmax.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using xlaserve::dense::kNR;
using xlaserve::dense::Panels;
using xlaserve::dense::Weights;

constexpr int64_t kMaxChunkPanels = 64;  // 1024 columns

// v replaces best as a later column's value: strictly larger, or the first NaN.
inline bool Better(float v, float best) {
  return v > best || (std::isnan(v) && !std::isnan(best));
}

template <Weights W>
void Run(ffi::ThreadPool& pool, int64_t T, int64_t K, int64_t N, int64_t columns,
         const float* x, const char* w, size_t bytes, const float* scale, int32_t* out) {
  const int64_t panels = (columns + kNR - 1) / kNR;  // the panels holding counted columns
  // Chunks as the matmul takes them, none wider than kMaxChunkPanels (the buffer a thread
  // holds): any split gives the same tokens.
  const int64_t per = std::min(
      xlaserve::dense::PanelsPerChunk(K, columns, bytes, std::max<int64_t>(pool.num_threads(), 1)),
      kMaxChunkPanels);
  const int64_t chunks = (panels + per - 1) / per;
  std::vector<float> best_value(chunks * T);
  std::vector<int32_t> best_index(chunks * T);
  const void* rows = xlaserve::dense::TileRows<W>(x, T, K);
  xlaserve::ParallelFor(pool, chunks, [&](int64_t begin, int64_t end) {
    const int64_t ld = per * kNR;
    std::vector<float> y(T * ld);
    for (int64_t c = begin; c < end; ++c) {
      const int64_t p0 = c * per, p1 = std::min(panels, p0 + per);
      Panels<W>(T, rows, K, w, bytes, p0, p1, N, scale, y.data(), ld);
      const int64_t first = p0 * kNR, width = std::min(columns, p1 * kNR) - first;
      for (int64_t r = 0; r < T; ++r) {
        const int32_t i = xlaserve::RowArgmax(y.data() + r * ld, width);
        best_value[c * T + r] = y[r * ld + i];
        best_index[c * T + r] = static_cast<int32_t>(first + i);
      }
    }
  });
  for (int64_t r = 0; r < T; ++r) {
    float best = best_value[r];
    int32_t index = best_index[r];
    for (int64_t c = 1; c < chunks; ++c) {
      if (Better(best_value[c * T + r], best)) {
        best = best_value[c * T + r];
        index = best_index[c * T + r];
      }
    }
    out[r] = index;
  }
}

// scale: float32[N] for 8-bit codes, float32[0] for float weights; columns: how many of the
// N outputs count (a vocabulary padded past the tokenizer's ids).
ffi::Error DenseArgmax(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                       ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::S32> tokens,
                       int64_t columns) {
  auto xd = x.dimensions();
  if (xd.size() != 2 || tokens->element_count() != static_cast<size_t>(xd[0]))
    return ffi::Error::InvalidArgument("dense_argmax: x must be [T, K] and tokens [T]");
  const int64_t T = xd[0], K = xd[1];
  const int64_t N = K == 0 ? 0 : static_cast<int64_t>(w.element_count()) / K;
  if (K == 0 || N * K != static_cast<int64_t>(w.element_count()))
    return ffi::Error::InvalidArgument("dense_argmax: w must hold K * N values in panels");
  if (columns < 1 || columns > N)
    return ffi::Error::InvalidArgument("dense_argmax: columns must be in [1, N]");
  const bool eight_bit = ffi::ByteWidth(w.element_type()) == 1;
  if (static_cast<int64_t>(scale.element_count()) != (eight_bit ? N : 0))
    return ffi::Error::InvalidArgument(
        "dense_argmax: scale must be [N] for 8-bit weights and [0] for float ones");
  if (T == 0) return ffi::Error::Success();
  const char* wp = static_cast<const char*>(w.untyped_data());
  const float* xp = x.typed_data();
  const float* sp = eight_bit ? scale.typed_data() : nullptr;
  int32_t* out = tokens->typed_data();
  switch (w.element_type()) {
    case ffi::DataType::F32: Run<Weights::kF32>(pool, T, K, N, columns, xp, wp, 4, sp, out); break;
    case ffi::DataType::BF16: Run<Weights::kBF16>(pool, T, K, N, columns, xp, wp, 2, sp, out); break;
    case ffi::DataType::F16: Run<Weights::kF16>(pool, T, K, N, columns, xp, wp, 2, sp, out); break;
    case ffi::DataType::S8: Run<Weights::kI8>(pool, T, K, N, columns, xp, wp, 1, sp, out); break;
    case ffi::DataType::F8E4M3FN: Run<Weights::kE4M3>(pool, T, K, N, columns, xp, wp, 1, sp, out); break;
    case ffi::DataType::F8E5M2: Run<Weights::kE5M2>(pool, T, K, N, columns, xp, wp, 1, sp, out); break;
    default:
      return ffi::Error::InvalidArgument(
          "dense_argmax: weights float32, bfloat16, float16, int8, float8_e4m3fn or "
          "float8_e5m2");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(xlaserve_dense_argmax, DenseArgmax,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("columns"));
