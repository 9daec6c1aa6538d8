// Device building blocks of the scalar-decay forward (scalar_decay/forward.cu): shared-memory map,
// chunk loader, chunk-local gate cumsum, and the fold step that LASP-2 reuses across ranks.
//
// Numerics (kernels/docs/maths.md, "Numerics"): gates, cumsums, exponent arguments and every state
// (S on chip, M_s, P_s, Lambda_s) are fp32; cumsums are chunk-local; every exponent is clamped to
// <= 0 (exp_nonpos), so nothing overflows and e^{G}·e^{-G} never appears.
#pragma once
#include <math.h>
#include <stdint.h>

#include "lasp/chunk/state_tile.cuh"
#include "lasp/chunk/tile_copy.cuh"
#include "lasp/mma.cuh"
#include "lasp/scalar_decay/forward_params.h"
#include "lasp/tma.cuh"

// The output kernels' products run on wgmma where the target has it (sm_90a), else on mma.sync.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define LASP_SD_WGMMA 1
#include "lasp/wgmma.cuh"
#else
#define LASP_SD_WGMMA 0
#endif

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
static_assert(kChunk == chunk::kChunk, "the shared tile loads assume this chunk size");

using chunk::exp_nonpos;
using chunk::for_each_state_pair;
using chunk::state_load;
using chunk::state_store;
using chunk::state_zero;
using chunk::StateLane;
using chunk::StateRegs;
// The shared tile loads for this CTA size.
template <int kRowChunks>
__device__ __forceinline__ void copy_tile_async(uint32_t dst, const uint16_t* row0, int64_t stride, int valid_rows,
                                                int tid) {
  chunk::copy_tile_async<kRowChunks, kThreads>(dst, row0, stride, valid_rows, tid);
}
template <int kRowChunks>
__device__ __forceinline__ void copy_tile_range_async(uint32_t dst, const uint16_t* row0, int64_t stride,
                                                      int first_valid, int valid_rows, const uint16_t* mapped,
                                                      int tid) {
  chunk::copy_tile_range_async<kRowChunks, kThreads>(dst, row0, stride, first_valid, valid_rows, mapped, tid);
}

// Shared-memory map of one CTA (byte offsets): kDepth stages of [Q] K V-tile (bf16, the swizzled
// layout of lasp::swizzle), then, in the output kernels (kHasStateCopies, by default kHasQ), two
// bf16 copies of its state tile [DK][kTileV] (one read this chunk, one written for the next; a pass
// without Q keeps them for a values step that reads S_n), then the stages' gates. Every tile
// starts 1024-byte aligned, which is what wgmma's (and the tensor copies') 128-byte swizzle needs:
// the buffer is declared __align__(1024), and these kernels declare no static shared memory, so
// it starts at the CTA's first usable byte, which is aligned. (ptxas takes the declaration as given
// and compiles any run-time test of it away; a static mbarrier array in front of the buffer made
// the tensor copies fault.)
template <int DK, bool kHasQ, int kDepth = kStages, bool kHasStateCopies = kHasQ>
struct Layout {
  static constexpr uint32_t kQKBytes = kChunk * DK * 2;
  static constexpr uint32_t kQ = 0;
  static constexpr uint32_t kK = kHasQ ? kQKBytes : 0;
  static constexpr uint32_t kV = kK + kQKBytes;
  static constexpr uint32_t kStageBytes = kV + kChunk * kTileV * 2;
  static constexpr uint32_t kSbf = kDepth * kStageBytes;
  static constexpr uint32_t kSbfBytes = DK * kTileV * 2;
  static constexpr uint32_t kGates = kSbf + (kHasStateCopies ? 2 * kSbfBytes : 0);
  static constexpr uint32_t kGateBytes = kChunk * 4;
  static constexpr uint32_t kBytes = kGates + kDepth * kGateBytes;
  // Offsets of the stage and of the gate slot that hold chunk i of a segment.
  static __device__ __forceinline__ uint32_t stage(int i) { return (i % kDepth) * kStageBytes; }
  static __device__ __forceinline__ uint32_t gates(int i) { return kGates + (i % kDepth) * kGateBytes; }
  static_assert(kStageBytes % 1024 == 0 && kSbfBytes % 1024 == 0, "tiles stay 1024-byte aligned");
};

// The fold of segment (or rank) prefixes: P_{s+1} = e^{Lambda_s} P_s + M_s, fp32, one element.
__device__ __forceinline__ float fold_step(float prefix, float lambda, float m) {
  return fmaf(expf(fminf(lambda, 0.f)), prefix, m);
}

// The gate values one lane needs for one chunk. b_r = sum_{i<=r} a_i is the chunk-local inclusive
// cumsum (natural log, fp32); tokens beyond T were zero-filled, so they count as a = 0.
struct ChunkGates {
  float row[2];     // b at this lane's fragment rows r = 16*warp + g and r + 8
  float col[8][2];  // b at this lane's fragment columns / k indices j = 8*nt + 2*t + e
  float gamma;      // b_63: the chunk's total log-decay
};

// ChunkGates with the chunk's document starts, for a family whose kernels mask at the starts
// instead of forgetting through a gate (mLSTM: kernels/docs/packed.md). Row r keeps the keys j >=
// f(r), the start of its document in the chunk, and the carried state's term only where f(r) =
// -1 (its document entered the chunk); the update keeps the keys from the chunk's last start on
// and carries the state only where the chunk holds no start. `starts` packs them in one register:
// byte hh holds f(r) + 1 of this lane's fragment row r = 16 warp + 8 hh + g, byte 2 the last
// start + 1 (0: none). The accessors read plain ChunkGates as a chunk without starts, so that
// every mask folds away in its loops. Every mask selects an exponent of -inf (exp 0), not a
// value: one code path, so that ptxas sees the state's registers written alike before every
// wgmma.
struct DocumentChunkGates : ChunkGates {
  uint32_t starts;
};

// f(r) of this lane's fragment row hh: the start of its document in the chunk, -1 where the
// document entered the chunk.
__device__ __forceinline__ int document_start(const ChunkGates&, int) { return -1; }
__device__ __forceinline__ int document_start(const DocumentChunkGates& cg, int hh) {
  return static_cast<int>((cg.starts >> (8 * hh)) & 0xffu) - 1;
}
// Whether row r (this lane's fragment row hh) scores key j: j <= r, and with documents j >= f(r)
// too.
__device__ __forceinline__ bool scores_key(const ChunkGates&, int, int j, int r) { return j <= r; }
__device__ __forceinline__ bool scores_key(const DocumentChunkGates& cg, int hh, int j, int r) {
  const int f = document_start(cg, hh);
  return j <= r && j >= f;
}
// The chunk's last start, -1 if none: the keys from it on reach the state leaving the chunk.
__device__ __forceinline__ int last_start(const ChunkGates&) { return -1; }
__device__ __forceinline__ int last_start(const DocumentChunkGates& cg) {
  return static_cast<int>((cg.starts >> 16) & 0xffu) - 1;
}

// The chunk-local inclusive cumsums lane l owns after a warp's scan of the 64 gates: b_{2l}, b_{2l+1}.
struct GatePair {
  float even, odd;
};

// Every warp scans the 64 gates itself (identical instructions, so identical bits): no barrier and
// no shared-memory write between the chunk's arrival and its use.
// `a`: this lane's gates a_{2l}, a_{2l+1}.
__device__ __forceinline__ GatePair scan_gate_pairs(float2 a, int lane) {
  constexpr unsigned kAll = 0xffffffffu;
  const float pair = a.x + a.y;
  float incl = pair;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const float y = __shfl_up_sync(kAll, incl, off);
    if (lane >= off) incl += y;
  }
  float excl = __shfl_up_sync(kAll, incl, 1);
  if (lane == 0) excl = 0.f;
  return {excl + a.x, excl + pair};
}

// The scan of the 64 gates of a chunk in shared memory.
__device__ __forceinline__ GatePair scan_gate_pairs(const float* s_gates, int lane) {
  return scan_gate_pairs(reinterpret_cast<const float2*>(s_gates)[lane], lane);
}

