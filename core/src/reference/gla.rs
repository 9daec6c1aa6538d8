//! GLA: linear attention with per-key vector gates (kernels/docs/maths.md, "Vector decay (GLA)").
//!
//! `S_t = Diag(e^{a_t}) S_{t-1} + k_t^T v_t`, `o_t = sigma q_t S_t`, with `a_t in R^{Dk}`, `<= 0`
//! (`g: [B, T, H, Dk]`).
//!
//! Chunkwise, with chunk-local cumsums `b_r in R^{Dk}` and `gamma = b_C`:
//! `O = sigma ((Q (.) e^b) S_n + A V)`, `S_{n+1} = Diag(e^gamma) S_n + (K (.) e^{gamma - b})^T V`,
//! `A_rj = [r >= j] sum_d q_rd k_jd e^{b_rd - b_jd}`. `A` is not a plain GEMM: factoring it as
//! `(Q (.) e^b)(K (.) e^{-b})^T` overflows once `-b` is large. So the chunk is split again into
//! sub-chunks, as the kernel will do (GLA paper §4, fla `chunk_gla`):
//! * off-diagonal sub-blocks (I > J) are a GEMM of `Q_I (.) e^{b_I - g*}` and `K_J (.) e^{g* - b_J}`
//!   with the reference row `g*` = b at the first row of sub-chunk I (both exponents `<= 0`);
//!   the backward's dk uses the last row of sub-chunk J instead (fla `chunk_gla_bwd_kernel_intra`);
//! * diagonal sub-blocks are evaluated elementwise with `e^{b_rd - b_jd}`, `r >= j`.

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
    forward_heads(inputs, Family::Gla, |h| forward_sweep(h, decay_step))
}

/// Chunkwise forward with chunk size `chunk` and secondary chunk size `sub_chunk` (both >= 1;
/// neither needs to divide the other or T; a `sub_chunk >= chunk` means one sub-chunk per chunk,
/// i.e. the whole intra-chunk block evaluated elementwise).
pub fn chunkwise_forward(
    inputs: &Inputs,
    chunk: usize,
    sub_chunk: usize,
) -> Result<Forward, ReferenceError> {
    check_chunk("chunk", chunk)?;
    check_chunk("sub_chunk", sub_chunk)?;
    forward_heads(inputs, Family::Gla, |h| {
        chunk_forward_head(h, chunk, sub_chunk)
    })
}

/// The states entering each chunk, `[B, N, H, Dk, Dv]` with `N = ceil(T / chunk)` (fla's `h`
/// layout; entry 0 is h0): what the chunk-state pass stores for the output pass and the backward.
pub fn chunk_states(inputs: &Inputs, chunk: usize) -> Result<Tensor, ReferenceError> {
    chunk_states_heads(inputs, Family::Gla, chunk, chunk_step)
}

/// Token-by-token reverse-mode backward (gate gradient directly, without a cumsum); the check for
/// [`backward`].
pub fn recurrent_backward(
    inputs: &Inputs,
    d_o: &Tensor,
    d_ht: Option<&Tensor>,
) -> Result<Grads, ReferenceError> {
    backward_heads(inputs, Family::Gla, d_o, d_ht, |h, d_o, d_ht| {
        reverse_sweep(h, d_o, d_ht, decay_step, decay_back)
    })
}

/// Chunkwise backward with secondary chunking (kernels/docs/maths.md, "Vector decay (GLA)"):
/// `dS_n = Diag(e^gamma) dS_{n+1} + sigma (Q (.) e^b)^T dO`, intra-chunk dq and dk through the
/// sub-chunk reference rows, per-key `dG_t = q_t (.) dq_t - k_t (.) dk_t`
/// (+ `rowsum(S_T (.) d_ht)` at the last token) and `da = reverse-cumsum(dG)`.
pub fn backward(
    inputs: &Inputs,
    chunk: usize,
    sub_chunk: usize,
    d_o: &Tensor,
    d_ht: Option<&Tensor>,
) -> Result<Grads, ReferenceError> {
    check_chunk("chunk", chunk)?;
    check_chunk("sub_chunk", sub_chunk)?;
    backward_heads(inputs, Family::Gla, d_o, d_ht, |h, d_o, d_ht| {
        chunk_backward_head(h, chunk, sub_chunk, d_o, d_ht)
    })
}

/// `x (.) e^{y - z}` elementwise (each exponent is `<= 0` at every call site).
fn scaled(x: &[f64], y: &[f64], z: &[f64]) -> Vec<f64> {
    x.iter()
        .zip(y)
        .zip(z)
        .map(|((x, y), z)| x * (y - z).exp())
        .collect()
}

