// The scalar-decay family's side of the LASP-2 exchange: the shard summary (M, Lambda) and its
// folds. The states kernels' segment states, their fold into the PE's own slot tile and into the
// shard-local prefixes, and the staging and fold of the other PEs' tiles; the protocol around
// them (epochs, waits, puts) is lasp/exchange/chain.cuh.
//   tile = M [Dk][64] row-major, then a 16-byte trailer (Lambda, 0, 0, 0);
//   fold: P = e^{Lambda} P + M, elementwise (sd::fold_step), in chain order.
#pragma once
#include <stdint.h>

#include "lasp/exchange/chain.cuh"
#include "lasp/scalar_decay/chunk.cuh"
#include "lasp/scalar_decay/lasp2_params.h"

namespace lasp {
namespace l2 {

using exchange::call_epoch;
using exchange::chain_pe;
using exchange::chain_position;
using exchange::stamp;
using sd::StateLane;
using sd::StateRegs;

// The CTA's segment of a states or output launch; grid z spans the launch's head group, which
// starts at head p.bh_begin.
__device__ __forceinline__ sd::SegmentArgs group_segment_args(const lasp_lasp2_params& p) {
  sd::SegmentArgs a = sd::segment_args(p);
  a.bh += p.bh_begin;
  return a;
}

// The states kernels' CTA (grid lasp2_states_grid): segment s's end state from zero -> ws_m [bh][s],
// its log-decay -> ws_lambda [bh][s]; the shard's tokens in order (the forward) or from last to
// first (kReversed, the backward: sd::TimeAxis).
template <int DK, bool kReversed>
__device__ __forceinline__ void shard_states(const lasp_lasp2_params& p) {
  const sd::SegmentArgs a = group_segment_args(p);
  const int64_t slot = (int64_t)a.bh * p.num_segments + blockIdx.y;
  sd::run_states_segment<DK, kReversed>(a, [&](StateRegs<DK>& s, const StateLane& ln, float lambda) {
    sd::state_store<DK>(s, ln, p.ws_m + slot * DK * p.Dv + a.vt * sd::kTileV, p.Dv);
    if (a.vt == 0 && threadIdx.x == 0) p.ws_lambda[slot] = lambda;
  });
}

// Folds the segment states of tile (bh, vt) from zero, s ascending, for s < count:
// acc = e^{Lambda_s} acc + M_s, and calls step(s, acc, d, c) after each s with the float4 of rows d,
// columns c..c+3 of the tile; `acc` ends as the fold of all `count` segments. Thread i owns float4
// columns (i % 16) of rows i / 16 + 32 j (FoldLane); fold_put and segment_prefix share this loop, so
// M_me and the prefixes L_s are the same fold.
// The fold is a chain of memory round trips, so the loads of LASP2_FOLD_BATCH segments are issued
// together: S segments cost ceil(S / LASP2_FOLD_BATCH) round trips. One segment at a time (an
// earlier version) cost one per segment, 8 at S = 8: about 10 us of fold_put before its puts and as
// much of segment_prefix before the output kernel (Nsight Compute, B=1 T=32K).
struct FoldLane {
  static constexpr int kCols = LASP2_TILE_V / 4;               // float4 columns of a tile row
  static constexpr int kRowStep = LASP2_FOLD_THREADS / kCols;  // rows between a thread's rows
  static constexpr int kMaxRows = 128 / kRowStep;              // a thread's rows at Dk = 128 (the largest)
  int rows;                                                    // a thread's rows at this Dk
  int d0, c;                                                   // its first row, its first column
  __device__ __forceinline__ explicit FoldLane(int Dk)
      : rows(Dk / kRowStep), d0(threadIdx.x / kCols), c((threadIdx.x % kCols) * 4) {}
  __device__ __forceinline__ int row(int j) const { return d0 + j * kRowStep; }
};
template <class Step>
__device__ __forceinline__ void fold_segments(const lasp_lasp2_params& p, int bh, int vt, int count,
                                              float4 (&acc)[FoldLane::kMaxRows], Step&& step) {
  constexpr int kMaxRows = FoldLane::kMaxRows, kBatch = LASP2_FOLD_BATCH;
  const FoldLane ln(p.Dk);
  const int64_t state_elems = (int64_t)p.Dk * p.Dv;
  const float* const m0 = p.ws_m + (int64_t)bh * p.num_segments * state_elems + vt * LASP2_TILE_V +
                          (int64_t)ln.d0 * p.Dv + ln.c;
  const float* const lam = p.ws_lambda + (int64_t)bh * p.num_segments;
#pragma unroll
  for (int j = 0; j < kMaxRows; ++j) acc[j] = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int s0 = 0; s0 < count; s0 += kBatch) {
    float4 m[kBatch][kMaxRows];
    float l[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      if (s0 + i >= count) continue;
      l[i] = __ldg(lam + s0 + i);
#pragma unroll
      for (int j = 0; j < kMaxRows; ++j)
        if (j < ln.rows)
          m[i][j] = __ldg(reinterpret_cast<const float4*>(m0 + (s0 + i) * state_elems +
                                                          (int64_t)j * FoldLane::kRowStep * p.Dv));
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      if (s0 + i >= count) continue;
#pragma unroll
      for (int j = 0; j < kMaxRows; ++j) {
        if (j >= ln.rows) continue;
        acc[j].x = sd::fold_step(acc[j].x, l[i], m[i][j].x);
        acc[j].y = sd::fold_step(acc[j].y, l[i], m[i][j].y);
        acc[j].z = sd::fold_step(acc[j].z, l[i], m[i][j].z);
        acc[j].w = sd::fold_step(acc[j].w, l[i], m[i][j].w);
        step(s0 + i, acc[j], ln.row(j), ln.c);
      }
    }
  }
}

// The chain tiles go through shared memory (free until a chunk pipeline starts): cp.async puts a
// whole batch of tiles in flight at once, so a batch costs about one L2 round trip, where folding
// from registers paid one round trip per tile (the last PE at W = 4 folds three slot tiles and a
// segment tile: ~6 us before its chunk loop against ~2 us on PE 0, in timelines). Staged rows
// are padded to 72 floats: the 4 rows a half-warp's float2 reads touch then start 8 banks apart, so
// the reads are free of bank conflicts (4-way unpadded). A slot tile's 16-byte trailer
// (Lambda_u, 0, 0, 0) follows its rows.
constexpr int kStagedLd = sd::kTileV + 8;  // floats per staged row
constexpr int kStagedTiles = 3;            // staged slots; the output kernel's last one holds the segment tile
template <int DK>
constexpr uint32_t staged_tile_bytes() {
  return DK * kStagedLd * 4 + 16;
}
static_assert(kStagedTiles * staged_tile_bytes<128>() <= lasp2_output_smem_bytes(128), "staged tiles exceed smem");
static_assert(kStagedTiles * staged_tile_bytes<64>() <= lasp2_output_smem_bytes(64), "staged tiles exceed smem");
// fold_arrived_tiles uses the first kStagedTiles - 1 slots: the shared memory of a kernel that folds
// chain tiles and nothing else (carry_in).
static_assert((kStagedTiles - 1) * staged_tile_bytes<128>() == lasp2_carry_in_smem_bytes(128), "host formula");
static_assert((kStagedTiles - 1) * staged_tile_bytes<64>() == lasp2_carry_in_smem_bytes(64), "host formula");

// Starts copying rows [0, DK) x columns [0, 64) of an fp32 tile (row stride `ld` floats) into the
// staged slot at shared address `slot`, with the 16 bytes after the rows if `trailer` (a slot tile).
template <int DK>
__device__ __forceinline__ void stage_tile(uint32_t slot, const float* rows, int64_t ld, bool trailer) {
  constexpr int kPiecesPerRow = sd::kTileV / 4;  // 16-byte pieces
#pragma unroll 4
  for (int i = threadIdx.x; i < DK * kPiecesPerRow; i += sd::kThreads) {
    const int row = i / kPiecesPerRow, piece = i % kPiecesPerRow;
    cp_async_16(slot + (row * kStagedLd + 4 * piece) * 4, rows + row * ld + 4 * piece, true);
  }
  if (trailer && threadIdx.x == 0) cp_async_16(slot + DK * kStagedLd * 4, rows + DK * ld, true);
}

// s = e^{lambda} s + the staged tile at `slot` (fold_step per element, as sd::state_fold).
template <int DK>
__device__ __forceinline__ void fold_staged(StateRegs<DK>& s, const StateLane& ln, const uint8_t* slot, float lambda) {
  sd::state_fold<DK>(s, ln, reinterpret_cast<const float*>(slot), kStagedLd, lambda);
}

// Lambda_u of a staged slot tile (its trailer's first float).
template <int DK>
__device__ __forceinline__ float staged_lambda(const uint8_t* slot) {
  return *reinterpret_cast<const float*>(slot + DK * kStagedLd * 4);
}

// s = the fold of what the schedule delivered, in chain order: e^{Lambda_u} s + M_u per tile u
// (slot tiles [parity][u][bh][vt]); staged through shared memory at `smem` (the first
// kStagedTiles - 1 staged slots), kStagedTiles - 1 tiles per batch. Call after Schedule::wait.
template <int DK, class Schedule>
__device__ __forceinline__ void fold_arrived_tiles(const lasp_lasp2_params& p, StateRegs<DK>& s, const StateLane& ln,
                                                   int bh, int vt, uint8_t* smem) {
  constexpr uint32_t kTileBytes = staged_tile_bytes<DK>();
  const uint32_t sbase = smem_addr(smem);
  Schedule::fold_arrived(
      p, bh, vt, lasp2_slot_tile_floats(DK), kStagedTiles - 1,
      [&](int j, const float* tile) { stage_tile<DK>(sbase + j * kTileBytes, tile, sd::kTileV, true); },
      [&](int j) {
        const uint8_t* slot = smem + j * kTileBytes;
        fold_staged<DK>(s, ln, slot, staged_lambda<DK>(slot));
      });
}

}  // namespace l2
}  // namespace lasp
