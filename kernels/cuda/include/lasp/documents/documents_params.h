// Parameters of the document-start marks (documents/documents.cu): packed documents (fla's
// cu_seqlens) for the families whose state forgets through a per-token log-decay, a_t <= 0 in
// S_t = e^{a_t} (...) S_{t-1} + ... (scalar decay, Gated DeltaNet). C, so that bindgen generates the
// host's struct from this file (kernels/build.rs).
//
// A document start is a token whose log-decay is minus infinity: the state entering it is
// forgotten, in every chunk, segment, summary and fold, forward and backward, with no kernel of
// the family knowing of documents. The kernels need finite gates (their chunk-local cumsums
// subtract), so a start gets LASP_DOCUMENT_START_LOG_DECAY instead: e^{-128} lies below fp32's
// smallest subnormal (e^{-103.3}) and is 0 in expf and in ex2.approx.ftz alike, so every factor
// that crosses a start is exactly 0, and every sum of log-decays over a start stays finite and
// below -128, so its exponential is exactly 0 too (no inf - inf). The price is the cumsums' rounding
// after a start: a power of two of magnitude 128 k after k starts in a 64-token chunk, so the
// exponent of a pair in one document is off by at most a few ulps of 128 k (2^-16 for k = 1), far
// below the bf16 rounding of the products it weighs (kernels/docs/packed.md).
#pragma once
#include <stdint.h>

#define LASP_DOCUMENT_START_LOG_DECAY (-128)  // what a start token's log-decay becomes (an fp32)
#define LASP_DOCUMENTS_THREADS 128            // the marks kernel's CTA
#define LASP_DOCUMENT_WORD_TOKENS 64          // tokens per start word: one chunk of the masking families

typedef struct {
  const void* cu_seqlens;     // int32 or int64 [num_offsets]: fla's offsets of the documents in the
                              // packed sequence, [0, l_1, l_1 + l_2, ..., total]; entries past the
                              // last may repeat the total (a fixed-capacity buffer: CUDA graphs)
  int32_t offsets_are_int64;  // 1: cu_seqlens holds int64, 0: int32
  int32_t num_offsets;        // entries of cu_seqlens (>= 2)
  int64_t shard_start;        // the packed sequence's index of the token of row 0 (< 0 where
                              // the rows begin before the sequence: no document starts there)
  int32_t B;                  // batch rows (each packed with the same documents)
  int32_t T;                  // the shard's tokens
  int32_t row_len;            // values per token of `values` (H for log-decays [B, T, H])
  float value;                // what a start token's values become
  float* values;              // [B, T, row_len] fp32, written in place at every start in the shard
} lasp_document_marks_params;

// Start words for the families that mask at document starts (GLA, mLSTM;
// lasp/documents/chunk_starts.cuh): bit i of words[c] is set where token 64 c + i of the shard
// starts a document; reversed (a loop from the shard's last token down: mLSTM's backward), where
// loop token 64 c + i, token T - 1 - (64 c + i), is followed by a start. The host zeroes
// the words first; grid (ceil(num_offsets / LASP_DOCUMENTS_THREADS)), block LASP_DOCUMENTS_THREADS:
// one atomicOr per offset in the shard (an OR, so the bits do not depend on the order), a grid
// fixed by the buffer's capacity for graph replays, as the marks'.
typedef struct {
  const void* cu_seqlens;     // as lasp_document_marks_params
  int32_t offsets_are_int64;
  int32_t num_offsets;
  int64_t shard_start;        // the packed sequence's index of the shard's token 0
  int32_t T;                  // the shard's tokens
  int32_t reversed;           // nonzero: the reversed loop's words
  uint64_t* words;            // [ceil(T / 64)]
} lasp_document_words_params;

// Entry slots for per-document final states: slots[c] = n where document n holds the state
// entering chunk c of the shard (its token 64 c - 1, on an earlier PE for c = 0, is in n) and ends
// in that chunk (its last token in [64 c, 64 c + 63], inside the shard), else -1 (the host fills
// the slots with -1 first). At most one document does both per chunk. The families' chunk loops
// store that state into n's slot, and a kernel of the family then adds the chunk's tokens of n.
// grid (ceil((num_offsets - 1) / LASP_DOCUMENTS_THREADS)), block LASP_DOCUMENTS_THREADS: one
// thread per document, a grid fixed by the buffer's capacity.
typedef struct {
  const void* cu_seqlens;     // as lasp_document_marks_params
  int32_t offsets_are_int64;
  int32_t num_offsets;
  int64_t shard_start;        // the packed sequence's index of the shard's token 0
  int32_t T;                  // the shard's tokens
  int32_t* slots;             // [ceil(T / 64)]
} lasp_document_entry_slots_params;
