// Gated DeltaNet's values step: what turns scalar decay's output loop (lasp::sd::run_segment_with)
// into the delta rule's. Per chunk, before the loop's products, the V tile is rewritten with
//   u = (I + L)^{-1} R,   R = diag(beta) (V - diag(e^b) K S_n),
// each token's error against the chunk's start state, corrected for the chunk's earlier tokens
// (kernels/docs/gated-delta.md); the products then give O and S_{n+1} from u as scalar decay's do
// from V. (I + L)^{-1} depends on K, the gates and beta only: the WY kernel (gated_delta/forward.cu)
// computes it for every chunk beforehand, and this step streams it in with the chunk.
//
// One warp per 16 rows of the chunk, as in the loop: K S_n for its rows (mma.sync, A = K, B = the
// loop's bf16 copy of S_n), R for its rows into a bf16 tile of V's layout, a barrier, u for its rows
// from all of R (A = (I + L)^{-1}, B = R), u over its V rows, a barrier that publishes the tile to
// the loop's products (through the async proxy where they are wgmma).
#pragma once
#include <stdint.h>

#include "lasp/gated_delta/forward_params.h"
#include "lasp/scalar_decay/chunk.cuh"

namespace lasp {
namespace gdn {

using sd::kChunk;
using sd::kStages;

// Shared memory of the values step, after the loop's own (with Q: the output kernel's,
// lasp_gdn_output_smem_bytes; without: the summary kernel's, lasp_gdn_summary_smem_bytes): kStages
// tiles of (I + L)^{-1} (bf16 [64 x 64], the swizzled layout, K-major as an A operand), one tile of
// R (V's layout), kStages x 64 betas (fp32).
template <int DK, bool kWithQ>
struct ValuesLayout {
  static constexpr int kDepth = kStages;  // slots of the tiles and betas: one per stage
  static constexpr uint32_t kTileBytes = kChunk * kChunk * 2;
  static constexpr uint32_t kTri = lasp_gdn_values_offset(DK, kWithQ);
  static constexpr uint32_t kR = kTri + kStages * kTileBytes;
  static constexpr uint32_t kBeta = kR + kTileBytes;
  static constexpr uint32_t kBytes = kBeta + kStages * kChunk * 4;
  static_assert(kBytes == lasp_gdn_values_smem_bytes(DK, kWithQ), "shared-memory map and host formula disagree");
  static_assert(kTri >= sd::Layout<DK, kWithQ, kStages, true>::kBytes && kTri % 1024 == 0,
                "tiles after the loop's, 1024-byte aligned");
};

// A barrier of the whole CTA, which runs the values step in the single-warpgroup loops.
struct CtaSync {
  __device__ __forceinline__ void operator()() const { __syncthreads(); }
};

// What the values step does with each chunk's u besides writing it over the V tile: nothing in the
// forward; the backward's states pass (gated_delta/backward.cu) stores it. Called by every thread
// of the step with segment chunk i and its rows' u (rows 16 warp + g and + 8, accumulator layout).
struct KeepU {
  __device__ __forceinline__ void operator()(int, int, int, int, const float (&)[8][4]) const {}
};

// The Values of run_segment_with for the CTA's (b, h) = blockIdx.z. kZeroValues: V taken as 0
// whatever the tile holds, so that the loop applies the chunks' transitions alone (a segment
// summary's A, lasp_gated_delta_summary_dk*). M: where the loop places these tiles
// (ValuesLayout, or the two-role loop's map) and how many slots it keeps. UStore: KeepU, or the
// backward's store of u. The flag is a template parameter and the tensors' addresses are formed
// from the parameters (constant memory) and the grid at each use: the output loop at Dk = 128 has
// no register to spare for anything that lives across it.
template <int DK, bool kZeroValues = false, class M = ValuesLayout<DK, true>, class UStore = KeepU>
struct Values {
  static constexpr bool kPlain = false;

  const lasp_gated_delta_params& p;
  UStore store_u{};

