// The chunks' WY form: (I + L)^{-1} of every chunk, L_rj = beta_r e^{b_r - b_j} (k_r . k_j) strictly
// lower, the part of a chunk's delta rule that does not depend on the state (the forward's kernel
// 1, gated_delta/forward.cu), and for the backward (gated_delta/backward.cu) also W = (I + L)^{-1}
// diag(beta e^b) K.
#pragma once
#include <stdint.h>

#include "lasp/chunk/tile_mma.cuh"
#include "lasp/gated_delta/backward_params.h"
#include "lasp/gated_delta/forward_params.h"
#include "lasp/gated_delta/tri_inverse.cuh"
#include "lasp/mma.cuh"
#include "lasp/scalar_decay/chunk.cuh"

namespace lasp {
namespace gdn {

using sd::kChunk;

// The WY kernel (the forward's kernel 1): chunk blockIdx.x of b*H+h = blockIdx.y, four warps, one per
// row block I (rows 16I..16I+15) of the chunk's N = -L and of X = (I + L)^{-1} = (I - N)^{-1}. Each
// warp runs the code of its own row block (wy_row_block<DK, I>), so that every index into a fragment
// array is a constant, and the warps meet at four named barriers (barrier.sync, not the .aligned
// form: each warp arrives from its own instructions), the same four in every row block. In order:
//
//   1. row block I: K K^T of its rows against the keys 0..16I+15 (the blocks on or left of the
//      diagonal) on the tensor cores, then N_rj = (-beta_r) e^{b_r - b_j} (k_r . k_j) for j < r, else
//      0, in fp32, kept in registers, and its diagonal block N_II stored row-major in the diagonal
//      square I of xt (fp32 X^T, lasp/gated_delta/tri_inverse.cuh);                       barrier 1
//   2. row blocks 0 and 1, lane l: D_k = (I - N_kk)^{-1} of block k = 2I + l / 16, column l % 16, by
//      forward substitution (x_r = [r == c] + sum_{j < r} N_kk[r][j] x_j, j ascending), written over
//      its square as D_k^T (tri::diagonal_block); row blocks 1, 2, 3 split their N_{I,k}, k < I, into
//      tf32 pairs;                                                                         barrier 2
//   3. level d = 1, 2, 3, barriers 3 and 4 between them: row block I >= d computes X_{I,J}, J = I - d,
//      S = sum_{k=J}^{I-1} N_{I,k} X_{k,J} (k ascending), then X_{I,J} = D_I S, both in 3xTF32 on the
//      tensor cores, each in one accumulator and a fixed order (tri::off_diagonal_block), into xt;
//   4. __syncthreads, then every thread rounds 32 elements of X to bf16 into ws_tri (the blocks above
//      the diagonal as zeros).
// Every sum has a fixed order and nothing is atomic: the same inputs give the same bits, in the
// forward and in the backward's WY kernel alike. The chunk's inverse is 120 FMAs in each of 64 lanes
// and 16 block products of 16 x 16 x 16 (12 mma.sync each), where a substitution of whole columns
// runs 2016 dependent FMAs in each of 64 threads. Virtual tokens (past T) have k = 0 and beta = 0:
// their rows of N are zero and of X the identity's.
//
// The row blocks' work grows with I (row block 3's about twice row block 0's), and a CTA's warp w
// usually issues from scheduler w % 4 of its SM: row block I runs in warp (I - chunk) mod 4, so the
// CTAs on an SM spread the heavy row blocks over its schedulers.
//
// kWithW (the backward's WY kernel, gated_delta/backward.cu): then also W = (I + L)^{-1} diag(beta
// e^b) K of the chunk into ws_w [B*H, N*64, Dk], from the bf16 inverse the forward uses.
constexpr int kWyBarrier = 1;  // the row blocks' named barrier (0 is __syncthreads)

template <int DK, int I>
__device__ __forceinline__ void wy_row_block(uint32_t sK, const float* s_gates, const float* s_beta, float* xt,
                                             int lane) {
  using F = sd::FragOffsets<DK>;
  constexpr int kTiles = 2 * (I + 1);  // n-tiles of the key columns 0..16I+15
  const int g = lane >> 2, t = lane & 3;

  // K K^T of rows 16I.. (the loop's Q K^T with K in Q's place), n-tile pairs 0..I.
  float acc[kTiles][4] = {};
  {
    const F off(I, lane);
#pragma unroll 4  // whole periods of FragOffsets (ks & 3 a constant); at Dk = 128 two passes, which
                  // hold fewer fragments in flight: fewer registers
    for (int ks = 0; ks < DK / 16; ++ks) {
      uint32_t ka[4];
      sd::row_fragment<DK>(ka, sK, off, ks);
#pragma unroll
      for (int np = 0; np <= I; ++np) {
        uint32_t kb[4];
        ldsm_x4(kb, sK + off.k[ks & 3] + F::kBlockBytes * (ks >> 2) + np * F::kRow16);
        mma_bf16(acc[2 * np], ka, kb[0], kb[1]);
        mma_bf16(acc[2 * np + 1], ka, kb[2], kb[3]);
      }
    }
  }
  // N = -L in place; only the diagonal block has columns j >= r.
  const sd::ChunkGates cg = sd::scan_gates(s_gates, I, lane);
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int r = 16 * I + 8 * hh + g;
    const float neg_beta = -s_beta[r];
#pragma unroll
    for (int nt = 0; nt < kTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int j = 8 * nt + 2 * t + e;
        const float n = neg_beta * chunk::exp_nonpos(cg.row[hh] - cg.col[nt][e]) * acc[nt][2 * hh + e];
        acc[nt][2 * hh + e] = nt < 2 * I || j < r ? n : 0.f;
      }
  }
#pragma unroll
  for (int nl = 0; nl < 2; ++nl)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh)
      *reinterpret_cast<float2*>(xt + (16 * I + 8 * hh + g) * tri::kPitch + 16 * I + 8 * nl + 2 * t) =
          make_float2(acc[2 * I + nl][2 * hh], acc[2 * I + nl][2 * hh + 1]);
  named_barrier_sync(kWyBarrier, LASP_GDN_WY_THREADS);  // 1: every diagonal square holds its N_kk

