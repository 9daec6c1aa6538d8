//! A small owned row-major `f64` tensor, and the relative-error metric every comparison uses.

use super::error::ReferenceError;

/// An owned, row-major (last index fastest) `f64` tensor.
///
/// Layouts used by the reference: `q, k` `[B, T, H, Dk]`; `v, o` `[B, T, H, Dv]`; scalar gates and
/// `beta` `[B, T, H]`; vector gates `[B, T, H, Dk]`; states `[B, H, Dk, Dv]`. The time axis is
/// always axis 1 of per-token tensors, which is what [`Tensor::slice_time`] and
/// [`Tensor::concat_time`] rely on.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    shape: Vec<usize>,
    data: Vec<f64>,
}

impl Tensor {
    /// A tensor of the given shape filled with zeros.
    pub fn zeros(shape: &[usize]) -> Tensor {
        Tensor {
            shape: shape.to_vec(),
            data: vec![0.0; shape.iter().product()],
        }
    }

    /// Wraps a row-major buffer, e.g. device memory converted to `f64`.
    pub fn from_vec(shape: &[usize], data: Vec<f64>) -> Result<Tensor, ReferenceError> {
        let expected: usize = shape.iter().product();
        if data.len() != expected {
            return Err(ReferenceError::DataLength {
                shape: shape.to_vec(),
                expected,
                got: data.len(),
            });
        }
        Ok(Tensor {
            shape: shape.to_vec(),
            data,
        })
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The values in row-major order.
    pub fn data(&self) -> &[f64] {
        &self.data
    }

    /// The values in row-major order, mutably (finite-difference tests perturb them in place).
    pub fn data_mut(&mut self) -> &mut [f64] {
        &mut self.data
    }

    /// The number of elements.
    pub fn len(&self) -> usize {
        self.data.len()
    }

    /// Whether the tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// The value at a multi-index.
    ///
    /// # Panics
    /// If the index has the wrong rank or is out of bounds.
    pub fn get(&self, index: &[usize]) -> f64 {
        assert_eq!(
            index.len(),
            self.shape.len(),
            "index {index:?} for shape {:?}",
            self.shape
        );
        let mut flat = 0;
        for (&i, &n) in index.iter().zip(&self.shape) {
            assert!(
                i < n,
                "index {index:?} out of bounds for shape {:?}",
                self.shape
            );
            flat = flat * n + i;
        }
        self.data[flat]
    }

    /// The multi-index of a flat (row-major) position; error messages use it.
    pub fn unravel(&self, mut flat: usize) -> Vec<usize> {
        let mut index = vec![0; self.shape.len()];
        for (slot, &n) in index.iter_mut().zip(&self.shape).rev() {
            *slot = flat % n;
            flat /= n;
        }
        index
    }

    /// Applies `f` to every element.
    pub fn map(&self, f: impl Fn(f64) -> f64) -> Tensor {
        Tensor {
            shape: self.shape.clone(),
            data: self.data.iter().map(|&x| f(x)).collect(),
        }
    }

    /// Rounds every value to the nearest bf16, so a bf16 device copy holds exactly these values.
    pub fn round_to_bf16(&self) -> Tensor {
        self.map(|x| half::bf16::from_f64(x).to_f64())
    }

    /// Rounds every value to the nearest f32, so an fp32 device copy holds exactly these values.
    pub fn round_to_f32(&self) -> Tensor {
        self.map(|x| f64::from(x as f32))
    }

    /// The first NaN or infinite value with its multi-index, if any.
    pub fn first_non_finite(&self) -> Option<(Vec<usize>, f64)> {
        let pos = self.data.iter().position(|x| !x.is_finite())?;
        Some((self.unravel(pos), self.data[pos]))
    }

    /// Tokens `[start, start + len)` of a per-token tensor `[B, T, ...]` (time on axis 1).
    ///
    /// # Panics
    /// If the tensor has rank < 2 or the range exceeds T.
    pub fn slice_time(&self, start: usize, len: usize) -> Tensor {
        assert!(
            self.shape.len() >= 2,
            "slice_time needs [B, T, ...], got {:?}",
            self.shape
        );
        let t = self.shape[1];
        assert!(
            start + len <= t,
            "tokens {start}..{} outside T = {t}",
            start + len
        );
        let row: usize = self.shape[2..].iter().product();
        let mut shape = self.shape.clone();
        shape[1] = len;
        let mut data = Vec::with_capacity(self.shape[0] * len * row);
        for b in 0..self.shape[0] {
            let base = (b * t + start) * row;
            data.extend_from_slice(&self.data[base..base + len * row]);
        }
        Tensor { shape, data }
    }

    /// Concatenates per-token tensors `[B, T_i, ...]` along time (the inverse of
    /// [`Tensor::slice_time`]), e.g. per-rank outputs into the full sequence.
    ///
    /// # Panics
    /// If `parts` is empty or the parts differ in any axis but time.
    pub fn concat_time(parts: &[Tensor]) -> Tensor {
        let first = parts.first().expect("concat_time needs at least one part");
        let mut shape = first.shape.clone();
        shape[1] = parts.iter().map(|p| p.shape[1]).sum();
        for p in parts {
            assert!(
                p.shape[0] == shape[0] && p.shape[2..] == shape[2..],
                "concat_time: part {:?} does not match {:?} outside axis 1",
                p.shape,
                first.shape
            );
        }
        let row: usize = shape[2..].iter().product();
        let mut data = Vec::with_capacity(shape.iter().product());
        for b in 0..shape[0] {
            for p in parts {
                let len = p.shape[1] * row;
                data.extend_from_slice(&p.data[b * len..(b + 1) * len]);
            }
        }
        Tensor { shape, data }
    }

    /// Rows `[T, D]` of head `(b, h)` of a per-token tensor `[B, T, H]` (D = 1) or `[B, T, H, D]`,
    /// copied into one contiguous buffer.
    pub(crate) fn head_rows(&self, b: usize, h: usize) -> Vec<f64> {
        let (t, heads, d) = (self.shape[1], self.shape[2], self.row_width());
        let mut rows = Vec::with_capacity(t * d);
        for ti in 0..t {
            let base = ((b * t + ti) * heads + h) * d;
            rows.extend_from_slice(&self.data[base..base + d]);
        }
        rows
    }

    /// The inverse of [`Tensor::head_rows`]: writes `[T, D]` rows back into head `(b, h)`.
    pub(crate) fn set_head_rows(&mut self, b: usize, h: usize, rows: &[f64]) {
        let (t, heads, d) = (self.shape[1], self.shape[2], self.row_width());
        for ti in 0..t {
            let base = ((b * t + ti) * heads + h) * d;
            self.data[base..base + d].copy_from_slice(&rows[ti * d..(ti + 1) * d]);
        }
    }

    /// The contiguous block of head `(b, h)` of a per-head tensor `[B, H, ...]` (e.g. a state).
    pub(crate) fn block(&self, b: usize, h: usize) -> &[f64] {
        let size: usize = self.shape[2..].iter().product();
        let start = (b * self.shape[1] + h) * size;
        &self.data[start..start + size]
    }

    /// [`Tensor::block`], mutably.
    pub(crate) fn block_mut(&mut self, b: usize, h: usize) -> &mut [f64] {
        let size: usize = self.shape[2..].iter().product();
        let start = (b * self.shape[1] + h) * size;
        &mut self.data[start..start + size]
    }

    /// Elements per token and head of a `[B, T, H, ...]` tensor (1 for `[B, T, H]`).
    fn row_width(&self) -> usize {
        self.shape[3..].iter().product()
    }
}

/// The comparison metric of every reference and GPU test: `||x - y||_2 / ||y||_2`, with `y` the
/// reference. A norm-wise relative error (as fla's `assert_close`) instead of a max-abs one, because
/// bf16 kernels have a per-element error proportional to the magnitudes involved, so a fixed
/// absolute tolerance is either too loose for small outputs or too tight for large ones.
///
/// Returns 0 when both are zero and infinity when only `y` is zero.
///
/// # Panics
/// If the lengths differ (comparing different tensors is a bug in the test).
pub fn rel_err(x: &[f64], y: &[f64]) -> f64 {
    assert_eq!(x.len(), y.len(), "rel_err: lengths differ");
    let diff = diff_norm(x, y);
    let norm = y.iter().map(|b| b * b).sum::<f64>().sqrt();
    if diff == 0.0 {
        0.0
    } else {
        diff / norm
    }
}

/// `||x - y||_2`.
fn diff_norm(x: &[f64], y: &[f64]) -> f64 {
    x.iter()
        .zip(y)
        .map(|(a, b)| (a - b) * (a - b))
        .sum::<f64>()
        .sqrt()
}

/// What every comparison checks first: equal lengths and finite values in `got`.
fn check_comparable(what: &str, got: &[f64], want: &[f64]) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!(
            "{what}: got {} values but the reference has {}",
            got.len(),
            want.len()
        ));
    }
    if let Some(pos) = got.iter().position(|x| !x.is_finite()) {
        return Err(format!(
            "{what}: value {} at flat index {pos} is not finite",
            got[pos]
        ));
    }
    Ok(())
}

