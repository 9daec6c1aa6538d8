//! Token-by-token mLSTM forwards: the stabilised definition and, as its check, the unstabilised
//! form.

use super::super::error::ReferenceError;
use super::super::linalg::{axpy, outer_add};
use super::head::{forward_heads, HeadState, MlstmHead};
use super::inputs::{MlstmForward, MlstmInputs};

/// The stabilised recurrence, token by token: the definition (module doc, "Recurrence").
pub fn recurrent_forward(inputs: &MlstmInputs) -> Result<MlstmForward, ReferenceError> {
    forward_heads(inputs, |head, state| {
        sweep(head, state, |head, t, state| {
            let m = (head.log_forget[t] + state.m).max(head.input_gate[t]);
            let forget = (head.log_forget[t] + state.m - m).exp();
            let input = (head.input_gate[t] - m).exp();
            state.m = m;
            write(head, t, state, forget, input);
            state.m
        })
    })
}

/// The unstabilised recurrence `C~_t = e^{lf_t} C~_{t-1} + e^{i_t} k_t^T v_t` (same for `n~`),
/// `h_t = sigma q_t C~_t / max(|sigma q_t . n~_t|, 1)`, from `(e^{m_0} C_0, e^{m_0} n_0)`: the
/// stabilised forward with `eps = 0` (`inputs.eps` is ignored), in exact arithmetic. Its final
/// state carries `m = 0`. Finite only while `e^{i_t}` and the states stay in f64's range.
pub fn unstabilised_forward(inputs: &MlstmInputs) -> Result<MlstmForward, ReferenceError> {
    forward_heads(inputs, |head, mut state| {
        let lift = state.m.exp();
        state.c.iter_mut().for_each(|x| *x *= lift);
        state.n.iter_mut().for_each(|x| *x *= lift);
        state.m = 0.0;
        let head = MlstmHead {
            eps: 0.0,
            ..head.tokens(0, head.t)
        };
        sweep(&head, state, |head, t, state| {
            let (forget, input) = (head.log_forget[t].exp(), head.input_gate[t].exp());
            write(head, t, state, forget, input);
            0.0
        })
    })
}

/// `C <- f' C + i' k_t^T v_t`, `n <- f' n + i' k_t`.
fn write(head: &MlstmHead, t: usize, state: &mut HeadState, forget: f64, input: f64) {
    state.c.iter_mut().for_each(|x| *x *= forget);
    state.n.iter_mut().for_each(|x| *x *= forget);
    outer_add(&mut state.c, input, head.k(t), head.v(t));
    axpy(&mut state.n, input, head.k(t));
}

/// Runs `step(head, t, state) -> m_t` over the tokens and reads `h_t` after each step.
fn sweep(
    head: &MlstmHead,
    mut state: HeadState,
    step: impl Fn(&MlstmHead, usize, &mut HeadState) -> f64,
) -> (Vec<f64>, HeadState) {
    let mut out = vec![0.0; head.t * head.dv];
    for (t, row) in out.chunks_mut(head.dv).enumerate() {
        let m = step(head, t, &mut state);
        let (num, qn) = head.read(t, &state);
        head.normalise(row, &num, qn, m);
    }
    (out, state)
}
