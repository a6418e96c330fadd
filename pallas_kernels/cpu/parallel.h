// Splitting a kernel's work over XLA:CPU's intra-op thread pool.
//
// XLA hands an FFI handler the pool its own ops use, so a kernel's threads never compete
// with another runtime's spinning workers. The same pool may be running other ops,
// including another of our kernels that is waiting too, so a caller never waits for a task
// to start: it claims work items itself alongside any pool task that does start, and waits
// only for items already claimed. A task that starts after all items are claimed does
// nothing, which is why the shared counters live on the heap.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace xlaserve {

struct WorkCounters {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

// Calls fn(begin, end) on disjoint ranges of `grain` items (the last may be shorter)
// covering [0, n), from the calling thread and from the pool.
template <typename F>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t n, F&& fn, int64_t grain = 1) {
  if (n <= 0) return;
  const int64_t chunks = (n + grain - 1) / grain;
  // The calling thread is one of the workers.
  const int64_t helpers = std::min<int64_t>(pool.num_threads() - 1, chunks - 1);
  if (helpers <= 0) {
    fn(int64_t{0}, n);
    return;
  }
  auto counters = std::make_shared<WorkCounters>();
  auto work = [counters, chunks, n, grain, f = &fn] {
    int64_t c;
    while ((c = counters->next.fetch_add(1, std::memory_order_relaxed)) < chunks) {
      (*f)(c * grain, std::min(n, (c + 1) * grain));
      counters->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t h = 0; h < helpers; ++h) {
    auto task = work;  // the pool takes its own copy
    pool.Schedule(std::move(task));
  }
  work();
  while (counters->done.load(std::memory_order_acquire) < chunks) std::this_thread::yield();
}

// Calls fn(r, n) for consecutive tiles of rows [r, r + n) covering [0, T), at most
// max_rows each and as even as can be (16 rows in tiles of 6: 6 + 5 + 5), so no tile is
// left with a few rows' worth of work per weight load.
template <typename F>
void EvenTiles(int64_t T, int64_t max_rows, F&& fn) {
  const int64_t tiles = (T + max_rows - 1) / max_rows;
  int64_t r = 0;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t n = (T - r) / (tiles - t) + ((T - r) % (tiles - t) != 0);
    fn(r, n);
    r += n;
  }
}

}  // namespace xlaserve
