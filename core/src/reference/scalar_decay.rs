//! Scalar-decay linear attention (simple GLA / RetNet / Lightning), kernels/docs/maths.md,
//! "Scalar decay: forward" and "Scalar decay: backward".
//!
//! `S_t = e^{a_t} S_{t-1} + k_t^T v_t`, `o_t = sigma q_t S_t`, one log-decay `a_t <= 0` per token
//! and head (`g: [B, T, H]`).
//!
//! The chunkwise form, per chunk of C rows with chunk-local cumsum `b_r` and `gamma = b_C`:
//! `O = sigma (diag(e^b) Q S_n + ((Q K^T) (.) D) V)` with `D_rj = [r >= j] e^{b_r - b_j}`, and
//! `S_{n+1} = e^gamma S_n + (diag(e^{gamma - b}) K)^T V`. Every exponent is `<= 0` and `D` is
//! evaluated only where `r >= j`.

use super::error::ReferenceError;
use super::gates::chunk_local_cumsum;
use super::head::{
    backward_heads, chunk_states_heads, entry_states, forward_heads, Head, HeadGrads,
};
use super::inputs::{Family, Inputs};
use super::linalg::{axpy, dot, mat_vec_add, outer_add, vec_mat_add};
use super::outputs::{Forward, Grads};
use super::recurrent::{decay_back, decay_gate_grad, decay_step, forward_sweep, reverse_sweep};
use super::tensor::Tensor;
use super::validate::check_chunk;

/// Token-by-token forward: the definition itself.
pub fn recurrent_forward(inputs: &Inputs) -> Result<Forward, ReferenceError> {
    forward_heads(inputs, Family::ScalarDecay, |h| {
        forward_sweep(h, decay_step)
    })
}

/// Chunkwise forward with chunk size `chunk` (any value >= 1; it need not divide T).
pub fn chunkwise_forward(inputs: &Inputs, chunk: usize) -> Result<Forward, ReferenceError> {
    check_chunk("chunk", chunk)?;
    forward_heads(inputs, Family::ScalarDecay, |h| {
        chunk_forward_head(h, chunk)
    })
}

/// The states entering each chunk, `[B, N, H, Dk, Dv]` with `N = ceil(T / chunk)` (fla's `h`
/// layout; entry 0 is h0): what the chunk-state pass stores for the output pass and the backward.
pub fn chunk_states(inputs: &Inputs, chunk: usize) -> Result<Tensor, ReferenceError> {
    chunk_states_heads(inputs, Family::ScalarDecay, chunk, chunk_step)
}

/// Token-by-token reverse-mode backward (gate gradient directly, without a cumsum); the check for
/// [`backward`].
pub fn recurrent_backward(
    inputs: &Inputs,
    d_o: &Tensor,
    d_ht: Option<&Tensor>,
) -> Result<Grads, ReferenceError> {
    backward_heads(inputs, Family::ScalarDecay, d_o, d_ht, |h, d_o, d_ht| {
        reverse_sweep(h, d_o, d_ht, decay_step, decay_back)
    })
}

/// Chunkwise backward by the analytic formulas of kernels/docs/maths.md, "Scalar decay:
/// backward": states recomputed chunk by chunk, `dS` swept in reverse,
/// `dG_t = q_t . dq_t - k_t . dk_t` (+ `<S_T, d_ht>` at the last token) and the gate gradient
/// `da_t = sum_{s >= t} dG_s`.
pub fn backward(
    inputs: &Inputs,
    chunk: usize,
    d_o: &Tensor,
    d_ht: Option<&Tensor>,
) -> Result<Grads, ReferenceError> {
    check_chunk("chunk", chunk)?;
    backward_heads(inputs, Family::ScalarDecay, d_o, d_ht, |h, d_o, d_ht| {
        chunk_backward_head(h, chunk, d_o, d_ht)
    })
}

/// `S_{n+1} = e^gamma S_n + sum_j e^{gamma - b_j} k_j^T values_j` for chunk `c0` with cumsum `b`
/// and value rows `values` (`[n, Dv]`): V itself here, the new values u for the delta rule.
pub(crate) fn advance_state(h: &Head, s: &mut [f64], c0: usize, b: &[f64], values: &[f64]) {
    let gamma = b[b.len() - 1];
    s.iter_mut().for_each(|x| *x *= gamma.exp());
    for (j, (&bj, value)) in b.iter().zip(values.chunks(h.dv)).enumerate() {
        outer_add(s, (gamma - bj).exp(), h.k(c0 + j), value);
    }
}

