// Final states of packed documents for scalar decay: the state after each document's last token
// (the maths: lasp/scalar_decay/document_states_params.h; the grid and the layouts:
// lasp/documents/final_states_params.h).
//
// One CTA per (document, b*H+h, 64 columns of Dv): the state entering the chunk that holds the
// document's last token (the chunk loop stored it in the document's slot), decayed to that token,
// plus the document's tokens of that chunk, on the CUDA cores in fp32. Warp 0 scans the log-decays
// from the last token down, so every weight is one exponential of a sum inside the document (no
// difference of cumsums); the chunk's keys (bf16) and weighted values (fp32) then sit in shared
// memory, and each thread accumulates a quarter of the rows of one column, reading each key row
// 8 values at a time, a load every lane of the warp shares.
#include <math.h>
#include <stdint.h>

#include "lasp/documents/final_states.cuh"
#include "lasp/scalar_decay/document_states_params.h"

namespace lasp {
namespace sd {

constexpr int kDocThreads = LASP_DOCUMENT_STATES_THREADS;
constexpr int kDocChunk = LASP_DOCUMENT_WORD_TOKENS;  // the chunk loops' chunk

template <int DK>
__device__ __forceinline__ void document_states(const lasp_document_states_params& p) {
  using Column = documents::StateColumn<DK>;
  constexpr int kRowsPerThread = Column::kRows;
  __shared__ float s_weight[kDocChunk];  // e^{sum of the log-decays after token j}, j from lo
  __shared__ float s_entry;              // the entering state's weight
  __shared__ __align__(16) uint16_t s_k[kDocChunk][DK];  // bf16, as loaded (static shared memory < 48 KiB)
  __shared__ float s_v[kDocChunk][64];

  const Column column(p);
  const int b = column.b, h = column.h, tile = column.tile, col = column.col, row0 = column.row0;
  const documents::DocumentTail tail = column.tail;
  float acc[kRowsPerThread];
#pragma unroll
  for (int m = 0; m < kRowsPerThread; ++m) acc[m] = 0.f;
  if (tail.ends_here) {
    const int lo = tail.lo, rows = tail.rows, end = lo + rows;
    const bool enters = tail.enters;
    const int64_t row_b = (int64_t)b * p.T;  // token 0 of batch row b
    if (threadIdx.x < 32) {
      // Weights from the last token down: lane l of pass r takes token end - 1 - (32 r + l).
      float carry = 0.f;
      for (int r0 = 0; r0 < rows; r0 += 32) {
        const int r = r0 + threadIdx.x;
        const float a = r < rows ? p.g[(row_b + end - 1 - r) * p.H + h] : 0.f;
        float inclusive = a;
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
          const float x = __shfl_up_sync(0xffffffffu, inclusive, off);
          if ((int)threadIdx.x >= off) inclusive += x;
        }
        float exclusive = __shfl_up_sync(0xffffffffu, inclusive, 1);
        if (threadIdx.x == 0) exclusive = 0.f;
        if (r < rows) s_weight[rows - 1 - r] = expf(carry + exclusive);
        carry += __shfl_sync(0xffffffffu, inclusive, 31);
      }
      if (threadIdx.x == 0) s_entry = expf(carry);  // the sum over [lo, end) = [j0, end)
    }
    if (enters) column.load(acc);
    for (int e = threadIdx.x; e < rows * DK; e += kDocThreads) {
      const int r = e / DK, d = e % DK;
      s_k[r][d] = p.k[((row_b + lo + r) * p.H + h) * DK + d];
    }
    __syncthreads();  // the weights
    for (int e = threadIdx.x; e < rows * 64; e += kDocThreads) {
      const int r = e / 64, c = e % 64;
      s_v[r][c] = s_weight[r] * documents::bf16_value(p.v[((row_b + lo + r) * p.H + h) * p.Dv + tile * 64 + c]);
    }
    if (enters) {
      const float w = s_entry;
#pragma unroll
      for (int m = 0; m < kRowsPerThread; ++m) acc[m] *= w;
    }
    __syncthreads();  // the keys and weighted values
    for (int r = 0; r < rows; ++r) {
      const float v = s_v[r][col];
      const uint4* keys = reinterpret_cast<const uint4*>(&s_k[r][row0]);  // 8 bf16 per load
#pragma unroll
      for (int m8 = 0; m8 < kRowsPerThread / 8; ++m8) {
        const uint4 k8 = keys[m8];
        const uint32_t pairs[4] = {k8.x, k8.y, k8.z, k8.w};
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          acc[8 * m8 + 2 * q] = fmaf(__uint_as_float(pairs[q] << 16), v, acc[8 * m8 + 2 * q]);
          acc[8 * m8 + 2 * q + 1] = fmaf(__uint_as_float(pairs[q] & 0xffff0000u), v, acc[8 * m8 + 2 * q + 1]);
        }
      }
    }
  }
  column.store(acc);
}

}  // namespace sd
}  // namespace lasp

// Instantiated from kernels/instances.rs, per Dk in {64, 128}:
//   lasp_scalar_decay_document_states_dk*  grid (num_offsets - 1, B*H, Dv / 64), block
//                                          LASP_DOCUMENT_STATES_THREADS, static shared memory
