//! Gated DeltaNet: the delta rule with scalar decay (fla `chunk_gated_delta_rule`, with q and k
//! taken as given, i.e. already L2-normalised if the model normalises them).
//!
//! `S_t = e^{a_t} S_{t-1} + beta_t k_t^T (v_t - e^{a_t} k_t S_{t-1})
//!      = e^{a_t} (I - beta_t k_t^T k_t) S_{t-1} + beta_t k_t^T v_t`, `o_t = sigma q_t S_t`,
//! with `g: [B, T, H]` (`<= 0`) and `beta: [B, T, H]`.
//!
//! Every update is affine in the state, so a token range maps `S_in` to `A S_in + h` with a
//! `[Dk, Dk]` transition `A`; that is the per-shard summary LASP-2 exchanges for this family.
//!
//! Chunkwise (the WY / UT form of fla's kernels), per chunk with chunk-local cumsum `b_r`: the
//! new values `u_r = beta_r (v_r - k_r e^{a_r} S_{r-1})` satisfy `u = U0 - W S_n`, where
//! `U0 = T V`, `W = T (e^b (.) K)` and `T = (I + L)^{-1} diag(beta)` with the strictly lower
//! `L_rj = beta_r e^{b_r - b_j} (k_r . k_j)` (applied by forward substitution, never inverted).
//! Then `O = sigma (diag(e^b) Q S_n + ((Q K^T) (.) D) u)` and
//! `S_{n+1} = e^gamma S_n + (diag(e^{gamma - b}) K)^T u`, scalar-decay attention's chunk formulas
//! with u in place of V (evaluated by [`scalar_decay`](super::scalar_decay)'s own code), and the
//! chunk's transition is `e^gamma I - (diag(e^{gamma - b}) K)^T W`.
//!
//! Two backwards return `dbeta` besides the usual gradients: the token-by-token reverse-mode
//! derivative ([`recurrent_backward`]), whose gate gradient comes out directly,
//! `da_t = <dP_t, P_t>` with `P_t = e^{a_t} S_{t-1}`, and the chunkwise one through each chunk's
//! WY form ([`chunkwise_backward`], derived in its module), which it checks.

use super::error::ReferenceError;
use super::gates::chunk_local_cumsum;
use super::head::{backward_heads, chunk_states_heads, forward_heads, Head, HeadGrads};
use super::inputs::{Family, Inputs};
use super::linalg::{axpy, dot, mat_vec_add, matmul, outer_add, vec_mat_add};
use super::outputs::{Forward, Grads};
use super::recurrent::{forward_sweep, reverse_sweep};
use super::scalar_decay::{add_chunk_output, advance_state};
use super::tensor::Tensor;
use super::validate::check_chunk;

mod chunk_backward;
pub use chunk_backward::chunkwise_backward;

/// Token-by-token forward: the definition itself.
pub fn recurrent_forward(inputs: &Inputs) -> Result<Forward, ReferenceError> {
    forward_heads(inputs, Family::DeltaRule, |h| forward_sweep(h, delta_step))
}

/// Chunkwise (WY) forward with chunk size `chunk` (any value >= 1; it need not divide T).
pub fn chunkwise_forward(inputs: &Inputs, chunk: usize) -> Result<Forward, ReferenceError> {
    check_chunk("chunk", chunk)?;
    forward_heads(inputs, Family::DeltaRule, |h| chunk_forward_head(h, chunk))
}

/// The states entering each chunk, `[B, N, H, Dk, Dv]` with `N = ceil(T / chunk)` (fla's `h`
/// layout; entry 0 is h0).
pub fn chunk_states(inputs: &Inputs, chunk: usize) -> Result<Tensor, ReferenceError> {
    chunk_states_heads(inputs, Family::DeltaRule, chunk, chunk_step)
}

/// Reverse-mode backward of the recurrence: `dq, dk, dv, dg, dbeta, dh0` of
/// `L = sum(o * d_o) + <S_T, d_ht>`.
pub fn recurrent_backward(
    inputs: &Inputs,
    d_o: &Tensor,
    d_ht: Option<&Tensor>,
) -> Result<Grads, ReferenceError> {
    backward_heads(inputs, Family::DeltaRule, d_o, d_ht, |h, d_o, d_ht| {
        reverse_sweep(h, d_o, d_ht, delta_step, delta_back)
    })
}

