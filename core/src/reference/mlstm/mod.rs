//! xLSTM's matrix LSTM (mLSTM) in mlstm_kernels' "mLSTMexp" semantics: exponential input gate,
//! sigmoid forget gate, a matrix memory `C`, a normaliser `n` and a stabiliser `m`, per
//! (batch, head).
//!
//! # Recurrence
//! With `q_t, k_t [Dk]`, `v_t [Dv]`, input-gate pre-activation `i_t`, forget-gate pre-activation
//! `f_t` and the log forget gate `lf_t = logsigmoid(f_t)`:
//! ```text
//! m_t  = max(lf_t + m_{t-1}, i_t)
//! i'_t = e^{i_t - m_t},   f'_t = e^{lf_t + m_{t-1} - m_t}         (both <= 1)
//! C_t  = f'_t C_{t-1} + i'_t k_t^T v_t
//! n_t  = f'_t n_{t-1} + i'_t k_t
//! h_t  = sigma q_t C_t / (max(|sigma q_t . n_t|, e^{-m_t}) + eps)
//! ```
//! * Scale convention (mlstm_kernels'): the query is scaled, `sigma = Dk^-1/2` by default
//!   ([`MlstmInputs::scale`]); `C` and `n` hold unscaled keys. Scaling `k` instead gives the same
//!   `h` (numerator and `q . n` are both linear in the scaled vector) but states `sigma` times
//!   these; this module scales `q` everywhere.
//! * `eps` ([`MlstmInputs::eps`], mlstm_kernels' default [`MLSTM_EPS`] = 1e-6) is added after the
//!   max, as mlstm_kernels does.
//! * Initial state `(C_0, n_0, m_0)` optional; absent means `C_0 = 0, n_0 = 0, m_0 = 0`
//!   (mlstm_kernels' zero initial state). The final state is `(C_T, n_T, m_T)`.
//!
//! # Why the stabiliser changes nothing but `eps`
//! `(C, n, m)` represents the unstabilised state `(e^m C, e^m n)`: unrolled,
//! `m_t = max(m_0 + sum_{s<=t} lf_s, max_{j<=t} (i_j + sum_{j<s<=t} lf_s))` is the largest
//! log-weight of any contribution, and `C~_t = e^{m_t} C_t` obeys
//! `C~_t = e^{lf_t} C~_{t-1} + e^{i_t} k_t^T v_t` (same for `n~`), so
//! `h_t = sigma q_t C~_t / (max(|sigma q_t . n~_t|, 1) + eps e^{m_t})`: with `eps = 0`, `h` does
//! not depend on `m` at all ([`unstabilised_forward`] computes that form, which overflows once
//! `i_t` exceeds ~709 in f64 or ~88 in f32). Every stabilised evaluation here produces the same
//! `m_t` (the maximum above, summed in a different order), so they agree including `eps`.

//! # Chunkwise
//! Chunk-local inclusive cumsums `b_r = sum_{s<=r} lf_s` of the log forget gates, `gamma = b_last`,
//! and the state `(C, n, m)` entering the chunk. Row `r` has the log-weights `m + b_r` (the
//! carried state) and `D_rj = i_j + b_r - b_j` (token `j <= r` of the chunk), and
//! `m_r = max(m + b_r, max_j D_rj)`, the recurrent `m_t` of the same token. Then
//! ```text
//! num_r = e^{m + b_r - m_r} sigma q_r C + sum_{j<=r} e^{D_rj - m_r} (sigma q_r . k_j) v_j
//! qn_r  = e^{m + b_r - m_r} sigma q_r . n + sum_{j<=r} e^{D_rj - m_r} (sigma q_r . k_j)
//! h_r   = num_r / (max(|qn_r|, e^{-m_r}) + eps)
//! ```
//! and the chunk's own contribution, stabilised on its own, `m_c = max_j (i_j + gamma - b_j)`,
//! `C_c = sum_j e^{i_j + gamma - b_j - m_c} k_j^T v_j` (`n_c` likewise), is added to the carried
//! state decayed by `gamma`, both rescaled to the larger stabiliser:
//! ```text
//! m' = max(m + gamma, m_c),  C' = e^{m + gamma - m'} C + e^{m_c - m'} C_c  (n' likewise)
//! ```
//! Every exponent is `<= 0`.
//!
//! # In the scalar-decay loop's form
//! The kernels run each chunk in the scalar-decay chunk loop, whose weights are `e^{row_r - col_j}`
//! (token j in row r), `e^{row_r}` (the carried state in row r) and, for the state leaving the
//! chunk, `e^{gamma}` and `e^{gamma - col_j}`. With the running maximum
//! `M_r = max(m, max_{j<=r} (i_j - b_j))`, so that `m_r = b_r + M_r`, and a shift `c` (`m`, or
//! `i_0 - b_0` from the empty state, whose carried terms are zero):
//! ```text
//! row_r = c - M_r,   col_j = c - i_j + b_j,   gamma = row_last,   m' = b_last + M_last
//! ```
//! gives the chunk step above term for term: `row_r - col_j = D_rj - m_r`, `row_r = m + b_r - m_r`,
//! `gamma = m + gamma_b - m'` and `gamma - col_j = i_j + gamma_b - b_j - m'` (`gamma_b = b_last`),
//! every one `<= 0`. `qn_r` is the loop's output for a column of ones in `v` plus the carried `n`,
//! and `n` is carried as a further value column. [`loop_form_forward`] computes this form.
//!
//! # LASP-2
//! Rank w owns a shard of consecutive tokens. Its summary `(C_w, n_w, m_w)` is the state the shard
//! reaches from the empty state (`m = -inf`, no contribution; the chunk steps above from there),
//! so `m_w = max_j (i_j + sum_{s > j, s in shard} lf_s)`, together with the shard's total log
//! forget gate `F_w = sum_{s in shard} lf_s`. After the all-gather every rank folds the summaries
//! of the ranks before it, in rank order, onto the initial state `P_0 = (C_0, n_0, m_0)`:
//! ```text
//! m_{P_{w+1}} = max(F_w + m_{P_w}, m_w)
//! C_{P_{w+1}} = e^{F_w + m_{P_w} - m_{P_{w+1}}} C_{P_w} + e^{m_w - m_{P_{w+1}}} C_w  (n likewise)
//! ```
//! (the chunk step's rule with the shard as the chunk), and computes its outputs chunkwise from
//! `P_w`. `P_w` is the recurrent state at the shard's start, `m` included (the fold's maximum is
//! the same largest log-weight), and `P_W` the final state.
//!
//! Packed documents ([`packed_recurrent_forward`], [`packed_lasp2_forward`],
//! [`packed_lasp2_backward`]): each document runs
//! from its own initial state; a shard holding a document start forgets the prefix
//! ([`MlstmCarry::Forget`]) and exchanges its last run's end state, so the fold above is unchanged
//! for every other shard.

