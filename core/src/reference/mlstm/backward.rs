//! The mLSTM's reverse-mode backward, token by token (module doc, "Backward").

use super::super::error::ReferenceError;
use super::super::linalg::{axpy, dot, mat_vec_add, outer_add, vec_mat_add};
use super::super::tensor::Tensor;
use super::super::validate::{check_finite, check_shape};
use super::head::{assemble_state, head_state, initial_head_state, HeadState, MlstmHead};
use super::inputs::{check_state, MlstmForward, MlstmInputs, MlstmState};

/// Upstream gradients: `d_h = dL/dh [B, T, H, Dv]` and the final-state cotangent
/// `(dL/dC_T, dL/dn_T, dL/dm_T)` (`None` means zero).
#[derive(Clone, Debug, PartialEq)]
pub struct MlstmCotangents {
    /// Gradient with respect to the hidden states, `[B, T, H, Dv]`.
    pub d_h: Tensor,
    /// Gradient with respect to the final state, or `None` for zero.
    pub d_final_state: Option<MlstmState>,
}

/// Gradients of `L = sum(h * d_h) + <C_T, dC_T> + <n_T, dn_T> + sum(m_T * dm_T)`
/// ([`MlstmForward::loss`]) with respect to every input, each shaped like its input.
#[derive(Clone, Debug, PartialEq)]
pub struct MlstmGrads {
    /// `dL/dq [B, T, H, Dk]`.
    pub dq: Tensor,
    /// `dL/dk [B, T, H, Dk]`.
    pub dk: Tensor,
    /// `dL/dv [B, T, H, Dv]`.
    pub dv: Tensor,
    /// `dL/di [B, T, H]` (input-gate pre-activations).
    pub d_input_gate: Tensor,
    /// `dL/df [B, T, H]` (forget-gate pre-activations).
    pub d_forget_gate: Tensor,
    /// `dL/d(C_0, n_0, m_0)`, returned even when the initial state is `None` (zero).
    pub d_initial_state: MlstmState,
}

impl MlstmForward {
    /// `L = sum(h * d_h) + <C_T, dC_T> + <n_T, dn_T> + sum(m_T * dm_T)`: the scalar the backward
    /// differentiates (finite-difference tests differentiate it too).
    pub fn loss(&self, cot: &MlstmCotangents) -> f64 {
        let dot = |a: &Tensor, b: &Tensor| -> f64 { dot(a.data(), b.data()) };
        dot(&self.h, &cot.d_h)
            + cot.d_final_state.as_ref().map_or(0.0, |d| {
                let s = &self.final_state;
                dot(&s.c, &d.c) + dot(&s.n, &d.n) + dot(&s.m, &d.m)
            })
    }
}

/// One head's gradients, `[T, ...]` rows and the initial-state gradient.
struct HeadGrads {
    dq: Vec<f64>,
    dk: Vec<f64>,
    dv: Vec<f64>,
    di: Vec<f64>,
    df: Vec<f64>,
    d_state: HeadState,
}

/// Reverse-mode backward of [`recurrent_forward`](super::recurrent_forward), the stabiliser
/// included (through the active branch of each max).
pub fn recurrent_backward(
    inputs: &MlstmInputs,
    cot: &MlstmCotangents,
) -> Result<MlstmGrads, ReferenceError> {
    inputs.validate()?;
    let s = inputs.shape;
    check_shape("d_h", "[B, T, H, Dv]", s.v(), &cot.d_h)?;
    check_finite("d_h", &cot.d_h)?;
    if let Some(d) = &cot.d_final_state {
        check_state("d_final_state", &s, d)?;
    }
    let (mut dq, mut dk, mut dv) = (
        Tensor::zeros(&s.qk()),
        Tensor::zeros(&s.qk()),
        Tensor::zeros(&s.v()),
    );
    let (mut di, mut df) = (Tensor::zeros(&s.per_token()), Tensor::zeros(&s.per_token()));
    let mut d_initial = Vec::with_capacity(s.b * s.h);
    for b in 0..s.b {
        for h in 0..s.h {
            let head = MlstmHead::gather(inputs, b, h);
            let d_final = cot
                .d_final_state
                .as_ref()
                .map_or_else(|| HeadState::zero(s.dk, s.dv), |d| head_state(d, b, h));
            let forget_gate = inputs.forget_gate.head_rows(b, h);
            let g = head_backward(
                &head,
                initial_head_state(inputs, b, h),
                &cot.d_h.head_rows(b, h),
                d_final,
                &forget_gate,
            );
            dq.set_head_rows(b, h, &g.dq);
            dk.set_head_rows(b, h, &g.dk);
            dv.set_head_rows(b, h, &g.dv);
            di.set_head_rows(b, h, &g.di);
            df.set_head_rows(b, h, &g.df);
            d_initial.push(g.d_state);
        }
    }
    Ok(MlstmGrads {
        dq,
        dk,
        dv,
        d_input_gate: di,
        d_forget_gate: df,
        d_initial_state: assemble_state(&s, &d_initial),
    })
}

