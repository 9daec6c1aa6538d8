// Warpgroup-level tensor-core primitives of sm_90a (wgmma): the shared-memory operand descriptor of
// the 128-byte-swizzled tiles of mma.cuh, m64n64k16 bf16 -> fp32 with A from shared memory (either
// major) or from registers, and the fences, commits and waits that order them (PTX ISA, "Asynchronous
// Warpgroup Level Matrix Multiply-Accumulate").
//
// A warpgroup is 4 consecutive warps. Warp w of it supplies and receives rows 16w..16w+15 of the
// 64-row A and D, in mma.sync's fragment layouts (mma.cuh): D register 4 nt + 2 hh + e of lane
// (g, t) is D[16w + 8hh + g][8nt + 2t + e], and an A k-step is mma.sync's A fragment of those rows.
// So float[8][4] accumulators and uint32_t[4] A fragments are shared with the mma.sync code.
#pragma once
#include <stdint.h>

namespace lasp {
namespace wg {

// Which index of an operand tile is contiguous in its 128-byte rows. K-major: the reduction index
// (Q as A; K as B of Q K^T, stored [token][d]). MN-major: the M or N index, rows are reduction
// indices (V as B, stored [token][column]; the bf16 state as B of Q S, stored [d][column]; K as A
// of K^T V, stored [token][d]). The value is the instruction's transpose flag.
enum class Major : int { kK = 0, kMN = 1 };

// Descriptor of a 128-byte-swizzled operand at shared address `addr` (PTX "matrix descriptor"):
// start address >> 4 (bits 0-13); leading byte offset (bits 16-29) 16 B: unused by these layouts,
// whose 16-element k-step lies inside one 128-byte row (K-major) and whose N = 64 is one row
// (MN-major); stride byte offset (bits 32-45) 1024 B between groups of 8 rows; base offset 0, so
// the 8-row group holding `addr` must start 1024-byte aligned; swizzle mode 1 = 128 B (bits 62-63).
// A k-step inside a K-major row starts 32 B further; an MN-major k-step is 16 rows = 2048 B further.
__device__ __forceinline__ uint64_t desc_sw128(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFFu) >> 4) | (1ull << 16) | (static_cast<uint64_t>(1024 >> 4) << 32) |
         (1ull << 62);
}

// Orders this warp's earlier register writes (accumulators, A fragments) before the next wgmma.
__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }

// Closes the group of wgmmas issued since the last commit.
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }

// Waits until at most N committed groups are still running (their registers are then final).
template <int N>
__device__ __forceinline__ void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Makes this thread's generic-proxy shared-memory writes (st.shared, completed cp.async) visible to
// the async proxy that wgmma reads through; the barrier after it publishes them to the warpgroup.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Pins an accumulator's registers at this point of the program: after a wait, no access to them is
// moved above it.
__device__ __forceinline__ void fence_operands(float (&d)[8][4]) {
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[i][e])::"memory");
}

#define LASP_WG_D32(d)                                                                                           \
  "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),       \
      "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),   \
      "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),   \
      "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),   \
      "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
#define LASP_WG_D32_LIST                                                                                         \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
  "%23, %24, %25, %26, %27, %28, %29, %30, %31}"

// d = A B (accumulate = false) or d += A B, m64n64k16, A and B from shared memory. A is K-major
// (Q) unless kMajorA says MN-major: rows are reduction indices and the 64 M indices are contiguous
// (K stored [token][d] as A = K^T of the states loop's update), the same layout as an MN-major B.
template <Major kMajorB, Major kMajorA = Major::kK>
__device__ __forceinline__ void mma_ss(float (&d)[8][4], uint64_t a, uint64_t b, bool accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " LASP_WG_D32_LIST ", %32, %33, p, 1, 1, %36, %35;\n}\n"
      : LASP_WG_D32(d)
      : "l"(a), "l"(b), "r"(static_cast<int>(accumulate)), "n"(static_cast<int>(kMajorB)),
        "n"(static_cast<int>(kMajorA)));
}

// d += A B (or d = A B where accumulate is false), m64n64k16, A from registers (this warp's 16
// rows, mma.sync's A fragment), B from shared memory. The A registers must stay unchanged until
// the group is waited for.
template <Major kMajorB>
__device__ __forceinline__ void mma_rs(float (&d)[8][4], const uint32_t (&a)[4], uint64_t b, bool accumulate = true) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " LASP_WG_D32_LIST
      ", {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
      : LASP_WG_D32(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(static_cast<int>(accumulate)),
        "n"(static_cast<int>(kMajorB)));
}

#undef LASP_WG_D32
#undef LASP_WG_D32_LIST

}  // namespace wg
}  // namespace lasp
