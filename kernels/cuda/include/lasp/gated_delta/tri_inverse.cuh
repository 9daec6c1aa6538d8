// The steps of the WY kernel's blocked (I - N)^{-1} (lasp/gated_delta/wy.cuh), N = -L strictly lower
// [64 x 64] in fp32, in 4 x 4 blocks of 16 x 16: the diagonal blocks D_k = (I - N_kk)^{-1} by forward
// substitution on CUDA cores, the blocks below them by block products on the tensor cores in
// 3xTF32 (about fp32's accuracy; a single tf32 product would round its operands to 11 bits).
// Subscripts I, J, k are block indices; I alone is the identity.
//
// The result lives in shared memory as X^T in fp32: xt[c * kPitch + r] = X[r][c]. kPitch = 72 floats
// puts consecutive rows 8 banks apart, so the block products' 64-bit fragment accesses are
// conflict-free: a half-warp's accesses at xt[(c0 + g) * kPitch + r0 + 2t], g, t < 4, cover the 32
// banks once. Before the substitution, the diagonal square of block k (xt rows and columns
// 16k..16k+15) holds N_kk row-major instead.
//
// Every product uses k-permuted fragments: k-slot t of an m16n8k8 fragment holds k index 2t, and
// slot t + 4 holds 2t + 1, in A and B alike, which leaves the product unchanged and lines the
// fragments up with the accumulator layout (lasp/mma.cuh):
//   A: a0 = A[g][2t], a1 = A[g+8][2t], a2 = A[g][2t+1], a3 = A[g+8][2t+1]: the accumulator of an
//      n-tile (c0, c1, c2, c3) read as (a0, a2, a1, a3);
//   B: b0 = B[2t][g], b1 = B[2t+1][g]: two adjacent floats of a row of B^T.
// So an accumulator is the next product's A with no shuffle, and an A operand whose rows (or a B
// operand whose columns) are rows of xt is read 64 bits at a time.
#pragma once
#include <stdint.h>

#include "lasp/gated_delta/forward_params.h"
#include "lasp/mma.cuh"

