//! Gate cumulative sums, built the way the kernels build them (kernels/docs/maths.md,
//! "Numerics", rule 2): cumsums are chunk-local, long prefixes are sums of chunk totals, and
//! decays between two positions come from a direct sum over the positions between them, never
//! from the difference of two long cumsums.
//!
//! Gate buffers are `[n, gate_dim]` rows with `gate_dim` 1 (scalar) or Dk (vector).

/// The gate of row `r`, key dimension `i` (a scalar gate serves every dimension).
pub(crate) fn at(a: &[f64], gate_dim: usize, r: usize, i: usize) -> f64 {
    a[r * gate_dim + if gate_dim == 1 { 0 } else { i }]
}

/// Inclusive cumsum over the rows of one chunk: `b_r = sum_{i <= r} a_i`.
pub(crate) fn chunk_local_cumsum(a: &[f64], gate_dim: usize) -> Vec<f64> {
    let mut b = a.to_vec();
    for r in 1..a.len() / gate_dim {
        for d in 0..gate_dim {
            b[r * gate_dim + d] += b[(r - 1) * gate_dim + d];
        }
    }
    b
}

/// The shard-local inclusive cumsum `G_t` as LASP-2's epilogue builds it: the prefix of chunk
/// totals plus the chunk-local cumsum.
pub(crate) fn shard_cumsum(a: &[f64], gate_dim: usize, chunk: usize) -> Vec<f64> {
    let mut out = Vec::with_capacity(a.len());
    let mut prefix = vec![0.0; gate_dim];
    for rows in a.chunks(chunk * gate_dim) {
        let b = chunk_local_cumsum(rows, gate_dim);
        for row in b.chunks(gate_dim) {
            out.extend(row.iter().zip(&prefix).map(|(x, p)| x + p));
        }
        let last = &b[b.len() - gate_dim..];
        prefix.iter_mut().zip(last).for_each(|(p, l)| *p += l);
    }
    out
}

/// Exclusive suffix sums `R_t = sum_{s > t} a_s` (= `Lambda - G_t`, computed without the
/// subtraction, so it is exactly `<= 0`).
pub(crate) fn suffix_sums(a: &[f64], gate_dim: usize) -> Vec<f64> {
    let n = a.len() / gate_dim;
    let mut out = vec![0.0; a.len()];
    for r in (0..n.saturating_sub(1)).rev() {
        for d in 0..gate_dim {
            out[r * gate_dim + d] = out[(r + 1) * gate_dim + d] + a[(r + 1) * gate_dim + d];
        }
    }
    out
}

/// Total `sum_t a_t` per gate dimension (the shard log-decay `Lambda`).
pub(crate) fn total(a: &[f64], gate_dim: usize) -> Vec<f64> {
    let mut sum = vec![0.0; gate_dim];
    for row in a.chunks(gate_dim) {
        sum.iter_mut().zip(row).for_each(|(s, x)| *s += x);
    }
    sum
}

/// In place, `da_t = sum_{s >= t} dG_s`: the gate gradient through the inclusive cumsum.
pub(crate) fn reverse_cumsum(dg: &mut [f64], gate_dim: usize) {
    let n = dg.len() / gate_dim;
    for r in (0..n.saturating_sub(1)).rev() {
        for d in 0..gate_dim {
            dg[r * gate_dim + d] += dg[(r + 1) * gate_dim + d];
        }
    }
}

/// `sum_i combine(q_ti dq_ti, k_ti dk_ti)` per row and gate dimension (over all of Dk for scalar
/// gates).
pub(crate) fn gate_grad_terms(
    q: &[f64],
    dq: &[f64],
    k: &[f64],
    dk: &[f64],
    dk_width: usize,
    gate_dim: usize,
    combine: impl Fn(f64, f64) -> f64,
) -> Vec<f64> {
    let n = q.len() / dk_width;
    let mut dg = vec![0.0; n * gate_dim];
    for r in 0..n {
        for i in 0..dk_width {
            let j = r * dk_width + i;
            dg[r * gate_dim + if gate_dim == 1 { 0 } else { i }] +=
                combine(q[j] * dq[j], k[j] * dk[j]);
        }
    }
    dg
}
