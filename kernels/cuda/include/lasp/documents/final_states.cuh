// What the families' final-states kernels of packed documents share (scalar_decay/ and
// gated_delta/document_states.cu): where document n's last chunk lies in this shard, and which of
// its tokens they add to the state entering that chunk (lasp_document_entry_slots).
#pragma once
#include <stdint.h>

#include "lasp/documents/documents_params.h"

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

}  // namespace documents
}  // namespace lasp
