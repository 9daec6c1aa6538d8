// The final states of packed documents for Gated DeltaNet (gated_delta/document_states.cu): what
// its kernel computes. Its parameters are every family's (lasp_document_states_params).
//
// The state after document n's last token e_n - 1 (shard tokens; the document may have begun on an
// earlier PE) is the delta rule's recurrence, S_t = e^{a_t} (S_{t-1} - beta_t k_t^T (k_t S_{t-1})) +
// beta_t k_t^T v_t, over the document's tokens of the chunk of 64 that holds e_n - 1, from the state
// entering that chunk where the document began before it (the walk stored it into n's slot of ht,
// with every earlier shard's and segment's prefix folded in: lasp_document_entry_slots), else from
// zero at the document's first token.
//
// The grid, the block and the parameters: lasp/documents/final_states_params.h.
#pragma once

#include "lasp/documents/final_states_params.h"