// The gates of a chunk as this lane's fragments need them (scan_gate_pairs, then shuffles).
// `pair`: this lane's gates a_{2l}, a_{2l+1}.
__device__ __forceinline__ ChunkGates scan_gates(float2 pair, int warp, int lane) {
  constexpr unsigned kAll = 0xffffffffu;
  const GatePair bp = scan_gate_pairs(pair, lane);
  const float b_even = bp.even;
  const float b_odd = bp.odd;

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

// The gates of a chunk in shared memory as this lane's fragments need them.
__device__ __forceinline__ ChunkGates scan_gates(const float* s_gates, int warp, int lane) {
  return scan_gates(reinterpret_cast<const float2*>(s_gates)[lane], warp, lane);
}


// ---------------------------------------------------------------------------------------------
// The segment loop: one CTA walks the chunks of its segment with the state on chip. Every forward
// kernel runs it (single-GPU: scalar_decay/forward.cu; LASP-2: scalar_decay/lasp2_forward.cu), each with a prologue that
// supplies the start state and an epilogue that takes the end state.
// ---------------------------------------------------------------------------------------------

// What one CTA runs: the tensors (fla layout, already the full [B, T, H, D] bases), its chunks and its
// (Dv tile, b*H+h).
struct SegmentArgs {
  const uint16_t* q;  // bf16 [B, T, H, DK] (unused by the states kernel)
  const uint16_t* k;  // bf16 [B, T, H, DK]
  const uint16_t* v;  // bf16 [B, T, H, Dv]
  const float* g;     // fp32 [B, T, H]
  uint16_t* o;        // bf16 [B, T, H, Dv] (unused by the states kernel)
  int T, H, Dv;
  int c_begin;        // first chunk of the segment
  int n_chunks;       // chunks of the segment (>= 1)
  int vt, bh;         // Dv tile and b*H+h of this CTA
  float scale;
};

// The loops' time axis over (b, h)'s rows of the fla layout [B, T, H, D] (multiply by D for
// elements): loop token t is row first + t * step, its gate row gate_first + t * step; loop tokens
// outside [lo, hi) are virtual (q = k = v = 0 and a = 0: they change neither the cumsums nor the
// state, and their outputs are not stored).
// In order (the forward): loop token t is token t, [lo, hi) = [0, T), and the ragged chunk is the
// last. Reversed (kReversed, the backward's dk and dv passes, lasp_scalar_decay_*_reversed_*):
// loop token t is token T_pad-1-t, T_pad = 64 * num_chunks, with log-decay a_{T_pad-t} (a_T := 0),
// so the same loops compute sums over later tokens; the T_pad - T virtual tokens come first
// ([lo, hi) = [T_pad - T, T_pad)), which puts every loop chunk boundary on a multiple of 64 of the
// tensors, where the in-order passes have theirs (the gate gradient meets the two directions' states
// there, scalar_decay/backward.cu). The gate of the first real token (token T-1) lies past (b, h)'s last
// token: it is zero-filled, never read (is_gate_read). A template parameter, so the in-order loops
// compile as if it did not exist.
template <bool kReversed>
struct TimeAxis {
  int64_t first, gate_first, step;
  int lo, hi;
  __device__ __forceinline__ TimeAxis(const SegmentArgs& a, int b, int h) {
    const int64_t row_b = (int64_t)b * a.T * a.H + h;  // token 0 of (b, h)
    if constexpr (kReversed) {
      const int t_pad = lasp_sd_num_chunks(a.T) * kChunk;
      first = row_b + (int64_t)(t_pad - 1) * a.H;
      gate_first = first + a.H;
      step = -(int64_t)a.H;
      lo = t_pad - a.T;
      hi = t_pad;
    } else {
      first = gate_first = row_b;
      step = a.H;
      lo = 0;
      hi = a.T;
    }
  }
  // Loop token `tok` is a token of the tensors.
  __device__ __forceinline__ bool is_token(int tok) const {
    if constexpr (kReversed) return tok >= lo;  // the loop ends at hi
    return tok < hi;
  }
  // The gate of loop token `tok` is read (else it is zero).
  __device__ __forceinline__ bool is_gate_read(int tok) const {
    if constexpr (kReversed) return tok > lo;
    return tok < hi;
  }
  // Rows [first valid, valid rows) of the chunk starting at loop token tok0 are tokens.
  __device__ __forceinline__ int first_valid_row(int tok0) const {
    if constexpr (kReversed) return lo - tok0;  // <= 0 except in loop chunk 0
    return 0;
  }
  __device__ __forceinline__ int valid_rows(int tok0) const { return hi - tok0; }
};

// The segment of this CTA: grid (Dv tile, segment, b*H+h) with `chunks_per_segment` chunks per
// segment (the last may hold fewer). Shared by every kernel family whose params carry the same
// field names (lasp_scalar_decay_params, lasp_lasp2_params).
template <class Params>
__device__ __forceinline__ SegmentArgs segment_args(const Params& p) {
  SegmentArgs a;
  a.q = p.q;
  a.k = p.k;
  a.v = p.v;
  a.g = p.g;
  a.o = p.o;
  a.T = p.T;
  a.H = p.H;
  a.Dv = p.Dv;
  a.c_begin = blockIdx.y * p.chunks_per_segment;
  a.n_chunks = min(p.chunks_per_segment, lasp_sd_num_chunks(p.T) - a.c_begin);  // >= 1 by the host's S
  a.vt = blockIdx.x;
  a.bh = blockIdx.z;
  a.scale = p.scale;
  return a;
}

// Where a document that holds the state entering loop chunk `chunk` ends in that chunk
// (p.entry_slots[chunk] = n >= 0, lasp/documents/documents_params.h), that state into document n's
// slot of p.document_states (fp32 [B, N, H, Dk, Dv]); the families' final states of packed
// documents add the chunk's tokens to it. A uniform load and branch. Params: any family's struct
// with H, Dv, entry_slots, documents and document_states (scalar decay's, Gated DeltaNet's).
template <int DK, class Params>
__device__ __forceinline__ void store_document_entry(const Params& p, const SegmentArgs& a, StateRegs<DK>& s,
                                                     const StateLane& ln, int chunk) {
  const int n = p.entry_slots[chunk];
  if (n < 0) return;
  const int64_t b = a.bh / p.H, h = a.bh % p.H;
  state_store<DK>(s, ln, p.document_states + ((b * p.documents + n) * p.H + h) * DK * p.Dv + a.vt * kTileV, p.Dv);
}

// s = e^{lambda} s + tile (fold_step per element).
template <int DK>
__device__ __forceinline__ void state_fold(StateRegs<DK>& s, const StateLane& ln, const float* base, int64_t ld,
                                           float lambda) {
  for_each_state_pair<DK>(s, ln, [&](float& x0, float& x1, int d, int c) {
    const float2 m = *reinterpret_cast<const float2*>(base + d * ld + c);
    x0 = fold_step(x0, lambda, m.x);
    x1 = fold_step(x1, lambda, m.y);
  });
}

// The state as the bf16 operand tiles of the backward's gate gradient (scalar_decay/backward.cu):
// x = hi + lo with hi = bf16(x), lo = bf16(x - hi) (16 significant bits), each laid out as wgmma
// reads it from shared memory, so the gate kernels copy the tiles as they are. `tile` is this CTA's
// 64-column tile of the state, `tiles` the state's column tiles; hi at `base`, lo `rows * 64 *
// tiles` elements further (rows: DK).
// kKMajor (the in-order dq pass, whose state is S^T: rows e of Dv, columns d of Dk): per 64 rows e,
//   S^T[e][..] as the K-major B of Q S: tile e / 64 = [d / 64][e % 64][128 B, lasp::swizzle].
// Else (the reversed dv pass, state dH / sigma: rows d of Dk, columns e of Dv): per 64 columns e,
//   dH as the MN-major B of K dH: tile e / 64 = [d][128 B, lasp::swizzle].
template <int DK, bool kKMajor>
__device__ __forceinline__ void state_store_tiles(StateRegs<DK>& s, const StateLane& ln, uint8_t* base, int tile,
                                                  int tiles) {
  const int64_t lo = (int64_t)DK * 64 * tiles * 2;  // bytes from hi to lo
  for_each_state_pair<DK>(s, ln, [&](float& x0, float& x1, int r, int c) {
    int64_t at;
    if constexpr (kKMajor) {
      at = (int64_t)(r / 64) * tiles * 8192 + tile * 8192 + swizzle(r % 64, c / 8, 64) + 2 * (c % 8);
    } else {
      at = (int64_t)tile * DK * 128 + swizzle(r, c / 8, DK) + 2 * (c % 8);
    }
    const uint32_t hi = pack_bf16x2(x0, x1);
    const uint32_t rest = pack_bf16x2(x0 - __uint_as_float(hi << 16), x1 - __uint_as_float(hi & 0xffff0000u));
    *reinterpret_cast<uint32_t*>(base + at) = hi;
    *reinterpret_cast<uint32_t*>(base + lo + at) = rest;
  });
}

// ---- Chunk-step building blocks (one warp: its 16 output rows and DK/4 state rows) ----

// Per-lane ldmatrix row offsets (swizzled). Every fragment load is a buffer base + one of these + a
// compile-time constant: moving a row by 16 keeps row % 8, and moving a chunk index by 8 is the next
// 64-column block (kBlockBytes further) with the same low 3 bits (the swizzled ones). Lane l
// addresses row (l & 7) + 8 * (one of its bits 3, 4) and chunk + (the other bit) of its 8x8 matrix l / 8.
template <int DK>
struct FragOffsets {
  static constexpr uint32_t kRow16 = 16 * 128;             // bytes of 16 rows of any tile (128-byte rows)
  static constexpr uint32_t kBlockBytes = kChunk * 128;    // bytes of one 64-column block of a Q / K tile
  uint32_t q[4];         // Q A-fragment,  rows 16 warp + .., chunk 2m (+ 8 per 4 k-steps)
  uint32_t k[4];         // K B-fragment,  rows 0.. (+ 16 per key n-tile pair), chunk 2m (+ 8 per 4 k-steps)
  uint32_t v[4];         // V / state B-fragment (.trans), rows 0.. (+ 16 per k-step), chunk 2m = n-tile pair m
  uint32_t kt[DK / 64];  // K^T A-fragment (.trans), rows 0.. (+ 16 per k-step), chunks of state rows 64 mt + 16 warp
  __device__ __forceinline__ FragOffsets(int warp, int lane) {
    const int l_row = lane & 7, l_b3 = (lane >> 3) & 1, l_b4 = lane >> 4;
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      q[m] = swizzle(16 * warp + l_row + 8 * l_b3, 2 * m + l_b4, kChunk);
      k[m] = swizzle(l_row + 8 * l_b4, 2 * m + l_b3, kChunk);
      v[m] = swizzle(l_row + 8 * l_b3, 2 * m + l_b4, kChunk);
    }
#pragma unroll
    for (int mt = 0; mt < DK / 64; ++mt) kt[mt] = swizzle(l_row + 8 * l_b4, (64 * mt + 16 * warp) / 8 + l_b3, kChunk);
  }
};

// The products of a [64 x DK] row tile (Q, or K in Gated DeltaNet's values step and WY kernel),
// one 16-wide k-step ks at a time, for this warp's 16 rows: its A fragment, then o += rows S_n
// (bf16 state copy at sS) and a += rows K^T (all 64 keys).
template <int DK>
__device__ __forceinline__ void row_fragment(uint32_t (&ra)[4], uint32_t sRows, const FragOffsets<DK>& off, int ks) {
  ldsm_x4(ra, sRows + off.q[ks & 3] + FragOffsets<DK>::kBlockBytes * (ks >> 2));
}