/// One forward step's stabiliser, decay and write weights, and which side won the max.
struct Step {
    m: f64,
    forget: f64,
    input: f64,
    decay_won: bool,
}

fn step_weights(head: &MlstmHead, t: usize, m_prev: f64) -> Step {
    let decayed = head.log_forget[t] + m_prev;
    let m = decayed.max(head.input_gate[t]);
    Step {
        m,
        forget: (decayed - m).exp(),
        input: (head.input_gate[t] - m).exp(),
        decay_won: decayed >= head.input_gate[t],
    }
}

fn head_backward(
    head: &MlstmHead,
    initial: HeadState,
    d_h: &[f64],
    d_final: HeadState,
    forget_gate: &[f64],
) -> HeadGrads {
    let (dk, dv, sigma) = (head.dk, head.dv, head.scale);
    // Forward, keeping every state: states[t] is the state before token t.
    let mut states = vec![initial];
    for t in 0..head.t {
        let mut next = states[t].clone();
        let w = step_weights(head, t, next.m);
        next.c.iter_mut().for_each(|x| *x *= w.forget);
        next.n.iter_mut().for_each(|x| *x *= w.forget);
        outer_add(&mut next.c, w.input, head.k(t), head.v(t));
        axpy(&mut next.n, w.input, head.k(t));
        next.m = w.m;
        states.push(next);
    }
    let mut g = HeadGrads {
        dq: vec![0.0; head.t * dk],
        dk: vec![0.0; head.t * dk],
        dv: vec![0.0; head.t * dv],
        di: vec![0.0; head.t],
        df: vec![0.0; head.t],
        d_state: d_final,
    };
    for t in (0..head.t).rev() {
        let (prev, cur) = (&states[t], &states[t + 1]);
        let w = step_weights(head, t, prev.m);
        let d = &mut g.d_state;
        // Output: h = num / den, num = sigma q C_t, den = max(|qn|, e^{-m_t}) + eps.
        let (num, qn) = head.read(t, cur);
        let floor = (-w.m).exp();
        let den = qn.abs().max(floor) + head.eps;
        let dh_t = &d_h[t * dv..(t + 1) * dv];
        let d_num: Vec<f64> = dh_t.iter().map(|x| x / den).collect();
        let d_den = -dot(dh_t, &num) / (den * den);
        let d_qn = if qn.abs() >= floor {
            d_den * qn.signum()
        } else {
            d.m -= d_den * floor;
            0.0
        };
        let dq = &mut g.dq[t * dk..(t + 1) * dk];
        mat_vec_add(dq, sigma, &cur.c, &d_num);
        axpy(dq, sigma * d_qn, &cur.n);
        outer_add(&mut d.c, sigma, head.q(t), &d_num);
        axpy(&mut d.n, sigma * d_qn, head.q(t));
        // Write: C_t = f' C_{t-1} + i' k^T v, n_t = f' n_{t-1} + i' k.
        let mut d_c_v = vec![0.0; dk];
        mat_vec_add(&mut d_c_v, 1.0, &d.c, head.v(t));
        let d_input = dot(head.k(t), &d_c_v) + dot(head.k(t), &d.n);
        let d_forget = dot(&d.c, &prev.c) + dot(&d.n, &prev.n);
        axpy(&mut g.dk[t * dk..(t + 1) * dk], w.input, &d_c_v);
        axpy(&mut g.dk[t * dk..(t + 1) * dk], w.input, &d.n);
        vec_mat_add(&mut g.dv[t * dv..(t + 1) * dv], w.input, head.k(t), &d.c);
        // Exponents: f' = e^{lf + m_{t-1} - m_t}, i' = e^{i - m_t}.
        let (d_log_forget_exp, d_input_exp) = (w.forget * d_forget, w.input * d_input);
        let mut d_lf = d_log_forget_exp;
        let mut d_m_prev = d_log_forget_exp;
        g.di[t] += d_input_exp;
        let d_m = d.m - d_log_forget_exp - d_input_exp;
        // m_t = max(lf + m_{t-1}, i).
        if w.decay_won {
            d_lf += d_m;
            d_m_prev += d_m;
        } else {
            g.di[t] += d_m;
        }
        // lf = logsigmoid(f): dlf/df = sigmoid(-f).
        g.df[t] = d_lf / (1.0 + forget_gate[t].exp());
        d.c.iter_mut().for_each(|x| *x *= w.forget);
        d.n.iter_mut().for_each(|x| *x *= w.forget);
        d.m = d_m_prev;
    }
    g
}
