// Device building blocks of the scalar-decay forward (scalar_decay_fwd.cu): shared-memory map,
// chunk loader, chunk-local gate cumsum, and the fold step that LASP-2 reuses across ranks.
//
// Numerics (research/kernel-anchors.md §5.5): gates, cumsums, exponent arguments and every state
// (S on chip, M_s, P_s, Lambda_s) are fp32; cumsums are chunk-local; every exponent is clamped to
// <= 0 (exp_nonpos), so nothing overflows and e^{G}·e^{-G} never appears.
#pragma once
#include <math.h>
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

// How the warps of a CTA share its segment's chunk loop (one template parameter of run_segment_with).
enum class Roles {
  // LASP_SD_THREADS = 4 warps. Warp w: output rows 16w..16w+15 and state rows w*DK/4.. (all 64
  // columns); every warp runs every product of its rows. The LASP-2 kernels and the "base" variant.
  kUniform,
  // LASP_SD_SPLIT_THREADS = 8 warps, two per scheduler, so one warp's tensor work hides the other's
  // latencies (ldmatrix, MUFU, shuffles, barriers), which bound the 4-warp loop at ~1/3 of mma.sync
  // peak. Warp w and w + 4 cover the same 16 output rows / DK/4 state rows (w4 = w % 4).
  //  output kernel: warps 0-3 "intra" issue the loads and compute Q K^T -> mask -> P V into an fp32
  //                 exchange tile; warps 4-7 "inter" compute Q S_n and the state update, then add
  //                 the exchange tile and store O. Each group runs about half of the HMMAs.
  //  states kernel: warps 0-3 accumulate tokens 0..31 of every chunk, warps 4-7 tokens 32..63, each
  //                 into a partial state with the same per-chunk decay; the two are summed at the end.
  kSplit,
};

template <Roles R>
constexpr int threads_of() {
  return R == Roles::kUniform ? LASP_SD_THREADS : LASP_SD_SPLIT_THREADS;
}

// Shared-memory map of one CTA (byte offsets). Each stage holds one chunk: [Q] K V-tile gates, all
// bf16 tiles row-major with 16-byte chunks swizzled (lasp::swizzle). The output kernel (kHasQ) adds
// two bf16 copies of its state tile [DK][kTileV]: one read this chunk, one written for the next;
// the split output kernel also the fp32 exchange tile of P V (fragment order, [warp][nt][hh][lane]).
// The split output kernel runs LASP_SD_SPLIT_STAGES stages so that it fits the uniform kernel's
// shared-memory size (the host launches both with lasp_sd_output_smem_bytes).
template <int DK, bool kHasQ, Roles R = Roles::kUniform>
struct Layout {
  static constexpr bool kExchange = kHasQ && R == Roles::kSplit;
  static constexpr int kStagesUsed = kExchange ? LASP_SD_SPLIT_STAGES : kStages;
  static constexpr uint32_t kQKBytes = kChunk * DK * 2;
  static constexpr uint32_t kQ = 0;
  static constexpr uint32_t kK = kHasQ ? kQKBytes : 0;
  static constexpr uint32_t kV = kK + kQKBytes;
  static constexpr uint32_t kG = kV + kChunk * kTileV * 2;
  static constexpr uint32_t kStageBytes = kG + kChunk * 4;
  static constexpr uint32_t kSbf = kStagesUsed * kStageBytes;
  static constexpr uint32_t kSbfBytes = DK * kTileV * 2;
  static constexpr uint32_t kX = kSbf + (kHasQ ? 2 * kSbfBytes : 0);
  static constexpr uint32_t kBytes = kX + (kExchange ? kChunk * kTileV * 4 : 0);
  static constexpr uint32_t kHostBytes = kHasQ ? lasp_sd_output_smem_bytes(DK) : lasp_sd_states_smem_bytes(DK);
  static_assert(kStageBytes % 128 == 0, "stages stay 128-byte aligned");
  static_assert(R == Roles::kSplit ? kBytes <= kHostBytes : kBytes == kHostBytes,
                "shared-memory map and host formula disagree");
  static_assert(kStagesUsed >= 2, "the pipeline needs at least two stages");
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


// ---------------------------------------------------------------------------------------------
// The segment loop: one CTA walks the chunks of its segment with the state on chip. Every forward
// kernel runs it (single-GPU: scalar_decay_fwd.cu; LASP-2: lasp2_fwd.cu), each with a prologue that
// supplies the start state and an epilogue that takes the end state.
// ---------------------------------------------------------------------------------------------

// What one CTA runs: the tensors (fla layout, already the full [B, T, H, D] bases), its chunks and its
// (Dv tile, b*H+h).
struct SegmentArgs {
  const uint16_t* q;  // bf16 [B, T, H, DK] (unused by the states variant)
  const uint16_t* k;  // bf16 [B, T, H, DK]
  const uint16_t* v;  // bf16 [B, T, H, Dv]
  const float* g;     // fp32 [B, T, H]
  uint16_t* o;        // bf16 [B, T, H, Dv] (unused by the states variant)
  int T, H, Dv;
  int c_begin;        // first chunk of the segment
  int n_chunks;       // chunks of the segment (>= 1)
  int vt, bh;         // Dv tile and b*H+h of this CTA
  float scale;
};

// The state elements a lane holds: s[mt][nt][2*hh + e] = S[d][c] with d = d_warp + 16*mt + 8*hh + g,
// c = 8*nt + 2*t + e (column within the 64-column tile).
struct StateLane {
  int d_warp, g, t;
};

template <int DK>
using StateRegs = float[DK / 64][8][4];

// f(x0, x1, d, c) for every element pair (columns c, c + 1 of row d) the lane holds.
template <int DK, class F>
__device__ __forceinline__ void for_each_state_pair(StateRegs<DK>& s, const StateLane& ln, F&& f) {
#pragma unroll
  for (int mt = 0; mt < DK / 64; ++mt)
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh)
        f(s[mt][nt][2 * hh], s[mt][nt][2 * hh + 1], ln.d_warp + 16 * mt + 8 * hh + ln.g, 8 * nt + 2 * ln.t);
}

