// The grouped (mixture-of-experts) forms of the matmul kernels: x's rows sorted by expert,
// group e holding sizes[e] rows after the groups before it, each against expert e's weight.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace xlaserve {

// bounds[e] .. bounds[e + 1]: group e's rows, bounds[E] the rows the groups fill. An error
// naming `kernel` when a size is negative or the sizes sum past M.
inline xla::ffi::Error GroupBounds(const char* kernel, xla::ffi::Buffer<xla::ffi::S32>& sizes,
                                   int64_t M, std::vector<int64_t>& bounds) {
  const int64_t E = static_cast<int64_t>(sizes.element_count());
  const int32_t* s = sizes.typed_data();
  bounds.assign(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) {
    if (s[e] < 0 || bounds[e] + s[e] > M)
      return xla::ffi::Error::InvalidArgument(
          std::string(kernel) + ": group sizes must be >= 0 and sum to at most M");
    bounds[e + 1] = bounds[e] + s[e];
  }
  return xla::ffi::Error::Success();
}

// Rows [from, M) of y [M, N]: zeros.
inline void ZeroRowsPast(float* y, int64_t from, int64_t M, int64_t N) {
  std::memset(y + from * N, 0, sizeof(float) * (M - from) * N);
}

}  // namespace xlaserve
