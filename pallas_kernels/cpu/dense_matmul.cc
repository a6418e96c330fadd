// y[T, N] = x[T, K] @ W[K, N] for float weights (float32, bfloat16 or float16) or 8-bit
// codes (int8, float8_e4m3fn, float8_e5m2) with one scale per output channel, and float32
// rows, with every output summed in one fixed order: y[r, n] = fma(x[r, K-1], W[K-1, n],
// ... fma(x[r, 1], W[1, n], x[r, 0] * W[0, n])), k ascending, whatever T is and whichever
// rows share the call, then times scale[n] for 8-bit codes (weight-only, as XLA's
// `x @ convert(W) * scale`). A row's result is then independent of its batch: XLA:CPU's dot picks
// other kernels and blockings for other row counts (every row of a 1-row float32 dot
// differed in its last bits from the same row of a 64-row one). bfloat16 weights take the
// rows rounded to bfloat16 and sum two k at a time, in vdpbf16ps's order
// (dense_bf16_pairs.h).
//
// The weights' packing and the tiles: dense_panels.h. Panels are split over XLA's intra-op
// threads.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "dense_panels.h"
#include "groups.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using xlaserve::dense::kNR;
using xlaserve::dense::Panels;
using xlaserve::dense::Weights;

// scale: float32[N], or null for float weights.
template <Weights W>
void Run(ffi::ThreadPool& pool, int64_t T, int64_t K, int64_t N, const float* x,
         const char* w, size_t bytes, const float* scale, float* y) {
  const int64_t panels = (N + kNR - 1) / kNR;
  const int64_t per = xlaserve::dense::PanelsPerChunk(K, N, bytes, pool.num_threads());
  const void* rows = xlaserve::dense::TileRows<W>(x, T, K);
  xlaserve::ParallelFor(pool, (panels + per - 1) / per, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c)
      Panels<W>(T, rows, K, w, bytes, c * per, std::min(panels, (c + 1) * per), N, scale,
                y + c * per * kNR, N);
  });
}

// scale: float32[N] for 8-bit codes, float32[0] for float weights.
ffi::Error DenseMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                       ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto yd = y->dimensions();
  if (xd.size() != 2 || yd.size() != 2 || xd[0] != yd[0])
    return ffi::Error::InvalidArgument("dense_matmul: x must be [T, K] and y [T, N]");
  const int64_t T = xd[0], K = xd[1], N = yd[1];
  if (static_cast<int64_t>(w.element_count()) != K * N)
    return ffi::Error::InvalidArgument(
        "dense_matmul: w must hold K * N values in panels of 16 columns");
  const bool eight_bit = ffi::ByteWidth(w.element_type()) == 1;
  if (static_cast<int64_t>(scale.element_count()) != (eight_bit ? N : 0))
    return ffi::Error::InvalidArgument(
        "dense_matmul: scale must be [N] for 8-bit weights and [0] for float ones");
  if (T == 0) return ffi::Error::Success();
  const char* wp = static_cast<const char*>(w.untyped_data());
  const float* xp = x.typed_data();
  const float* sp = eight_bit ? scale.typed_data() : nullptr;
  float* yp = y->typed_data();
  switch (w.element_type()) {
    case ffi::DataType::F32: Run<Weights::kF32>(pool, T, K, N, xp, wp, 4, sp, yp); break;
    case ffi::DataType::BF16: Run<Weights::kBF16>(pool, T, K, N, xp, wp, 2, sp, yp); break;
    case ffi::DataType::F16: Run<Weights::kF16>(pool, T, K, N, xp, wp, 2, sp, yp); break;
    case ffi::DataType::S8: Run<Weights::kI8>(pool, T, K, N, xp, wp, 1, sp, yp); break;
    case ffi::DataType::F8E4M3FN: Run<Weights::kE4M3>(pool, T, K, N, xp, wp, 1, sp, yp); break;
    case ffi::DataType::F8E5M2: Run<Weights::kE5M2>(pool, T, K, N, xp, wp, 1, sp, yp); break;
    default:
      return ffi::Error::InvalidArgument(
          "dense_matmul: weights float32, bfloat16, float16, int8, float8_e4m3fn or "
          "float8_e5m2");
  }
  return ffi::Error::Success();
}