/// Adds chunk `c0`'s output rows `O = sigma (diag(e^b) Q S_n + ((Q K^T) (.) D) values)` to `o`
/// (`[T, Dv]`), with cumsum `b`, entry state `s` and value rows `values` (`[n, Dv]`): V itself
/// here, the new values u for the delta rule.
pub(crate) fn add_chunk_output(
    h: &Head,
    c0: usize,
    b: &[f64],
    s: &[f64],
    values: &[f64],
    o: &mut [f64],
) {
    let dv = h.dv;
    for (r, &br) in b.iter().enumerate() {
        let (t, q) = (c0 + r, h.q(c0 + r));
        let out = &mut o[t * dv..(t + 1) * dv];
        vec_mat_add(out, h.scale * br.exp(), q, s);
        for (j, value) in values.chunks(dv).take(r + 1).enumerate() {
            let w = h.scale * (br - b[j]).exp() * dot(q, h.k(c0 + j));
            axpy(out, w, value);
        }
    }
}

/// The value rows `[n, Dv]` of chunk `(c0, n)`.
fn chunk_values(h: &Head, c0: usize, n: usize) -> &[f64] {
    &h.v[c0 * h.dv..(c0 + n) * h.dv]
}

/// [`advance_state`] for chunk `(c0, n)`.
fn chunk_step(h: &Head, s: &mut [f64], c0: usize, n: usize) {
    let b = chunk_local_cumsum(h.gates(c0, n), 1);
    advance_state(h, s, c0, &b, chunk_values(h, c0, n));
}

fn chunk_forward_head(h: &Head, chunk: usize) -> (Vec<f64>, Vec<f64>) {
    let mut s = h.h0.clone();
    let mut o = vec![0.0; h.t * h.dv];
    for (c0, n) in h.chunks(chunk) {
        let b = chunk_local_cumsum(h.gates(c0, n), 1);
        add_chunk_output(h, c0, &b, &s, chunk_values(h, c0, n), &mut o);
        advance_state(h, &mut s, c0, &b, chunk_values(h, c0, n));
    }
    (o, s)
}

fn chunk_backward_head(h: &Head, chunk: usize, d_o: &[f64], d_ht: &[f64]) -> HeadGrads {
    let (dk, dv, sigma) = (h.dk, h.dv, h.scale);
    // Chunk-entry states S_n, recomputed as fla's backward does (`chunk_fwd_h`, fp32 states).
    let (states, _) = entry_states(h, chunk, chunk_step);
    let mut g = HeadGrads::zeros(h);
    // ds holds dS_{n+1} while chunk n is processed.
    let mut ds = d_ht.to_vec();
    for ((c0, n), s_n) in h.chunks(chunk).zip(&states).rev() {
        let b = chunk_local_cumsum(h.gates(c0, n), 1);
        let gamma = b[n - 1];
        for r in 0..n {
            let t = c0 + r;
            let do_r = &d_o[t * dv..(t + 1) * dv];
            // dQ = sigma diag(e^b) dO S^T + dP K, dP = sigma (dO V^T) (.) D.
            mat_vec_add(
                &mut g.dq[t * dk..(t + 1) * dk],
                sigma * b[r].exp(),
                s_n,
                do_r,
            );
            for j in 0..=r {
                let tj = c0 + j;
                let decay = (b[r] - b[j]).exp();
                let dp = sigma * decay * dot(do_r, h.v(tj));
                axpy(&mut g.dq[t * dk..(t + 1) * dk], dp, h.k(tj));
                axpy(&mut g.dk[tj * dk..(tj + 1) * dk], dp, h.q(t));
                let a = sigma * decay * dot(h.q(t), h.k(tj));
                axpy(&mut g.dv[tj * dv..(tj + 1) * dv], a, do_r);
            }
        }
        for (j, &bj) in b.iter().enumerate() {
            // dK += diag(e^{gamma - b}) V dS_{n+1}^T, dV += diag(e^{gamma - b}) K dS_{n+1}.
            let tj = c0 + j;
            let w = (gamma - bj).exp();
            mat_vec_add(&mut g.dk[tj * dk..(tj + 1) * dk], w, &ds, h.v(tj));
            vec_mat_add(&mut g.dv[tj * dv..(tj + 1) * dv], w, h.k(tj), &ds);
        }
        // dS_n = e^gamma dS_{n+1} + sigma (diag(e^b) Q)^T dO.
        ds.iter_mut().for_each(|x| *x *= gamma.exp());
        for (r, &br) in b.iter().enumerate() {
            outer_add(
                &mut ds,
                sigma * br.exp(),
                h.q(c0 + r),
                &d_o[(c0 + r) * dv..(c0 + r + 1) * dv],
            );
        }
    }
    g.dh0 = ds;
    g.dg = decay_gate_grad(h, d_o, d_ht);
    g
}
