// Final states of packed documents for scalar decay: the state after each document's last token
// (lasp/scalar_decay/document_states_params.h has the maths, the grid and the layouts).
//
// One CTA per (document, b*H+h, 64 columns of Dv): the state entering the block that holds the
// document's last token, decayed to that token, plus the document's tokens of that block (at most
// LASP_SD_BLOCK_CHUNKS * 64), on the CUDA cores in fp32. Warp 0 scans the log-decays from the last
// token down, so every weight is one exponential of a sum inside the document (no difference of
// cumsums); the tokens then pass through shared memory LASP_SD_DOCUMENT_STATES_ROWS at a time.
#include <math.h>
#include <stdint.h>

#include "lasp/mma.cuh"
#include "lasp/scalar_decay/document_states_params.h"
#include "lasp/scalar_decay/forward_params.h"

namespace lasp {
namespace sd {

constexpr int kDocThreads = LASP_SD_DOCUMENT_STATES_THREADS;
constexpr int kDocRows = LASP_SD_DOCUMENT_STATES_ROWS;
constexpr int kBlockTokens = LASP_SD_BLOCK_CHUNKS * 64;

__device__ __forceinline__ int64_t document_offset(const lasp_sd_document_states_params& p, int i) {
  return p.offsets_are_int64 ? static_cast<const int64_t*>(p.cu_seqlens)[i]
                             : static_cast<const int32_t*>(p.cu_seqlens)[i];
}

__device__ __forceinline__ float bf16_value(uint16_t x) { return __uint_as_float(static_cast<uint32_t>(x) << 16); }

// Element (d, c) of one (b, h)'s state in a block-states slot: the hi + lo bf16 pair the in-order
// pass stored (state_store_tiles<DK, true>), column c of column tile `tile` of `tiles`.
__device__ __forceinline__ float block_state_at(const uint8_t* slot, int d, int c, int tile, int tiles, int dk) {
  const int64_t lo = (int64_t)dk * 64 * tiles * 2;
  const int64_t at = (int64_t)(d / 64) * tiles * 8192 + tile * 8192 + swizzle(d % 64, c / 8, 64) + 2 * (c % 8);
  return bf16_value(*reinterpret_cast<const uint16_t*>(slot + at)) +
         bf16_value(*reinterpret_cast<const uint16_t*>(slot + lo + at));
}

template <int DK>
__device__ __forceinline__ void document_states(const lasp_sd_document_states_params& p) {
  constexpr int kRowsPerThread = DK / (kDocThreads / 64);
  __shared__ float s_weight[kBlockTokens];  // e^{sum of the log-decays after token j}, j from lo
  __shared__ float s_entry;                 // the entering state's weight
  __shared__ __align__(16) float s_k[kDocRows][DK];
  __shared__ float s_v[kDocRows][64];

  const int n = blockIdx.x, bh = blockIdx.y, tile = blockIdx.z;
  const int b = bh / p.H, h = bh % p.H;
  const int docs = p.num_offsets - 1;
  // Thread i: column i % 64 of the tile, rows row0 .. row0 + kRowsPerThread - 1, so that a warp
  // reads each key row's values as float4s every lane shares (one load per 4 rows).
  const int col = threadIdx.x % 64, row0 = threadIdx.x / 64 * kRowsPerThread;
  float* out = p.ht + (((int64_t)b * docs + n) * p.H + h) * DK * p.Dv + tile * 64 + col;

  const int64_t first = document_offset(p, n) - p.shard_start;  // may be < 0: began on an earlier PE
  const int64_t end = document_offset(p, n + 1) - p.shard_start;
  float acc[kRowsPerThread];
#pragma unroll
  for (int m = 0; m < kRowsPerThread; ++m) acc[m] = 0.f;
  if (end > first && end >= 1 && end <= p.T) {
    const int j0 = (int)((end - 1) / kBlockTokens) * kBlockTokens;
    const bool enters = first < j0;  // the document holds the state entering the block
    const int lo = enters ? j0 : (int)first;
    const int rows = (int)end - lo;
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
    __syncthreads();
    if (enters) {
      const uint8_t* slot = static_cast<const uint8_t*>(p.block_states) +
                            ((int64_t)bh * lasp_sd_num_blocks(p.T) + j0 / kBlockTokens) * DK * p.Dv * 4;
      const float w = s_entry;
#pragma unroll
      for (int m = 0; m < kRowsPerThread; ++m)
        acc[m] = w * block_state_at(slot, row0 + m, col, tile, p.Dv / 64, DK);
    }
    for (int r0 = 0; r0 < rows; r0 += kDocRows) {
      const int staged = min(kDocRows, rows - r0);
      __syncthreads();  // the previous rows are read
      for (int e = threadIdx.x; e < staged * DK; e += kDocThreads) {
        const int r = e / DK, d = e % DK;
        s_k[r][d] = bf16_value(p.k[((row_b + lo + r0 + r) * p.H + h) * DK + d]);
      }
      for (int e = threadIdx.x; e < staged * 64; e += kDocThreads) {
        const int r = e / 64, c = e % 64;
        s_v[r][c] = s_weight[r0 + r] * bf16_value(p.v[((row_b + lo + r0 + r) * p.H + h) * p.Dv + tile * 64 + c]);
      }
      __syncthreads();
      for (int r = 0; r < staged; ++r) {
        const float v = s_v[r][col];
        const float4* keys = reinterpret_cast<const float4*>(&s_k[r][row0]);
#pragma unroll
        for (int m4 = 0; m4 < kRowsPerThread / 4; ++m4) {
          const float4 k4 = keys[m4];
          acc[4 * m4 + 0] = fmaf(k4.x, v, acc[4 * m4 + 0]);
          acc[4 * m4 + 1] = fmaf(k4.y, v, acc[4 * m4 + 1]);
          acc[4 * m4 + 2] = fmaf(k4.z, v, acc[4 * m4 + 2]);
          acc[4 * m4 + 3] = fmaf(k4.w, v, acc[4 * m4 + 3]);
        }
      }
    }
  }
#pragma unroll
  for (int m = 0; m < kRowsPerThread; ++m) out[(int64_t)(row0 + m) * p.Dv] = acc[m];
}

}  // namespace sd
}  // namespace lasp

// Instantiated from kernels/instances.rs, per Dk in {64, 128}:
//   lasp_scalar_decay_document_states_dk*  grid (num_offsets - 1, B*H, Dv / 64), block
//                                          LASP_SD_DOCUMENT_STATES_THREADS, static shared memory