// s = 0.
template <int DK>
__device__ __forceinline__ void state_zero(StateRegs<DK>& s, const StateLane& ln) {
  for_each_state_pair<DK>(s, ln, [](float& x0, float& x1, int, int) { x0 = 0.f, x1 = 0.f; });
}

// s = tile, element (d, c) at base[d * ld + c] (fp32, 8-byte aligned rows).
template <int DK>
__device__ __forceinline__ void state_load(StateRegs<DK>& s, const StateLane& ln, const float* base, int64_t ld) {
  for_each_state_pair<DK>(s, ln, [&](float& x0, float& x1, int d, int c) {
    const float2 x = *reinterpret_cast<const float2*>(base + d * ld + c);
    x0 = x.x, x1 = x.y;
  });
}

// s = e^{lambda} s + tile (fold_step per element). kL2 reads through L2 only (ld.global.cg), for data
// another GPU or a NIC wrote while this kernel ran.
template <int DK, bool kL2 = false>
__device__ __forceinline__ void state_fold(StateRegs<DK>& s, const StateLane& ln, const float* base, int64_t ld,
                                           float lambda) {
  for_each_state_pair<DK>(s, ln, [&](float& x0, float& x1, int d, int c) {
    const float2* src = reinterpret_cast<const float2*>(base + d * ld + c);
    const float2 m = kL2 ? __ldcg(src) : *src;
    x0 = fold_step(x0, lambda, m.x);
    x1 = fold_step(x1, lambda, m.y);
  });
}

// tile = s.
template <int DK>
__device__ __forceinline__ void state_store(StateRegs<DK>& s, const StateLane& ln, float* base, int64_t ld) {
  for_each_state_pair<DK>(s, ln, [&](float& x0, float& x1, int d, int c) {
    *reinterpret_cast<float2*>(base + d * ld + c) = make_float2(x0, x1);
  });
}

// ---- Chunk-step building blocks (one warp; w4 = its 16-row output block and DK/4-row state block) ----

