// The backward's walk over a segment of GLA's chunks (gla/backward.cu, gla/lasp2_backward.cu): the
// reverse recurrence of the state gradient, storing the gradient leaving every chunk.
#pragma once
#include <stdint.h>

#include "lasp/gla/backward_params.h"
#include "lasp/gla/chunk.cuh"

namespace lasp {
namespace gla {

// ---------------------------------------------------------------------------------------------
// The walk: one CTA per (segment, b*H+h) with one warpgroup per 64 columns of Dv, each holding its
// fp32 gradient tile [Dk x 64] in registers; the gate work of a chunk is done once for all of them.
// From the segment's last chunk to its first:
//   store dS_{n+1};  dS <- diag(e^{gamma}) dS + (Q (.) sigma e^{b})^T dO
// Every weight is <= sigma: no chunk is steep here. Packed documents: only rows below the chunk's
// first start reach the state entering it, and a chunk holding a start carries nothing (its decay
// is 0, the segment's log-decay -inf). The store goes through shared memory (the
// chunk's gate tile, read no more by then) so that every global store is a whole 16 bytes of a
// row.
// ---------------------------------------------------------------------------------------------
constexpr int kWalkStages = LASP_GLA_WALK_STAGES;

template <int DK, int DV>
struct WalkLayout {
  static constexpr int kThreads = 128 * (DV / 64);
  static constexpr uint32_t kQ = 0;
  static constexpr uint32_t kDo = kChunk * DK * 2;
  static constexpr uint32_t kGates = kDo + kChunk * DV * 2;
  static constexpr uint32_t kStageBytes = kGates + kChunk * DK * 4;
  static constexpr uint32_t kTotals = kWalkStages * kStageBytes;  // float2 [row block][pair], then e^{gamma}
  static constexpr uint32_t kBytes = kTotals + kThreads * 8;
  static constexpr uint32_t kStagingBlock = DK * 64 * 2;  // a warpgroup's bf16 state tile
  static_assert(kDo % 1024 == 0 && kGates % 1024 == 0 && kStageBytes % 1024 == 0, "tiles stay 1024-byte aligned");
  static_assert(DK * DV * 2 <= kChunk * DK * 4, "the staged state fits in the gate tile");
  static_assert(DK * 4 <= kThreads * 8, "e^{gamma} fits where the scan totals were");
  static __device__ __forceinline__ uint32_t stage(int i) { return (i % kWalkStages) * kStageBytes; }
};

// Walks segment `sg` (of the tensors of `p`: any params struct with GLA's q, d_o, g, scale and
// starts; kPacked: p.starts holds the chunks' start words)
// from its last chunk to its first, from the gradient in `s` (warpgroup `group`'s 64 columns), storing the bf16 gradient leaving each chunk to `store` + chunk * Dk * Dv
// (row-major [Dk, Dv]) unless it is NULL; leaves the gradient entering the segment in `s` and the
// segment's log-decay (this thread's column pair of its gate lane) in `lambda`.
template <int DK, int DV, bool kPacked, class P>
__device__ __forceinline__ void run_walk(const P& p, const Segment& sg, StateRegs<DK>& s, uint16_t* store,
                                         float2& lambda) {
  using L = WalkLayout<DK, DV>;
  constexpr int kThreads = L::kThreads;
  using G = GateLane<DK, kThreads>;
  static_assert(L::kBytes == lasp_gla_walk_smem_bytes(DK, DV), "shared-memory map and host formula disagree");
  extern __shared__ __align__(1024) uint8_t smem[];
  const uint32_t sbase = smem_addr(smem);
  const int tid = threadIdx.x, warp = (tid >> 5) & 3, lane = tid & 31, group = tid >> 7;
  const int64_t row0 = (int64_t)sg.b * sg.T * sg.H + sg.h;  // token 0 of (b, h)
  const int64_t qk_stride = (int64_t)sg.H * DK, v_stride = (int64_t)sg.H * DV;
  const uint16_t* q = p.q + row0 * DK;
  const uint16_t* d_o = p.d_o + row0 * DV;
  const float* gate = p.g + row0 * DK;
  float* decay = reinterpret_cast<float*>(smem + L::kTotals);
  auto chunk_of = [&](int j) { return sg.c_begin + sg.n_chunks - 1 - j; };

  auto issue_step = [&](int j) {
    const uint32_t stage = sbase + L::stage(j);
    const int tok0 = chunk_of(j) * kChunk;
    const int valid = min(kChunk, sg.T - tok0);
    chunk::copy_tile_async<DK / 8, kThreads>(stage + L::kQ, q + tok0 * qk_stride, qk_stride, valid, tid);
    chunk::copy_tile_async<DV / 8, kThreads>(stage + L::kDo, d_o + tok0 * v_stride, v_stride, valid, tid);
    copy_gates_async<DK, kThreads>(stage + L::kGates, gate + tok0 * qk_stride, qk_stride, valid, tid);
  };

  const StateLane ln{16 * warp, lane >> 2, lane & 3};
  const G gl(tid);
#pragma unroll
  for (int j = 0; j < kWalkStages - 1; ++j) {
    if (j < sg.n_chunks) issue_step(j);
    cp_async_commit();
  }
  lambda = make_float2(0.f, 0.f);
  auto words = ChunkStarts::Ahead<kPacked>::first(p.starts, chunk_of(0), sg.n_chunks > 0);
  for (int j = 0; j < sg.n_chunks; ++j) {
    cp_async_wait<kWalkStages - 2>();
    __syncthreads();  // chunk j has landed, for every thread; chunk j-1's e^{gamma} is read
    const uint32_t stage = L::stage(j);
    float* s_gates = reinterpret_cast<float*>(smem + stage + L::kGates);
    float2* totals = reinterpret_cast<float2*>(smem + L::kTotals);
    const ChunkStarts starts = words.next(p.starts, chunk_of(j + 1), j + 1 < sg.n_chunks);
    const int entering_below = starts.first();
    scan_row_block(s_gates, totals, gl);
    __syncthreads();  // every row block's total is written
    const ColumnScan cs = scan_columns(s_gates, totals, gl);
    // Q (.) sigma e^{b} in place, eight rows at a time with their loads first.
    float2 run = cs.before;
    constexpr int kBatch = 8;
    static_assert(G::kRows % kBatch == 0, "whole batches of rows");
#pragma unroll
    for (int i0 = 0; i0 < G::kRows; i0 += kBatch) {
      float2 a[kBatch];
      uint32_t qw[kBatch];
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        const int r = gl.first + i0 + i;
        a[i] = gate_pair<DK>(s_gates, r, gl.pair);
        qw[i] = *reinterpret_cast<const uint32_t*>(smem + stage + L::kQ + gl.tile_offset(r));
      }
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        const int r = gl.first + i0 + i;
        run = add2(run, a[i]);
        *reinterpret_cast<uint32_t*>(smem + stage + L::kQ + gl.tile_offset(r)) =
            scale_bf16x2(qw[i], p.scale * exp_nonpos(run.x), p.scale * exp_nonpos(run.y));
      }
    }
    // Packed documents: rows from the chunk's first start on do not reach the entering state
    // (cleared after the loop, which stays the loop without documents).
    if (kPacked && starts.any()) clear_rows(smem + stage + L::kQ, gl, entering_below, kChunk);
    lambda = starts.any() ? make_float2(-INFINITY, -INFINITY) : add2(lambda, cs.gamma);
    wg::fence_proxy_async();  // the decayed Q visible to wgmma's async proxy
    wg::wait<0>();            // chunk j-1's update is done: s is final, its stage is free
    __syncthreads();          // the decayed Q complete; the gates and the scan totals are read no more
    if (j + kWalkStages - 1 < sg.n_chunks) issue_step(j + kWalkStages - 1);
    cp_async_commit();
    if (gl.first == 0) {
      reinterpret_cast<float2*>(decay)[gl.pair] = starts.any() ? make_float2(0.f, 0.f)
                                                               : make_float2(exp_nonpos(cs.gamma.x), exp_nonpos(cs.gamma.y));
    }
    // The gradient leaving this chunk, as bf16 rows.
    uint8_t* staging = smem + stage + L::kGates;
    if (store) {
      uint8_t* mine = staging + group * L::kStagingBlock;
      for_each_state_pair<DK>(s, ln, [&](float& x0, float& x1, int d, int c) {
        *reinterpret_cast<uint32_t*>(mine + swizzle(d, c / 8, DK) + 4 * ln.t) = pack_bf16x2(x0, x1);
      });
    }
    __syncthreads();  // e^{gamma} and the staged state are written
    if (store) {
      uint16_t* dst = store + (int64_t)chunk_of(j) * DK * DV;
      constexpr int kPieces = DK * DV / 8;  // 16-byte pieces: [warpgroup][row d][8]
      for (int i = tid; i < kPieces; i += kThreads) {
        const int vt = i / (DK * 8), d = (i / 8) % DK, c16 = i % 8;
        *reinterpret_cast<uint4*>(dst + (int64_t)d * DV + vt * 64 + 8 * c16) =
            *reinterpret_cast<const uint4*>(staging + vt * L::kStagingBlock + swizzle(d, c16, DK));
      }
    }
    for_each_state_pair<DK>(s, ln, [&](float& x0, float& x1, int d, int) {
      const float w = decay[d];
      x0 *= w, x1 *= w;
    });
    wg::fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
      for (int mt = 0; mt < DK / 64; ++mt)
        wg::mma_ss<wg::Major::kMN, wg::Major::kMN>(
            s[mt], wg::desc_sw128(sbase + stage + L::kQ + mt * kBlockBytes + kk * kRow16),
            wg::desc_sw128(sbase + stage + L::kDo + group * kBlockBytes + kk * kRow16), true);
    wg::commit();
  }
  wg::wait<0>();
#pragma unroll
  for (int mt = 0; mt < DK / 64; ++mt) wg::fence_operands(s[mt]);
}

// The state lane of this thread in its warpgroup's tile.
__device__ __forceinline__ StateLane walk_lane() {
  const int lane = threadIdx.x & 31;
  return StateLane{16 * (int)((threadIdx.x >> 5) & 3), lane >> 2, lane & 3};
}

}  // namespace gla
}  // namespace lasp