/// `P = e^{a_t} S_{t-1}`; `u = beta (v - k P)`; `S_t = P + k^T u`.
fn delta_step(h: &Head, t: usize, s: &mut [f64]) {
    let decay = h.g[t].exp();
    s.iter_mut().for_each(|x| *x *= decay);
    let mut u = h.v(t).to_vec();
    vec_mat_add(&mut u, -1.0, h.k(t), s);
    u.iter_mut().for_each(|x| *x *= h.beta[t]);
    outer_add(s, 1.0, h.k(t), &u);
}

/// The l2 norms of the products that the recurrent backward's `dg` and `dbeta` sum
/// (`dg_t = <dP_t, P_t>`, `dbeta_t = <du_t, r_t>`) over every token and head. A computation that
/// rounds those operands to a relative precision eps errs by about eps times these norms (the
/// products' roundings add like a random walk), whatever cancellation leaves of the sums: the
/// scale a kernel that keeps its chunk states in bf16 is checked against.
pub fn gate_and_beta_product_norms(
    inputs: &Inputs,
    d_o: &Tensor,
    d_ht: Option<&Tensor>,
) -> Result<(f64, f64), ReferenceError> {
    let squares = backward_heads(inputs, Family::DeltaRule, d_o, d_ht, |h, d_o, d_ht| {
        reverse_sweep(h, d_o, d_ht, delta_step, |h, t, s_prev, ds, g| {
            delta_back_with(h, t, s_prev, ds, g, |x, y| {
                x.iter().zip(y).map(|(a, b)| (a * b) * (a * b)).sum()
            })
        })
    })?;
    let total = |x: &Tensor| x.data().iter().sum::<f64>().sqrt();
    let dbeta = squares.dbeta.as_ref().map_or(0.0, total);
    Ok((total(&squares.dg), dbeta))
}

/// Reverse of [`delta_step`], with `dS = dL/dS_t` on entry and `dL/dS_{t-1}` on exit.
fn delta_back(h: &Head, t: usize, s_prev: &[f64], ds: &mut [f64], g: &mut HeadGrads) {
    delta_back_with(h, t, s_prev, ds, g, dot);
}

/// [`delta_back`] with `pair(x, y)` for the two sums `dbeta_t` and `dg_t` are (`dot`, or what
/// [`gate_and_beta_product_norms`] measures of them).
fn delta_back_with(
    h: &Head,
    t: usize,
    s_prev: &[f64],
    ds: &mut [f64],
    g: &mut HeadGrads,
    pair: impl Fn(&[f64], &[f64]) -> f64,
) {
    let (dk, dv) = (h.dk, h.dv);
    let (k, v, beta, decay) = (h.k(t), h.v(t), h.beta[t], h.g[t].exp());
    let p: Vec<f64> = s_prev.iter().map(|x| x * decay).collect();
    // r = v - k P is the delta-rule residual, u = beta r.
    let mut r = v.to_vec();
    vec_mat_add(&mut r, -1.0, k, &p);
    let u: Vec<f64> = r.iter().map(|x| beta * x).collect();
    let dk_t = &mut g.dk[t * dk..(t + 1) * dk];
    // S_t = P + k^T u.
    mat_vec_add(dk_t, 1.0, ds, &u);
    let mut du = vec![0.0; dv];
    vec_mat_add(&mut du, 1.0, k, ds);
    // u = beta (v - k P).
    axpy(&mut g.dv[t * dv..(t + 1) * dv], beta, &du);
    g.dbeta[t] += pair(&du, &r);
    mat_vec_add(dk_t, -beta, &p, &du);
    outer_add(ds, -beta, k, &du);
    // P = e^{a_t} S_{t-1}: dP/da_t = P.
    g.dg[t] += pair(ds, &p);
    ds.iter_mut().for_each(|x| *x *= decay);
}

/// One chunk in WY form: chunk-local cumsum `b` (`[n]`), `U0 = T V` (`[n, Dv]`) and
/// `W = T (e^b (.) K)` (`[n, Dk]`), by forward substitution of `(I + L) X = diag(beta) Y`.
struct Wy {
    b: Vec<f64>,
    u0: Vec<f64>,
    w: Vec<f64>,
}

