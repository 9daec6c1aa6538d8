// Final states of packed documents for Gated DeltaNet: the state after each document's last token
// (the maths: lasp/gated_delta/document_states_params.h; the grid and the layouts:
// lasp/documents/final_states_params.h).
//
// One CTA per (document, b*H+h, 64 columns of Dv): the delta rule's steps over the document's
// tokens of the chunk that holds its last token (at most 64), in fp32 on the CUDA cores, from the
// state entering the chunk (the walk stored it in the document's slot) or from zero. The chunk's
// keys (bf16), values, log-decays and write strengths sit in shared memory; thread i holds a
// quarter of the rows of column i % 64, and each step's k S_{t-1} is the sum of the four quarters'
// partial sums, exchanged through shared memory (double-buffered: one barrier per step).
#include <math.h>
#include <stdint.h>

#include "lasp/documents/final_states.cuh"
#include "lasp/gated_delta/document_states_params.h"

namespace lasp {
namespace gdn {

constexpr int kDocThreads = LASP_DOCUMENT_STATES_THREADS;
constexpr int kDocChunk = LASP_DOCUMENT_WORD_TOKENS;  // the chunk loops' chunk

template <int DK>
__device__ __forceinline__ void document_states(const lasp_document_states_params& p) {
  using Column = documents::StateColumn<DK>;
  constexpr int kQuarters = Column::kQuarters, kRowsPerThread = Column::kRows;
  __shared__ __align__(16) uint16_t s_k[kDocChunk][DK];
  __shared__ float s_v[kDocChunk][64];
  __shared__ float s_decay[kDocChunk], s_beta[kDocChunk];
  __shared__ float s_partial[2][kQuarters][64];

  const Column column(p);
  const int b = column.b, h = column.h, tile = column.tile, col = column.col, quarter = column.quarter,
            row0 = column.row0;
  const documents::DocumentTail tail = column.tail;
  float s[kRowsPerThread];
#pragma unroll
  for (int m = 0; m < kRowsPerThread; ++m) s[m] = 0.f;
  if (tail.ends_here) {
    const int lo = tail.lo, rows = tail.rows;
    const bool enters = tail.enters;
    const int64_t row_b = (int64_t)b * p.T;  // token 0 of batch row b
    if (enters) column.load(s);
    for (int e = threadIdx.x; e < rows * DK; e += kDocThreads) {
      const int r = e / DK, d = e % DK;
      s_k[r][d] = p.k[((row_b + lo + r) * p.H + h) * DK + d];
    }
    for (int e = threadIdx.x; e < rows * 64; e += kDocThreads) {
      const int r = e / 64, c = e % 64;
      s_v[r][c] = documents::bf16_value(p.v[((row_b + lo + r) * p.H + h) * p.Dv + tile * 64 + c]);
    }
    if (threadIdx.x < rows) {
      const int64_t at = (row_b + lo + threadIdx.x) * p.H + h;
      // A document's first token starts from zero, so its own decay is never needed: 0 there
      // keeps a start's forgetting log-decay (-128) out of the arithmetic.
      s_decay[threadIdx.x] = !enters && threadIdx.x == 0 ? 0.f : expf(p.g[at]);
      s_beta[threadIdx.x] = p.beta[at];
    }
    __syncthreads();
    for (int r = 0; r < rows; ++r) {
      const uint16_t* key = &s_k[r][row0];
      float partial = 0.f;
#pragma unroll
      for (int m = 0; m < kRowsPerThread; ++m) partial = fmaf(documents::bf16_value(key[m]), s[m], partial);
      s_partial[r & 1][quarter][col] = partial;
      __syncthreads();
      float ks = 0.f;  // (k_r S_{r-1}) of this column, the quarters summed in order
#pragma unroll
      for (int q = 0; q < kQuarters; ++q) ks += s_partial[r & 1][q][col];
      // S_r = e^{a_r} (S_{r-1} - beta k^T (k S_{r-1})) + beta k^T v_r, per element of the column.
      const float decay = s_decay[r], erased = s_beta[r] * ks, written = s_beta[r] * s_v[r][col];
#pragma unroll
      for (int m = 0; m < kRowsPerThread; ++m) {
        const float k = documents::bf16_value(key[m]);
        s[m] = fmaf(k, written, decay * fmaf(-k, erased, s[m]));
      }
    }
  }
  column.store(s);
}

}  // namespace gdn
}  // namespace lasp

// Instantiated from kernels/instances.rs, per Dk in {64, 128}:
//   lasp_gated_delta_document_states_dk*  grid (num_offsets - 1, B*H, Dv / 64), block
//                                         LASP_DOCUMENT_STATES_THREADS, static shared memory