// Per-lane ldmatrix row offsets (swizzled). Every fragment load is a buffer base + one of these + a
// compile-time constant: moving a row by 16 keeps row % 8, and moving a chunk index by 8 leaves its
// low 3 bits (the swizzled ones) alone. Lane l addresses row (l & 7) + 8 * (one of its bits 3, 4) and
// chunk + (the other bit) of its 8x8 matrix l / 8.
template <int DK>
struct FragOffsets {
  static constexpr int kQKChunks = DK / 8;
  static constexpr int kVChunks = kTileV / 8;
  static constexpr uint32_t kQKRow16 = 16 * kQKChunks * 16;  // bytes of 16 rows of a Q/K tile
  static constexpr uint32_t kVRow16 = 16 * kVChunks * 16;    // bytes of 16 rows of a V / state tile
  uint32_t q[4];         // Q A-fragment,  rows 16 w4 + .., chunk 2m (+ 8 per 4 k-steps)
  uint32_t k[4];         // K B-fragment,  rows 0.. (+ 16 per key n-tile pair), chunk 2m (+ 8 per 4 k-steps)
  uint32_t v[4];         // V / state B-fragment (.trans), rows 0.. (+ 16 per k-step), chunk 2m = n-tile pair m
  uint32_t kt[DK / 64];  // K^T A-fragment (.trans), rows 0.. (+ 16 per k-step), chunks of state rows d_warp + 16 mt
  __device__ __forceinline__ FragOffsets(int w4, int lane) {
    const int l_row = lane & 7, l_b3 = (lane >> 3) & 1, l_b4 = lane >> 4;
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      q[m] = swizzle(16 * w4 + l_row + 8 * l_b3, 2 * m + l_b4, kQKChunks);
      k[m] = swizzle(l_row + 8 * l_b4, 2 * m + l_b3, kQKChunks);
      v[m] = swizzle(l_row + 8 * l_b3, 2 * m + l_b4, kVChunks);
    }
#pragma unroll
    for (int mt = 0; mt < DK / 64; ++mt) kt[mt] = swizzle(l_row + 8 * l_b4, (w4 * DK / 4 + 16 * mt) / 8 + l_b3, kQKChunks);
  }
};

// One pass over Dk of this warp's 16 Q rows: kInter: o += Q S_n (bf16 state copy at sS); kScores:
// a += Q K^T (all 64 keys). The uniform loop runs both and shares the Q fragments.
template <int DK, bool kInter, bool kScores>
__device__ __forceinline__ void q_products(float (&o)[8][4], float (&a)[8][4], uint32_t sQ, uint32_t sS, uint32_t sK,
                                           const FragOffsets<DK>& off) {
  using F = FragOffsets<DK>;
#pragma unroll
  for (int ks = 0; ks < DK / 16; ++ks) {
    uint32_t qa[4];
    ldsm_x4(qa, sQ + off.q[ks & 3] + 128 * (ks >> 2));
    // o += Q S_n (B[k = d][n = c] stored row-major -> ldmatrix.trans).
    if constexpr (kInter) {
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        uint32_t sb[4];
        ldsm_x4_trans(sb, sS + off.v[np] + ks * F::kVRow16);
        mma_bf16(o[2 * np], qa, sb[0], sb[1]);
        mma_bf16(o[2 * np + 1], qa, sb[2], sb[3]);
      }
    }
    // a += Q K^T (B[k = d][n = j] = K[j][d]: K stored [j][d] is B's transpose -> plain ldmatrix).
    // All 64 key columns, although columns j > 16 w4 + 15 are masked: branch-free identical streams,
    // 8 independent accumulator chains, and the critical path (w4 = 3 needs every column) unchanged.
    if constexpr (kScores) {
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        uint32_t kb[4];
        ldsm_x4(kb, sK + off.k[ks & 3] + 128 * (ks >> 2) + np * F::kQKRow16);
        mma_bf16(a[2 * np], qa, kb[0], kb[1]);
        mma_bf16(a[2 * np + 1], qa, kb[2], kb[3]);
      }
    }
  }
}

// Row r of the inter term gets sigma e^{b_r}.
__device__ __forceinline__ void scale_inter_rows(float (&o)[8][4], const ChunkGates& cg, float scale) {
  const float row_scale[2] = {scale * exp_nonpos(cg.row[0]), scale * exp_nonpos(cg.row[1])};
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      o[nt][2 * hh] *= row_scale[hh];
      o[nt][2 * hh + 1] *= row_scale[hh];
    }
}