// o += rows S_n, k-step ks (B[k = d][n = c] stored row-major -> ldmatrix.trans).
template <int DK>
__device__ __forceinline__ void times_state_step(float (&o)[8][4], const uint32_t (&ra)[4], uint32_t sS,
                                                 const FragOffsets<DK>& off, int ks) {
#pragma unroll
  for (int np = 0; np < 4; ++np) {
    uint32_t sb[4];
    ldsm_x4_trans(sb, sS + off.v[np] + ks * FragOffsets<DK>::kRow16);
    mma_bf16(o[2 * np], ra, sb[0], sb[1]);
    mma_bf16(o[2 * np + 1], ra, sb[2], sb[3]);
  }
}

// a += rows K^T, k-step ks (B[k = d][n = j] = K[j][d]: K stored [j][d] is B's transpose -> plain
// ldmatrix). All 64 key columns, although columns j > 16 warp + 15 are masked in the scores:
// branch-free identical streams, 8 independent accumulator chains, and the critical path (warp 3
// needs every column) unchanged.
template <int DK>
__device__ __forceinline__ void times_keys_step(float (&a)[8][4], const uint32_t (&ra)[4], uint32_t sK,
                                                const FragOffsets<DK>& off, int ks) {
  using F = FragOffsets<DK>;
#pragma unroll
  for (int np = 0; np < 4; ++np) {
    uint32_t kb[4];
    ldsm_x4(kb, sK + off.k[ks & 3] + F::kBlockBytes * (ks >> 2) + np * F::kRow16);
    mma_bf16(a[2 * np], ra, kb[0], kb[1]);
    mma_bf16(a[2 * np + 1], ra, kb[2], kb[3]);
  }
}

// One pass over Dk of this warp's 16 Q rows, sharing the Q fragments: o += Q S_n and a += Q K^T
// (kStateLo as in issue_q_products).
template <int DK, bool kStateLo = false>
__device__ __forceinline__ void q_products(float (&o)[8][4], float (&a)[8][4], uint32_t sQ, uint32_t sS, uint32_t sK,
                                           const FragOffsets<DK>& off, uint32_t sS_lo = 0) {
#pragma unroll
  for (int ks = 0; ks < DK / 16; ++ks) {
    uint32_t qa[4];
    row_fragment<DK>(qa, sQ, off, ks);
    times_state_step<DK>(o, qa, sS, off, ks);
    if constexpr (kStateLo) times_state_step<DK>(o, qa, sS_lo, off, ks);
    times_keys_step<DK>(a, qa, sK, off, ks);
  }
}

// Row r of the inter term gets sigma e^{b_r} (0 in a row the carried state does not reach).
template <class Gates>
__device__ __forceinline__ void scale_inter_rows(float (&o)[8][4], const Gates& cg, float scale) {
  const float row_scale[2] = {scale * exp_nonpos(document_start(cg, 0) < 0 ? cg.row[0] : -INFINITY),
                              scale * exp_nonpos(document_start(cg, 1) < 0 ? cg.row[1] : -INFINITY)};
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      o[nt][2 * hh] *= row_scale[hh];
      o[nt][2 * hh + 1] *= row_scale[hh];
    }
}

// The default row sink of scores_to_p: nothing.
struct NoRowSink {
  __device__ __forceinline__ void operator()(int, float) const {}
};

// Scores get sigma [r >= j] e^{b_r - b_j}, then become bf16 A fragments (accumulator layout of
// n-tiles 2kk, 2kk+1 = A layout of k-step kk). Masked before the exp (-inf -> 0): no branch, no inf.
// `row_sink(hh, x)` takes each fp32 pair sum of fragment row hh before the rounding (a family that
// needs the weighted scores' row sums, mLSTM's normaliser, adds them up; the default does nothing).
// With documents (DocumentChunkGates) the mask also drops the keys before the row's document.
template <class RowSink = NoRowSink, class Gates = ChunkGates>
__device__ __forceinline__ void scores_to_p(uint32_t (&pa)[4][4], const float (&a)[8][4], const Gates& cg, int warp,
                                            int g, int t, float scale, const RowSink& row_sink = RowSink{}) {
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = 16 * warp + 8 * hh + g;
      const int j = 8 * nt + 2 * t;
      const float d0 = exp_nonpos(scores_key(cg, hh, j, r) ? cg.row[hh] - cg.col[nt][0] : -INFINITY);
      const float d1 = exp_nonpos(scores_key(cg, hh, j + 1, r) ? cg.row[hh] - cg.col[nt][1] : -INFINITY);
      const float x0 = scale * a[nt][2 * hh] * d0;
      const float x1 = scale * a[nt][2 * hh + 1] * d1;
      row_sink(hh, x0 + x1);
      pa[nt >> 1][(nt & 1) * 2 + hh] = pack_bf16x2(x0, x1);
    }
}

// The no-exp probe's stand-in for scores_to_p: the scores rounded to bf16 A fragments as they are
// (no mask, no decay, no sigma).
__device__ __forceinline__ void scores_to_p_unweighted(uint32_t (&pa)[4][4], const float (&a)[8][4]) {
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) pa[nt >> 1][(nt & 1) * 2 + hh] = pack_bf16x2(a[nt][2 * hh], a[nt][2 * hh + 1]);
}

// S <- e^gamma S (0 where a document starts in the chunk).
template <int DK, class Gates>
__device__ __forceinline__ void scale_state(StateRegs<DK>& s, const Gates& cg) {
  const float decay = exp_nonpos(last_start(cg) < 0 ? cg.gamma : -INFINITY);
#pragma unroll
  for (int mt = 0; mt < DK / 64; ++mt)
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[mt][nt][e] *= decay;
}

// The key weights e^{gamma - b_j} of the update's K~ = diag(e^{gamma - b}) K (0 for the keys
// before the chunk's last document start).
template <class Gates>
__device__ __forceinline__ void key_weights(float (&wk)[8][2], const Gates& cg) {
  const int lo = last_start(cg);
  const int t = threadIdx.x & 3;  // wk[nt][e] weighs key 8 nt + 2 t + e
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) wk[nt][e] = exp_nonpos(8 * nt + 2 * t + e >= lo ? cg.gamma - cg.col[nt][e] : -INFINITY);
}

// S <- e^gamma S, and the key weights.
template <int DK, class Gates>
__device__ __forceinline__ void decay_state(StateRegs<DK>& s, float (&wk)[8][2], const Gates& cg) {
  scale_state<DK>(s, cg);
  key_weights(wk, cg);
}

// B fragments of V rows 16kk.., n-tiles 2np, 2np+1.
template <int DK>
__device__ __forceinline__ void load_v(uint32_t (&vb)[4][4], uint32_t sV, const FragOffsets<DK>& off, int kk) {
#pragma unroll
  for (int np = 0; np < 4; ++np) ldsm_x4_trans(vb[np], sV + off.v[np] + kk * FragOffsets<DK>::kRow16);
}

// o += P[:, 16kk..16kk+15] V[16kk.., :]  (k-steps kk > warp hold only masked zeros: kept, branch-free).
__device__ __forceinline__ void pv_step(float (&o)[8][4], const uint32_t (&p)[4], const uint32_t (&vb)[4][4]) {
#pragma unroll
  for (int np = 0; np < 4; ++np) {
    mma_bf16(o[2 * np], p, vb[np][0], vb[np][1]);
    mma_bf16(o[2 * np + 1], p, vb[np][2], vb[np][3]);
  }
}

// One K~^T A fragment of the state update: state rows 64 mt + 16 warp .., tokens 16 kk ..
// (ldmatrix.trans of K, A[m = d][k = j] = K[j][d]), each token column j scaled by e^{gamma - b_j}
// in fp32 before rounding to bf16 (kWeighK = false: K unweighted, wk unused; the no-exp probe and,
// on architectures without wgmma, the states loop ask for that).
template <int DK, bool kWeighK>
__device__ __forceinline__ void weighted_kt_fragment(uint32_t (&ka)[4], uint32_t sK, const FragOffsets<DK>& off,
                                                     int mt, int kk, const float (&wk)[8][2]) {
  ldsm_x4_trans(ka, sK + off.kt[mt] + kk * FragOffsets<DK>::kRow16);
  if constexpr (kWeighK) {
    ka[0] = scale_bf16x2(ka[0], wk[2 * kk][0], wk[2 * kk][1]);          // j = 16kk + 2t + {0,1}
    ka[1] = scale_bf16x2(ka[1], wk[2 * kk][0], wk[2 * kk][1]);
    ka[2] = scale_bf16x2(ka[2], wk[2 * kk + 1][0], wk[2 * kk + 1][1]);  // j = 16kk + 8 + 2t + {0,1}
    ka[3] = scale_bf16x2(ka[3], wk[2 * kk + 1][0], wk[2 * kk + 1][1]);
  }
}

// S += K~[16kk.., rows]^T V[16kk.., :] (kWeighK as in weighted_kt_fragment).
template <int DK, bool kWeighK = true>
__device__ __forceinline__ void state_step(StateRegs<DK>& s, uint32_t sK, const FragOffsets<DK>& off, int kk,
                                           const float (&wk)[8][2], const uint32_t (&vb)[4][4]) {
#pragma unroll
  for (int mt = 0; mt < DK / 64; ++mt) {
    uint32_t ka[4];
    weighted_kt_fragment<DK, kWeighK>(ka, sK, off, mt, kk, wk);
#pragma unroll
    for (int np = 0; np < 4; ++np) {
      mma_bf16(s[mt][2 * np], ka, vb[np][0], vb[np][1]);
      mma_bf16(s[mt][2 * np + 1], ka, vb[np][2], vb[np][3]);
    }
  }
}

// The state update over the chunk's 4 k-steps, where no P V shares the V fragments (kWeighK as in
// weighted_kt_fragment; false in the states loop, whose V is already weighted).
template <int DK, bool kWeighK = true>
__device__ __forceinline__ void state_update(StateRegs<DK>& s, uint32_t sK, uint32_t sV, const FragOffsets<DK>& off,
                                             const float (&wk)[8][2]) {
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    uint32_t vb[4][4];
    load_v<DK>(vb, sV, off, kk);
    state_step<DK, kWeighK>(s, sK, off, kk, wk, vb);
  }
}

