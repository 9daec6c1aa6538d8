// Tensor Memory Accelerator loads (sm_90) and the shared-memory mbarriers that say when they have
// landed (PTX ISA: "cp.async.bulk.tensor", "mbarrier").
//
// One thread issues a whole tile: the hardware walks the tensor map (encoded on the host, passed in
// the kernel's __grid_constant__ parameters), fills rows outside the tensor with zeros and writes
// the 128-byte swizzle of lasp::swizzle. Each copy credits its bytes to an mbarrier; a phase of the
// mbarrier completes when its expected arrivals have arrived and every expected byte has landed.
#pragma once
#include <stdint.h>

#include "lasp/scalar_decay/forward_params.h"

namespace lasp {
namespace tma {

// Sets up the mbarrier at shared address `bar` for phases of `arrivals` arrivals. Publish it to the
// CTA (fence_init, then a CTA barrier) before any thread or copy uses it.
__device__ __forceinline__ void init(uint32_t bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(arrivals) : "memory");
}

// Orders the mbarrier initialisations above before the tensor copies that complete on them.
__device__ __forceinline__ void fence_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }

// Arrives on `bar` and adds `bytes` to what its current phase waits for (the copies issued next).
__device__ __forceinline__ void arrive_expect_bytes(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

// Arrives on `bar` once every cp.async this thread issued before has landed. The arrival is not
// added to the phase's count (.noinc): the count given to init includes it.
__device__ __forceinline__ void arrive_after_cp_async(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

// Waits until the phase of `bar` with parity `parity` has completed; its copies' data is then
// visible to this thread and to the async proxy (wgmma). A wait inside one CTA on its own copies:
// it ends unless a copy faults, and a faulting copy ends the kernel with an error.
__device__ __forceinline__ void wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "wait_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_%=;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// Copies the box at coordinates (c0, c1, c2, c3) (innermost first, in elements) of the 4-d tensor
// `map` to shared address `dst` (1024-byte aligned for the 128-byte swizzle), crediting `bar`.
__device__ __forceinline__ void load_4d(uint32_t dst, const lasp_tensor_map& map, int c0, int c1, int c2, int c3,
                                        uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, "
      "%5}], [%6];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(&map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
      : "memory");
}

// Copies the box at coordinates (c0, c1, c2) (innermost first, in elements) of the 3-d tensor `map`
// to shared address `dst` (16-byte aligned without a swizzle), crediting `bar`.
__device__ __forceinline__ void load_3d(uint32_t dst, const lasp_tensor_map& map, int c0, int c1, int c2,
                                        uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
      "[%5];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(&map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}

// Copies the tile at shared address `src` (one of `map`'s boxes, in its swizzle) to the box at
// coordinates (c0, c1, c2, c3) of the 4-d tensor `map`, in this thread's bulk group (the parts past
// the tensor's edge are not written). The caller has fenced its shared writes for the async proxy
// (fence_shared_for_copies) and met its writers at a barrier.
__device__ __forceinline__ void store_4d(const lasp_tensor_map& map, int c0, int c1, int c2, int c3, uint32_t src) {
  asm volatile(
      "cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [%0, {%1, %2, %3, %4}], [%5];\n" ::"l"(
          reinterpret_cast<uint64_t>(&map)),
      "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(src)
      : "memory");
}

// Makes this thread's shared-memory writes visible to the async proxy the tensor copies read
// through (as wgmma's fence_proxy_async does for wgmma); a barrier after it publishes them.
__device__ __forceinline__ void fence_shared_for_copies() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Closes this thread's bulk group of the stores issued since the last one.
__device__ __forceinline__ void store_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }

// Waits until at most kPending of this thread's bulk groups are still reading shared memory: the
// tiles of the others may be written again.
template <int kPending>
__device__ __forceinline__ void store_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
}

// Waits until every bulk group of this thread has completed (its writes performed).
__device__ __forceinline__ void store_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

// Fetches the tensor map into the descriptor cache ahead of its first copy.
__device__ __forceinline__ void prefetch_map(const lasp_tensor_map& map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&map)) : "memory");
}

}  // namespace tma
}  // namespace lasp