  // Chunk `chunk`'s (I + L)^{-1} tile and betas into slot i % M::kDepth (betas of virtual tokens 0),
  // by the 128 threads of the warpgroup that runs the step.
  __device__ __forceinline__ void issue(uint32_t sbase, int i, int chunk, int tok0, int valid, int tid) const {
    const int slot = i % M::kDepth;
    const int bh = blockIdx.z, b = bh / p.H, h = bh - b * p.H;
    const uint16_t* tri = p.ws_tri + ((int64_t)bh * lasp_gdn_num_chunks(p.T) + chunk) * kChunk * kChunk;
    sd::copy_tile_async<kChunk / 8>(sbase + M::kTri + slot * M::kTileBytes, tri, kChunk, kChunk, tid);
    if (tid < kChunk) {
      const bool ok = tid < valid;
      const float* beta = p.beta + ((int64_t)b * p.T + tok0 + tid) * p.H + h;  // [b, tok0 + tid, h]
      cp_async_4(sbase + M::kBeta + (slot * kChunk + tid) * 4, ok ? beta : p.beta, ok);
    }
  }

  // V tile at sV <- u for segment chunk i (state copy sS = S_n, gates cg, key tile sK); `sync` is
  // a barrier of the threads that run the step.
  template <int kDk, class Sync = CtaSync>
  __device__ __forceinline__ void apply(uint32_t sbase, int i, uint32_t sK, uint32_t sV, uint32_t sS,
                                        const sd::FragOffsets<kDk>& off, const sd::ChunkGates& cg, int warp,
                                        int lane, Sync sync = Sync{}) const {
    static_assert(kDk == DK, "one key width");
    extern __shared__ __align__(1024) uint8_t smem[];  // the loop's buffer
    const int g = lane >> 2, t = lane & 3;
    const int slot = i % M::kDepth;

    // K S_n for this warp's rows (the loop's Q S_n with K in Q's place).
    float ks[8][4] = {};
#pragma unroll
    for (int kstep = 0; kstep < DK / 16; ++kstep) {
      uint32_t ka[4];
      sd::row_fragment<DK>(ka, sK, off, kstep);
      sd::times_state_step<DK>(ks, ka, sS, off, kstep);
    }

    // R = diag(beta) (V - diag(e^b) K S_n) for this warp's rows, rounded to bf16 once: element
    // (r, 8 nt + 2 t + e) of the accumulators is at byte swizzle(r, nt) + 4 t (+ 2 e) of a tile.
    uint8_t* v_tile = smem + (sV - sbase);
    uint8_t* r_tile = smem + M::kR;
    const float* s_beta = reinterpret_cast<const float*>(smem + M::kBeta) + slot * kChunk;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = 16 * warp + 8 * hh + g;
      const float beta_r = s_beta[r];
      const float decay_r = chunk::exp_nonpos(cg.row[hh]);
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        const uint32_t at = swizzle(r, nt, kChunk) + 4 * t;
        const uint32_t vv = kZeroValues ? 0u : *reinterpret_cast<const uint32_t*>(v_tile + at);
        const float r0 = beta_r * (__uint_as_float(vv << 16) - decay_r * ks[nt][2 * hh]);
        const float r1 = beta_r * (__uint_as_float(vv & 0xffff0000u) - decay_r * ks[nt][2 * hh + 1]);
        *reinterpret_cast<uint32_t*>(r_tile + at) = pack_bf16x2(r0, r1);
      }
    }
    sync();  // R complete; every warp has read its V rows

    // u = (I + L)^{-1} R for this warp's rows (k-steps past the diagonal block multiply zeros).
    float u[8][4] = {};
    const uint32_t sTri = sbase + M::kTri + slot * M::kTileBytes;
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      uint32_t ta[4];
      ldsm_x4(ta, sTri + off.q[kk]);
      uint32_t rb[4][4];
      sd::load_v<DK>(rb, sbase + M::kR, off, kk);
      sd::pv_step(u, ta, rb);
    }
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = 16 * warp + 8 * hh + g;
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
        *reinterpret_cast<uint32_t*>(v_tile + swizzle(r, nt, kChunk) + 4 * t) =
            pack_bf16x2(u[nt][2 * hh], u[nt][2 * hh + 1]);
    }
    store_u(i, warp, g, t, u);
#if LASP_SD_WGMMA
    wg::fence_proxy_async();  // the products read the tile through the async proxy
#endif
    sync();  // u complete before any warp's products; R free for the next chunk
  }
};

}  // namespace gdn
}  // namespace lasp
