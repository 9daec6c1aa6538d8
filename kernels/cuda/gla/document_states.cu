// Final states of packed documents for GLA: the state after each document's last token
// (the maths: lasp/gla/document_states_params.h; the grid and the layouts:
// lasp/documents/final_states_params.h).
//
// One CTA per (document, b*H+h, 64 columns of Dv): the state entering the chunk that holds the
// document's last token (the output loop stored it in the document's slot), decayed to that
// token row by row, plus the document's tokens of that chunk, on the CUDA cores in fp32. Thread d
// scans dimension d's log-decays from the last token down (the tile staged in shared memory first,
// in coalesced rows), so every weight is one exponential of a sum inside the document, and leaves
// the weighted key k_j[d] e^{...} in place of the log-decay; each thread then accumulates a
// quarter of the rows of one column.
#include <math.h>
#include <stdint.h>

#include "lasp/documents/final_states.cuh"
#include "lasp/gla/document_states_params.h"

namespace lasp {
namespace gla {

constexpr int kDocThreads = LASP_DOCUMENT_STATES_THREADS;
constexpr int kDocChunk = LASP_DOCUMENT_WORD_TOKENS;  // the chunk loops' chunk

template <int DK>
__device__ __forceinline__ void document_states(const lasp_document_states_params& p) {
  using Column = documents::StateColumn<DK>;
  constexpr int kRowsPerThread = Column::kRows;
  static_assert(DK <= kDocThreads, "one scanning thread per key dimension");
  // The log-decays, then (in place, by the scan) the weighted keys: 32 KiB at Dk = 128.
  __shared__ __align__(16) float s_weighted[kDocChunk][DK];
  __shared__ uint16_t s_v[kDocChunk][64];  // bf16, as loaded
  __shared__ __align__(16) float s_entry[DK];  // the entering state's weight per row

  const Column column(p);
  const int b = column.b, h = column.h, tile = column.tile, row0 = column.row0;
  const documents::DocumentTail tail = column.tail;
  float acc[kRowsPerThread];
#pragma unroll
  for (int m = 0; m < kRowsPerThread; ++m) acc[m] = 0.f;
  if (tail.ends_here) {
    const int lo = tail.lo, rows = tail.rows;
    const int64_t token0 = ((int64_t)b * p.T + lo) * p.H + h;  // (b, lo, h)
    for (int e = threadIdx.x; e < rows * DK; e += kDocThreads) {
      const int r = e / DK, d = e % DK;
      s_weighted[r][d] = p.g[(token0 + (int64_t)r * p.H) * DK + d];
    }
    for (int e = threadIdx.x; e < rows * 64; e += kDocThreads) {
      const int r = e / 64, c = e % 64;
      s_v[r][c] = p.v[(token0 + (int64_t)r * p.H) * p.Dv + tile * 64 + c];
    }
    if (tail.enters) column.load(acc);
    __syncthreads();  // the log-decays and values
    if (threadIdx.x < DK) {
      const int d = threadIdx.x;
      float after = 0.f;  // the sum of the log-decays after token r, inside the document
#pragma unroll 8
      for (int r = rows - 1; r >= 0; --r) {
        const float a = s_weighted[r][d];
        const float key = documents::bf16_value(p.k[(token0 + (int64_t)r * p.H) * DK + d]);
        s_weighted[r][d] = key * expf(after);
        after += a;
      }
      s_entry[d] = expf(after);  // the sum over [lo, end) = [j0, end)
    }
    __syncthreads();  // the weighted keys and the entering weights
    if (tail.enters) {
#pragma unroll
      for (int m = 0; m < kRowsPerThread; ++m) acc[m] *= s_entry[row0 + m];
    }
    column.add_tokens(acc, s_weighted, s_v, rows);
  }
  column.store(acc);
}

}  // namespace gla
}  // namespace lasp

// Instantiated from kernels/instances.rs, per Dk in {64, 128}:
//   lasp_gla_document_states_dk*  grid (num_offsets - 1, B*H, Dv / 64), block
//                                 LASP_DOCUMENT_STATES_THREADS, static shared memory