// bf16 copy of the warp's state rows into the state buffer at byte offset buf (for the next Q S).
template <int DK>
__device__ __forceinline__ void store_state_bf16(uint8_t* smem, uint32_t buf, StateRegs<DK>& s, const StateLane& ln) {
  for_each_state_pair<DK>(s, ln, [&](float& x0, float& x1, int d, int c) {
    *reinterpret_cast<uint32_t*>(smem + buf + swizzle(d, c / 8, DK) + 4 * ln.t) = pack_bf16x2(x0, x1);
  });
}

// Timed variants of the output kernel, kernels of their own (…_probe_*) that forward_bench --probes
// times next to the real one to split its time into memory and compute (kernels/docs/scalar-decay.md,
// "Probes"). Measurement tools only: their O is not the forward's output. kNone is the production
// kernel; every probe keeps its grid, CTA shape, shared-memory map, pipeline depth, barriers and
// O stores.
enum class Probe {
  kNone,
  // Every chunk's Q, K, V, gates through the same cp.async pipeline and O stored to the same
  // addresses, but no math: O = bits of the staged Q, K, V tiles and gates (read from shared
  // memory, so the tiles are used).
  kMemory,
  // All the math, but each stage is filled once (the segment's first kStages chunks) and chunk i
  // computes on whatever stage i % kStages holds; every chunk's O goes to the rows of the segment's
  // first chunk (same store instructions, absorbed by L2 instead of written to HBM).
  kCompute,
  // kCompute without the elementwise gate work: no e^{b_r} row scaling, no causal mask / decay / sigma
  // on the scores, no state decay, no e^{gamma - b_j} weights on K (what is left: ldmatrix, mma,
  // bf16 packing, the fragment and state stores; the gate scan is then dead and compiled out).
  kNoExp,
};

#if LASP_SD_WGMMA
// wgmma building blocks of the output kernels' chunk steps (sm_90a).
// All K~^T A fragments of a chunk's state update (weighted_kt_fragment for every mt, kk).
template <int DK, bool kWeighK>
__device__ __forceinline__ void weighted_kt_fragments(uint32_t (&kta)[DK / 64][4][4], uint32_t sK,
                                                      const FragOffsets<DK>& off, const float (&wk)[8][2]) {
#pragma unroll
  for (int mt = 0; mt < DK / 64; ++mt)
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) weighted_kt_fragment<DK, kWeighK>(kta[mt][kk], sK, off, mt, kk, wk);
}

// Issue (no fence, commit or wait) o = Q S_n and acc = Q K^T: A = Q, B = S_bf (MN-major) / K
// (K-major), all from shared memory. kStateLo: S_n is split, S_bf + S_lo (see output_chunk), and
// o also takes Q S_lo.
template <int DK, bool kStateLo = false>
__device__ __forceinline__ void issue_q_products(float (&o)[8][4], float (&acc)[8][4], uint32_t sQ, uint32_t sS,
                                                 uint32_t sK, uint32_t sS_lo = 0) {
  using F = FragOffsets<DK>;
#pragma unroll
  for (int ks = 0; ks < DK / 16; ++ks) {
    const uint32_t k_step = F::kBlockBytes * (ks >> 2) + 32 * (ks & 3);  // of a K-major Q / K tile
    const uint64_t q_desc = wg::desc_sw128(sQ + k_step);
    wg::mma_ss<wg::Major::kMN>(o, q_desc, wg::desc_sw128(sS + ks * F::kRow16), ks > 0);
    if constexpr (kStateLo) wg::mma_ss<wg::Major::kMN>(o, q_desc, wg::desc_sw128(sS_lo + ks * F::kRow16), true);
    wg::mma_ss<wg::Major::kK>(acc, q_desc, wg::desc_sw128(sK + k_step), ks > 0);
  }
}

// Issue S += K~^T V: A = K~^T from registers, B = V (MN-major).
template <int DK>
__device__ __forceinline__ void issue_state_update(StateRegs<DK>& s, const uint32_t (&kta)[DK / 64][4][4],
                                                   uint32_t sV) {
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)
#pragma unroll
    for (int mt = 0; mt < DK / 64; ++mt)
      wg::mma_rs<wg::Major::kMN>(s[mt], kta[mt][kk], wg::desc_sw128(sV + kk * FragOffsets<DK>::kRow16));
}

// Issue o += P V: A = P from registers (the accumulator layout is the A layout), B = V.
template <int DK>
__device__ __forceinline__ void issue_pv(float (&o)[8][4], const uint32_t (&pa)[4][4], uint32_t sV) {
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) wg::mma_rs<wg::Major::kMN>(o, pa[kk], wg::desc_sw128(sV + kk * FragOffsets<DK>::kRow16));
}

#endif

// What a family adds to output_chunk; NoChunkExtras adds nothing. Members:
//   kStateLo, state_lo: with kStateLo, state_lo holds the bf16 of S_n - S_bf (the same layout as
//                the copy), and o also takes Q S_lo, so Q S_n is exact to 16 significant bits
//                (mLSTM divides its output by a normaliser kept in fp32, which the bf16 copy's
//                rounding would not cancel in);
//   row_sink:    see scores_to_p.
struct NoChunkExtras {
  static constexpr bool kStateLo = false;
  uint32_t state_lo = 0;
  NoRowSink row_sink;
};

// One chunk of the output kernel: o = sigma (diag(e^b) Q S_n + (Q K^T ⊙ D) V) for this warp's 16 rows
// (accumulator layout), S <- S_{n+1}. sQ, sK, sV: the chunk's stage; sS: the bf16 copy of S_n.
// kProbe kNoExp drops the elementwise gate work (see Probe). extras: what a family adds
// (NoChunkExtras). cg: ChunkGates, or DocumentChunkGates for a chunk whose loop masks at document
// starts.
#if LASP_SD_WGMMA
// sm_90a: the four products on the warpgroup's tensor cores (wgmma m64n64k16; the CTA's 4 warps
// are one warpgroup), in three groups so that the warps' elementwise work runs beside them:
//            first S <- e^gamma S and the K~^T fragments (ldmatrix.trans of K, scaled by e^{gamma-b_j})
//   group 1  o = Q S_n, a = Q K^T             A = Q, B = S_bf (MN-major) / K (K-major), shared memory
//   group 2  S += K~^T V                       A = K~^T from registers, B = V (MN-major)
//            wait for group 1: o *= sigma e^{b_r}; P = sigma (a ⊙ D) as bf16 A fragments
//   group 3  o += P V                          A = P from registers, B = V
// and wait for all. Same products, roundings and order of terms as the mma.sync path. The state's
// registers are rewritten only while no wgmma is in flight (ptxas otherwise inserts a wait for
// group 1 right there, serialising it with that work).
template <int DK, Probe kProbe, class Extras = NoChunkExtras, class Gates = ChunkGates>
__device__ __forceinline__ void output_chunk(float (&o)[8][4], StateRegs<DK>& s, uint32_t sQ, uint32_t sK,
                                             uint32_t sV, uint32_t sS, const FragOffsets<DK>& off,
                                             const Gates& cg, int warp, int g, int t, float scale,
                                             const Extras& extras = Extras{}) {
  constexpr bool kGates = kProbe != Probe::kNoExp;
  float wk[8][2];
  if constexpr (kGates) decay_state<DK>(s, wk, cg);
  uint32_t kta[DK / 64][4][4];
  weighted_kt_fragments<DK, kGates>(kta, sK, off, wk);

  float acc[8][4];  // Q K^T
  wg::fence();
  issue_q_products<DK, Extras::kStateLo>(o, acc, sQ, sS, sK, extras.state_lo);
  wg::commit();
  issue_state_update<DK>(s, kta, sV);
  wg::commit();

  wg::wait<1>();
  wg::fence_operands(o);
  wg::fence_operands(acc);
  uint32_t pa[4][4];  // A fragments of sigma (Q K^T ⊙ D), one per 16-token k-step
  if constexpr (kGates) {
    scale_inter_rows(o, cg, scale);
    scores_to_p(pa, acc, cg, warp, g, t, scale, extras.row_sink);
  } else {
    scores_to_p_unweighted(pa, acc);
  }
  wg::fence();
  issue_pv<DK>(o, pa, sV);
  wg::commit();
  wg::wait<0>();
  wg::fence_operands(o);
#pragma unroll
  for (int mt = 0; mt < DK / 64; ++mt) wg::fence_operands(s[mt]);
}

// The chunk's state update alone, S <- e^gamma S + K~^T V, for a pass that stores no O (Gated
// DeltaNet's segment summaries): output_chunk without its Q products.
template <int DK, class Gates = ChunkGates>
__device__ __forceinline__ void state_chunk(StateRegs<DK>& s, uint32_t sK, uint32_t sV, const FragOffsets<DK>& off,
                                            const Gates& cg) {
  float wk[8][2];
  decay_state<DK>(s, wk, cg);
  uint32_t kta[DK / 64][4][4];
  weighted_kt_fragments<DK, true>(kta, sK, off, wk);
  wg::fence();
  issue_state_update<DK>(s, kta, sV);
  wg::commit();
  wg::wait<0>();
#pragma unroll
  for (int mt = 0; mt < DK / 64; ++mt) wg::fence_operands(s[mt]);
}
#else
// Other architectures: warp-level mma.sync, one pass over Dk for Q S_n and Q K^T sharing the Q
// fragments, then P V and the state update sharing the V fragments.
template <int DK, Probe kProbe, class Extras = NoChunkExtras, class Gates = ChunkGates>
__device__ __forceinline__ void output_chunk(float (&o)[8][4], StateRegs<DK>& s, uint32_t sQ, uint32_t sK,
                                             uint32_t sV, uint32_t sS, const FragOffsets<DK>& off,
                                             const Gates& cg, int warp, int g, int t, float scale,
                                             const Extras& extras = Extras{}) {
  constexpr bool kGates = kProbe != Probe::kNoExp;
  float acc[8][4] = {};  // Q K^T
  uint32_t pa[4][4];     // A fragments of sigma (Q K^T ⊙ D), one per 16-token k-step
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[nt][e] = 0.f;
  q_products<DK, Extras::kStateLo>(o, acc, sQ, sS, sK, off, extras.state_lo);
  float wk[8][2];
  if constexpr (kGates) {
    scale_inter_rows(o, cg, scale);
    scores_to_p(pa, acc, cg, warp, g, t, scale, extras.row_sink);
    decay_state<DK>(s, wk, cg);
  } else {
    scores_to_p_unweighted(pa, acc);
  }
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    uint32_t vb[4][4];
    load_v<DK>(vb, sV, off, kk);
    pv_step(o, pa[kk], vb);
    state_step<DK, kGates>(s, sK, off, kk, wk, vb);
  }
}

