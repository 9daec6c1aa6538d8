// Bounded waits on NVSHMEM signal words.
//
// A peer that died or took another code path must not hang the job: every wait polls with a
// deadline on the global nanosecond timer and, when it expires, records what it waited for in a
// lasp_wait_diag and returns false. The caller then leaves the kernel early; the host reads the
// diagnostics after the stream completes and reports PE, slot and epoch.
#pragma once
#include <stdint.h>
#include "lasp/wait_diagnostics.h"

namespace lasp {

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Acquire load at system scope: once it returns the epoch, the data the peer put before its
// signal is visible to this thread (put-with-signal orders data before the signal on every
// transport).
__device__ __forceinline__ uint64_t load_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

struct WaitSite {
  lasp_wait_diag* diag;
  uint64_t timeout_ns;
  int32_t me;
};

// Waits until *signal >= expected. Returns false (after recording the first failure of the
// launch) if the deadline passes or another wait of this kernel already failed.
__device__ inline bool wait_signal_ge(const WaitSite& site, const uint64_t* signal, uint64_t expected,
                                      int32_t peer, int32_t slot, uint32_t kind) {
  uint64_t seen = load_acquire_sys(signal);
  if (seen >= expected) return true;
  const uint64_t start = global_ns();
  uint32_t spins = 0;
  while (true) {
    seen = load_acquire_sys(signal);
    if (seen >= expected) return true;
    // Check the clock and the shared failure flag only every few polls: both cost more than the
    // poll itself.
    if ((++spins & 63u) == 0) {
      if (*(volatile uint32_t*)&site.diag->failed) return false;
      const uint64_t waited = global_ns() - start;
      if (waited > site.timeout_ns) {
        if (atomicCAS(&site.diag->failed, 0u, 1u) == 0u) {
          site.diag->kind = kind;
          site.diag->waiting_pe = site.me;
          site.diag->peer_pe = peer;
          site.diag->slot = slot;
          site.diag->expected = expected;
          site.diag->seen = seen;
          site.diag->waited_ns = waited;
          __threadfence_system();
        }
        return false;
      }
    }
  }
}

}  // namespace lasp
