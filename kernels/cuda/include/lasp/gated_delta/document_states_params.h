// Parameters of the final states of packed documents for Gated DeltaNet
// (gated_delta/document_states.cu). C, so that bindgen generates the host's struct from this file
// (kernels/build.rs).
//
// The state after document n's last token e_n - 1 (shard tokens; the document may have begun on an
// earlier PE) is the delta rule's recurrence, S_t = e^{a_t} (S_{t-1} - beta_t k_t^T (k_t S_{t-1})) +
// beta_t k_t^T v_t, over the document's tokens of the chunk of 64 that holds e_n - 1, from the state
// entering that chunk where the document began before it (the walk stored it into n's slot of ht,
// with every earlier shard's and segment's prefix folded in: lasp_document_entry_slots), else from
// zero at the document's first token.
//
// grid (num_offsets - 1, B*H, Dv / 64), block LASP_GDN_DOCUMENT_STATES_THREADS, static shared
// memory: CTA (n, b*H+h, column tile) rewrites its 64 columns of document n's state in row b of ht
// (the columns are independent: k S_{t-1} is per column). A document that does not end in this
// shard (or holds no token) gets zeros: every PE writes the whole of ht, and the sum over the PEs is
// every document's final state. A grid fixed by the capacity of cu_seqlens.
#pragma once
#include <stdint.h>

#define LASP_GDN_DOCUMENT_STATES_THREADS 256  // thread i: column i % 64 of the tile, a quarter of the rows

typedef struct {
  const void* cu_seqlens;     // int32 or int64 [num_offsets]: fla's offsets, as lasp_document_marks_params
  int32_t offsets_are_int64;  // 1: cu_seqlens holds int64, 0: int32
  int32_t num_offsets;        // entries of cu_seqlens (>= 2): N = num_offsets - 1 documents
  int64_t shard_start;        // the packed sequence's index of the shard's token 0
  const uint16_t* k;          // bf16 [B, T, H, Dk], the shard's keys
  const uint16_t* v;          // bf16 [B, T, H, Dv], the shard's values
  const float* g;             // fp32 [B, T, H], the shard's log-decays
  const float* beta;          // fp32 [B, T, H], the shard's write strengths
  float* ht;                  // fp32 [B, N, H, Dk, Dv]: in, the entry states the walk stored; out,
                              // every document's final state, zeros for those that end elsewhere
  int32_t B;
  int32_t T;                  // the shard's tokens (>= 1)
  int32_t H;
  int32_t Dk;                 // 64 or 128 (the kernel's suffix)
  int32_t Dv;                 // multiple of 64
} lasp_gdn_document_states_params;
