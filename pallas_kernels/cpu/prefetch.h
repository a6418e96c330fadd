// Software prefetch of a chunk's K and V slots, a few lines at a time from inside the loops
// over the chunk before it: pages lie scattered over the cache, where the hardware prefetcher
// cannot follow, and asking for a whole chunk at once stalls the core until most of it has
// arrived instead of overlapping the reads with arithmetic.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <limits>

namespace xlaserve {

// Up to kMaxSlots runs of `bytes` bytes each, fetched line by line in order.
template <int64_t kMaxSlots>
struct Prefetcher {
  const char* start[kMaxSlots];
  int64_t count = 0, bytes = 0, i = 0, b = 0;  // slots, bytes per slot; next slot and offset

  void Reset(int64_t n, int64_t slot_bytes) { count = n, bytes = slot_bytes, i = b = 0; }
  // Prefetches the line at (slot, offset) and moves the pair past it; false when every line
  // has been asked for.
  bool Next(int64_t& slot, int64_t& offset) const {
    if (slot >= count) return false;
    _mm_prefetch(start[slot] + offset, _MM_HINT_T0);
    if ((offset += 64) >= bytes) offset = 0, ++slot;
    return true;
  }
  void Step(int64_t lines) {
    for (; lines > 0 && Next(i, b); --lines) {}
  }
  void Finish() { Step(std::numeric_limits<int64_t>::max()); }

  // One line at a time from a hot loop. The position stays in registers until the cursor
  // goes: Step() on the Prefetcher itself stores it back on every call, and the next call
  // waits for that store.
  struct Cursor {
    Prefetcher& pf;
    int64_t i, b;
    explicit Cursor(Prefetcher& p) : pf(p), i(p.i), b(p.b) {}
    ~Cursor() { pf.i = i, pf.b = b; }
    void Step() { pf.Next(i, b); }
  };
};

}  // namespace xlaserve