// The chunk's state update alone (see the sm_90a build's).
template <int DK, class Gates = ChunkGates>
__device__ __forceinline__ void state_chunk(StateRegs<DK>& s, uint32_t sK, uint32_t sV, const FragOffsets<DK>& off,
                                            const Gates& cg) {
  float wk[8][2];
  decay_state<DK>(s, wk, cg);
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    uint32_t vb[4][4];
    load_v<DK>(vb, sV, off, kk);
    state_step<DK, true>(s, sK, off, kk, wk, vb);
  }
}
#endif

// The default chunk hook of the segment loops: nothing.
struct NoChunkHook {
  template <class S, class Lane>
  __device__ __forceinline__ void operator()(S&, const Lane&, int) const {}
};

// The values the output loop's products take from a chunk: by default its V tile as it is. A
// family whose update writes other values (Gated DeltaNet's u = (I + L)^{-1} diag(beta) (V -
// diag(e^b) K S_n), lasp/gated_delta/values.cuh) passes a type with the same two members:
//   issue(sbase, i, chunk, tok0, valid, tid): cp.async copies of what it needs of the segment's
//       chunk i (sequence chunk `chunk`, first token tok0, `valid` rows of tokens) into its own
//       shared memory, inside the chunk's commit group (so the loop's wait covers them);
//   apply<DK>(sbase, i, sK, sV, sS, off, cg, warp, lane): called by every thread after the chunk
//       has landed, before its products, with the bf16 state copy sS of S_n; rewrites the V tile
//       at sV (its barriers are its own, and its last one publishes the tile to the products).
struct PlainValues {
  static constexpr bool kPlain = true;
  __device__ __forceinline__ void issue(uint32_t, int, int, int, int, int) const {}
  template <int DK>
  __device__ __forceinline__ void apply(uint32_t, int, uint32_t, uint32_t, uint32_t, const FragOffsets<DK>&,
                                        const ChunkGates&, int, int) const {}
};

// Runs one CTA's segment of an output kernel (O for every token; the states kernels run
// run_states_segment).
//   start(s, lane) -> bool: fills the fp32 start state (called once by every thread, before any
//                   cp.async; it may contain __syncthreads). If it returns false (uniformly across the
//                   CTA), the CTA still runs its loop but stores no O and does not call end.
//   end(s, lane, lambda): the epilogue, given the segment's end state and its log-decay
//                   (sum of the chunks' gamma in chunk order).
//   at_chunk(s, lane, c): called by every thread at the start of loop chunk c (of the sequence),
//                   with the state entering it (the backward's passes write some of them).
//   values:         what the products take as the chunk's values (PlainValues: V; in order only).
// kProbe: Probe::kNone except in the output kernel's probes. kStoreO = false: a states pass that
// wants only the end state (Gated DeltaNet's segment summaries): no Q tile (its shared memory,
// lasp_sd_update_smem_bytes, leaves room for two CTAs per SM), no O, each chunk only its values
// step and state update (state_chunk).
template <int DK, Probe kProbe = Probe::kNone, bool kReversed = false, bool kStoreO = true, class Start,
          class End, class AtChunk = NoChunkHook, class Values = PlainValues>
__device__ __forceinline__ void run_segment_with(const SegmentArgs& a, Start&& start, End&& end,
                                                 AtChunk&& at_chunk = AtChunk{}, const Values& values = Values{}) {
  static_assert(Values::kPlain || (!kReversed && kProbe == Probe::kNone),
                "a values step runs in the in-order production loop only");
  // Without O the loop reads no Q: its stages hold K and V only (lasp_sd_update_smem_bytes).
  using L = Layout<DK, kStoreO, kStages, true>;
  static_assert(L::kBytes == (kStoreO ? lasp_sd_output_smem_bytes(DK) : lasp_sd_update_smem_bytes(DK)),
                "shared-memory map and host formula disagree");
  constexpr int kQKChunks = DK / 8;
  constexpr int kVChunks = kTileV / 8;
  static_assert(DK == 64 || DK == 128, "Dk must be 64 or 128");
  constexpr bool kMath = kProbe != Probe::kMemory;
  constexpr bool kEveryChunkFromMemory = kProbe == Probe::kNone || kProbe == Probe::kMemory;

  extern __shared__ __align__(1024) uint8_t smem[];  // aligned: see Layout
  const uint32_t sbase = smem_addr(smem);
  // `& 3` is a no-op in the 4-warp CTA that tells the compiler warp < 4 (nvcc 13.0 without it:
  // output_dk64 210 registers instead of 203, lasp2_output_dk64 228 instead of 223).
  const int tid = threadIdx.x, warp = (tid >> 5) & 3, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int vt = a.vt, bh = a.bh;
  const int b = bh / a.H, h = bh % a.H;
  const int T = a.T, Dv = a.Dv;
  const int c_begin = a.c_begin;
  const int n_chunks = a.n_chunks;

  const TimeAxis<kReversed> axis(a, b, h);
  const int64_t row_bt0 = axis.first;  // loop token 0 of (b, h)
  const int64_t qk_stride = axis.step * DK, v_stride = axis.step * Dv;
  const uint16_t* q = a.q + row_bt0 * DK;
  const uint16_t* k = a.k + row_bt0 * DK;
  const uint16_t* v = a.v + row_bt0 * Dv + vt * kTileV;
  const float* gate = a.g + axis.gate_first;

  // Chunks copied from global memory: all, or for the compute probes one per stage.
  const int n_loaded = kEveryChunkFromMemory ? n_chunks : min(n_chunks, kStages);
  // Chunk i of this segment -> stage i % kStages.
  auto issue_chunk = [&](int i) {
    const uint32_t stage = sbase + L::stage(i);
    const uint32_t gates = sbase + L::gates(i);
    const int tok0 = (c_begin + i) * kChunk;
    if constexpr (kReversed) {
      const int lo = axis.first_valid_row(tok0), hi = axis.valid_rows(tok0);
      copy_tile_range_async<kQKChunks>(stage + L::kQ, q + tok0 * qk_stride, qk_stride, lo, hi, a.q, tid);
      copy_tile_range_async<kQKChunks>(stage + L::kK, k + tok0 * qk_stride, qk_stride, lo, hi, a.k, tid);
      copy_tile_range_async<kVChunks>(stage + L::kV, v + tok0 * v_stride, v_stride, lo, hi, a.v, tid);
      if (tid < kChunk) {
        const bool ok = axis.is_gate_read(tok0 + tid);
        cp_async_4(gates + 4 * tid, ok ? gate + (tok0 + tid) * axis.step : a.g, ok);
      }
    } else {
      const int valid = min(kChunk, T - tok0);
      if constexpr (kStoreO) copy_tile_async<kQKChunks>(stage + L::kQ, q + tok0 * qk_stride, qk_stride, valid, tid);
      copy_tile_async<kQKChunks>(stage + L::kK, k + tok0 * qk_stride, qk_stride, valid, tid);
      copy_tile_async<kVChunks>(stage + L::kV, v + tok0 * v_stride, v_stride, valid, tid);
      if (tid < kChunk) {
        const bool ok = tid < valid;
        cp_async_4(gates + 4 * tid, ok ? gate + (tok0 + tid) * axis.step : gate, ok);
      }
      values.issue(sbase, i, c_begin + i, tok0, valid, tid);
    }
  };

  const StateLane ln{16 * warp, g, t};
  float s[DK / 64][8][4];
  const FragOffsets<DK> off(warp, lane);

  // A CTA whose start failed still runs the loop (on whatever state it has) but stores nothing: an
  // early exit here would make the compiler treat the whole loop as divergent code and give up the
  // uniform datapath (+25 integer instructions per chunk, +4 registers in output_dk128). Issuing the
  // first cp.async before `start` (to overlap a wait) costs registers: 32 B of spills in output_dk128.
  const bool store = start(s, ln);
  // Prologue: chunks 0 .. kStages-2 in flight (one commit group each, empty ones included, so the
  // wait count below is uniform).
#pragma unroll
  for (int i = 0; i < kStages - 1; ++i) {
    if (i < n_loaded) issue_chunk(i);
    cp_async_commit();
  }
  store_state_bf16<DK>(smem, L::kSbf, s, ln);

  float lambda = 0.f;  // segment log-decay, summed over chunks in order (deterministic)
  for (int i = 0; i < n_chunks; ++i) {
    cp_async_wait<kStages - 2>();
#if LASP_SD_WGMMA
    // This thread's landed chunk and its bf16 state writes, visible to wgmma's async proxy.
    wg::fence_proxy_async();
#endif
    // After this barrier: chunk i is in smem for every thread; every warp is done with chunk i-1,
    // so its stage can be refilled and the bf16 state buffer it read can be rewritten.
    __syncthreads();
    if (i + kStages - 1 < n_loaded) issue_chunk(i + kStages - 1);
    cp_async_commit();

    const uint32_t stage = L::stage(i);
    const uint32_t sK = sbase + stage + L::kK;
    const uint32_t sV = sbase + stage + L::kV;
    const float* s_gates = reinterpret_cast<const float*>(smem + L::gates(i));
    const ChunkGates cg = scan_gates(s_gates, warp, lane);
    lambda += cg.gamma;

    const uint32_t sQ = sbase + stage + L::kQ;
    const uint32_t sS = sbase + L::kSbf + (i & 1) * L::kSbfBytes;
    const int tok0 = (c_begin + (kEveryChunkFromMemory ? i : 0)) * kChunk;  // first token of the O rows
    float o[8][4];  // O rows of this warp, 64 columns (8 n-tiles)
    at_chunk(s, ln, c_begin + i);
    if constexpr (kMath) {
      values.template apply<DK>(sbase, i, sK, sV, sS, off, cg, warp, lane);
      if constexpr (kStoreO)
        output_chunk<DK, kProbe>(o, s, sQ, sK, sV, sS, off, cg, warp, g, t, a.scale);
      else
        state_chunk<DK>(s, sK, sV, off, cg);
    }
    if constexpr (kStoreO) {  // a pass without O has no o to store
      // bf16 pair (columns 8 nt + 2t, +1) of O row 16 warp + 8 hh + g.
      auto o_pair = [&](int nt, int hh) -> uint32_t {
        if constexpr (kMath) {
          return pack_bf16x2(o[nt][2 * hh], o[nt][2 * hh + 1]);
        } else {
          const int r = 16 * warp + 8 * hh + g;
          const uint8_t* st = smem + stage;
          const uint32_t in_chunk = 4 * t;  // the pair's byte offset in its 16-byte chunk nt
          const uint32_t qw = *reinterpret_cast<const uint32_t*>(st + L::kQ + swizzle(r, nt, kChunk) + in_chunk);
          const uint32_t kw = *reinterpret_cast<const uint32_t*>(st + L::kK + swizzle(r, nt, kChunk) + in_chunk);
          const uint32_t vw = *reinterpret_cast<const uint32_t*>(st + L::kV + swizzle(r, nt, kChunk) + in_chunk);
          return qw ^ kw ^ vw ^ reinterpret_cast<const uint32_t*>(s_gates)[r];
        }
      };
      // O rows of virtual tokens (the ragged chunk) are not stored.
      uint16_t* o_tile = a.o + row_bt0 * Dv + vt * kTileV + 2 * t;
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int tok = tok0 + 16 * warp + 8 * hh + g;
        if (store && (kReversed ? axis.is_token(tok) : tok < T)) {
          uint16_t* dst = o_tile + tok * v_stride;
#pragma unroll
          for (int nt = 0; nt < 8; ++nt) *reinterpret_cast<uint32_t*>(dst + 8 * nt) = o_pair(nt, hh);
        }
      }
    }
    if (kMath && i + 1 < n_chunks) store_state_bf16<DK>(smem, L::kSbf + ((i + 1) & 1) * L::kSbfBytes, s, ln);
  }

  if (store) end(s, ln, lambda);
}

