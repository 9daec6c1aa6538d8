// The products of lasp/chunk/tile_mma.cuh for a whole warpgroup on sm_90a's wgmma: acc[64 x N] +=
// op(A)[64 x K] op(B)[K x N], both operands read by the tensor cores straight from the swizzled
// tiles (no fragment loads, B read once per warpgroup instead of once per warp). Warp w of the
// warpgroup holds rows 16 w.. of acc in mma.sync's accumulator layout, so the code around a
// product is the same as around tile_mma's with m0 = 16 w.
//
// A tile whose index along a row is the reduction index is a K-major operand (A as stored, B
// transposed); one whose rows are the reduction index is MN-major (A transposed, B as stored).
// Shared-memory writes a product reads must be published first: fence_proxy_async() by the
// writing threads, then a barrier (publish()).
#pragma once
#include <stdint.h>

#include "lasp/chunk/tile_mma.cuh"
#include "lasp/wgmma.cuh"

namespace lasp {
namespace chunk {

// Makes this thread's shared-memory writes (st.shared and landed cp.async) visible to the tensor
// cores' async proxy, then waits for the whole CTA.
__device__ __forceinline__ void publish() {
  wg::fence_proxy_async();
  __syncthreads();
}

namespace detail {

// Start of the operand at (row, col) of tile t: rows of 128 bytes, column blocks of 64. K-major:
// row = the M or N index (a multiple of 8), col = the k-step's first reduction index (a multiple of
// 16: 32 bytes further per step inside the row). MN-major: row = the reduction index (a multiple of
// 16), col = the first M or N index (N = 32 may start half-way along a row).
__device__ __forceinline__ uint64_t operand(const Tile& t, int row, int col) {
  return wg::desc_sw128(t.base + (col / 64) * t.rows * 128 + row * 128 + (col % 64) * 2);
}

template <int N, wg::Major kB, wg::Major kA>
__device__ __forceinline__ void mma_ss(float (&d)[N / 8][4], uint64_t a, uint64_t b) {
  static_assert(N == 64 || N == 32, "the products here are 64 or 32 columns wide");
  if constexpr (N == 64) {
    wg::mma_ss<kB, kA>(d, a, b, true);
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, %19, %18;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
          "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
          "+f"(d[3][2]), "+f"(d[3][3])
        : "l"(a), "l"(b), "n"(static_cast<int>(kB)), "n"(static_cast<int>(kA)));
  }
}

template <int NT>
__device__ __forceinline__ void fence_operands(float (&d)[NT][4]) {
#pragma unroll
  for (int i = 0; i < NT; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[i][e])::"memory");
}

}  // namespace detail

// Issues acc[64 x N] += op(a)[m0.., ka0..ka0 + K) op(b)[kb0..kb0 + K, n0..n0 + N), N in {32, 64};
// kAT: A = a^T (then m0 is a multiple of 64), kBT: B = b^T. Part of a group: after wg::fence(),
// before wg::commit(); acc is final after the group's wait and wg_settle.
template <int K, int N, bool kAT, bool kBT>
__device__ __forceinline__ void wg_issue(float (&acc)[N / 8][4], const Tile& a, int m0, int ka0, const Tile& b,
                                         int n0, int kb0) {
  static_assert(K % 16 == 0, "whole k-steps");
  constexpr wg::Major kMajorA = kAT ? wg::Major::kMN : wg::Major::kK;
  constexpr wg::Major kMajorB = kBT ? wg::Major::kK : wg::Major::kMN;
#pragma unroll
  for (int ks = 0; ks < K / 16; ++ks) {
    const int ka = ka0 + 16 * ks, kb = kb0 + 16 * ks;
    const uint64_t da = kAT ? detail::operand(a, ka, m0) : detail::operand(a, m0, ka);
    const uint64_t db = kBT ? detail::operand(b, n0, kb) : detail::operand(b, kb, n0);
    detail::mma_ss<N, kMajorB, kMajorA>(acc, da, db);
  }
}

// Waits for every committed group and pins the accumulators there.
template <class... Acc>
__device__ __forceinline__ void wg_settle(Acc&... acc) {
  wg::wait<0>();
  (detail::fence_operands(acc), ...);
}

// One product, issued and waited for.
template <int K, int N, bool kAT, bool kBT>
__device__ __forceinline__ void wg_tiles(float (&acc)[N / 8][4], const Tile& a, int m0, int ka0, const Tile& b,
                                         int n0, int kb0) {
  wg::fence();
  wg_issue<K, N, kAT, kBT>(acc, a, m0, ka0, b, n0, kb0);
  wg::commit();
  wg_settle(acc);
}

// Issues acc[64 x 64] += A B with this warp's 16 rows of A in registers, a[ks] the A fragments of
// k-step ks (mma.sync's layout: acc_to_a, or weighted_a_fragments), B = b (MN-major) rows kb0..,
// columns n0..; part of a group as wg_issue. The A registers stay unchanged until the wait.
template <int K>
__device__ __forceinline__ void wg_issue_regs(float (&acc)[8][4], const uint32_t (&a)[K / 16][4], const Tile& b,
                                              int n0, int kb0) {
#pragma unroll
  for (int ks = 0; ks < K / 16; ++ks) wg::mma_rs<wg::Major::kMN>(acc, a[ks], detail::operand(b, kb0 + 16 * ks, n0));
}

}  // namespace chunk
}  // namespace lasp
