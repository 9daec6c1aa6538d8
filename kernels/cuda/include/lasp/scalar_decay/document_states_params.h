// The final states of packed documents for scalar decay (scalar_decay/document_states.cu): what
// its kernel computes. Its parameters are every family's (lasp_document_states_params).
//
// The state after document n's last token e_n - 1 (shard tokens; the document may have begun on an
// earlier PE) is
//   S = e^{sum_{t = j0}^{e_n - 1} a_t} S_{j0} + sum_{j = max(s_n, j0)}^{e_n - 1} e^{sum_{t = j + 1}^{e_n - 1} a_t} k_j^T v_j
// with j0 the first token of the chunk of 64 that holds e_n - 1, S_{j0} the state entering that
// chunk (the forward's output kernel or the walk stored it into n's slot of ht, with every earlier
// shard's and segment's prefix folded in: lasp_document_entry_slots) and the first term only where
// the document began before j0. Every sum runs inside the document, so the log-decays may be the
// caller's or the forgetting ones (lasp/documents/documents_params.h) alike.
//
// The grid, the block and the parameters: lasp/documents/final_states_params.h.
#pragma once

#include "lasp/documents/final_states_params.h"
