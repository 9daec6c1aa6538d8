// The final states of packed documents for the mLSTM (mlstm/document_states.cu): what its kernel
// computes. Its parameters are every family's (lasp_document_states_params), with the mLSTM's own
// fields (i_gate, ht_n, ht_m, entry_m).
//
// The state after document n's last token e_n - 1 (shard tokens; the document may have begun on an
// earlier PE), with lf_t = logsigmoid(f_t) and F_j = sum_{t = j + 1}^{e_n - 1} lf_t, is the
// recurrence (lasp/mlstm/forward_params.h) unrolled over the document's tokens of its last chunk:
//   m = max(m_{j0} + F_{j0 - 1}, max_j (i_j + F_j))
//   C = e^{m_{j0} + F_{j0 - 1} - m} C_{j0} + sum_j e^{i_j + F_j - m} k_j^T v_j
//   n = e^{m_{j0} + F_{j0 - 1} - m} n_{j0} + sum_j e^{i_j + F_j - m} k_j
// over j = max(s_n, j0) .. e_n - 1, with j0 the first token of the chunk of 64 that holds e_n - 1
// and (C_{j0}, n_{j0}, m_{j0}) the state entering that chunk (the forward's output loop stored C
// into n's slot of ht, n into ht_n and m into entry_m, with every earlier shard's and segment's
// prefix folded in: lasp_document_entry_slots) where the document began before j0, else
// mlstm_kernels' zero state (0, 0, m = 0) entering the document's first token s_n. Every exponent
// is <= 0, and every sum runs inside the document.
//
// The grid, the block and the parameters: lasp/documents/final_states_params.h; the CTAs of
// column tile 0 also write n and m.
#pragma once

#include "lasp/documents/final_states_params.h"