// ---------------------------------------------------------------------------------------------
// The states loop: a segment's end state from zero and its log-decay (pass 1 of the single-GPU
// forward, kernel 1 of LASP-2),
//   M = sum_t e^{Lambda - B_t} k_t^T v_t,   Lambda = sum_t a_t,   B_t = a_1 + ... + a_t,
// over the segment's tokens t, which is the output loop's S <- e^gamma S + K~^T V from zero,
// unrolled. The chunks are walked from the segment's last to its first, so when a chunk arrives
// the log-decay after it (E, summed so far) is known, and with it every token's weight to the
// segment's end, e^{E + gamma - b_t} (exponent <= 0). The weights scale the chunk's V rows in
// shared memory (V~ = diag(w) V, one rounding to bf16 as the output loop's K~) and the update is a
// plain K^T V~ into an accumulator that is never rescaled: 8 wgmma per chunk at Dk 128, both
// operands in shared memory, queued on the tensor cores behind the previous chunk's, and the loop
// streams K and V at 72 % of the DRAM peak (Nsight Compute, B=1 T=32K). The forward walk it
// replaces decayed the state every chunk, which had to wait for the previous chunk's products, and
// ran 64 mma.sync, 24 ldmatrix and 32 K weightings per thread and chunk: it was bound by what an SM
// issues. Same result up to rounding, not the same bits; every kernel that needs a segment's
// (M, Lambda) gets them from here, so every LASP-2 mode sees the same bits.
// ---------------------------------------------------------------------------------------------
constexpr int kStatesStages = LASP_SD_STATES_STAGES;
static_assert(kStatesStages >= 2, "the pipeline needs at least two stages");

// V~ = diag(w) V for this thread's share of a swizzled V tile: half `half` (16-byte chunks
// 4 half .. 4 half + 3, 32 columns) of row r, all of whose elements take weight w. A quarter-warp's
// 16-byte accesses (4 rows, both halves) fall in 8 different chunk columns: no bank conflicts.
__device__ __forceinline__ void weigh_v_half_row(uint8_t* tile, int r, int half, float w) {
#pragma unroll
  for (int c = 4 * half; c < 4 * half + 4; ++c) {
    uint4* chunk = reinterpret_cast<uint4*>(tile + swizzle(r, c, kChunk));
    uint4 x = *chunk;
    x.x = scale_bf16x2(x.x, w, w);
    x.y = scale_bf16x2(x.y, w, w);
    x.z = scale_bf16x2(x.z, w, w);
    x.w = scale_bf16x2(x.w, w, w);
    *chunk = x;
  }
}

#if LASP_SD_WGMMA
// Issue S += K^T V~ for one chunk: A = K^T read in place (K stored [token][d] is an MN-major A, one
// 64-column block per 64 state rows), B = V~ (MN-major), all from shared memory.
template <int DK>
__device__ __forceinline__ void issue_states_update(StateRegs<DK>& s, uint32_t sK, uint32_t sV) {
  using F = FragOffsets<DK>;
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)
#pragma unroll
    for (int mt = 0; mt < DK / 64; ++mt)
      wg::mma_ss<wg::Major::kMN, wg::Major::kMN>(s[mt], wg::desc_sw128(sK + mt * F::kBlockBytes + kk * F::kRow16),
                                                 wg::desc_sw128(sV + kk * F::kRow16), true);
}
#endif

// Runs one CTA's segment of a states kernel (grid as the output kernels': Dv tile, segment, b*H+h).
//   end(s, lane, lambda): the epilogue, given the segment's end state M and its log-decay Lambda
//                   (the chunks' gamma summed from the last chunk to the first).
template <int DK, bool kReversed = false, class End>
__device__ __forceinline__ void run_states_segment(const SegmentArgs& a, End&& end) {
  using L = Layout<DK, false, kStatesStages>;
  static_assert(L::kBytes == lasp_sd_states_smem_bytes(DK), "shared-memory map and host formula disagree");
  static_assert(DK == 64 || DK == 128, "Dk must be 64 or 128");
  constexpr unsigned kAll = 0xffffffffu;

  extern __shared__ __align__(1024) uint8_t smem[];  // aligned: see Layout
  const uint32_t sbase = smem_addr(smem);
  const int tid = threadIdx.x, warp = (tid >> 5) & 3, lane = tid & 31;
  const int b = a.bh / a.H, h = a.bh % a.H;
  const int T = a.T;
  const TimeAxis<kReversed> axis(a, b, h);
  const int64_t row_bt0 = axis.first;  // loop token 0 of (b, h)
  const int64_t k_stride = axis.step * DK, v_stride = axis.step * a.Dv;
  const uint16_t* k = a.k + row_bt0 * DK;
  const uint16_t* v = a.v + row_bt0 * a.Dv + a.vt * kTileV;
  const float* gate = a.g + axis.gate_first;

  // Step j takes chunk n_chunks - 1 - j of the segment, in stage j % kStatesStages.
  auto issue_step = [&](int j) {
    const uint32_t stage = sbase + L::stage(j);
    const int tok0 = (a.c_begin + a.n_chunks - 1 - j) * kChunk;
    if constexpr (kReversed) {
      const int lo = axis.first_valid_row(tok0), hi = axis.valid_rows(tok0);
      copy_tile_range_async<DK / 8>(stage + L::kK, k + tok0 * k_stride, k_stride, lo, hi, a.k, tid);
      copy_tile_range_async<kTileV / 8>(stage + L::kV, v + tok0 * v_stride, v_stride, lo, hi, a.v, tid);
      if (tid < kChunk) {
        const bool ok = axis.is_gate_read(tok0 + tid);
        cp_async_4(sbase + L::gates(j) + 4 * tid, ok ? gate + (tok0 + tid) * axis.step : a.g, ok);
      }
    } else {
      const int valid = min(kChunk, T - tok0);
      copy_tile_async<DK / 8>(stage + L::kK, k + tok0 * k_stride, k_stride, valid, tid);
      copy_tile_async<kTileV / 8>(stage + L::kV, v + tok0 * v_stride, v_stride, valid, tid);
      if (tid < kChunk) {
        const bool ok = tid < valid;
        cp_async_4(sbase + L::gates(j) + 4 * tid, ok ? gate + (tok0 + tid) * axis.step : gate, ok);
      }
    }
  };

  const StateLane ln{16 * warp, lane >> 2, lane & 3};
  StateRegs<DK> s;
  state_zero<DK>(s, ln);
#if !LASP_SD_WGMMA
  const FragOffsets<DK> off(warp, lane);
  const float unweighted[8][2] = {};  // state_update's key weights, unused with kWeighK = false
#endif
#pragma unroll
  for (int j = 0; j < kStatesStages - 1; ++j) {
    if (j < a.n_chunks) issue_step(j);
    cp_async_commit();
  }

  const int row = tid >> 1;  // the V row this thread weighs, and which half of it
  const int half = tid & 1;
  float after = 0.f;  // E: log-decay of the segment's chunks after this step's, summed from the last
  for (int j = 0; j < a.n_chunks; ++j) {
    cp_async_wait<kStatesStages - 2>();
    __syncthreads();  // step j's chunk has landed, for every thread
    const uint32_t stage = L::stage(j);
    const GatePair bp = scan_gate_pairs(reinterpret_cast<const float*>(smem + L::gates(j)), lane);
    const float gamma = __shfl_sync(kAll, bp.odd, 31);
    const float b_even = __shfl_sync(kAll, bp.even, row >> 1);
    const float b_odd = __shfl_sync(kAll, bp.odd, row >> 1);
    const float b_row = (row & 1) ? b_odd : b_even;
    weigh_v_half_row(smem + stage + L::kV, row, half, exp_nonpos(after + (gamma - b_row)));
#if LASP_SD_WGMMA
    wg::fence_proxy_async();  // V~ visible to wgmma's async proxy
    wg::wait<0>();            // step j-1's products are done with its stage
#endif
    __syncthreads();  // V~ complete; no warp reads step j-1's stage any more: refill it
    if (j + kStatesStages - 1 < a.n_chunks) issue_step(j + kStatesStages - 1);
    cp_async_commit();
#if LASP_SD_WGMMA
    wg::fence();
    issue_states_update<DK>(s, sbase + stage + L::kK, sbase + stage + L::kV);
    wg::commit();
#else
    state_update<DK, false>(s, sbase + stage + L::kK, sbase + stage + L::kV, off, unweighted);
#endif
    after += gamma;
  }
#if LASP_SD_WGMMA
  wg::wait<0>();
#pragma unroll
  for (int mt = 0; mt < DK / 64; ++mt) wg::fence_operands(s[mt]);
#endif
  end(s, ln, after);
}

