//! Token-by-token forms: the forward recurrence and its reverse-mode derivative, shared by the
//! three families, which differ only in their state update `S_{t-1} -> S_t`.
//!
//! The reverse sweep keeps a checkpoint of the state every [`CHECKPOINT`] tokens and recomputes the
//! states of one block at a time, so memory is `O((T / 64 + 64) Dk Dv)` per head rather than
//! `O(T Dk Dv)`; states are never recovered by undoing a decay (`e^{-a}` can overflow).

use super::gates::at;
use super::head::{Head, HeadGrads};
use super::linalg::{axpy, dot, mat_vec_add, outer_add, vec_mat_add};

/// Tokens between stored states in the reverse sweep.
const CHECKPOINT: usize = 64;

/// Runs `step(head, t, S)` (which turns `S_{t-1}` into `S_t` in place) from `h0` and reads
/// `o_t = sigma q_t S_t`. Returns `(o rows [T, Dv], S_T)`.
pub(crate) fn forward_sweep(
    h: &Head,
    step: impl Fn(&Head, usize, &mut [f64]),
) -> (Vec<f64>, Vec<f64>) {
    let mut s = h.h0.clone();
    let mut o = vec![0.0; h.t * h.dv];
    for (t, out) in o.chunks_mut(h.dv).enumerate() {
        step(h, t, &mut s);
        vec_mat_add(out, h.scale, h.q(t), &s);
    }
    (o, s)
}

/// Reverse-mode derivative of [`forward_sweep`]. `back(head, t, S_{t-1}, dS, grads)` receives
/// `dS = dL/dS_t` (the output term already added) and must add token t's gradients to `grads`
/// and turn `dS` into `dL/dS_{t-1}`. The output term `o_t = sigma q_t S_t` is handled here:
/// `dq_t = sigma S_t d_o_t^T`, `dS_t += sigma q_t^T d_o_t`.
pub(crate) fn reverse_sweep(
    h: &Head,
    d_o: &[f64],
    d_ht: &[f64],
    step: impl Fn(&Head, usize, &mut [f64]),
    back: impl Fn(&Head, usize, &[f64], &mut [f64], &mut HeadGrads),
) -> HeadGrads {
    let (dk, dv) = (h.dk, h.dv);
    let mut checkpoints = Vec::with_capacity(h.t.div_ceil(CHECKPOINT));
    let mut s = h.h0.clone();
    for t in 0..h.t {
        if t % CHECKPOINT == 0 {
            checkpoints.push(s.clone());
        }
        step(h, t, &mut s);
    }
    let mut grads = HeadGrads::zeros(h);
    let mut ds = d_ht.to_vec();
    for (c, start) in checkpoints.iter().zip((0..h.t).step_by(CHECKPOINT)).rev() {
        let end = h.t.min(start + CHECKPOINT);
        let mut states = vec![c.clone()];
        for t in start..end {
            let mut next = states[t - start].clone();
            step(h, t, &mut next);
            states.push(next);
        }
        for t in (start..end).rev() {
            let do_t = &d_o[t * dv..(t + 1) * dv];
            mat_vec_add(
                &mut grads.dq[t * dk..(t + 1) * dk],
                h.scale,
                &states[t - start + 1],
                do_t,
            );
            outer_add(&mut ds, h.scale, h.q(t), do_t);
            back(h, t, &states[t - start], &mut ds, &mut grads);
        }
    }
    grads.dh0 = ds;
    grads
}

/// The gate gradient of scalar-decay attention or GLA by the straddling pairs:
/// `da_{t,i} = e^{a_{t,i}} <dS_t[i], S_{t-1}[i]>` ([`decay_back`]), with `dS_{T-1}` including
/// `d_ht`. Every term is a sum of decayed pair products on one side of `t`, so even where the
/// decay is strong (where `dg` is many orders of magnitude below `q . dq`) the result keeps f64's
/// relative accuracy; the chunkwise rule `dg_t = sum_{u >= t} (q_u . dq_u - k_u . dk_u)` sums
/// pairs on both sides of `t` that cancel, and loses that accuracy to the cancellation. The
/// chunkwise references take their `dg` from here.
pub(crate) fn decay_gate_grad(h: &Head, d_o: &[f64], d_ht: &[f64]) -> Vec<f64> {
    reverse_sweep(h, d_o, d_ht, decay_step, decay_back).dg
}

/// The decayed update of scalar-decay attention and GLA: `S_t = Diag(e^{a_t}) S_{t-1} + k_t^T v_t`
/// (a scalar gate decays every row alike).
pub(crate) fn decay_step(h: &Head, t: usize, s: &mut [f64]) {
    for (i, row) in s.chunks_mut(h.dv).enumerate() {
        let decay = at(&h.g, h.gate_dim, t, i).exp();
        row.iter_mut().for_each(|x| *x *= decay);
    }
    outer_add(s, 1.0, h.k(t), h.v(t));
}

/// Reverse of [`decay_step`]: `dk_t = dS_t v_t^T`, `dv_t = k_t dS_t`,
/// `da_{t,i} = e^{a_{t,i}} <dS_t[i], S_{t-1}[i]>` (summed over rows for a scalar gate),
/// `dS_{t-1} = Diag(e^{a_t}) dS_t`. The gate gradient comes out directly, with no cumsum, which
/// makes this an independent check of the chunkwise reverse-cumsum rule.
pub(crate) fn decay_back(
    h: &Head,
    t: usize,
    s_prev: &[f64],
    ds: &mut [f64],
    grads: &mut HeadGrads,
) {
    let (dk, dv) = (h.dk, h.dv);
    let (k, v) = (h.k(t), h.v(t));
    let dv_t = &mut grads.dv[t * dv..(t + 1) * dv];
    for i in 0..dk {
        let row = &mut ds[i * dv..(i + 1) * dv];
        grads.dk[t * dk + i] += dot(row, v);
        axpy(dv_t, k[i], row);
        let decay = at(&h.g, h.gate_dim, t, i).exp();
        let gi = if h.gate_dim == 1 { 0 } else { i };
        grads.dg[t * h.gate_dim + gi] += decay * dot(row, &s_prev[i * dv..(i + 1) * dv]);
        row.iter_mut().for_each(|x| *x *= decay);
    }
}