namespace lasp {
namespace gdn {
namespace tri {

constexpr int kPitch = LASP_GDN_TRI_PITCH;
static_assert(kPitch >= 64 && kPitch % 32 == 8, "xt's rows: 64 floats, 8 banks apart");

// Operands in 3xTF32: x = hi + lo with hi = tf32(x) and lo = tf32(x - hi) (x - hi is exact), so
// hi + lo carries 22 of fp32's 24 significant bits.
struct FragA {
  uint32_t hi[4], lo[4];
};
struct FragB {
  uint32_t hi[2], lo[2];
};

__device__ __forceinline__ void split(float x, uint32_t& hi, uint32_t& lo) {
  hi = tf32_rn(x);
  lo = tf32_rn(x - __uint_as_float(hi));
}

__device__ __forceinline__ FragA split_a(float a0, float a1, float a2, float a3) {
  FragA f;
  split(a0, f.hi[0], f.lo[0]);
  split(a1, f.hi[1], f.lo[1]);
  split(a2, f.hi[2], f.lo[2]);
  split(a3, f.hi[3], f.lo[3]);
  return f;
}

__device__ __forceinline__ FragB split_b(float b0, float b1) {
  FragB f;
  split(b0, f.hi[0], f.lo[0]);
  split(b1, f.hi[1], f.lo[1]);
  return f;
}

// acc += A B: A_lo B_hi, A_hi B_lo, then A_hi B_hi, in this order into the one accumulator (A_lo B_lo,
// below 2^-22 of the product, left out).
__device__ __forceinline__ void mma_3xtf32(float (&acc)[4], const FragA& a, const FragB& b) {
  mma_tf32(acc, a.lo, b.hi[0], b.hi[1]);
  mma_tf32(acc, a.hi, b.lo[0], b.lo[1]);
  mma_tf32(acc, a.hi, b.hi[0], b.hi[1]);
}

// D_k = (I - N_kk)^{-1}, column c of diagonal block k (the lane's), by forward substitution in fp32:
// x_r = [r == c] + sum_{j < r} N_kk[r][j] x_j, j ascending (x_j = 0 for j < c, so those terms add
// exact zeros), 120 FMAs in chains of at most 15. N_kk's rows are read from the block's square, four
// floats at a time; once the whole warp has read them, D_k^T is written over the square (xt[16k + c]
// [16k + r] = D_k[r][c]). A warp's half-warps take two adjacent blocks, whose squares lie 16 banks
// apart: the broadcast reads of N never conflict.
__device__ __forceinline__ void diagonal_block(float* xt, int k, int c) {
  const float* square = xt + 16 * k * (kPitch + 1);
  float x[16];
#pragma unroll
  for (int r = 0; r < 16; ++r) {
    float acc = r == c ? 1.f : 0.f;
#pragma unroll
    for (int j4 = 0; j4 < (r + 3) / 4; ++j4) {
      const float4 n4 = *reinterpret_cast<const float4*>(square + r * kPitch + 4 * j4);
      const float n[4] = {n4.x, n4.y, n4.z, n4.w};
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (4 * j4 + e < r) acc = fmaf(n[e], x[4 * j4 + e], acc);
    }
    x[r] = acc;
  }
  __syncwarp();
  float4* column = reinterpret_cast<float4*>(xt + (16 * k + c) * kPitch + 16 * k);
#pragma unroll
  for (int q = 0; q < 4; ++q) column[q] = make_float4(x[4 * q], x[4 * q + 1], x[4 * q + 2], x[4 * q + 3]);
}

// The B fragments of N_{I,k}^T, k < I, from the lane's accumulator of row block I of N
// (acc[nt][2 hh + e] = N[16 I + 8 hh + g][8 nt + 2 t + e]): k-step ks of block k, n-tile nn is
// b0 = N[16 I + 8 nn + g][16 k + 8 ks + 2 t] = acc[2 k + ks][2 nn], b1 its right neighbour.
template <int I, int NT>
__device__ __forceinline__ void lower_fragments(FragB (&n)[I][2][2], const float (&acc)[NT][4]) {
  static_assert(NT >= 2 * I, "the accumulator covers the blocks left of the diagonal");
#pragma unroll
  for (int k = 0; k < I; ++k)
#pragma unroll
    for (int ks = 0; ks < 2; ++ks)
#pragma unroll
      for (int nn = 0; nn < 2; ++nn) n[k][ks][nn] = split_b(acc[2 * k + ks][2 * nn], acc[2 * k + ks][2 * nn + 1]);
}

// The B fragments of D_I^T from xt: k-step ks, n-tile nn is b0 = D_I[8 nn + g][8 ks + 2 t] =
// xt[16 I + 8 ks + 2 t][16 I + 8 nn + g], b1 = D_I[8 nn + g][8 ks + 2 t + 1]. Read once per warp.
__device__ __forceinline__ void diagonal_fragments(FragB (&d)[2][2], const float* xt, int i, int g, int t) {
  const float* square = xt + 16 * i * (kPitch + 1);
#pragma unroll
  for (int ks = 0; ks < 2; ++ks)
#pragma unroll
    for (int nn = 0; nn < 2; ++nn) {
      const float* at = square + (8 * ks + 2 * t) * kPitch + 8 * nn + g;
      d[ks][nn] = split_b(at[0], at[kPitch]);
    }
}

// X_{I,J}, J < I, by the warp of row block I once X_{k,J} (J <= k < I) are in xt: S = sum_{k=J}^{I-1} N_{I,k} X_{k,J}
// (k ascending, then k-step, each step in mma_3xtf32's order), then X_{I,J} = D_I S, both as their
// transposes, S^T = sum_k X_{k,J}^T N_{I,k}^T and X_{I,J}^T = S^T D_I^T (m: X's column in block J,
// n: its row in block I): X_{k,J}^T's A fragments are rows of xt, N_{I,k}^T's B fragments come from
// the lane's registers (lower_fragments), S^T's accumulator is the second product's A, and D_I^T's B
// fragments come from diagonal_fragments. X_{I,J}^T goes into xt, 64 bits per row and n-tile.
template <int I, int J>
__device__ __forceinline__ void off_diagonal_block(float* xt, const FragB (&n)[I][2][2], const FragB (&d)[2][2],
                                                   int g, int t) {
  static_assert(0 <= J && J < I && I < 4, "a block below the diagonal");
  float s[2][4] = {};
#pragma unroll
  for (int k = J; k < I; ++k)
#pragma unroll
    for (int ks = 0; ks < 2; ++ks) {
      // A[m][kk] = X[16 k + kk][16 J + m]: rows 16 J + g and 16 J + g + 8 of xt.
      const float* at = xt + (16 * J + g) * kPitch + 16 * k + 8 * ks + 2 * t;
      const float2 upper = *reinterpret_cast<const float2*>(at);
      const float2 lower = *reinterpret_cast<const float2*>(at + 8 * kPitch);
      const FragA a = split_a(upper.x, lower.x, upper.y, lower.y);
#pragma unroll
      for (int nn = 0; nn < 2; ++nn) mma_3xtf32(s[nn], a, n[k][ks][nn]);
    }
  float x[2][4] = {};
#pragma unroll
  for (int ks = 0; ks < 2; ++ks) {
    const FragA a = split_a(s[ks][0], s[ks][2], s[ks][1], s[ks][3]);
#pragma unroll
    for (int nn = 0; nn < 2; ++nn) mma_3xtf32(x[nn], a, d[ks][nn]);
  }
#pragma unroll
  for (int nn = 0; nn < 2; ++nn) {
    float* at = xt + (16 * J + g) * kPitch + 16 * I + 8 * nn + 2 * t;
    *reinterpret_cast<float2*>(at) = make_float2(x[nn][0], x[nn][1]);
    *reinterpret_cast<float2*>(at + 8 * kPitch) = make_float2(x[nn][2], x[nn][3]);
  }
}

}  // namespace tri
}  // namespace gdn
}  // namespace lasp