// ---------------------------------------------------------------------------------------------
// The two-role segment loop: the single-GPU output kernel where S = 1 (one CTA per SM keeps every
// sequence whole, so a single 4-warp CTA would run each chunk's dependent steps alone on its SM).
// Two warpgroups that overlap chunk by chunk, and a warp that feeds them:
//   state group (warps 0-3): advances the fp32 state S_n -> S_{n+1} in registers and writes the
//     bf16 copy of S_{n+1}: one chunk ahead;
//   output group (warps 4-7): O of chunk n from Q, K, V and the bf16 S_n, stored to global memory;
//   loading warp (warp 8): loads every chunk, Q, K, V by the Tensor Memory Accelerator and the
//     gates by cp.async, kRolesStages chunks in flight.
// They meet only at one mbarrier per stage (its chunk has landed) and at named barriers
// (RoleBarriers): bf16 state written (which also frees the previous chunk's stage for the loading
// warp) and read (double buffer). So a chunk costs the longer role's step instead of both in
// sequence, and neither role spends instructions on copies (measured: 2 % faster at
// B=4, T=8K than the state group's cp.async copies; one thread of either group issuing
// the tensor copies was slower). Same products, roundings and order of terms as output_chunk: the
// same bits as the one-warpgroup kernel.
// ---------------------------------------------------------------------------------------------
constexpr int kRolesThreads = LASP_SD_ROLES_THREADS;
constexpr int kRolesStages = LASP_SD_ROLES_STAGES;
static_assert(kRolesThreads == 2 * kThreads + 32, "the two-role kernel is two 4-warp groups and a loading warp");
static_assert(kRolesStages >= 2, "the pipeline needs at least two stages");

// Named barriers (id 0 is __syncthreads), each pairing the groups: one arrives, one syncs.
struct RoleBarriers {
  static constexpr int kSbfFull = 1;              // + buffer: bf16 state copy written
  static constexpr int kSbfEmpty = kSbfFull + 2;  // + buffer: bf16 state copy read
  static constexpr int kOStaged = kSbfEmpty + 2;  // the output group's own: O's staging tile written / free
  static_assert(kOStaged < 16, "16 named barriers per CTA");
};

// Rows 16 warp + 8 hh + g, columns 8 nt + 2 t (+1) of a [64 x 64] bf16 tile at `tile` in the
// swizzled layout (the V tile's, a K-major A operand's): the accumulator's pairs, rounded, each
// row scaled by row_scale[hh].
__device__ __forceinline__ void store_rows_bf16(uint8_t* tile, const float (&acc)[8][4], const float (&row_scale)[2],
                                                int warp, int g, int t) {
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int r = 16 * warp + 8 * hh + g;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
      *reinterpret_cast<uint32_t*>(tile + swizzle(r, nt, kChunk) + 4 * t) =
          pack_bf16x2(row_scale[hh] * acc[nt][2 * hh], row_scale[hh] * acc[nt][2 * hh + 1]);
  }
}

// One chunk's O rows of an output warpgroup (its kThreads threads, `o` as store_rows_bf16 takes
// it) out through the staging tile `tile` (shared address `tile_addr`): written once the previous
// chunk's copy has read the tile, then copied by `issuer` (one thread of the warpgroup) to Dv
// columns `col0`.. of rows `token0`.. of (b, h) in `o_map`; rows past T are not written. `barrier`
// is a named barrier of the warpgroup's own. The issuer waits for its last copy after the loop
// (tma::store_wait_all).
__device__ __forceinline__ void store_o_staged(const float (&o)[8][4], uint8_t* tile, uint32_t tile_addr, int barrier,
                                               bool issuer, const lasp_tensor_map& o_map, int col0, int h,
                                               int token0, int b, int warp, int g, int t) {
  if (issuer) tma::store_wait_read<0>();
  named_barrier_sync(barrier, kThreads);
  const float one[2] = {1.f, 1.f};
  store_rows_bf16(tile, o, one, warp, g, t);
  tma::fence_shared_for_copies();
  named_barrier_sync(barrier, kThreads);
  if (issuer) {
    tma::store_4d(o_map, col0, h, token0, b, tile_addr);
    tma::store_commit();
  }
}

// The tensor maps the two-role kernel's copies read q, k and v through (lasp_sd_roles_params).
struct QkvMaps {
  const lasp_tensor_map& q;
  const lasp_tensor_map& k;
  const lasp_tensor_map& v;
};

// By one thread of a loading warp: the tensor copies of a chunk's Q and K (every 64-column block)
// and of its V tile vt of (b, h), from token tok0, into the stage at `stage` of the shared-memory
// map L (rows beyond T arrive as zeros), their bytes counted on the stage's mbarrier `bar`, with
// `extra_bytes` of copies the caller issues next on the same phase.
template <int DK, class L>
__device__ __forceinline__ void load_chunk_tiles(uint32_t stage, uint32_t bar, const QkvMaps& maps, int vt, int h,
                                                 int tok0, int b, uint32_t extra_bytes = 0) {
  constexpr uint32_t kBlockBytes = kChunk * 128;  // one box: 64 tokens x 64 columns, a 64-column block of a tile
  tma::arrive_expect_bytes(bar, (2 * DK / 64 + 1) * kBlockBytes + extra_bytes);
#pragma unroll
  for (int kb = 0; kb < DK / 64; ++kb) {
    tma::load_4d(stage + L::kQ + kb * kBlockBytes, maps.q, 64 * kb, h, tok0, b, bar);
    tma::load_4d(stage + L::kK + kb * kBlockBytes, maps.k, 64 * kb, h, tok0, b, bar);
  }
  tma::load_4d(stage + L::kV, maps.v, vt * kTileV, h, tok0, b, bar);
}

// State role, one chunk: S <- e^gamma S + K~^T V (output_chunk's state update on its own), in
// three calls so that the next chunk's preparation runs while this chunk's products do
// (run_roles_segment_with). What the update needs of its chunk besides the state: the gates and,
// on sm_90a, the K~^T A fragments (elsewhere the key weights, applied inside the mma.sync update).
template <int DK>
struct StateStep {
  ChunkGates cg;
#if LASP_SD_WGMMA
  uint32_t kta[DK / 64][4][4];
#else
  float wk[8][2];
#endif
};

// The chunk's StateStep (gates from shared memory, K from its stage); reads no state.
template <int DK>
__device__ __forceinline__ void prepare_state_step(StateStep<DK>& st, const float* s_gates, uint32_t sK,
                                                   const FragOffsets<DK>& off, int warp, int lane) {
  st.cg = scan_gates(s_gates, warp, lane);
#if LASP_SD_WGMMA
  float wk[8][2];
  key_weights(wk, st.cg);
  weighted_kt_fragments<DK, true>(st.kta, sK, off, wk);
#else
  key_weights(st.wk, st.cg);
#endif
}

// Starts the update: on sm_90a its products are issued and left running (the state's registers and
// st.kta must not change until finish_state_step); elsewhere it runs to completion here.
template <int DK>
__device__ __forceinline__ void start_state_step(StateRegs<DK>& s, const StateStep<DK>& st, uint32_t sK, uint32_t sV,
                                                 const FragOffsets<DK>& off) {
  scale_state<DK>(s, st.cg);
#if LASP_SD_WGMMA
  wg::fence();
  issue_state_update<DK>(s, st.kta, sV);
  wg::commit();
#else
  state_update<DK>(s, sK, sV, off, st.wk);
#endif
}

template <int DK>
__device__ __forceinline__ void finish_state_step(StateRegs<DK>& s) {
#if LASP_SD_WGMMA
  wg::wait<0>();
#pragma unroll
  for (int mt = 0; mt < DK / 64; ++mt) wg::fence_operands(s[mt]);
#endif
}