//! # Backward
//! [`recurrent_backward`] is reverse mode through the stabilised recurrence as written, `m`
//! included: each max passes its gradient to the side that won, the denominator's to `|qn|` or to
//! `e^{-m_t}`. Through `h` alone `m` matters only via `eps` (see above), but the final state's
//! `(C_T, n_T, m_T)` depends on it, so its cotangent flows through `m` too. The gradient is that of
//! `L = sum(h * d_h) + <C_T, dC_T> + <n_T, dn_T> + sum(m_T dm_T)` ([`MlstmForward::loss`]),
//! checked against central finite differences of the forward.
//!
//! # Chunkwise backward
//! [`chunkwise_backward`] is reverse mode through the chunk form ("Chunkwise" above), from the
//! chunk-entry states recomputed as the forward carries them. Every term of a chunk is
//! `e^{l - m_r} x` with a log-weight `l` (the carried state's `m + b_r` or token j's `D_rj`) and
//! `m_r` the row's largest log-weight, the winner's; the state leaving the chunk is such a sum too,
//! at the last row's `m_r`. A term's exponent `l - m_r` passes its gradient `g` (the term times
//! its cotangent) to the inputs of `l` and `-g` to those of the winner's log-weight. Both hold the
//! log forget gates up to row r, so only the gates between their starts remain
//! (`l_j - l_j' = i_j - i_j' + sum_{j < s <= j'} lf_s` for `j < j'`), and the gradient goes to those
//! directly: no term enters a gradient as `+g - g`, and the winner's own term adds nothing. What
//! depends on `m_r` itself, the floor `e^{-m_r}` and the exit cotangent `dm'`, goes to the
//! winner's log-weight. This is the full derivative of the stabilised forward, normaliser and
//! stabiliser included, the same function as the recurrent form's: it equals
//! [`recurrent_backward`] wherever no max is tied.
//!
//! # TFLA's gradient
//! NX-AI/mlstm_kernels' chunkwise backward (`mlstm_kernels/torch/chunkwise/native/bw.py`, and the
//! Triton kernels under `mlstm_kernels/triton/chunkwise/xl_chunk/` that
//! `mlstm_kernels/torch/chunkwise/triton_xl_chunk/bw.py` drives) is not the full derivative.
//! It divides `d_h_t` by the forward's stored denominator `max(|qn_t|, e^{-m_t})` (+ eps) and
//! reuses the forward's stabilisers as constants, which is the exact gradient of the surrogate
//! ```text
//! h_t = [e^{-m_t} / den_t] num~_t
//! C_T = [e^{G_T - m_T}] (e^{[m_0]} C_0 + sum_j e^{i_j - G_j} k_j^T v_j)
//! ```
//! with `[.]` held constant, `num~_t = sigma q_t C~_t` the unstabilised numerator and `G` the
//! inclusive cumsum of `lf`: no gradient through `n` (`qn_t`), the floor or any `m`; `dn_T`,
//! `dm_T` ignored; `dn_0 = dm_0 = 0`. ([`MlstmGradient::Tfla`]: reverse mode with every `m`
//! constant and `d_qn = 0`, then `-<dC_T, C_T>` on every `lf`, the final state's `e^{G_T}`.)
//! Against the full derivative, `dv` and `dC_0` are the same; the rest differ by terms
//! proportional to `<d_h_t, h_t>` per row (the denominator, floor included, and `eps e^{m_t}` are
//! per-row scalars, see "Why the stabiliser changes nothing but `eps`"), to `<dC_T, C_T>`
//! (through `m_T`; for TFLA also the dropped `e^{G_T}`), and to `dn_T`, `dm_T`. So where every
//! row's `d_h_t` is orthogonal to `h_t` (what a scale-invariant norm of each head's `h_t`, xLSTM's
//! group norm without its epsilon, passes back), `<dC_T, C_T> = 0` and `dn_T = dm_T = 0`, the two
//! agree except `dm_0`: TFLA's 0, the full derivative's `<dC_0, C_0>` (`m_0` scales `C_0`).
//! The dropped `e^{G_T}` also makes TFLA's gradient depend on where calls split the sequence: a
//! call handing its state `P` to the next (whose `dC_0` is its `dC_T`) lacks `<dC_P, P>` on its
//! log forget gates, which one call over both has. [`lasp2_backward`] computes the full derivative;
//! [`lasp2_backward_tfla`] TFLA's (below).

