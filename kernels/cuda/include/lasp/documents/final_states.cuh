// What the families' final-states kernels of packed documents share (scalar_decay/, gla/ and
// gated_delta/document_states.cu): where document n's last chunk lies in this shard, which of its
// tokens they add to the state entering that chunk (lasp_document_entry_slots), and which part of
// the state a thread holds.
#pragma once
#include <stdint.h>

#include "lasp/documents/documents_params.h"
#include "lasp/documents/final_states_params.h"

namespace lasp {
namespace documents {

// Document n's tokens of the chunk of 64 that holds its last token, when that token is in this
// shard: [lo, lo + rows) (1 to 64 tokens); `enters` where the document began before the chunk
// (j0), so that its state entering the chunk (stored in its slot by the chunk loop) carries in,
// else the tokens start from zero at the document's first, lo.
struct DocumentTail {
  bool ends_here;  // its last token is in the shard (and it holds one)
  bool enters;
  int j0, lo, rows;
};

__device__ __forceinline__ int64_t document_offset(const void* cu_seqlens, int offsets_are_int64, int i) {
  return offsets_are_int64 ? static_cast<const int64_t*>(cu_seqlens)[i] : static_cast<const int32_t*>(cu_seqlens)[i];
}

__device__ __forceinline__ DocumentTail document_tail(const void* cu_seqlens, int offsets_are_int64, int n,
                                                      int64_t shard_start, int T) {
  const int64_t first = document_offset(cu_seqlens, offsets_are_int64, n) - shard_start;  // < 0: began earlier
  const int64_t end = document_offset(cu_seqlens, offsets_are_int64, n + 1) - shard_start;
  DocumentTail tail{};
  tail.ends_here = end > first && end >= 1 && end <= T;
  if (!tail.ends_here) return tail;
  tail.j0 = (int)((end - 1) / LASP_DOCUMENT_WORD_TOKENS) * LASP_DOCUMENT_WORD_TOKENS;
  tail.enters = first < tail.j0;
  tail.lo = tail.enters ? tail.j0 : (int)first;
  tail.rows = (int)end - tail.lo;
  return tail;
}

__device__ __forceinline__ float bf16_value(uint16_t x) { return __uint_as_float(static_cast<uint32_t>(x) << 16); }

// CTA (n, b*H+h, tile) of a states kernel (lasp/documents/final_states_params.h): document n's
// tokens of its last chunk in this shard, and this thread's part of the state, column `col` of the
// tile's 64 and the rows [row0, row0 + kRows) (quarter `quarter` of them) of document n's state in
// row b of ht.
template <int DK>
struct StateColumn {
  static constexpr int kQuarters = LASP_DOCUMENT_STATES_THREADS / 64;
  static constexpr int kRows = DK / kQuarters;
  int b, h, tile, col, quarter, row0;
  int64_t ld;  // Dv: from one row of the column to the next
  float* out;  // row row0 of the column
  DocumentTail tail;

  __device__ __forceinline__ explicit StateColumn(const lasp_document_states_params& p) {
    const int n = blockIdx.x, bh = blockIdx.y;
    b = bh / p.H, h = bh % p.H, tile = blockIdx.z;
    col = threadIdx.x % 64, quarter = threadIdx.x / 64, row0 = quarter * kRows;
    ld = p.Dv;
    const int docs = p.num_offsets - 1;
    out = p.ht + (((int64_t)b * docs + n) * p.H + h) * DK * p.Dv + (int64_t)row0 * p.Dv + tile * 64 + col;
    tail = document_tail(p.cu_seqlens, p.offsets_are_int64, n, p.shard_start, p.T);
  }
  // The entering state the chunk loop stored (where tail.enters).
  __device__ __forceinline__ void load(float (&x)[kRows]) const {
#pragma unroll
    for (int m = 0; m < kRows; ++m) x[m] = out[m * ld];
  }
  __device__ __forceinline__ void store(const float (&x)[kRows]) const {
#pragma unroll
    for (int m = 0; m < kRows; ++m) out[m * ld] = x[m];
  }
  // x += the tokens' outer products on this thread's part: over rows r < `rows` of shared memory,
  // keys[r][row0 + m] (fp32, weighted already) times values[r][col] (bf16), four keys per load
  // (a load every lane of the warp shares).
  __device__ __forceinline__ void add_tokens(float (&x)[kRows], const float (*keys)[DK], const uint16_t (*values)[64],
                                             int rows) const {
    for (int r = 0; r < rows; ++r) {
      const float v = bf16_value(values[r][col]);
      const float4* k4s = reinterpret_cast<const float4*>(&keys[r][row0]);
#pragma unroll
      for (int m4 = 0; m4 < kRows / 4; ++m4) {
        const float4 k4 = k4s[m4];
        x[4 * m4] = fmaf(k4.x, v, x[4 * m4]);
        x[4 * m4 + 1] = fmaf(k4.y, v, x[4 * m4 + 1]);
        x[4 * m4 + 2] = fmaf(k4.z, v, x[4 * m4 + 2]);
        x[4 * m4 + 3] = fmaf(k4.w, v, x[4 * m4 + 3]);
      }
    }
  }
};

}  // namespace documents
}  // namespace lasp
