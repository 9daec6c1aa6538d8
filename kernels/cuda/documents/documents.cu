// Document-start marks: every token of the shard that starts a document gets `value` in all its
// row_len values (lasp/documents/documents_params.h). The log-decays a family reads become
// LASP_DOCUMENT_START_LOG_DECAY there (a copy of the caller's gates), and the gradient of the
// caller's gates becomes 0 there (the layer never reads a start's gate).
//
// grid (num_offsets, B), block LASP_DOCUMENTS_THREADS: CTA (i, b) reads offset i and, when it
// falls in the shard, writes that token's row of batch row b. A fixed grid whatever the documents,
// so a captured graph replays with other documents in the same cu_seqlens buffer. Offsets that
// repeat (the padding of a fixed-capacity buffer) write the same values again.
//
// Start words: the families that mask at the starts instead (GLA) read one word per chunk of 64
// tokens, bit i for token i of the chunk (lasp/documents/chunk_starts.cuh).
#include <stdint.h>

#include "lasp/documents/documents_params.h"

extern "C" __global__ void __launch_bounds__(LASP_DOCUMENTS_THREADS)
    lasp_document_marks(const __grid_constant__ lasp_document_marks_params p) {
  const int i = blockIdx.x;
  const int64_t start = p.offsets_are_int64 ? static_cast<const int64_t*>(p.cu_seqlens)[i]
                                            : static_cast<const int32_t*>(p.cu_seqlens)[i];
  const int64_t token = start - p.shard_start;
  if (token < 0 || token >= p.T) return;  // the total, past every shard, lands here too
  float* row = p.values + ((int64_t)blockIdx.y * p.T + token) * p.row_len;
  for (int e = threadIdx.x; e < p.row_len; e += LASP_DOCUMENTS_THREADS) row[e] = p.value;
}

// Start words (lasp_document_words_params): the word of the chunk holding each start in the shard
// gets the start's bit; reversed, the word of the loop chunk holding the token before each start
// (loop token T - start: the shard's last token for a start that opens the next shard).
extern "C" __global__ void __launch_bounds__(LASP_DOCUMENTS_THREADS)
    lasp_document_chunk_words(const __grid_constant__ lasp_document_words_params p) {
  const int i = blockIdx.x * LASP_DOCUMENTS_THREADS + threadIdx.x;
  if (i >= p.num_offsets) return;
  const int64_t start = p.offsets_are_int64 ? static_cast<const int64_t*>(p.cu_seqlens)[i]
                                            : static_cast<const int32_t*>(p.cu_seqlens)[i];
  const int64_t token = start - p.shard_start;
  if (p.reversed ? token < 1 || token > p.T : token < 0 || token >= p.T) return;
  const int64_t bit = p.reversed ? p.T - token : token;
  atomicOr(reinterpret_cast<unsigned long long*>(p.words + bit / LASP_DOCUMENT_WORD_TOKENS),
           1ull << (bit % LASP_DOCUMENT_WORD_TOKENS));
}

// Entry slots (lasp_document_entry_slots_params): the chunk holding each document's last token
// names the document where the document began before that chunk.
extern "C" __global__ void __launch_bounds__(LASP_DOCUMENTS_THREADS)
    lasp_document_entry_slots(const __grid_constant__ lasp_document_entry_slots_params p) {
  const int n = blockIdx.x * LASP_DOCUMENTS_THREADS + threadIdx.x;
  if (n >= p.num_offsets - 1) return;
  const int64_t start = (p.offsets_are_int64 ? static_cast<const int64_t*>(p.cu_seqlens)[n]
                                             : static_cast<const int32_t*>(p.cu_seqlens)[n]) -
                        p.shard_start;
  const int64_t end = (p.offsets_are_int64 ? static_cast<const int64_t*>(p.cu_seqlens)[n + 1]
                                           : static_cast<const int32_t*>(p.cu_seqlens)[n + 1]) -
                      p.shard_start;
  if (end <= start || end < 1 || end > p.T) return;  // empty, or its last token is on another PE
  const int64_t chunk = (end - 1) / LASP_DOCUMENT_WORD_TOKENS;
  if (start < chunk * LASP_DOCUMENT_WORD_TOKENS) p.slots[chunk] = n;
}
