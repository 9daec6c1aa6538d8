// Warp-level products of bf16 tiles in shared memory (mma.sync m16n8k16, fp32 accumulate), with
// either operand taken as stored or transposed, each product one call (the WY kernel's W), and the
// register fragments and accumulator walks the warpgroup products of tile_wgmma.cuh share (the
// chunkwise backward multiplies the same tiles in every orientation: dO u^T, A^T dW, dP^T Q, ...).
//
// A tile is `rows` x (64 * blocks) bf16 in the swizzled layout of lasp::swizzle (column blocks of
// rows x 128 bytes), 128-byte aligned: what chunk::copy_tile_async writes for [64 x D] token tiles,
// and, for a [D x 64] state tile, D/64 such tiles one after the other.
//
// A warp computes acc[16 x N] += A[m0.., k] B[k, n0..] over K; the accumulator element (row
// m0 + g + 8 hh, column n0 + 8 nt + 2 t + e) is acc[nt][2 hh + e] (g = lane / 4, t = lane % 4).
#pragma once
#include <stdint.h>

#include "lasp/mma.cuh"

namespace lasp {
namespace chunk {

struct Tile {
  uint32_t base;  // shared address
  int rows;
  // Shared address of 16-byte chunk `chunk` (columns 8 chunk..) of row `row`.
  __device__ __forceinline__ uint32_t at(int row, int chunk) const { return base + swizzle(row, chunk, rows); }
};

// The lane's roles in an ldmatrix.x4: row (lane & 7) of matrix lane / 8, whose bits b3 and b4 pick
// the matrix's 8-row block or 16-byte chunk.
struct LdsmLane {
  int row, b3, b4;
  __device__ __forceinline__ explicit LdsmLane(int lane) : row(lane & 7), b3((lane >> 3) & 1), b4(lane >> 4) {}
  // Shared address of row row0 + this lane's row, chunk chunk0 + bit (row0 % 8 == 0, chunk0 even):
  // then the swizzle's (chunk ^ row) & 7 is (chunk0 & 7) ^ (bit ^ row), a per-lane value XOR a value
  // the caller's unrolled loops know, instead of a sum to swizzle at every load.
  __device__ __forceinline__ uint32_t at(const Tile& t, int row0, int chunk0, int bit) const {
    return t.base + (chunk0 >> 3) * t.rows * 128 + (row0 + row) * 128 + (((chunk0 & 7) ^ bit ^ row) << 4);
  }
};

// A fragment (16 x 16) at rows m0, k-columns k0 (both multiples of 16): A = T (kTransposed:
// A[m][k] = T[k][m]).
template <bool kTransposed>
__device__ __forceinline__ void a_fragment(uint32_t (&a)[4], const Tile& t, int m0, int k0, const LdsmLane& l) {
  if constexpr (kTransposed)
    ldsm_x4_trans(a, l.at(t, k0 + 8 * l.b4, m0 / 8, l.b3));
  else
    ldsm_x4(a, l.at(t, m0 + 8 * l.b3, k0 / 8, l.b4));
}

// B fragments of two n-tiles (n0.., n0 + 8..) at k-rows k0 (multiples of 16): B = T (kTransposed:
// B[k][n] = T[n][k]). b[0], b[1] are n-tile n0's registers, b[2], b[3] n-tile n0 + 8's.
template <bool kTransposed>
__device__ __forceinline__ void b_fragments(uint32_t (&b)[4], const Tile& t, int n0, int k0, const LdsmLane& l) {
  if constexpr (kTransposed)
    ldsm_x4(b, l.at(t, n0 + 8 * l.b4, k0 / 8, l.b3));
  else
    ldsm_x4_trans(b, l.at(t, k0 + 8 * l.b3, n0 / 8, l.b4));
}

// acc += a_frag B[k0.., n0..n0 + N) for one 16-deep k-step.
template <int N, bool kBT>
__device__ __forceinline__ void mma_step(float (&acc)[N / 8][4], const uint32_t (&a)[4], const Tile& b, int n0, int k0,
                                         const LdsmLane& l) {
#pragma unroll
  for (int np = 0; np < N / 16; ++np) {
    uint32_t bf[4];
    b_fragments<kBT>(bf, b, n0 + 16 * np, k0, l);
    mma_bf16(acc[2 * np], a, bf[0], bf[1]);
    mma_bf16(acc[2 * np + 1], a, bf[2], bf[3]);
  }
}

// acc[16 x N] += op(a)[m0.., ka0..ka0 + K) op(b)[kb0..kb0 + K, n0..n0 + N).
template <int K, int N, bool kAT, bool kBT>
__device__ __forceinline__ void mma_tiles(float (&acc)[N / 8][4], const Tile& a, int m0, int ka0, const Tile& b,
                                          int n0, int kb0, int lane) {
  static_assert(K % 16 == 0 && N % 16 == 0, "whole 16 x 16 fragments");
  const LdsmLane l(lane);
#pragma unroll
  for (int ks = 0; ks < K / 16; ++ks) {
    uint32_t af[4];
    a_fragment<kAT>(af, a, m0, ka0 + 16 * ks, l);
    mma_step<N, kBT>(acc, af, b, n0, kb0 + 16 * ks, l);
  }
}

// The A fragments of op(a)[m0.., ka0..ka0 + K) (this warp's 16 rows), A's column k scaled by w(k)
// in fp32 before rounding to bf16: wk[ks] holds the weights of this lane's k indices in k-step
// ks, {2t, 2t + 1, 2t + 8, 2t + 9}.
template <int K, bool kAT>
__device__ __forceinline__ void weighted_a_fragments(uint32_t (&af)[K / 16][4], const Tile& a, int m0, int ka0,
                                                     const float (&wk)[K / 16][4], int lane) {
  const LdsmLane l(lane);
#pragma unroll
  for (int ks = 0; ks < K / 16; ++ks) {
    a_fragment<kAT>(af[ks], a, m0, ka0 + 16 * ks, l);
    af[ks][0] = scale_bf16x2(af[ks][0], wk[ks][0], wk[ks][1]);
    af[ks][1] = scale_bf16x2(af[ks][1], wk[ks][0], wk[ks][1]);
    af[ks][2] = scale_bf16x2(af[ks][2], wk[ks][2], wk[ks][3]);
    af[ks][3] = scale_bf16x2(af[ks][3], wk[ks][2], wk[ks][3]);
  }
}

// The A fragments of k-step ks of a 16 x 64 accumulator (its n-tiles 2 ks, 2 ks + 1), rounded to
// bf16: the accumulator layout of two n-tiles is the A layout of one k-step.
__device__ __forceinline__ void acc_to_a(uint32_t (&a)[4][4], const float (&acc)[8][4]) {
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) a[nt >> 1][(nt & 1) * 2 + hh] = pack_bf16x2(acc[nt][2 * hh], acc[nt][2 * hh + 1]);
}

// f(x0, x1, row, col) for every accumulator pair (columns col, col + 1) the lane holds.
template <int N, class F>
__device__ __forceinline__ void for_each_acc_pair(float (&acc)[N / 8][4], int m0, int n0, int lane, F&& f) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int nt = 0; nt < N / 8; ++nt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) f(acc[nt][2 * hh], acc[nt][2 * hh + 1], m0 + g + 8 * hh, n0 + 8 * nt + 2 * t);
}