/// The chunk-local cumsum rows `b_r` (`[n, Dk]`) of chunk `(c0, n)`.
fn cumsum(h: &Head, c0: usize, n: usize) -> Vec<f64> {
    chunk_local_cumsum(h.gates(c0, n), h.dk)
}

/// `q_t (.) e^{b_r}`: query row t decayed from the chunk start (`b_r`, row r of the cumsum).
fn decayed_query(h: &Head, t: usize, b_r: &[f64]) -> Vec<f64> {
    h.q(t).iter().zip(b_r).map(|(q, b)| q * b.exp()).collect()
}

/// The sub-chunks `[start, end)` of a chunk of `n` rows (the last may be short).
fn sub_chunks(n: usize, sub: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..n)
        .step_by(sub)
        .map(move |start| (start, n.min(start + sub)))
}

/// The keys of the rows before sub-chunk start `si`, each against the reference row
/// `g* = b_{si}`: `k_j (.) e^{g* - b_j}` for `j < si` (exponents `<= 0`), the right-hand side of
/// the off-diagonal GEMMs.
fn keys_before(h: &Head, c0: usize, b: &[f64], si: usize) -> Vec<Vec<f64>> {
    let dk = h.dk;
    let g_star = &b[si * dk..(si + 1) * dk];
    (0..si)
        .map(|j| scaled(h.k(c0 + j), g_star, &b[j * dk..(j + 1) * dk]))
        .collect()
}

/// `S_{n+1} = Diag(e^gamma) S_n + (K (.) e^{gamma - b})^T V`.
fn advance_state(h: &Head, s: &mut [f64], c0: usize, b: &[f64]) {
    let dk = h.dk;
    let gamma = &b[b.len() - dk..];
    for (row, g) in s.chunks_mut(h.dv).zip(gamma) {
        row.iter_mut().for_each(|x| *x *= g.exp());
    }
    for (j, bj) in b.chunks(dk).enumerate() {
        outer_add(s, 1.0, &scaled(h.k(c0 + j), gamma, bj), h.v(c0 + j));
    }
}

/// [`advance_state`] for chunk `(c0, n)`.
fn chunk_step(h: &Head, s: &mut [f64], c0: usize, n: usize) {
    advance_state(h, s, c0, &cumsum(h, c0, n));
}

/// The intra-chunk scores `A` (`[n, n]`, zero above the diagonal, without sigma) by secondary
/// chunking.
fn intra_scores(h: &Head, c0: usize, b: &[f64], sub: usize) -> Vec<f64> {
    let dk = h.dk;
    let n = b.len() / dk;
    let row = |r: usize| &b[r * dk..(r + 1) * dk];
    let mut a = vec![0.0; n * n];
    for (si, ei) in sub_chunks(n, sub) {
        // Off-diagonal: every earlier row j < si against reference row g* = b_{si}.
        let g_star = row(si);
        let kt = keys_before(h, c0, b, si);
        for r in si..ei {
            let qt = scaled(h.q(c0 + r), row(r), g_star);
            for (j, kj) in kt.iter().enumerate() {
                a[r * n + j] = dot(&qt, kj);
            }
            // Diagonal sub-block, elementwise.
            for j in si..=r {
                a[r * n + j] = dot(h.q(c0 + r), &scaled(h.k(c0 + j), row(r), row(j)));
            }
        }
    }
    a
}

/// Adds the intra-chunk dq and dk for `dA` (`[n, n]`, sigma included) by secondary chunking: dq of
/// sub-chunk I against reference row `b` at its first row, dk of sub-chunk J against `b` at its
/// last row, diagonal sub-blocks elementwise.
fn intra_grads(h: &Head, c0: usize, b: &[f64], sub: usize, da: &[f64], g: &mut HeadGrads) {
    let dk = h.dk;
    let n = b.len() / dk;
    let row = |r: usize| &b[r * dk..(r + 1) * dk];
    for (si, ei) in sub_chunks(n, sub) {
        let g_star = row(si);
        let kt = keys_before(h, c0, b, si);
        for r in si..ei {
            let mut acc = vec![0.0; dk];
            for (j, kj) in kt.iter().enumerate() {
                axpy(&mut acc, da[r * n + j], kj);
            }
            let t = c0 + r;
            let dq = &mut g.dq[t * dk..(t + 1) * dk];
            axpy(dq, 1.0, &scaled(&acc, row(r), g_star));
            for j in si..=r {
                axpy(dq, da[r * n + j], &scaled(h.k(c0 + j), row(r), row(j)));
            }
        }
    }
    for (sj, ej) in sub_chunks(n, sub) {
        let g_end = row(ej - 1);
        let qt: Vec<Vec<f64>> = (ej..n)
            .map(|r| scaled(h.q(c0 + r), row(r), g_end))
            .collect();
        for j in sj..ej {
            let mut acc = vec![0.0; dk];
            for (i, qr) in qt.iter().enumerate() {
                axpy(&mut acc, da[(ej + i) * n + j], qr);
            }
            let t = c0 + j;
            let dkj = &mut g.dk[t * dk..(t + 1) * dk];
            axpy(dkj, 1.0, &scaled(&acc, g_end, row(j)));
            for r in j..ej {
                axpy(dkj, da[r * n + j], &scaled(h.q(c0 + r), row(r), row(j)));
            }
        }
    }
}

