// The chunks' WY form: (I + L)^{-1} of every chunk, L_rj = beta_r e^{b_r - b_j} (k_r . k_j) strictly
// lower, the part of a chunk's delta rule that does not depend on the state (the forward's kernel
// 1, gated_delta/forward.cu), and for the backward (gated_delta/backward.cu) also W = (I + L)^{-1}
// diag(beta e^b) K.
#pragma once
#include <stdint.h>

#include "lasp/chunk/tile_mma.cuh"
#include "lasp/gated_delta/backward_params.h"
#include "lasp/gated_delta/forward_params.h"
#include "lasp/mma.cuh"
#include "lasp/scalar_decay/chunk.cuh"

namespace lasp {
namespace gdn {

using sd::kChunk;

// The WY kernel (the forward's kernel 1): chunk blockIdx.x of b*H+h = blockIdx.y, two warps. K K^T
// on the tensor cores (warp w: rows 16w.. and 16(w + 2)..), L in fp32 shared memory, then
// (I + L)^{-1} by forward substitution, one column per thread, X[r][c] = [r == c] - sum_{j < r}
// L[r][j] X[j][c], in fp32 and in a fixed order (X[j][c] = 0 for j < c, so the terms above the
// diagonal add exact zeros). The chain of 2016 dependent FMAs per column sets the kernel's time, so
// the CTA is the two warps that substitute: more chunks per SM, no warp idle at the barrier. Virtual
// tokens (past T) have k = 0 and beta = 0: their rows of L are zero and of X the identity's.
//
// kWithW (the backward's WY kernel, gated_delta/backward.cu): then also W = (I + L)^{-1} diag(beta
// e^b) K of the chunk into ws_w [B*H, N*64, Dk], from the bf16 inverse the forward uses.
template <int DK, bool kWithW = false>
__device__ __forceinline__ void run_wy(const lasp_gated_delta_params& p, uint16_t* ws_w = nullptr) {
  constexpr int kPitch = LASP_GDN_TRI_PITCH;
  extern __shared__ __align__(1024) uint8_t smem[];
  const int chunk = blockIdx.x, bh = blockIdx.y;
  const int b = bh / p.H, h = bh % p.H;
  static_assert(LASP_GDN_WY_THREADS == kChunk, "one thread per column of the substitution");
  constexpr int kRowBlocks = kChunk / 16 / (LASP_GDN_WY_THREADS / 32);  // 16-row blocks per warp
  const int tid = threadIdx.x, warp = (tid >> 5) & 1, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int tok0 = chunk * kChunk;
  const int valid = min(kChunk, p.T - tok0);
  const int64_t row0 = ((int64_t)b * p.T + tok0) * p.H + h;  // token tok0 of (b, h) in [B, T, H]

  const uint32_t sK = smem_addr(smem);
  float* s_gates = reinterpret_cast<float*>(smem + kChunk * DK * 2);
  float* s_beta = s_gates + kChunk;
  float* s_l = s_beta + kChunk;
  // The loader is written for a 128-thread CTA: each thread plays two of its threads.
  sd::copy_tile_async<DK / 8>(sK, p.k + row0 * DK, (int64_t)p.H * DK, valid, tid);
  sd::copy_tile_async<DK / 8>(sK, p.k + row0 * DK, (int64_t)p.H * DK, valid, tid + LASP_GDN_WY_THREADS);
  cp_async_commit();
  if (tid < kChunk) {
    const bool ok = tid < valid;
    s_gates[tid] = ok ? p.g[row0 + (int64_t)tid * p.H] : 0.f;
    s_beta[tid] = ok ? p.beta[row0 + (int64_t)tid * p.H] : 0.f;
  }
  cp_async_wait<0>();
  __syncthreads();

  // K K^T, 16 rows and all 64 columns at a time (the loop's Q K^T with K in Q's place): row block
  // rb = warp + 2 i of the chunk.
#pragma unroll
  for (int i = 0; i < kRowBlocks; ++i) {
    const int rb = warp + 2 * i;
    const sd::FragOffsets<DK> off(rb, lane);
    float kk[8][4] = {};
#pragma unroll
    for (int ks = 0; ks < DK / 16; ++ks) {
      uint32_t ka[4];
      sd::row_fragment<DK>(ka, sK, off, ks);
      sd::times_keys_step<DK>(kk, ka, sK, off, ks);
    }
    const sd::ChunkGates cg = sd::scan_gates(s_gates, rb, lane);
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = 16 * rb + 8 * hh + g;
      const float beta_r = s_beta[r];
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int j = 8 * nt + 2 * t + e;
          s_l[r * kPitch + j] =
              j < r ? beta_r * chunk::exp_nonpos(cg.row[hh] - cg.col[nt][e]) * kk[nt][2 * hh + e] : 0.f;
        }
    }
  }
  __syncthreads();

  {
    const int c = tid;
    float x[kChunk];
#pragma unroll
    for (int r = 0; r < kChunk; ++r) {
      float acc = r == c ? 1.f : 0.f;
#pragma unroll
      for (int j = 0; j < r; ++j) acc = fmaf(-s_l[r * kPitch + j], x[j], acc);
      x[r] = acc;
    }
    // Row r of the tile: the 64 threads write its 64 consecutive elements.
    uint16_t* dst = p.ws_tri + ((int64_t)bh * lasp_gdn_num_chunks(p.T) + chunk) * kChunk * kChunk + c;
#pragma unroll
    for (int r = 0; r < kChunk; ++r) dst[r * kChunk] = static_cast<uint16_t>(pack_bf16x2(x[r], 0.f) & 0xffffu);
    if constexpr (kWithW) {
      uint8_t* x_tile = smem + lasp_gdn_bwd_wy_tri_offset(DK);
#pragma unroll
      for (int r = 0; r < kChunk; ++r)
        *reinterpret_cast<uint16_t*>(x_tile + swizzle(r, c / 8, kChunk) + 2 * (c % 8)) =
            static_cast<uint16_t>(pack_bf16x2(x[r], 0.f) & 0xffffu);
    }
  }
  if constexpr (kWithW) {
    __syncthreads();  // the inverse's tile is complete and L is read: its space holds the row weights
    float* s_row_weight = s_l;
#pragma unroll
    for (int i = 0; i < kRowBlocks; ++i) {
      const sd::ChunkGates cg = sd::scan_gates(s_gates, warp + 2 * i, lane);
      if (t == 0) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int r = 16 * (warp + 2 * i) + 8 * hh + g;
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
#pragma unroll 1
    for (int i = 0; i < kRowBlocks; ++i) {
      const int m0 = 16 * (warp + 2 * i);
      float w[DK / 8][4] = {};
      chunk::mma_tiles<kChunk, DK, false, false>(w, inverse, m0, 0, weighted_keys, 0, 0, lane);
      chunk::for_each_acc_pair<DK>(w, m0, 0, lane, [&](float& x0, float& x1, int r, int col) {
        *reinterpret_cast<uint32_t*>(w_rows + r * DK + col) = pack_bf16x2(x0, x1);
      });
    }
  }
}

}  // namespace gdn
}  // namespace lasp