/// Checks `rel_err(got, want) <= tol` and, when it fails, says by how much and where the largest
/// elementwise difference is (flat index), so a failing GPU test points at the bad region.
/// Non-finite values in `got` always fail.
pub fn assert_rel_close(what: &str, got: &[f64], want: &[f64], tol: f64) -> Result<(), String> {
    check_comparable(what, got, want)?;
    let err = rel_err(got, want);
    if err <= tol {
        return Ok(());
    }
    let (worst, diff) = got
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .enumerate()
        .fold(
            (0, 0.0),
            |best, (i, d)| if d > best.1 { (i, d) } else { best },
        );
    Err(format!(
        "{what}: relative error {err:.3e} > tolerance {tol:.1e} (||want|| = {:.3e}); largest \
         difference {diff:.3e} at flat index {worst}: got {}, want {}",
        want.iter().map(|b| b * b).sum::<f64>().sqrt(),
        got[worst],
        want[worst]
    ))
}

/// Checks `||got - want||_2 <= tol * scale` for quantities whose natural error scale is not their
/// own norm, e.g. gate gradients against [`Grads::gate_grad_scale`](super::Grads::gate_grad_scale).
/// Non-finite values in `got` always fail.
pub fn assert_close_to_scale(
    what: &str,
    got: &[f64],
    want: &[f64],
    scale: f64,
    tol: f64,
) -> Result<(), String> {
    check_comparable(what, got, want)?;
    let diff = diff_norm(got, want);
    if diff <= tol * scale {
        return Ok(());
    }
    Err(format!(
        "{what}: ||got - want|| = {diff:.3e} > tolerance {tol:.1e} x scale {scale:.3e}"
    ))
}
