// Parameters of every family's final-states kernel of packed documents
// (scalar_decay/, gla/, gated_delta/ and mlstm/document_states.cu; the maths of each in its family's
// document_states_params.h). C, so that bindgen generates the host's struct from this file
// (kernels/build.rs).
//
// grid (num_offsets - 1, B*H, Dv / 64), block LASP_DOCUMENT_STATES_THREADS, static shared memory:
// CTA (n, b*H+h, column tile) rewrites its 64 columns of document n's state in row b of ht, from
// the state entering the chunk that holds the document's last token (the family's chunk loop
// stored it into n's slot of ht, with every earlier shard's and segment's prefix folded in:
// lasp_document_entry_slots) where the document began before that chunk. A document that does not
// end in this shard (or holds no token) gets zeros: every PE writes the whole of ht, and the sum
// over the PEs is every document's final state. A grid fixed by the capacity of cu_seqlens, so a
// captured graph replays with other documents in the same buffer.
#pragma once
#include <stdint.h>

#define LASP_DOCUMENT_STATES_THREADS 256  // thread i: column i % 64 of the tile, a quarter of the rows

typedef struct {
  const void* cu_seqlens;     // int32 or int64 [num_offsets]: fla's offsets, as lasp_document_marks_params
  int32_t offsets_are_int64;  // 1: cu_seqlens holds int64, 0: int32
  int32_t num_offsets;        // entries of cu_seqlens (>= 2): N = num_offsets - 1 documents
  int64_t shard_start;        // the packed sequence's index of the shard's token 0
  const uint16_t* k;          // bf16 [B, T, H, Dk], the shard's keys
  const uint16_t* v;          // bf16 [B, T, H, Dv], the shard's values
  const float* g;             // fp32 log-decays: [B, T, H], GLA's [B, T, H, Dk]; mLSTM's forget-gate
                              // pre-activations [B, T, H]
  const float* beta;          // fp32 [B, T, H], Gated DeltaNet's write strengths; NULL elsewhere
  float* ht;                  // fp32 [B, N, H, Dk, Dv]: in, the entry states the chunk loop stored;
                              // out, every document's final state, zeros for those that end on
                              // another PE (mLSTM: its C)
  // mLSTM's only (NULL elsewhere): its input-gate pre-activations, the rest of its states (n in
  // and out like ht; m out) and the stabilisers entering the chunks (stored by the output loop).
  const float* i_gate;        // fp32 [B, T, H]
  float* ht_n;                // fp32 [B, N, H, Dk]
  float* ht_m;                // fp32 [B, N, H]
  const float* entry_m;       // fp32 [B, N, H]
  int32_t B;
  int32_t T;                  // the shard's tokens (>= 1)
  int32_t H;
  int32_t Dk;                 // 64 or 128 (the kernel's suffix)
  int32_t Dv;                 // multiple of 64
} lasp_document_states_params;
