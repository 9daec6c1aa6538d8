//! Token-by-token mLSTM forwards: the stabilised definition and, as its check, the unstabilised
//! form.

use super::super::error::ReferenceError;
use super::super::linalg::{axpy, outer_add};
use super::super::tensor::Tensor;
use super::head::{forward_heads, initial_head_state, HeadState, MlstmHead};
use super::inputs::{MlstmForward, MlstmInputs};

/// The stabilised recurrence, token by token: the definition (module doc, "Recurrence").
pub fn recurrent_forward(inputs: &MlstmInputs) -> Result<MlstmForward, ReferenceError> {
    forward_heads(inputs, |head, state| sweep(head, state, stabilised_step))
}

/// How much each token's normaliser cancels, `[B, T, H]`: `kappa_t = sigma sum_d |q_td n_td| /
/// (max(|sigma q_t . n_t|, e^{-m_t}) + eps)`, the factor by which a relative error in `n` or in
/// the products of `q . n` grows in `h_t`. It is about 10 for random q and n; a token whose query is
/// almost orthogonal to the keys that dominate `n` has thousands or more, and its `h_t` (large,
/// as `1 / |q . n|`) is determined by fp32 operands only to `kappa_t` times their rounding.
pub fn normaliser_conditioning(inputs: &MlstmInputs) -> Result<Tensor, ReferenceError> {
    inputs.validate()?;
    let s = inputs.shape;
    let mut out = Tensor::zeros(&s.per_token());
    for b in 0..s.b {
        for h in 0..s.h {
            let head = MlstmHead::gather(inputs, b, h);
            let mut state = initial_head_state(inputs, b, h);
            let rows: Vec<f64> = (0..head.t)
                .map(|t| {
                    let m = stabilised_step(&head, t, &mut state);
                    let (terms, qn) = head
                        .q(t)
                        .iter()
                        .zip(&state.n)
                        .fold((0.0, 0.0), |(a, d), (q, n)| (a + (q * n).abs(), d + q * n));
                    head.scale * terms / ((head.scale * qn).abs().max((-m).exp()) + head.eps)
                })
                .collect();
            out.set_head_rows(b, h, &rows);
        }
    }
    Ok(out)
}

/// One token of the stabilised recurrence: updates `state` and returns `m_t`.
fn stabilised_step(head: &MlstmHead, t: usize, state: &mut HeadState) -> f64 {
    let m = (head.log_forget[t] + state.m).max(head.input_gate[t]);
    let forget = (head.log_forget[t] + state.m - m).exp();
    let input = (head.input_gate[t] - m).exp();
    state.m = m;
    write(head, t, state, forget, input);
    state.m
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
