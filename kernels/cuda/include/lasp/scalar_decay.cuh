// Device building blocks of the scalar-decay forward (scalar_decay_fwd.cu): shared-memory map,
// chunk loader, chunk-local gate cumsum, and the fold step that LASP-2 reuses across ranks.
//
// Numerics (research/kernel-anchors.md §5.5): gates, cumsums, exponent arguments and every state
// (S on chip, M_s, P_s, Lambda_s) are fp32; cumsums are chunk-local; every exponent is clamped to
// <= 0 (exp_nonpos), so nothing overflows and e^{G}·e^{-G} never appears.
#pragma once
#include <stdint.h>

#include "lasp/mma.cuh"
#include "lasp/scalar_decay_params.h"

namespace lasp {
namespace sd {

constexpr int kChunk = LASP_SD_CHUNK;
constexpr int kTileV = LASP_SD_TILE_V;
constexpr int kThreads = LASP_SD_THREADS;
constexpr int kStages = LASP_SD_STAGES;
constexpr int kWarps = kThreads / 32;
static_assert(kChunk == 64 && kTileV == 64 && kWarps == 4,
              "fragment bookkeeping assumes 64-token chunks, 64-column V tiles and 4 warps of 16 rows");
static_assert(kStages >= 2, "the pipeline needs at least two stages");

// Shared-memory map of one CTA (byte offsets). Each stage holds one chunk: [Q] K V-tile gates, all
// bf16 tiles row-major with 16-byte chunks swizzled (lasp::swizzle). The output kernel (kHasQ) adds
// two bf16 copies of its state tile [DK][kTileV]: one read this chunk, one written for the next.
template <int DK, bool kHasQ>
struct Layout {
  static constexpr uint32_t kQKBytes = kChunk * DK * 2;
  static constexpr uint32_t kQ = 0;
  static constexpr uint32_t kK = kHasQ ? kQKBytes : 0;
  static constexpr uint32_t kV = kK + kQKBytes;
  static constexpr uint32_t kG = kV + kChunk * kTileV * 2;
  static constexpr uint32_t kStageBytes = kG + kChunk * 4;
  static constexpr uint32_t kSbf = kStages * kStageBytes;
  static constexpr uint32_t kSbfBytes = DK * kTileV * 2;
  static constexpr uint32_t kBytes = kSbf + (kHasQ ? 2 * kSbfBytes : 0);
  static_assert(kStageBytes % 128 == 0, "stages stay 128-byte aligned");
  static_assert(kBytes == (kHasQ ? lasp_sd_output_smem_bytes(DK) : lasp_sd_states_smem_bytes(DK)),
                "shared-memory map and host formula disagree");
};

// e^x for x that is <= 0 in exact arithmetic; the clamp absorbs rounding of differences of cumsums.
// x = -inf (a masked entry) gives exactly 0.
__device__ __forceinline__ float exp_nonpos(float x) { return ex2_approx(fminf(x, 0.f) * 1.4426950408889634f); }

// The fold of segment (or rank) prefixes: P_{s+1} = e^{Lambda_s} P_s + M_s, fp32, one element.
__device__ __forceinline__ float fold_step(float prefix, float lambda, float m) {
  return fmaf(expf(fminf(lambda, 0.f)), prefix, m);
}

// Async copy of a [kChunk x 8*kRowChunks] bf16 tile whose row r starts at row0 + r*stride (elements)
// into swizzled shared memory at dst. Rows >= valid_rows are zero-filled (ragged last chunk).
// Thread tid always copies 16-byte chunk tid % kRowChunks of rows tid / kRowChunks + i*kRowStep:
// consecutive threads read consecutive 16 B of a row, and the shared offsets step by constants.
template <int kRowChunks>
__device__ __forceinline__ void copy_tile_async(uint32_t dst, const uint16_t* row0, int64_t stride, int valid_rows,
                                                int tid) {
  constexpr int kRowStep = kThreads / kRowChunks;
  constexpr int kPerThread = kChunk / kRowStep;
  static_assert(kRowStep % 8 == 0 && kPerThread * kRowStep == kChunk, "rows must keep their swizzle phase");
  const int r0 = tid / kRowChunks, c = tid % kRowChunks;
  const uint16_t* src = row0 + r0 * stride + c * 8;
  const int64_t src_step = kRowStep * stride;
  dst += swizzle(r0, c, kRowChunks);  // rows r0 + i*kRowStep share r0 % 8, hence the swizzle
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const bool ok = r0 + i * kRowStep < valid_rows;
    cp_async_16(dst + i * kRowStep * kRowChunks * 16, ok ? src : row0, ok);
    src += src_step;
  }
}

// The gate values one lane needs for one chunk. b_r = sum_{i<=r} a_i is the chunk-local inclusive
// cumsum (natural log, fp32); tokens beyond T were zero-filled, so they count as a = 0.
struct ChunkGates {
  float row[2];     // b at this lane's fragment rows r = 16*warp + g and r + 8
  float col[8][2];  // b at this lane's fragment columns / k indices j = 8*nt + 2*t + e
  float gamma;      // b_63: the chunk's total log-decay
};

// Every warp scans the 64 gates itself (identical instructions, so identical bits): no barrier and
// no shared-memory write between the chunk's arrival and its use. Lane l owns b_{2l}, b_{2l+1}.
__device__ __forceinline__ ChunkGates scan_gates(const float* s_gates, int warp, int lane) {
  constexpr unsigned kAll = 0xffffffffu;
  const float2 a = reinterpret_cast<const float2*>(s_gates)[lane];
  const float pair = a.x + a.y;
  float incl = pair;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const float y = __shfl_up_sync(kAll, incl, off);
    if (lane >= off) incl += y;
  }
  float excl = __shfl_up_sync(kAll, incl, 1);
  if (lane == 0) excl = 0.f;
  const float b_even = excl + a.x;
  const float b_odd = excl + pair;

  ChunkGates cg;
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = 16 * warp + 8 * h + g;
    const float e = __shfl_sync(kAll, b_even, r >> 1);
    const float o = __shfl_sync(kAll, b_odd, r >> 1);
    cg.row[h] = (r & 1) ? o : e;
  }
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
    cg.col[nt][0] = __shfl_sync(kAll, b_even, 4 * nt + t);
    cg.col[nt][1] = __shfl_sync(kAll, b_odd, 4 * nt + t);
  }
  cg.gamma = __shfl_sync(kAll, b_odd, 31);
  return cg;
}

}  // namespace sd
}  // namespace lasp