  if constexpr (I < 2) tri::diagonal_block(xt, 2 * I + (lane >> 4), lane & 15);
  if constexpr (I == 0) {
    named_barrier_sync(kWyBarrier, LASP_GDN_WY_THREADS);  // 2
    named_barrier_sync(kWyBarrier, LASP_GDN_WY_THREADS);  // 3
    named_barrier_sync(kWyBarrier, LASP_GDN_WY_THREADS);  // 4
  } else {
    tri::FragB n[I][2][2];
    tri::lower_fragments<I>(n, acc);
    named_barrier_sync(kWyBarrier, LASP_GDN_WY_THREADS);  // 2: every D_k^T is in xt
    tri::FragB d[2][2];
    tri::diagonal_fragments(d, xt, I, g, t);
    tri::off_diagonal_block<I, I - 1>(xt, n, d, g, t);
    named_barrier_sync(kWyBarrier, LASP_GDN_WY_THREADS);  // 3: level 1 is in xt
    if constexpr (I >= 2) tri::off_diagonal_block<I, I - 2>(xt, n, d, g, t);
    named_barrier_sync(kWyBarrier, LASP_GDN_WY_THREADS);  // 4: level 2 is in xt
    if constexpr (I >= 3) tri::off_diagonal_block<I, I - 3>(xt, n, d, g, t);
  }
}

