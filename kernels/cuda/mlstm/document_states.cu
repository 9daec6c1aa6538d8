// Final states of packed documents for the mLSTM: the stabilised state (C, n, m) after each
// document's last token (the maths: lasp/mlstm/document_states_params.h; the grid and the layouts:
// lasp/documents/final_states_params.h).
//
// One CTA per (document, b*H+h, 64 columns of Dv): the state entering the chunk that holds the
// document's last token (the output loop stored it in the document's slots), rescaled to the
// document's final stabiliser, plus the document's tokens of that chunk, on the CUDA cores in
// fp32. Warp 0 scans the log forget gates from the last token down, takes the stabiliser as the
// maximum of the terms' log weights and leaves every token's weight e^{i_j + F_j - m} in shared
// memory; the chunk's keys, weighted, then sit there in fp32 beside its values (bf16, as loaded),
// and each thread accumulates a quarter of the rows of one column, four keys per load, as GLA's
// kernel does (keys in bf16, two more instructions per product: 42 us against 38 for 17
// documents of 16 heads at 1x32K on one H200). The CTAs of column tile 0 also add up n (thread d: key dimension d) and write m;
// every CTA computes m with the same instructions, so their weights agree bit for bit.
#include <math.h>
#include <stdint.h>

#include "lasp/documents/final_states.cuh"
#include "lasp/mlstm/document_states_params.h"
#include "lasp/mlstm/fold.cuh"

namespace lasp {
namespace mlstm {

constexpr int kDocThreads = LASP_DOCUMENT_STATES_THREADS;
constexpr int kDocChunk = LASP_DOCUMENT_WORD_TOKENS;  // the chunk loops' chunk

template <int DK>
__device__ __forceinline__ void document_states(const lasp_document_states_params& p) {
  using Column = documents::StateColumn<DK>;
  constexpr int kRowsPerThread = Column::kRows;
  constexpr unsigned kAll = 0xffffffffu;
  static_assert(DK <= kDocThreads, "one thread per key dimension adds up n");
  __shared__ float s_weight[kDocChunk];  // i_j + F_j, then e^{i_j + F_j - m}, j from lo
  __shared__ float s_entry;              // the entering state's weight
  __shared__ float s_m;                  // the document's final stabiliser
  __shared__ __align__(16) float s_weighted[kDocChunk][DK];  // e^{i_j + F_j - m} k_j: 32 KiB at Dk = 128
  __shared__ uint16_t s_v[kDocChunk][64];                    // bf16, as loaded

  const Column column(p);
  const int b = column.b, h = column.h, tile = column.tile;
  const documents::DocumentTail tail = column.tail;
  const int64_t slot = ((int64_t)b * (p.num_offsets - 1) + blockIdx.x) * p.H + h;  // (b, n, h)
  const bool writes_n = tile == 0 && (int)threadIdx.x < DK;
  float acc[kRowsPerThread];
#pragma unroll
  for (int m = 0; m < kRowsPerThread; ++m) acc[m] = 0.f;
  float n = 0.f, m_out = 0.f;
  if (tail.ends_here) {
    const int lo = tail.lo, rows = tail.rows, end = lo + rows;
    const bool enters = tail.enters;
    const int64_t row_b = (int64_t)b * p.T;  // token 0 of batch row b
    if (threadIdx.x < 32) {
      // F_j from the last token down: lane l of pass r takes token end - 1 - (32 r + l); the
      // running maximum of i_j + F_j beside it.
      const int lane = threadIdx.x;
      float carry = 0.f, top = -INFINITY;
      for (int r0 = 0; r0 < rows; r0 += 32) {
        const int r = r0 + lane;
        const int64_t at = (row_b + end - 1 - r) * p.H + h;
        const float lf = r < rows ? log_sigmoid(p.g[at]) : 0.f;
        float inclusive = lf;
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
          const float x = __shfl_up_sync(kAll, inclusive, off);
          if (lane >= off) inclusive += x;
        }
        float exclusive = __shfl_up_sync(kAll, inclusive, 1);
        if (lane == 0) exclusive = 0.f;
        if (r < rows) {
          const float log_weight = p.i_gate[at] + (carry + exclusive);
          s_weight[rows - 1 - r] = log_weight;
          top = fmaxf(top, log_weight);
        }
        carry += __shfl_sync(kAll, inclusive, 31);
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) top = fmaxf(top, __shfl_xor_sync(kAll, top, off));
      // The entering state: the stored one, or the zero state's m = 0 at the document's start.
      const float entry_log = (enters ? p.entry_m[slot] : 0.f) + carry;
      const float m_doc = fmaxf(entry_log, top);
      __syncwarp();
      for (int r = lane; r < rows; r += 32) s_weight[r] = expf(s_weight[r] - m_doc);
      if (lane == 0) {
        s_entry = expf(entry_log - m_doc);
        s_m = m_doc;
      }
    }
    if (enters) column.load(acc);
    if (enters && writes_n) n = p.ht_n[slot * DK + threadIdx.x];
    for (int e = threadIdx.x; e < rows * 64; e += kDocThreads) {
      const int r = e / 64, c = e % 64;
      s_v[r][c] = p.v[((row_b + lo + r) * p.H + h) * p.Dv + tile * 64 + c];
    }
    __syncthreads();  // the weights
    for (int e = threadIdx.x; e < rows * DK; e += kDocThreads) {
      const int r = e / DK, d = e % DK;
      s_weighted[r][d] = s_weight[r] * documents::bf16_value(p.k[((row_b + lo + r) * p.H + h) * DK + d]);
    }
    const float w_entry = s_entry;
    m_out = s_m;
    if (enters) {
#pragma unroll
      for (int m = 0; m < kRowsPerThread; ++m) acc[m] *= w_entry;
    }
    __syncthreads();  // the weighted keys and the values
    column.add_tokens(acc, s_weighted, s_v, rows);
    if (writes_n) {
      const int d = threadIdx.x;
      n *= w_entry;
      for (int r = 0; r < rows; ++r) n += s_weighted[r][d];
    }
  }
  column.store(acc);
  if (writes_n) p.ht_n[slot * DK + threadIdx.x] = n;
  if (tile == 0 && threadIdx.x == 0) p.ht_m[slot] = m_out;
}

}  // namespace mlstm
}  // namespace lasp

// Instantiated from kernels/instances.rs, per Dk in {64, 128}:
//   lasp_mlstm_document_states_dk*  grid (num_offsets - 1, B*H, Dv / 64), block
//                                   LASP_DOCUMENT_STATES_THREADS, static shared memory
