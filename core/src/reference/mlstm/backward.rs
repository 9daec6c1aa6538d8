//! The mLSTM's reverse-mode backward, token by token (module doc, "Backward").

use super::super::error::ReferenceError;
use super::super::linalg::{axpy, dot, mat_vec_add, outer_add, vec_mat_add};
use super::gradient::MlstmGradient;
use super::head::{backward_heads, HeadGrads, HeadState, MlstmHead};
use super::inputs::{MlstmCotangents, MlstmGrads, MlstmInputs};

/// Reverse-mode backward of [`recurrent_forward`](super::recurrent_forward): with
/// [`MlstmGradient::Full`], the stabiliser included (through the active branch of each max); with
/// [`MlstmGradient::Tfla`], mlstm_kernels' gradient.
pub fn recurrent_backward(
    inputs: &MlstmInputs,
    cot: &MlstmCotangents,
    gradient: MlstmGradient,
) -> Result<MlstmGrads, ReferenceError> {
    backward_heads(inputs, cot, |head, initial, d_h, d_final| {
        head_backward(head, initial, d_h, d_final, gradient)
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
    gradient: MlstmGradient,
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
    let d_final = gradient.exit_cotangent(d_final);
    let mut g = HeadGrads::zeros(head, d_final.clone());
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
        let d_qn = match gradient {
            // TFLA divides d_h by the forward's denominator and stops there.
            MlstmGradient::Tfla => 0.0,
            MlstmGradient::Full => {
                let d_den = -dot(dh_t, &num) / (den * den);
                if qn.abs() >= floor {
                    d_den * qn.signum()
                } else {
                    d.m -= d_den * floor;
                    0.0
                }
            }
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
        g.di[t] += d_input_exp;
        g.d_log_forget[t] = d_log_forget_exp;
        let d_m_prev = match gradient {
            // m_{t-1} and m_t are constants: the exponents pass their gradients to lf and i alone.
            MlstmGradient::Tfla => 0.0,
            MlstmGradient::Full => {
                // m_{t-1} enters f' as lf does, and m_t = max(lf + m_{t-1}, i).
                let d_m = d.m - d_log_forget_exp - d_input_exp;
                if w.decay_won {
                    g.d_log_forget[t] += d_m;
                    d_log_forget_exp + d_m
                } else {
                    g.di[t] += d_m;
                    d_log_forget_exp
                }
            }
        };
        d.c.iter_mut().for_each(|x| *x *= w.forget);
        d.n.iter_mut().for_each(|x| *x *= w.forget);
        d.m = d_m_prev;
    }
    gradient.drop_exit_decay(&mut g, &states[head.t], &d_final);
    g
}
