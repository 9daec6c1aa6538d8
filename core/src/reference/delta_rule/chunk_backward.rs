//! The chunkwise backward of the delta rule through each chunk's WY / UT form (the derivative
//! fla's `chunk_gated_delta_rule` backward computes), in f64.
//!
//! Per chunk, with entry state `S`, chunk-local cumsum `b`, `gamma = b_{n-1}`, the strictly lower
//! `L_rj = beta_r e^{b_r - b_j} (k_r . k_j)` and `M = I + L`, the forward is
//! ```text
//! M U0 = diag(beta) V,   M W = diag(beta) diag(e^b) K,   u = U0 - W S,
//! O_r  = sigma (e^{b_r} q_r S + sum_{j <= r} e^{b_r - b_j} (q_r . k_j) u_j),
//! S'   = e^gamma S + sum_j e^{gamma - b_j} k_j^T u_j.
//! ```
//! Reverse mode, given `dO` and `dS' = dL/dS'` (from the next chunk, or `d_ht`):
//! 1. output: `dq_r += sigma e^{b_r} S dO_r^T + sum_{j <= r} dP_rj k_j`,
//!    `dk_j += sum_{r >= j} dP_rj q_r`, `du_j += sum_{r >= j} sigma e^{b_r - b_j} (q_r . k_j) dO_r`,
//!    `dS += sigma (diag(e^b) Q)^T dO`, with `dP_rj = sigma e^{b_r - b_j} (dO_r . u_j)`;
//! 2. transition: `du_j += e^{gamma - b_j} k_j dS'`, `dk_j += e^{gamma - b_j} dS' u_j^T`,
//!    `dS += e^gamma dS'`;
//! 3. WY form: `dU0 = du`, `dW_r = -S du_r^T`, `dS -= W^T du`; the triangular solves `M X = Z`
//!    back-propagate as `dZ = M^{-T} dX` (back substitution) and `dM = -dZ X^T`, so with
//!    `Y_U = M^{-T} dU0`, `Y_W = M^{-T} dW`: `dv_r += beta_r Y_U_r`,
//!    `dk_r += beta_r e^{b_r} Y_W_r`, `dbeta_r += Y_U_r . v_r + e^{b_r} Y_W_r . k_r`, and through
//!    `dL_rj = -(Y_U_r . U0_j + Y_W_r . W_j)` the terms of `L_rj` give `dbeta_r`, `dk_r`, `dk_j`.
//!
//! Gate gradient: every gate enters through a decay factor `e^{sum_{t in (lo, hi]} a_t}`
//! (`e^{b_r - b_j}`: `(j, r]`; `e^{b_r}`: the chunk's tokens up to r; `e^{gamma - b_j}`: after j;
//! `e^gamma`: the whole chunk), whose derivative with respect to `a_t` is the term itself for each
//! `t` in the range. So each term's contribution is added to the tokens it straddles directly,
//! rather than to `db` followed by a reverse cumsum: a term then never enters a token's `da`
//! as `+x - x`, and `da` keeps f64's relative accuracy where strong decay makes it tiny next to
//! the terms (the same reason the recurrent sweep's `<dP_t, P_t>` is accurate). The cost is
//! `O(C)` per term, `O(C^3)` per chunk, nothing next to a reference's other work.

use std::ops::RangeInclusive;

use super::super::error::ReferenceError;
use super::super::head::{backward_heads, entry_states, Head, HeadGrads};
use super::super::inputs::{Family, Inputs};
use super::super::linalg::{axpy, dot, mat_vec_add, outer_add, vec_mat_add};
use super::super::outputs::Grads;
use super::super::tensor::Tensor;
use super::super::validate::check_chunk;
use super::{chunk_step, lower_entry, Wy};

/// Chunkwise backward with chunk size `chunk` (any value >= 1; it need not divide T):
/// `dq, dk, dv, dg, dbeta, dh0` of `L = sum(o * d_o) + <S_T, d_ht>`, through each chunk's WY form
/// (the module doc has the derivation). The check for it is [`super::recurrent_backward`].
pub fn chunkwise_backward(
    inputs: &Inputs,
    chunk: usize,
    d_o: &Tensor,
    d_ht: Option<&Tensor>,
) -> Result<Grads, ReferenceError> {
    check_chunk("chunk", chunk)?;
    backward_heads(inputs, Family::DeltaRule, d_o, d_ht, |h, d_o, d_ht| {
        chunk_backward_head(h, chunk, d_o, d_ht)
    })
}