//! # LASP-2 backward
//! `L = sum_w L_w(P_w, shard w) + <P_W, d_final>` with `P_{w+1} = fold(P_w, summary_w)` and
//! `summary_w` a function of shard w alone, so ([`lasp2_backward`]):
//! * each rank runs the chunkwise backward of its outputs from `P_w` with no exit cotangent: its
//!   tokens' share, and `E_w = dL_w/dP_w`, which it all-gathers;
//! * every rank folds the state gradients downwards through the transposed fold
//!   ([`fold_backward`]): `D_{W-1} = d_final`, `D_{w-1} = E_w + (fold_P)^T D_w`, so
//!   `D_w = dL/dP_{w+1}`, the gradient of the state leaving rank w, and `E_0 + (fold_P)^T D_0` is
//!   the initial state's;
//! * rank w's summary gets `(fold_summary)^T D_w`; its chunkwise backward from the empty state
//!   (no outputs) gives the tokens' other share, and `dF_w` goes to every log forget gate of the
//!   shard.
//!
//! The transposed fold is the chunk step's (`m' = max(F + m_P, m_w)`): the prefix gets
//! `e^{F + m_P - m'} (dC', dn')` and the summary `e^{m_w - m'} (dC', dn')`; the log-weight that
//! lost the max gets its term's share `g = e^{l - m'} (<dC', C> + <dn', n>)`, the winner's gets
//! `dm' - g`, and the prefix's log-weight `F + m_P` passes its gradient to both `m_P` and `F`.
//!
//! # LASP-2 backward of TFLA's gradient
//! With every stabiliser a constant the fold is linear in C with the prefix factor
//! `e^{F_w + m_{P_w} - m_{P_{w+1}}}` (the ratio of the two stabilised forms of one state), so
//! ([`lasp2_backward_tfla`]): each rank's backward of its outputs from `P_w` with no exit
//! cotangent gives `E_w = dL_w/dC_{P_w}`, which it sends to the ranks before it; the descending
//! fold `D_{W-1} = dC_T`, `D_{w-1} = e^{F_w + m_{P_w} - m_{P_{w+1}}} D_w + E_w` gives the cotangent
//! of the state leaving each rank; each rank then runs TFLA's backward from `P_w` with `D_w` at
//! its exit. That backward drops its exit's decay `<D_w, C_{P_{w+1}}>` from its log forget gates
//! where one call over the whole sequence drops only `<dC_T, C_T>`, so each rank adds
//! `<D_w, C_{P_{w+1}}> - <dC_T, C_T>` to every one of them (zero on the last rank): the later
//! ranks' `q . dq - k . dk`, summed.

mod backward;
mod chunk_backward;
mod chunkwise;
mod gradient;
mod head;
mod inputs;
mod lasp2;
mod lasp2_tfla;
mod loop_form;
mod packed;
mod recurrent;

pub use backward::recurrent_backward;
pub use chunk_backward::chunkwise_backward;
pub use chunkwise::chunkwise_forward;
pub use gradient::MlstmGradient;
pub use inputs::{
    MlstmCotangents, MlstmForward, MlstmGrads, MlstmInputs, MlstmRegime, MlstmSpec, MlstmState,
    MLSTM_EPS,
};
pub use lasp2::{
    fold, fold_backward, lasp2_backward, lasp2_forward, FoldCotangents, MlstmLasp2,
    MlstmLasp2Backward, ShardSummary,
};
pub use lasp2_tfla::{lasp2_backward_tfla, MlstmLasp2TflaBackward};
pub use loop_form::{
    loop_form_forward, loop_gates, packed_loop_form_forward, packed_loop_gates, LoopGates,
};
pub use packed::{
    packed_lasp2_backward, packed_lasp2_forward, packed_normaliser_conditioning,
    packed_recurrent_backward, packed_recurrent_forward, MlstmCarry, MlstmPackedBackward,
    MlstmPackedForward, MlstmPackedGrads, MlstmPackedInputs, MlstmPackedLasp2, PackedMlstmSummary,
};
pub use recurrent::{normaliser_conditioning, recurrent_forward, unstabilised_forward};
