//! The chunkwise mLSTM forward in the stabilised form (module doc, "Chunkwise").

use super::super::error::ReferenceError;
use super::super::gates::chunk_local_cumsum;
use super::super::linalg::{axpy, dot, outer_add};
use super::super::validate::check_chunk;
use super::head::{forward_heads, HeadState, MlstmHead};
use super::inputs::{MlstmForward, MlstmInputs};

/// Chunkwise forward with chunk size `chunk` (>= 1; it need not divide T).
pub fn chunkwise_forward(
    inputs: &MlstmInputs,
    chunk: usize,
) -> Result<MlstmForward, ReferenceError> {
    check_chunk("chunk", chunk)?;
    forward_heads(inputs, |head, state| forward_from(head, state, chunk))
}

/// One head's chunkwise forward from `state`: `(h rows [T, Dv], final state)`.
pub(crate) fn forward_from(
    head: &MlstmHead,
    mut state: HeadState,
    chunk: usize,
) -> (Vec<f64>, HeadState) {
    let mut out = vec![0.0; head.t * head.dv];
    for (c0, len) in head.chunks(chunk) {
        let b = chunk_local_cumsum(&head.log_forget[c0..c0 + len], 1);
        for r in 0..len {
            let t = c0 + r;
            let inter = state.m + b[r];
            let intra: Vec<f64> = (0..=r)
                .map(|j| head.input_gate[c0 + j] + (b[r] - b[j]))
                .collect();
            let m = intra.iter().copied().fold(inter, f64::max);
            let (mut num, mut qn) = head.read(t, &state);
            let carried = (inter - m).exp();
            num.iter_mut().for_each(|x| *x *= carried);
            qn *= carried;
            for (j, d) in intra.iter().enumerate() {
                let score = (d - m).exp() * head.scale * dot(head.q(t), head.k(c0 + j));
                axpy(&mut num, score, head.v(c0 + j));
                qn += score;
            }
            head.normalise(&mut out[t * head.dv..(t + 1) * head.dv], &num, qn, m);
        }
        advance(head, &mut state, c0, len);
    }
    (out, state)
}

/// Carries `state` across chunk `[c0, c0 + len)`: decayed by the chunk's total log forget gate
/// `gamma`, plus the chunk's contribution, at the larger stabiliser. Returns `gamma`.
pub(crate) fn advance(head: &MlstmHead, state: &mut HeadState, c0: usize, len: usize) -> f64 {
    let (contribution, gamma) = chunk_contribution(head, c0, len);
    state.combine(state.m + gamma, &contribution, contribution.m);
    gamma
}

/// What chunk `[c0, c0 + len)` adds to the state, stabilised on its own, and its total log forget
/// gate `gamma = b_{len-1}`: `m_c = max_j (i_j + gamma - b_j)`,
/// `C_c = sum_j e^{i_j + gamma - b_j - m_c} k_j^T v_j`, `n_c` likewise.
fn chunk_contribution(head: &MlstmHead, c0: usize, len: usize) -> (HeadState, f64) {
    let b = chunk_local_cumsum(&head.log_forget[c0..c0 + len], 1);
    let gamma = b[len - 1];
    let log_weights: Vec<f64> = (0..len)
        .map(|j| head.input_gate[c0 + j] + (gamma - b[j]))
        .collect();
    let m = log_weights
        .iter()
        .copied()
        .fold(f64::NEG_INFINITY, f64::max);
    let mut contribution = HeadState {
        m,
        ..HeadState::zero(head.dk, head.dv)
    };
    for (j, w) in log_weights.iter().enumerate() {
        let weight = (w - m).exp();
        outer_add(&mut contribution.c, weight, head.k(c0 + j), head.v(c0 + j));
        axpy(&mut contribution.n, weight, head.k(c0 + j));
    }
    (contribution, gamma)
}