fn chunk_backward_head(h: &Head, chunk: usize, d_o: &[f64], d_ht: &[f64]) -> HeadGrads {
    let dv = h.dv;
    // Chunk-entry states, recomputed as fla's backward does (`chunk_gated_delta_rule_fwd_h`).
    let (states, _) = entry_states(h, chunk, chunk_step);
    let mut g = HeadGrads::zeros(h);
    // dL/dS leaving the chunk being processed; after chunk 0, dL/dh0.
    let mut ds = d_ht.to_vec();
    for ((c0, n), s) in h.chunks(chunk).zip(&states).rev() {
        let c = Chunk::recompute(h, c0, n, s);
        let mut acc = ChunkCotangents::zeros(h, n);
        c.output_backward(&d_o[c0 * dv..(c0 + n) * dv], &mut acc, &mut g);
        c.transition_backward(&ds, &mut acc, &mut g);
        c.wy_backward(&mut acc, &mut g);
        axpy(&mut g.dg[c0..c0 + n], 1.0, &acc.da);
        ds = acc.ds;
    }
    g.dh0 = ds;
    g
}

/// One chunk's forward quantities, recomputed from its entry state `s`.
struct Chunk<'a> {
    h: &'a Head,
    c0: usize,
    n: usize,
    s: &'a [f64],
    wy: Wy,
    /// The new values `u = U0 - W S` (`[n, Dv]`).
    u: Vec<f64>,
}

/// The cotangents accumulated inside one chunk: of the new values u (`[n, Dv]`), of the entry
/// state (`[Dk, Dv]`) and of the chunk's gates (`[n]`).
struct ChunkCotangents {
    du: Vec<f64>,
    ds: Vec<f64>,
    da: Vec<f64>,
}

impl ChunkCotangents {
    fn zeros(h: &Head, n: usize) -> ChunkCotangents {
        ChunkCotangents {
            du: vec![0.0; n * h.dv],
            ds: vec![0.0; h.dk * h.dv],
            da: vec![0.0; n],
        }
    }

    /// Adds the gate derivative `x` of a decay term over the gates `tokens` (chunk-local) to each
    /// of them (the module doc says why not through a cumsum).
    fn add_decay_term(&mut self, tokens: RangeInclusive<usize>, x: f64) {
        self.da[tokens].iter_mut().for_each(|d| *d += x);
    }
}

