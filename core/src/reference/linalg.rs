//! The few dense vector/matrix kernels the reference needs, on row-major slices. States are
//! `[Dk, Dv]` row-major; q, k rows have Dk entries, v and o rows Dv.

/// `a . b`.
pub(crate) fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// `y += alpha x`.
pub(crate) fn axpy(y: &mut [f64], alpha: f64, x: &[f64]) {
    y.iter_mut().zip(x).for_each(|(yi, xi)| *yi += alpha * xi);
}

/// `s += alpha x^T y` for a `[x.len(), y.len()]` matrix `s`.
pub(crate) fn outer_add(s: &mut [f64], alpha: f64, x: &[f64], y: &[f64]) {
    for (row, &xi) in s.chunks_mut(y.len()).zip(x) {
        axpy(row, alpha * xi, y);
    }
}

/// `out += alpha x s` (row vector times matrix) for `s` `[x.len(), out.len()]`.
pub(crate) fn vec_mat_add(out: &mut [f64], alpha: f64, x: &[f64], s: &[f64]) {
    for (row, &xi) in s.chunks(out.len()).zip(x) {
        axpy(out, alpha * xi, row);
    }
}

/// `out += alpha s y^T` (matrix times column vector) for `s` `[out.len(), y.len()]`.
pub(crate) fn mat_vec_add(out: &mut [f64], alpha: f64, s: &[f64], y: &[f64]) {
    for (oi, row) in out.iter_mut().zip(s.chunks(y.len())) {
        *oi += alpha * dot(row, y);
    }
}

/// `c = a b` for `a` `[n, m]` and `b` `[m, p]`, with `p = b.len() / m`.
pub(crate) fn matmul(a: &[f64], b: &[f64], m: usize) -> Vec<f64> {
    let p = b.len() / m;
    let mut c = vec![0.0; a.len() / m * p];
    for (crow, arow) in c.chunks_mut(p).zip(a.chunks(m)) {
        vec_mat_add(crow, 1.0, arow, b);
    }
    c
}

/// `a^T b` for `a` `[m, n]` and `b` `[m, p]`, with `m` rows each.
pub(crate) fn matmul_tn(a: &[f64], b: &[f64], m: usize) -> Vec<f64> {
    let (n, p) = (a.len() / m, b.len() / m);
    let mut c = vec![0.0; n * p];
    for (arow, brow) in a.chunks(n).zip(b.chunks(p)) {
        outer_add(&mut c, 1.0, arow, brow);
    }
    c
}