template <int DK, bool kWithW = false>
__device__ __forceinline__ void run_wy(const lasp_gated_delta_params& p, uint16_t* ws_w = nullptr) {
  constexpr int kPitch = tri::kPitch;
  extern __shared__ __align__(1024) uint8_t smem[];
  const int chunk = blockIdx.x, bh = blockIdx.y;
  const int b = bh / p.H, h = bh % p.H;
  static_assert(LASP_GDN_WY_THREADS == 4 * 32 && kChunk == 64, "one warp per 16-row block of the chunk");
  static_assert(LASP_GDN_WY_THREADS == LASP_SD_THREADS, "the tile loader's CTA size");
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int tok0 = chunk * kChunk;
  const int valid = min(kChunk, p.T - tok0);
  const int64_t row0 = ((int64_t)b * p.T + tok0) * p.H + h;  // token tok0 of (b, h) in [B, T, H]

  const uint32_t sK = smem_addr(smem);
  float* s_gates = reinterpret_cast<float*>(smem + kChunk * DK * 2);
  float* s_beta = s_gates + kChunk;
  float* xt = s_beta + kChunk;
  sd::copy_tile_async<DK / 8>(sK, p.k + row0 * DK, (int64_t)p.H * DK, valid, tid);
  cp_async_commit();
  if (tid < kChunk) {
    const bool ok = tid < valid;
    s_gates[tid] = ok ? p.g[row0 + (int64_t)tid * p.H] : 0.f;
    s_beta[tid] = ok ? p.beta[row0 + (int64_t)tid * p.H] : 0.f;
  }
  cp_async_wait<0>();
  __syncthreads();

  switch ((warp + chunk) & 3) {  // the row block
    case 0:
      wy_row_block<DK, 0>(sK, s_gates, s_beta, xt, lane);
      break;
    case 1:
      wy_row_block<DK, 1>(sK, s_gates, s_beta, xt, lane);
      break;
    case 2:
      wy_row_block<DK, 2>(sK, s_gates, s_beta, xt, lane);
      break;
    default:
      wy_row_block<DK, 3>(sK, s_gates, s_beta, xt, lane);
      break;
  }
  __syncthreads();

  // The tile in bf16, 16 bytes (8 columns) at a time: thread tid takes row r = tid % 64, column
  // chunks 2q + tid / 64, so the lanes of a warp read 32 consecutive floats of xt's rows. Block
  // column q > r / 16 lies above the diagonal: zeros (xt's floats there are never written).
  {
    const int r = tid & (kChunk - 1);
    uint16_t* dst = p.ws_tri + (((int64_t)bh * lasp_gdn_num_chunks(p.T) + chunk) * kChunk + r) * kChunk;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int c8 = 2 * q + (tid >> 6);
      const float* col = xt + 8 * c8 * kPitch + r;
      const bool above = q > r / 16;
      uint4 v;
      v.x = above ? 0u : pack_bf16x2(col[0], col[kPitch]);
      v.y = above ? 0u : pack_bf16x2(col[2 * kPitch], col[3 * kPitch]);
      v.z = above ? 0u : pack_bf16x2(col[4 * kPitch], col[5 * kPitch]);
      v.w = above ? 0u : pack_bf16x2(col[6 * kPitch], col[7 * kPitch]);
      st_global_16(dst + 8 * c8, v);
      if constexpr (kWithW)
        *reinterpret_cast<uint4*>(smem + lasp_gdn_bwd_wy_tri_offset(DK) + swizzle(r, c8, kChunk)) = v;
    }
  }
  if constexpr (kWithW) {
    __syncthreads();  // the inverse's tile is complete and xt is read: its space holds the row weights
    float* s_row_weight = xt;
    {
      const sd::ChunkGates cg = sd::scan_gates(s_gates, warp, lane);
      if (t == 0) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int r = 16 * warp + 8 * hh + g;
          s_row_weight[r] = s_beta[r] * chunk::exp_nonpos(cg.row[hh]);
        }
      }
    }
    __syncthreads();
    // K <- diag(beta e^b) K in place, 16 bytes at a time.
    for (int idx = tid; idx < kChunk * DK / 8; idx += LASP_GDN_WY_THREADS) {
      const int r = idx / (DK / 8), c16 = idx % (DK / 8);
      uint4* at = reinterpret_cast<uint4*>(smem + swizzle(r, c16, kChunk));
      uint4 x = *at;
      const float w = s_row_weight[r];
      x.x = scale_bf16x2(x.x, w, w), x.y = scale_bf16x2(x.y, w, w);
      x.z = scale_bf16x2(x.z, w, w), x.w = scale_bf16x2(x.w, w, w);
      *at = x;
    }
    __syncthreads();
    const chunk::Tile inverse{sK + lasp_gdn_bwd_wy_tri_offset(DK), kChunk}, weighted_keys{sK, kChunk};
    uint16_t* w_rows = ws_w + ((int64_t)bh * lasp_gdn_num_chunks(p.T) + chunk) * kChunk * DK;
    const int m0 = 16 * warp;
    float w[DK / 8][4] = {};
    chunk::mma_tiles<kChunk, DK, false, false>(w, inverse, m0, 0, weighted_keys, 0, 0, lane);
    chunk::for_each_acc_pair<DK>(w, m0, 0, lane, [&](float& x0, float& x1, int r, int col) {
      *reinterpret_cast<uint32_t*>(w_rows + r * DK + col) = pack_bf16x2(x0, x1);
    });
  }
}

}  // namespace gdn
}  // namespace lasp