fn chunk_forward_head(h: &Head, chunk: usize, sub: usize) -> (Vec<f64>, Vec<f64>) {
    let (dk, dv) = (h.dk, h.dv);
    let mut s = h.h0.clone();
    let mut o = vec![0.0; h.t * dv];
    for (c0, n) in h.chunks(chunk) {
        let b = cumsum(h, c0, n);
        let a = intra_scores(h, c0, &b, sub);
        for r in 0..n {
            let t = c0 + r;
            let out = &mut o[t * dv..(t + 1) * dv];
            let qb = decayed_query(h, t, &b[r * dk..(r + 1) * dk]);
            vec_mat_add(out, h.scale, &qb, &s);
            for j in 0..=r {
                axpy(out, h.scale * a[r * n + j], h.v(c0 + j));
            }
        }
        advance_state(h, &mut s, c0, &b);
    }
    (o, s)
}

fn chunk_backward_head(h: &Head, chunk: usize, sub: usize, d_o: &[f64], d_ht: &[f64]) -> HeadGrads {
    let (dk, dv, sigma) = (h.dk, h.dv, h.scale);
    let (states, _) = entry_states(h, chunk, chunk_step);
    let mut g = HeadGrads::zeros(h);
    // ds holds dS_{n+1} while chunk n is processed.
    let mut ds = d_ht.to_vec();
    for ((c0, n), s_n) in h.chunks(chunk).zip(&states).rev() {
        let b = cumsum(h, c0, n);
        let gamma = &b[(n - 1) * dk..];
        let a = intra_scores(h, c0, &b, sub);
        let do_row = |r: usize| &d_o[(c0 + r) * dv..(c0 + r + 1) * dv];
        let mut da = vec![0.0; n * n];
        for r in 0..n {
            let t = c0 + r;
            // Inter-chunk dq: sigma e^{b_r} (.) (S_n d_o_r^T).
            let mut sd = vec![0.0; dk];
            mat_vec_add(&mut sd, sigma, s_n, do_row(r));
            let eb = b[r * dk..(r + 1) * dk].iter();
            g.dq[t * dk..(t + 1) * dk]
                .iter_mut()
                .zip(sd)
                .zip(eb)
                .for_each(|((x, y), br)| {
                    *x += y * br.exp();
                });
            for j in 0..=r {
                da[r * n + j] = sigma * dot(do_row(r), h.v(c0 + j));
                axpy(
                    &mut g.dv[(c0 + j) * dv..(c0 + j + 1) * dv],
                    sigma * a[r * n + j],
                    do_row(r),
                );
            }
        }
        intra_grads(h, c0, &b, sub, &da, &mut g);
        for j in 0..n {
            // dK += e^{gamma - b} (.) (dS_{n+1} v^T), dV += (K (.) e^{gamma - b}) dS_{n+1}.
            let t = c0 + j;
            let mut dsv = vec![0.0; dk];
            mat_vec_add(&mut dsv, 1.0, &ds, h.v(t));
            axpy(
                &mut g.dk[t * dk..(t + 1) * dk],
                1.0,
                &scaled(&dsv, gamma, &b[j * dk..(j + 1) * dk]),
            );
            let kt = scaled(h.k(t), gamma, &b[j * dk..(j + 1) * dk]);
            vec_mat_add(&mut g.dv[t * dv..(t + 1) * dv], 1.0, &kt, &ds);
        }
        // dS_n = Diag(e^gamma) dS_{n+1} + sigma (Q (.) e^b)^T dO.
        for (row, gi) in ds.chunks_mut(dv).zip(gamma) {
            row.iter_mut().for_each(|x| *x *= gi.exp());
        }
        for r in 0..n {
            let qb = decayed_query(h, c0 + r, &b[r * dk..(r + 1) * dk]);
            outer_add(&mut ds, sigma, &qb, do_row(r));
        }
    }
    g.dh0 = ds;
    g.dg = decay_gate_grad(h, d_o, d_ht);
    g
}