// The bf16 pair at (row, col), col even, of a tile.
__device__ __forceinline__ uint32_t& tile_pair(uint8_t* smem, uint32_t smem_base, const Tile& t, int row, int col) {
  return *reinterpret_cast<uint32_t*>(smem + (t.at(row, col / 8) - smem_base) + 2 * (col % 8));
}

// sum over this lane's columns of acc * T (same positions), reduced over the quad: the lane's rows'
// dot products over columns n0..n0 + N (rows m0 + g, m0 + g + 8).
template <int N>
__device__ __forceinline__ float2 row_dots(const float (&acc)[N / 8][4], uint8_t* smem, uint32_t smem_base,
                                           const Tile& t, int m0, int n0, int lane) {
  const int g = lane >> 2, tq = lane & 3;
  float sum[2] = {0.f, 0.f};
#pragma unroll
  for (int nt = 0; nt < N / 8; ++nt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const uint32_t y = tile_pair(smem, smem_base, t, m0 + g + 8 * hh, n0 + 8 * nt + 2 * tq);
      sum[hh] += acc[nt][2 * hh] * __uint_as_float(y << 16) + acc[nt][2 * hh + 1] * __uint_as_float(y & 0xffff0000u);
    }
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    sum[hh] += __shfl_xor_sync(0xffffffffu, sum[hh], 1);
    sum[hh] += __shfl_xor_sync(0xffffffffu, sum[hh], 2);
  }
  return make_float2(sum[0], sum[1]);
}

}  // namespace chunk
}  // namespace lasp
