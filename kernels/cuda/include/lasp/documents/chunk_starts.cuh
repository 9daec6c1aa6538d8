// Where documents start in one chunk of 64 tokens, for the families that mask at the starts
// instead of forgetting through a gate (GLA: its gates are per key, kernels/docs/packed.md). The
// word comes from lasp_document_chunk_words (documents/documents.cu): bit i set where token
// 64 c + i of the shard starts a document. The chunk loops are kernels of their own with
// kPacked = true (kernels/instances.rs); without documents every word is the constant 0, every
// mask folds away and the loops compile as they would with no documents in the product.
#pragma once
#include <stdint.h>

#include "lasp/mma.cuh"

namespace lasp {
namespace documents {

constexpr int kWordTokens = 64;

struct ChunkStarts {
  uint64_t word;

  // Chunk `chunk`'s word, for a kernel of one chunk (the grads kernel: its first use comes after
  // the chunk's tiles have landed); the constant 0 without documents.
  template <bool kPacked>
  static __device__ __forceinline__ ChunkStarts load(const uint64_t* words, int chunk) {
    if constexpr (kPacked) return ChunkStarts{__ldg(words + chunk)};
    return ChunkStarts{0ull};
  }

  // For a chunk loop short of registers (the output loop): chunk `chunk`'s word to shared memory
  // at `dst` in the caller's cp.async group, the one that brings the chunk's tiles, so that it
  // lands with them and no chunk waits on a load from L2 at its head.
  template <bool kPacked>
  static __device__ __forceinline__ void copy_async(uint32_t dst, const uint64_t* words, int chunk) {
    if constexpr (kPacked) cp_async_8(dst, words + chunk, true);
  }

  // The word copy_async brought to `slot` (once its group has landed, after a barrier); the
  // constant 0 without documents.
  template <bool kPacked>
  static __device__ __forceinline__ ChunkStarts landed(const uint8_t* slot) {
    if constexpr (kPacked) return ChunkStarts{*reinterpret_cast<const uint64_t*>(slot)};
    return ChunkStarts{0ull};
  }

  // For a chunk loop with registers to spare (the states pass, whose two CTAs per SM leave no byte
  // of shared memory, and the walk): the words one chunk ahead, in a register; the load of the
  // next chunk's word is issued as this chunk's is taken, so that no chunk waits on a load from
  // L2 at its head.
  template <bool kPacked>
  struct Ahead {
    uint64_t word;
    // The loop's first chunk's word (0 where the loop is empty).
    static __device__ __forceinline__ Ahead first(const uint64_t* words, int chunk, bool valid) {
      if constexpr (kPacked) return Ahead{valid ? __ldg(words + chunk) : 0ull};
      return Ahead{0ull};
    }
    // This chunk's word; loads chunk `following`'s where there is one (`valid`).
    __device__ __forceinline__ ChunkStarts next(const uint64_t* words, int following, bool valid) {
      const ChunkStarts now{word};
      if constexpr (kPacked) word = valid ? __ldg(words + following) : 0ull;
      return now;
    }
  };

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