// Scores get sigma [r >= j] e^{b_r - b_j}, then become bf16 A fragments (accumulator layout of
// n-tiles 2kk, 2kk+1 = A layout of k-step kk). Masked before the exp (-inf -> 0): no branch, no inf.
__device__ __forceinline__ void scores_to_p(uint32_t (&pa)[4][4], const float (&a)[8][4], const ChunkGates& cg, int w4,
                                            int g, int t, float scale) {
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = 16 * w4 + 8 * hh + g;
      const int j = 8 * nt + 2 * t;
      const float d0 = exp_nonpos(j <= r ? cg.row[hh] - cg.col[nt][0] : -INFINITY);
      const float d1 = exp_nonpos(j + 1 <= r ? cg.row[hh] - cg.col[nt][1] : -INFINITY);
      const float x0 = scale * a[nt][2 * hh] * d0;
      const float x1 = scale * a[nt][2 * hh + 1] * d1;
      pa[nt >> 1][(nt & 1) * 2 + hh] = pack_bf16x2(x0, x1);
    }
}

// S <- e^gamma S, and the key weights e^{gamma - b_j} of the update's K~ = diag(e^{gamma - b}) K.
template <int DK>
__device__ __forceinline__ void decay_state(StateRegs<DK>& s, float (&wk)[8][2], const ChunkGates& cg) {
  const float decay = exp_nonpos(cg.gamma);
#pragma unroll
  for (int mt = 0; mt < DK / 64; ++mt)
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[mt][nt][e] *= decay;
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) wk[nt][e] = exp_nonpos(cg.gamma - cg.col[nt][e]);
}

// B fragments of V rows 16kk.., n-tiles 2np, 2np+1.
template <int DK>
__device__ __forceinline__ void load_v(uint32_t (&vb)[4][4], uint32_t sV, const FragOffsets<DK>& off, int kk) {
#pragma unroll
  for (int np = 0; np < 4; ++np) ldsm_x4_trans(vb[np], sV + off.v[np] + kk * FragOffsets<DK>::kVRow16);
}

// o += P[:, 16kk..16kk+15] V[16kk.., :]  (k-steps kk > w4 hold only masked zeros: kept, branch-free).
__device__ __forceinline__ void pv_step(float (&o)[8][4], const uint32_t (&p)[4], const uint32_t (&vb)[4][4]) {
#pragma unroll
  for (int np = 0; np < 4; ++np) {
    mma_bf16(o[2 * np], p, vb[np][0], vb[np][1]);
    mma_bf16(o[2 * np + 1], p, vb[np][2], vb[np][3]);
  }
}

// S += K~[16kk.., rows]^T V[16kk.., :]: A[m = d][k = j] = K[j][d] (ldmatrix.trans), each k column j
// scaled by e^{gamma - b_j} in fp32 before rounding to bf16.
template <int DK>
__device__ __forceinline__ void state_step(StateRegs<DK>& s, uint32_t sK, const FragOffsets<DK>& off, int kk,
                                           const float (&wk)[8][2], const uint32_t (&vb)[4][4]) {
#pragma unroll
  for (int mt = 0; mt < DK / 64; ++mt) {
    uint32_t ka[4];
    ldsm_x4_trans(ka, sK + off.kt[mt] + kk * FragOffsets<DK>::kQKRow16);
    ka[0] = scale_bf16x2(ka[0], wk[2 * kk][0], wk[2 * kk][1]);          // j = 16kk + 2t + {0,1}
    ka[1] = scale_bf16x2(ka[1], wk[2 * kk][0], wk[2 * kk][1]);
    ka[2] = scale_bf16x2(ka[2], wk[2 * kk + 1][0], wk[2 * kk + 1][1]);  // j = 16kk + 8 + 2t + {0,1}
    ka[3] = scale_bf16x2(ka[3], wk[2 * kk + 1][0], wk[2 * kk + 1][1]);
#pragma unroll
    for (int np = 0; np < 4; ++np) {
      mma_bf16(s[mt][2 * np], ka, vb[np][0], vb[np][1]);
      mma_bf16(s[mt][2 * np + 1], ka, vb[np][2], vb[np][3]);
    }
  }
}