impl Wy {
    fn new(h: &Head, c0: usize, n: usize) -> Wy {
        let (dk, dv) = (h.dk, h.dv);
        let b = chunk_local_cumsum(h.gates(c0, n), 1);
        let mut u0 = vec![0.0; n * dv];
        let mut w = vec![0.0; n * dk];
        for r in 0..n {
            let beta = h.beta[c0 + r];
            let (done_u, rest_u) = u0.split_at_mut(r * dv);
            let (done_w, rest_w) = w.split_at_mut(r * dk);
            let (ur, wr) = (&mut rest_u[..dv], &mut rest_w[..dk]);
            axpy(ur, beta, h.v(c0 + r));
            axpy(wr, beta * b[r].exp(), h.k(c0 + r));
            for j in 0..r {
                let c = lower_entry(h, c0, &b, r, j);
                axpy(ur, -c, &done_u[j * dv..(j + 1) * dv]);
                axpy(wr, -c, &done_w[j * dk..(j + 1) * dk]);
            }
        }
        Wy { b, u0, w }
    }

    /// The chunk's new values `u = U0 - W S_n` (`[n, Dv]`).
    fn new_values(&self, s: &[f64], dk: usize) -> Vec<f64> {
        let mut u = self.u0.clone();
        let dv = s.len() / dk;
        for (ur, wr) in u.chunks_mut(dv).zip(self.w.chunks(dk)) {
            vec_mat_add(ur, -1.0, wr, s);
        }
        u
    }

    /// `e^{gamma - b_j}`: how token j's write decays by the end of the chunk.
    fn end_decay(&self, j: usize) -> f64 {
        (self.b[self.b.len() - 1] - self.b[j]).exp()
    }
}

/// `L_rj = beta_r e^{b_r - b_j} (k_r . k_j)` (`j < r`), the strictly lower part of the chunk's
/// triangular system `(I + L) X = diag(beta) Y`, for chunk `c0` with cumsum `b`.
fn lower_entry(h: &Head, c0: usize, b: &[f64], r: usize, j: usize) -> f64 {
    h.beta[c0 + r] * (b[r] - b[j]).exp() * dot(h.k(c0 + r), h.k(c0 + j))
}

fn chunk_forward_head(h: &Head, chunk: usize) -> (Vec<f64>, Vec<f64>) {
    let mut s = h.h0.clone();
    let mut o = vec![0.0; h.t * h.dv];
    for (c0, n) in h.chunks(chunk) {
        let wy = Wy::new(h, c0, n);
        let u = wy.new_values(&s, h.dk);
        add_chunk_output(h, c0, &wy.b, &s, &u, &mut o);
        advance_state(h, &mut s, c0, &wy.b, &u);
    }
    (o, s)
}

/// The state pass alone, for [`chunk_states`].
fn chunk_step(h: &Head, s: &mut [f64], c0: usize, n: usize) {
    let wy = Wy::new(h, c0, n);
    let u = wy.new_values(s, h.dk);
    advance_state(h, s, c0, &wy.b, &u);
}

/// The transition `A` (`[Dk, Dk]`) of the head's whole token range, `S_T = A S_0 + S_T|_{S_0=0}`,
/// as the ordered product of the chunk transitions `e^gamma I - (diag(e^{gamma - b}) K)^T W`.
pub(crate) fn transition_head(h: &Head, chunk: usize) -> Vec<f64> {
    let dk = h.dk;
    let identity = |scale: f64| {
        let mut m = vec![0.0; dk * dk];
        (0..dk).for_each(|i| m[i * dk + i] = scale);
        m
    };
    let mut total = identity(1.0);
    for (c0, n) in h.chunks(chunk) {
        let wy = Wy::new(h, c0, n);
        let mut a = identity(wy.b[n - 1].exp());
        for j in 0..n {
            outer_add(
                &mut a,
                -wy.end_decay(j),
                h.k(c0 + j),
                &wy.w[j * dk..(j + 1) * dk],
            );
        }
        total = matmul(&a, &total, dk);
    }
    total
}