// Output role, one chunk: o = sigma (diag(e^b) Q S_n + (Q K^T ⊙ D) V) for this warp's 16 rows
// (output_chunk without the state update). sS: the bf16 copy of S_n; sbf_read() is called once
// the products that read it are done.
template <int DK, class SbfRead>
__device__ __forceinline__ void output_role_chunk(float (&o)[8][4], uint32_t sQ, uint32_t sK, uint32_t sV, uint32_t sS,
                                                  const FragOffsets<DK>& off, const ChunkGates& cg, int warp, int g,
                                                  int t, float scale, SbfRead&& sbf_read) {
  float acc[8][4];  // Q K^T
#if LASP_SD_WGMMA
  wg::fence();
  issue_q_products<DK>(o, acc, sQ, sS, sK);
  wg::commit();
  wg::wait<0>();
  wg::fence_operands(o);
  wg::fence_operands(acc);
#else
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[nt][e] = acc[nt][e] = 0.f;
  q_products<DK>(o, acc, sQ, sS, sK, off);
#endif
  sbf_read();
  uint32_t pa[4][4];  // A fragments of sigma (Q K^T ⊙ D), one per 16-token k-step
  scale_inter_rows(o, cg, scale);
  scores_to_p(pa, acc, cg, warp, g, t, scale);
#if LASP_SD_WGMMA
  wg::fence();
  issue_pv<DK>(o, pa, sV);
  wg::commit();
  wg::wait<0>();
  wg::fence_operands(o);
#else
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    uint32_t vb[4][4];
    load_v<DK>(vb, sV, off, kk);
    pv_step(o, pa[kk], vb);
  }
#endif
}

// Runs one CTA's segment with the two roles and the loading warp (kRolesThreads threads), loading
// through `maps` and storing O through `o_map` (o's map in the boxes of v's): the output group
// writes each chunk's O into a staging tile that one of its threads copies out (a warp's own stores
// in flight held it at its next named barrier: kernels/docs/scalar-decay.md). start, end and
// at_chunk as in run_segment_with: start is called by both groups
// (the state group's s is the one used), end and at_chunk by the state group only. Needs the Tensor
// Memory Accelerator (sm_90 and later); the host launches it nowhere else (ForwardPlan), and
// elsewhere it traps.
template <int DK, class Start, class End, class AtChunk = NoChunkHook>
__device__ __forceinline__ void run_roles_segment_with(const SegmentArgs& a, const QkvMaps& maps,
                                                       const lasp_tensor_map& o_map, Start&& start, End&& end,
                                                       AtChunk&& at_chunk = AtChunk{}) {
#if __CUDA_ARCH__ >= 900
  using L = Layout<DK, true, kRolesStages>;
  using B = RoleBarriers;
  static_assert(DK == 64 || DK == 128, "Dk must be 64 or 128");
  // After the tiles and gates: one mbarrier per stage (its chunk has landed). In the dynamic
  // buffer, not in static shared memory, which would move the buffer off its 1024-byte alignment.
  constexpr uint32_t kLanded = L::kBytes;
  static_assert(kLanded % 8 == 0, "mbarriers are 8-byte aligned");
  // After the mbarriers, from the next 1024-byte boundary (the copies' swizzle): O's staging tile.
  constexpr uint32_t kOStage = (kLanded + 8 * kRolesStages + 1023) / 1024 * 1024;
  static_assert(kOStage + kChunk * kTileV * 2 == lasp_sd_roles_smem_bytes(DK),
                "shared-memory map and host formula disagree");
  constexpr int kPair = 2 * kThreads;  // arrivals per phase of kSbfEmpty: the two groups
  constexpr int kAll = kRolesThreads;  // arrivals per phase of kSbfFull: the groups and the loading warp
  constexpr uint32_t kLandedArrivals = 1 + 32;  // the issuing lane's byte count and the loading warp's gate copies

  extern __shared__ __align__(1024) uint8_t smem[];  // aligned: see Layout
  const uint32_t sbase = smem_addr(smem);
  const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  const bool state_group = threadIdx.x < 128, loading_warp = threadIdx.x >= 256;
  const int g = lane >> 2, t = lane & 3;
  const int T = a.T, n_chunks = a.n_chunks;
  const int b = a.bh / a.H, h = a.bh % a.H;
  const int64_t row_bt0 = (int64_t)b * T * a.H + h;  // token 0 of (b, h)
  const StateLane ln{16 * warp, g, t};
  const FragOffsets<DK> off(warp, lane);
  auto sbf = [](int i) { return L::kSbf + (i & 1) * L::kSbfBytes; };  // bf16 copy of S_i
  // Chunk i is in stage i % kRolesStages; its arrival completes phase i / kRolesStages of that
  // stage's mbarrier. A stage is refilled only after both groups are done with its chunk (see the
  // loading warp's loop), so no waiter can miss a phase.
  auto landed_bar = [&](int i) { return sbase + kLanded + 8 * (i % kRolesStages); };
  auto wait_landed = [&](int i) { tma::wait(landed_bar(i), static_cast<uint32_t>(i / kRolesStages) & 1u); };

  if (threadIdx.x == 0) {
#pragma unroll
    for (int i = 0; i < kRolesStages; ++i) tma::init(landed_bar(i), kLandedArrivals);
    tma::fence_init();
    tma::prefetch_map(maps.q);
    tma::prefetch_map(maps.k);
    tma::prefetch_map(maps.v);
    tma::prefetch_map(o_map);
  }
  __syncthreads();

  const float* gate = a.g + row_bt0;
  // Chunk i of the segment -> stage i % kRolesStages, by the loading warp: lane 0 issues the tensor
  // copies (rows beyond T arrive as zeros), every lane copies two gates (zero beyond T) and
  // arrives once they have landed.
  auto issue_chunk = [&](int i) {
    const uint32_t stage = sbase + L::stage(i), bar = landed_bar(i);
    const int tok0 = (a.c_begin + i) * kChunk;
    if (lane == 0) load_chunk_tiles<DK, L>(stage, bar, maps, a.vt, h, tok0, b);
#pragma unroll
    for (int r = lane; r < kChunk; r += 32) {
      const bool ok = tok0 + r < T;
      cp_async_4(sbase + L::gates(i) + 4 * r, ok ? gate + (int64_t)(tok0 + r) * a.H : gate, ok);
    }
    tma::arrive_after_cp_async(bar);
  };
  if (loading_warp) {
    for (int i = 0; i < kRolesStages && i < n_chunks; ++i) issue_chunk(i);
    // S_i written (kSbfFull) means the state group is done with chunk i - 1's stage (its update
    // read it before S_i), and the phase completes only once every output warp has reached chunk
    // i, past its reads of chunk i - 1: chunk i + kRolesStages - 1 goes there. This warp takes
    // part in every phase, and waits for each (an arrival could count towards the phase before).
    for (int i = 0; i < n_chunks; ++i) {
      named_barrier_sync(B::kSbfFull + i % 2, kAll);
      if (i >= 1 && i + kRolesStages - 1 < n_chunks) issue_chunk(i + kRolesStages - 1);
    }
    return;
  }

  float s[DK / 64][8][4];
  const bool store = start(s, ln);

  if (state_group) {
    store_state_bf16<DK>(smem, sbf(0), s, ln);
#if LASP_SD_WGMMA
    wg::fence_proxy_async();
#endif
    named_barrier_arrive(B::kSbfFull + 0, kAll);
    // Chunk j's StateStep once it has landed. The chain is pipelined by one chunk: chunk i + 1 is
    // prepared while chunk i's update products run, so what is left in series per chunk is the
    // decay, the products and the bf16 copy (measured: 7 % faster at B=4, T=8K than
    // preparing each chunk after the previous one's bf16 copy).
    auto arrive_and_prepare = [&](int j, StateStep<DK>& st) {
      wait_landed(j);
      prepare_state_step<DK>(st, reinterpret_cast<const float*>(smem + L::gates(j)), sbase + L::stage(j) + L::kK,
                             off, warp, lane);
    };
    StateStep<DK> step;  // chunk i's
    arrive_and_prepare(0, step);
    float lambda = 0.f;  // segment log-decay, summed over chunks in order (deterministic)
    for (int i = 0; i < n_chunks; ++i) {
      const uint32_t stage = sbase + L::stage(i);
      lambda += step.cg.gamma;
      at_chunk(s, ln, a.c_begin + i);
      start_state_step<DK>(s, step, stage + L::kK, stage + L::kV, off);
      StateStep<DK> next;
      if (i + 1 < n_chunks) arrive_and_prepare(i + 1, next);
      finish_state_step<DK>(s);
      if (i + 1 < n_chunks) {
        // S_{i+1}'s buffer last held S_{i-1}: the output group must be done reading it.
        if (i >= 1) named_barrier_sync(B::kSbfEmpty + (i + 1) % 2, kPair);
        store_state_bf16<DK>(smem, sbf(i + 1), s, ln);
#if LASP_SD_WGMMA
        wg::fence_proxy_async();
#endif
        named_barrier_arrive(B::kSbfFull + (i + 1) % 2, kAll);
        step = next;
      }
    }
    if (store) end(s, ln, lambda);
  } else {
    const bool o_issuer = threadIdx.x == kThreads;  // the output group's first thread copies O out
    for (int i = 0; i < n_chunks; ++i) {
      wait_landed(i);
      named_barrier_sync(B::kSbfFull + i % 2, kAll);
      const uint32_t stage = sbase + L::stage(i);
      const ChunkGates cg = scan_gates(reinterpret_cast<const float*>(smem + L::gates(i)), warp, lane);
      // S_i's buffer is written again (with S_{i+2}) only if there is a chunk i + 2.
      auto sbf_read = [&] {
        if (i + 2 < n_chunks) named_barrier_arrive(B::kSbfEmpty + i % 2, kPair);
      };
      float o[8][4];  // O rows of this warp, 64 columns (8 n-tiles)
      output_role_chunk<DK>(o, stage + L::kQ, stage + L::kK, stage + L::kV, sbase + sbf(i), off, cg, warp, g, t,
                            a.scale, sbf_read);
      if (store)
        store_o_staged(o, smem + kOStage, sbase + kOStage, B::kOStaged, o_issuer, o_map, a.vt * kTileV, h,
                       (a.c_begin + i) * kChunk, b, warp, g, t);
    }
    if (o_issuer) tma::store_wait_all();
  }
#else
  __trap();
#endif
}


}  // namespace sd
}  // namespace lasp