// The state update over k-steps kK0 .. kK0 + kN - 1 (tokens 16 kK0 .. 16 (kK0 + kN) - 1).
template <int DK, int kK0, int kN>
__device__ __forceinline__ void state_update_ksteps(StateRegs<DK>& s, uint32_t sK, uint32_t sV,
                                                    const FragOffsets<DK>& off, const float (&wk)[8][2]) {
#pragma unroll
  for (int kk = kK0; kk < kK0 + kN; ++kk) {
    uint32_t vb[4][4];
    load_v<DK>(vb, sV, off, kk);
    state_step<DK>(s, sK, off, kk, wk, vb);
  }
}

// bf16 copy of the warp's state rows into the state buffer at byte offset buf (for the next Q S).
template <int DK>
__device__ __forceinline__ void store_state_bf16(uint8_t* smem, uint32_t buf, StateRegs<DK>& s, const StateLane& ln) {
  for_each_state_pair<DK>(s, ln, [&](float& x0, float& x1, int d, int c) {
    *reinterpret_cast<uint32_t*>(smem + buf + swizzle(d, c / 8, kTileV / 8) + 4 * ln.t) = pack_bf16x2(x0, x1);
  });
}

// Offset of this lane's float2 (n-tile nt, row half hh) in the exchange tile: fragment order, so
// the intra warp's store and the inter warp's load of the same lane are contiguous 256 B per warp.
__device__ __forceinline__ uint32_t exchange_offset(int w4, int nt, int hh, int lane) {
  return static_cast<uint32_t>((((w4 * 8 + nt) * 2 + hh) * 32 + lane) * 8);
}

constexpr int kBarExchange = 1;  // named barrier: P V tile written (intra arrives, inter syncs)