// The grouped form, a mixture-of-experts projection: rows sorted by expert, group e's rows
// (sizes[e] of them, after the groups before it) against expert e's panels (w holds E
// weights of K * N values, each packed as above) and channel scales (scale float32[E * N]
// for 8-bit codes, [0] for float weights). Each row goes through the same tiles and FMA
// order as the single kernel's, so it gets the same bits whatever its group's size; rows
// past the groups are zeros. Work items are (expert, panel) pairs.
template <Weights W>
void RunGrouped(ffi::ThreadPool& pool, int64_t E, const int64_t* start, const int32_t* sizes,
                int64_t K, int64_t N, const float* x, const char* w, size_t bytes,
                const float* scale, float* y) {
  const int64_t panels = (N + kNR - 1) / kNR;
  const void* rows = xlaserve::dense::TileRows<W>(x, start[E], K);
  xlaserve::ParallelFor(pool, E * panels, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t e = i / panels, p = i % panels;
      if (sizes[e] == 0) continue;
      Panels<W>(sizes[e], xlaserve::dense::RowAt<W>(rows, start[e], K), K,
                w + e * K * N * bytes, bytes, p, p + 1, N,
                scale ? scale + e * N : nullptr, y + start[e] * N + p * kNR, N);
    }
  });
}

ffi::Error DenseMatmulGrouped(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                              ffi::Buffer<ffi::S32> group_sizes, ffi::AnyBuffer w,
                              ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto yd = y->dimensions();
  if (xd.size() != 2 || yd.size() != 2 || xd[0] != yd[0])
    return ffi::Error::InvalidArgument("dense_matmul_grouped: x must be [M, K] and y [M, N]");
  const int64_t M = xd[0], K = xd[1], N = yd[1];
  const int64_t E = static_cast<int64_t>(group_sizes.element_count());
  if (static_cast<int64_t>(w.element_count()) != E * K * N)
    return ffi::Error::InvalidArgument(
        "dense_matmul_grouped: w must hold E weights of K * N values in panels");
  const bool eight_bit = ffi::ByteWidth(w.element_type()) == 1;
  if (static_cast<int64_t>(scale.element_count()) != (eight_bit ? E * N : 0))
    return ffi::Error::InvalidArgument(
        "dense_matmul_grouped: scale must be [E * N] for 8-bit weights and [0] for float ones");
  std::vector<int64_t> bounds;  // group e: rows [bounds[e], bounds[e + 1])
  if (auto error = xlaserve::GroupBounds("dense_matmul_grouped", group_sizes, M, bounds);
      error.failure())
    return error;
  float* yp = y->typed_data();
  xlaserve::ZeroRowsPast(yp, bounds[E], M, N);
  if (bounds[E] == 0) return ffi::Error::Success();
  const int32_t* sizes = group_sizes.typed_data();
  const char* wp = static_cast<const char*>(w.untyped_data());
  const float* xp = x.typed_data();
  const float* sp = eight_bit ? scale.typed_data() : nullptr;
  const int64_t* st = bounds.data();
  switch (w.element_type()) {
    case ffi::DataType::F32: RunGrouped<Weights::kF32>(pool, E, st, sizes, K, N, xp, wp, 4, sp, yp); break;
    case ffi::DataType::BF16: RunGrouped<Weights::kBF16>(pool, E, st, sizes, K, N, xp, wp, 2, sp, yp); break;
    case ffi::DataType::F16: RunGrouped<Weights::kF16>(pool, E, st, sizes, K, N, xp, wp, 2, sp, yp); break;
    case ffi::DataType::S8: RunGrouped<Weights::kI8>(pool, E, st, sizes, K, N, xp, wp, 1, sp, yp); break;
    case ffi::DataType::F8E4M3FN: RunGrouped<Weights::kE4M3>(pool, E, st, sizes, K, N, xp, wp, 1, sp, yp); break;
    case ffi::DataType::F8E5M2: RunGrouped<Weights::kE5M2>(pool, E, st, sizes, K, N, xp, wp, 1, sp, yp); break;
    default:
      return ffi::Error::InvalidArgument(
          "dense_matmul_grouped: weights float32, bfloat16, float16, int8, float8_e4m3fn or "
          "float8_e5m2");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(xlaserve_dense_matmul_grouped, DenseMatmulGrouped,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(xlaserve_dense_matmul, DenseMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