impl<'a> Chunk<'a> {
    fn recompute(h: &'a Head, c0: usize, n: usize, s: &'a [f64]) -> Chunk<'a> {
        let wy = Wy::new(h, c0, n);
        let u = wy.new_values(s, h.dk);
        Chunk { h, c0, n, s, wy, u }
    }

    fn u(&self, j: usize) -> &[f64] {
        &self.u[j * self.h.dv..(j + 1) * self.h.dv]
    }

    /// Through `O_r = sigma (e^{b_r} q_r S + sum_{j <= r} e^{b_r - b_j} (q_r . k_j) u_j)`.
    fn output_backward(&self, d_o: &[f64], acc: &mut ChunkCotangents, g: &mut HeadGrads) {
        let (h, dk, dv, sigma) = (self.h, self.h.dk, self.h.dv, self.h.scale);
        let b = &self.wy.b;
        for (r, do_r) in d_o.chunks(dv).enumerate() {
            let t = self.c0 + r;
            let q = h.q(t);
            let entry = sigma * b[r].exp();
            let mut qs = vec![0.0; dv];
            vec_mat_add(&mut qs, 1.0, q, self.s);
            acc.add_decay_term(0..=r, entry * dot(&qs, do_r));
            mat_vec_add(&mut g.dq[t * dk..(t + 1) * dk], entry, self.s, do_r);
            outer_add(&mut acc.ds, entry, q, do_r);
            for j in 0..=r {
                let tj = self.c0 + j;
                let decay = sigma * (b[r] - b[j]).exp();
                let qk = dot(q, h.k(tj));
                axpy(&mut acc.du[j * dv..(j + 1) * dv], decay * qk, do_r);
                let dp = decay * dot(do_r, self.u(j));
                axpy(&mut g.dq[t * dk..(t + 1) * dk], dp, h.k(tj));
                axpy(&mut g.dk[tj * dk..(tj + 1) * dk], dp, q);
                acc.add_decay_term(j + 1..=r, dp * qk);
            }
        }
    }

    /// Through `S' = e^gamma S + sum_j e^{gamma - b_j} k_j^T u_j`, with `ds_next = dL/dS'`.
    fn transition_backward(&self, ds_next: &[f64], acc: &mut ChunkCotangents, g: &mut HeadGrads) {
        let (h, dk, dv, last) = (self.h, self.h.dk, self.h.dv, self.n - 1);
        for j in 0..self.n {
            let tj = self.c0 + j;
            let w = self.wy.end_decay(j);
            let mut k_ds = vec![0.0; dv];
            vec_mat_add(&mut k_ds, 1.0, h.k(tj), ds_next);
            axpy(&mut acc.du[j * dv..(j + 1) * dv], w, &k_ds);
            mat_vec_add(&mut g.dk[tj * dk..(tj + 1) * dk], w, ds_next, self.u(j));
            acc.add_decay_term(j + 1..=last, w * dot(&k_ds, self.u(j)));
        }
        let carry = self.wy.b[last].exp();
        axpy(&mut acc.ds, carry, ds_next);
        acc.add_decay_term(0..=last, carry * dot(ds_next, self.s));
    }

    /// Through `u = U0 - W S` and the triangular solves `M U0 = diag(beta) V`,
    /// `M W = diag(beta) diag(e^b) K`.
    fn wy_backward(&self, acc: &mut ChunkCotangents, g: &mut HeadGrads) {
        let (h, dk, dv, n) = (self.h, self.h.dk, self.h.dv, self.n);
        let (b, u0, w) = (&self.wy.b, &self.wy.u0, &self.wy.w);
        let mut lower = vec![0.0; n * n];
        for r in 0..n {
            for j in 0..r {
                lower[r * n + j] = lower_entry(h, self.c0, b, r, j);
            }
        }
        // dU0 = du; dW_r = -S du_r^T; dS -= W^T du.
        let mut y_u = acc.du.clone();
        let mut y_w = vec![0.0; n * dk];
        for (r, du_r) in acc.du.chunks(dv).enumerate() {
            mat_vec_add(&mut y_w[r * dk..(r + 1) * dk], -1.0, self.s, du_r);
            outer_add(&mut acc.ds, -1.0, &w[r * dk..(r + 1) * dk], du_r);
        }
        solve_transposed(&lower, &mut y_u, dv);
        solve_transposed(&lower, &mut y_w, dk);
        for r in 0..n {
            let t = self.c0 + r;
            let (beta, k) = (h.beta[t], h.k(t));
            let (yu_r, yw_r) = (&y_u[r * dv..(r + 1) * dv], &y_w[r * dk..(r + 1) * dk]);
            // The right-hand sides beta_r v_r and beta_r e^{b_r} k_r.
            let entry = b[r].exp();
            let yw_k = dot(yw_r, k);
            axpy(&mut g.dv[t * dv..(t + 1) * dv], beta, yu_r);
            axpy(&mut g.dk[t * dk..(t + 1) * dk], beta * entry, yw_r);
            g.dbeta[t] += dot(yu_r, h.v(t)) + entry * yw_k;
            acc.add_decay_term(0..=r, beta * entry * yw_k);
            // dM = -Y X^T on the strictly lower entries L_rj = beta_r e^{b_r - b_j} (k_r . k_j).
            for j in 0..r {
                let tj = self.c0 + j;
                let d_lower =
                    -(dot(yu_r, &u0[j * dv..(j + 1) * dv]) + dot(yw_r, &w[j * dk..(j + 1) * dk]));
                let l_rj = lower[r * n + j];
                let decay = (b[r] - b[j]).exp();
                g.dbeta[t] += d_lower * decay * dot(k, h.k(tj));
                axpy(
                    &mut g.dk[t * dk..(t + 1) * dk],
                    d_lower * beta * decay,
                    h.k(tj),
                );
                axpy(&mut g.dk[tj * dk..(tj + 1) * dk], d_lower * beta * decay, k);
                acc.add_decay_term(j + 1..=r, d_lower * l_rj);
            }
        }
    }
}

/// Solves `(I + L)^T Y = X` in place for the `[n, width]` rows `x`, with `lower` the strictly
/// lower `[n, n]` L: back substitution, `Y_j = X_j - sum_{r > j} L_rj Y_r`. It is the backward of
/// the forward substitution [`Wy::new`] applies.
fn solve_transposed(lower: &[f64], x: &mut [f64], width: usize) {
    let n = x.len() / width;
    for j in (0..n).rev() {
        let (head, solved) = x.split_at_mut((j + 1) * width);
        let x_j = &mut head[j * width..];
        for (r, y_r) in solved.chunks(width).enumerate() {
            axpy(x_j, -lower[(j + 1 + r) * n + j], y_r);
        }
    }
}