// Runs one CTA's segment (kOutput = false: states only, K, V, gates; kOutput = true: outputs too)
// with R's work split (see Roles; blockDim.x must be threads_of<R>()).
//   start(s, lane) -> bool: fills the fp32 start state before any cp.async. kUniform: called by every
//                   thread, may contain __syncthreads. kSplit: called by the warps that hold the
//                   running state (output: warps 4-7; states: warps 0-3, warps 4-7 start from zero),
//                   must not contain CTA-wide barriers. If it returns false (uniformly across the
//                   callers), the CTA still runs its loop but stores no O and does not call end.
//   end(s, lane, lambda): the epilogue, given the segment's end state and its log-decay (sum of the
//                   chunks' gamma in chunk order); called by the same warps as start.
template <int DK, bool kOutput, Roles R = Roles::kUniform, class Start, class End>
__device__ __forceinline__ void run_segment_with(const SegmentArgs& a, Start&& start, End&& end) {
  using L = Layout<DK, kOutput, R>;
  constexpr int kQKChunks = DK / 8;
  constexpr int kVChunks = kTileV / 8;
  constexpr int kStagesN = L::kStagesUsed;
  constexpr bool kSplit = R == Roles::kSplit;
  static_assert(DK == 64 || DK == 128, "Dk must be 64 or 128");

  extern __shared__ __align__(128) uint8_t smem[];
  const uint32_t sbase = smem_addr(smem);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int w4 = warp & 3;      // 16-row output block and DK/4-row state block of this warp
  const int group = warp >> 2;  // kSplit: 0 = intra / tokens 0..31, 1 = inter / tokens 32..63
  const bool loads = !kSplit || group == 0;              // warps that issue (and wait for) the cp.async
  const bool holds_state = !(kSplit && kOutput) || group == 1;
  const bool runs_start = !kSplit || (kOutput ? group == 1 : group == 0);
  const int g = lane >> 2, t = lane & 3;
  const int vt = a.vt, bh = a.bh;
  const int b = bh / a.H, h = bh % a.H;
  const int T = a.T, Dv = a.Dv;
  const int c_begin = a.c_begin;
  const int n_chunks = a.n_chunks;

  const int64_t row_bt0 = (int64_t)b * T * a.H + h;  // token 0 of (b, h); fla layout [B, T, H, D]
  const int64_t qk_stride = (int64_t)a.H * DK, v_stride = (int64_t)a.H * Dv;
  const uint16_t* q = a.q + row_bt0 * DK;
  const uint16_t* k = a.k + row_bt0 * DK;
  const uint16_t* v = a.v + row_bt0 * Dv + vt * kTileV;
  const float* gate = a.g + row_bt0;

  // Chunk i of this segment -> stage i % kStagesN (by the LASP_SD_THREADS loading threads).
  auto issue_chunk = [&](int i) {
    const uint32_t stage = sbase + (i % kStagesN) * L::kStageBytes;
    const int tok0 = (c_begin + i) * kChunk;
    const int valid = min(kChunk, T - tok0);
    if constexpr (kOutput) copy_tile_async<kQKChunks>(stage + L::kQ, q + tok0 * qk_stride, qk_stride, valid, tid);
    copy_tile_async<kQKChunks>(stage + L::kK, k + tok0 * qk_stride, qk_stride, valid, tid);
    copy_tile_async<kVChunks>(stage + L::kV, v + tok0 * v_stride, v_stride, valid, tid);
    if (tid < kChunk) {
      const bool ok = tid < valid;
      cp_async_4(stage + L::kG + 4 * tid, ok ? gate + (int64_t)(tok0 + tid) * a.H : gate, ok);
    }
  };

  const StateLane ln{w4 * (DK / 4), g, t};
  float s[DK / 64][8][4];
  const FragOffsets<DK> off(w4, lane);

  // A CTA whose start failed still runs the loop (on whatever state it has) but stores nothing: an
  // early exit here would make the compiler treat the whole loop as divergent code and give up the
  // uniform datapath (+25 integer instructions per chunk, +4 registers in output_dk128). Issuing the
  // first cp.async before `start` (to overlap a wait) costs registers: 32 B of spills in output_dk128.
  bool store = true;
  if (runs_start)
    store = start(s, ln);
  else
    state_zero<DK>(s, ln);  // kSplit states kernel, tokens 32..63: its partial starts at zero
  if (loads) {
#pragma unroll
    for (int i = 0; i < kStagesN - 1; ++i) {
      if (i < n_chunks) issue_chunk(i);
      cp_async_commit();
    }
  }
  if constexpr (kOutput)
    if (holds_state) store_state_bf16<DK>(smem, L::kSbf, s, ln);

  float lambda = 0.f;  // segment log-decay, summed over chunks in order (deterministic)
  for (int i = 0; i < n_chunks; ++i) {
    if (loads) cp_async_wait<kStagesN - 2>();
    // After this barrier: chunk i is in smem for every thread; every warp is done with chunk i-1,
    // so its stage can be refilled, the bf16 state buffer it read rewritten, the exchange tile reused.
    __syncthreads();
    if (loads) {
      if (i + kStagesN - 1 < n_chunks) issue_chunk(i + kStagesN - 1);
      cp_async_commit();
    }

    const uint32_t stage = (i % kStagesN) * L::kStageBytes;
    const uint32_t sK = sbase + stage + L::kK;
    const uint32_t sV = sbase + stage + L::kV;
    const ChunkGates cg = scan_gates(reinterpret_cast<const float*>(smem + stage + L::kG), w4, lane);
    lambda += cg.gamma;

    if constexpr (!kOutput) {
      // ---- States kernel: S <- e^gamma S + K~^T V (kSplit: this group's 32 tokens only) ----
      float wk[8][2];
      decay_state<DK>(s, wk, cg);
      if constexpr (!kSplit) {
        state_update_ksteps<DK, 0, 4>(s, sK, sV, off, wk);
      } else if (group == 0) {  // compile-time k-steps in both branches: wk stays in registers
        state_update_ksteps<DK, 0, 2>(s, sK, sV, off, wk);
      } else {
        state_update_ksteps<DK, 2, 2>(s, sK, sV, off, wk);
      }
    } else {
      const uint32_t sQ = sbase + stage + L::kQ;
      const uint32_t sS = sbase + L::kSbf + (i & 1) * L::kSbfBytes;
      const int tok0 = (c_begin + i) * kChunk;
      float o[8][4] = {};  // O rows 16 w4.., 64 columns (8 n-tiles)
      if (!kSplit || group == 0) {
        // ---- Intra: scores Q K^T (and, uniform, the inter term Q S_n in the same pass) ----
        float acc[8][4] = {};
        uint32_t pa[4][4];  // A fragments of sigma (Q K^T ⊙ D), one per 16-token k-step
        q_products<DK, !kSplit, true>(o, acc, sQ, sS, sK, off);
        if constexpr (!kSplit) scale_inter_rows(o, cg, a.scale);
        scores_to_p(pa, acc, cg, w4, g, t, a.scale);
        float wk[8][2];
        if constexpr (!kSplit) decay_state<DK>(s, wk, cg);
        // (P V)  and, uniform, the state update, sharing the V fragments.
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          uint32_t vb[4][4];
          load_v<DK>(vb, sV, off, kk);
          pv_step(o, pa[kk], vb);
          if constexpr (!kSplit) state_step<DK>(s, sK, off, kk, wk, vb);
        }
        if constexpr (kSplit) {
          // Hand P V to the inter warp of the same rows; no wait (it syncs on the named barrier).
#pragma unroll
          for (int nt = 0; nt < 8; ++nt)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh)
              *reinterpret_cast<float2*>(smem + L::kX + exchange_offset(w4, nt, hh, lane)) =
                  make_float2(o[nt][2 * hh], o[nt][2 * hh + 1]);
          named_bar_arrive(kBarExchange, threads_of<R>());
        }
      } else {
        // ---- Inter (kSplit, warps 4-7): Q S_n, the state update, then O = inter + exchanged P V ----
        float unused[8][4];
        q_products<DK, true, false>(o, unused, sQ, sS, sK, off);
        scale_inter_rows(o, cg, a.scale);
        float wk[8][2];
        decay_state<DK>(s, wk, cg);
        state_update_ksteps<DK, 0, 4>(s, sK, sV, off, wk);
        if (i + 1 < n_chunks) store_state_bf16<DK>(smem, L::kSbf + ((i + 1) & 1) * L::kSbfBytes, s, ln);
        named_bar_sync(kBarExchange, threads_of<R>());
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            const float2 x = *reinterpret_cast<const float2*>(smem + L::kX + exchange_offset(w4, nt, hh, lane));
            o[nt][2 * hh] += x.x;
            o[nt][2 * hh + 1] += x.y;
          }
      }
      if (holds_state) {
        // O rows beyond T (ragged last chunk) are not stored.
        uint16_t* o_tile = a.o + row_bt0 * Dv + vt * kTileV + 2 * t;
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int tok = tok0 + 16 * w4 + 8 * hh + g;
          if (store && tok < T) {
            uint16_t* dst = o_tile + tok * v_stride;
#pragma unroll
            for (int nt = 0; nt < 8; ++nt)
              *reinterpret_cast<uint32_t*>(dst + 8 * nt) = pack_bf16x2(o[nt][2 * hh], o[nt][2 * hh + 1]);
          }
        }
        if (!kSplit && i + 1 < n_chunks) store_state_bf16<DK>(smem, L::kSbf + ((i + 1) & 1) * L::kSbfBytes, s, ln);
      }
    }
  }

  if constexpr (kSplit && !kOutput) {
    // S = S(tokens 0..31) + S(tokens 32..63): warps 4-7 hand their partial state over through the
    // (now idle) stage buffers; only empty cp.async groups can still be pending.
    __syncthreads();
    // [w4][mt][nt][lane] float4: each warp-wide access is 512 contiguous bytes.
    float4* part = reinterpret_cast<float4*>(smem) + w4 * (DK / 64) * 8 * 32 + lane;
    if (group == 1) {
#pragma unroll
      for (int mt = 0; mt < DK / 64; ++mt)
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
          part[(mt * 8 + nt) * 32] = make_float4(s[mt][nt][0], s[mt][nt][1], s[mt][nt][2], s[mt][nt][3]);
    }
    __syncthreads();
    if (group == 0) {
#pragma unroll
      for (int mt = 0; mt < DK / 64; ++mt)
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
          const float4 x = part[(mt * 8 + nt) * 32];
          s[mt][nt][0] += x.x, s[mt][nt][1] += x.y, s[mt][nt][2] += x.z, s[mt][nt][3] += x.w;
        }
    }
  }
  if (store && runs_start) end(s, ln, lambda);
}

}  // namespace sd
}  // namespace lasp
