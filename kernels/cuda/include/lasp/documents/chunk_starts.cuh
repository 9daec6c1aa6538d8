// Where documents start in one chunk of 64 tokens, for the families that mask at the starts
// instead of forgetting through a gate (GLA: its gates are per key, kernels/docs/packed.md). The
// word comes from lasp_document_chunk_words (documents/documents.cu): bit i set where token
// 64 c + i of the shard starts a document. The chunk loops are kernels of their own with
// kPacked = true (kernels/instances.rs); without documents every word is the constant 0, every
// mask folds away and the loops compile as they would with no documents in the product.
#pragma once
#include <stdint.h>

namespace lasp {
namespace documents {

constexpr int kWordTokens = 64;

struct ChunkStarts {
  uint64_t word;

  // Chunk `chunk`'s word; the constant 0 without documents.
  template <bool kPacked>
  static __device__ __forceinline__ ChunkStarts load(const uint64_t* words, int chunk) {
    if constexpr (kPacked) return ChunkStarts{__ldg(words + chunk)};
    return ChunkStarts{0ull};
  }

  // Brings chunk `chunk`'s word into L1 ahead of its load (a loop issues it a chunk early, so
  // that the load does not wait on L2 at the head of every chunk).
  template <bool kPacked>
  static __device__ __forceinline__ void prefetch(const uint64_t* words, int chunk) {
    if constexpr (kPacked) asm volatile("prefetch.global.L1 [%0];" ::"l"(words + chunk));
  }

  __device__ __forceinline__ bool any() const { return word != 0; }

  // The first start (64 if none): rows below it continue the document that enters the chunk,
  // the only ones the entering state reaches.
  __device__ __forceinline__ int first() const { return word ? __ffsll(static_cast<long long>(word)) - 1 : kWordTokens; }

  // The last start (-1 if none): keys from it on are in the document that leaves the chunk, the
  // only ones that reach the state leaving it.
  __device__ __forceinline__ int last() const { return word ? 63 - __clzll(static_cast<long long>(word)) : -1; }

  // The start of row r's document in the chunk, f(r): the last start at or before r, -1 if none
  // (the document entered the chunk). Key j <= r is in row r's document where j >= f(r).
  __device__ __forceinline__ int start_at_or_before(int r) const {
    const uint64_t through_r = word & (~0ull >> (63 - r));
    return through_r ? 63 - __clzll(static_cast<long long>(through_r)) : -1;
  }

  // The end (exclusive) of row r's document in the chunk: the first start after r, 64 if none.
  __device__ __forceinline__ int document_end(int r) const {
    const uint64_t after = r >= 63 ? 0ull : word & (~0ull << (r + 1));
    return after ? __ffsll(static_cast<long long>(after)) - 1 : kWordTokens;
  }
};

}  // namespace documents
}  // namespace lasp
