//! What the forward and backward passes return.

use super::gates::{gate_grad_terms, reverse_cumsum};
use super::inputs::Inputs;
use super::tensor::Tensor;

/// A forward pass: the output and the state after the last token.
#[derive(Clone, Debug, PartialEq)]
pub struct Forward {
    /// `o [B, T, H, Dv]`, `o_t = sigma q_t S_t`.
    pub o: Tensor,
    /// `S_T [B, H, Dk, Dv]`; for packed documents ([`super::packed`]) each document's final
    /// state, `[B, N, H, Dk, Dv]`.
    pub final_state: Tensor,
}

impl Forward {
    /// The scalar whose gradient the backward functions return:
    /// `L = sum(o * d_o) + <S_T, d_ht>` (`d_ht = None` means zero). Finite-difference tests
    /// differentiate this.
    pub fn loss(&self, d_o: &Tensor, d_ht: Option<&Tensor>) -> f64 {
        let dot = |a: &Tensor, b: &Tensor| a.data().iter().zip(b.data()).map(|(x, y)| x * y).sum();
        let out: f64 = dot(&self.o, d_o);
        out + d_ht.map_or(0.0, |d| dot(&self.final_state, d))
    }
}

/// Gradients of `L = sum(o * d_o) + <S_T, d_ht>` with respect to every input, each shaped like
/// its input.
#[derive(Clone, Debug, PartialEq)]
pub struct Grads {
    /// `dL/dq [B, T, H, Dk]`.
    pub dq: Tensor,
    /// `dL/dk [B, T, H, Dk]`.
    pub dk: Tensor,
    /// `dL/dv [B, T, H, Dv]`.
    pub dv: Tensor,
    /// `dL/dg`, shaped like g: `[B, T, H]` or `[B, T, H, Dk]`.
    pub dg: Tensor,
    /// `dL/dbeta [B, T, H]` for the delta rule, `None` for the other families.
    pub dbeta: Option<Tensor>,
    /// `dL/dh0 [B, H, Dk, Dv]`, returned even when `h0` is `None` (the gradient with respect to
    /// a zero initial state is what LASP-2 exchanges as `dM_w`); for packed documents
    /// ([`super::packed`]) one per document, `[B, N, H, Dk, Dv]`.
    pub dh0: Tensor,
}

impl Grads {
    /// The scale to measure `dg` errors against: `||reverse-cumsum(m)||_2` with
    /// `m_t = sum_i |q_ti dq_ti| + |k_ti dk_ti|` (per key dimension for vector gates).
    ///
    /// The chunkwise gate gradient `da_t = sum_{s >= t} (q_s . dq_s - k_s . dk_s)` is a sum of
    /// differences of terms of that size; when the decays are strong those terms nearly cancel
    /// and `||dg||` is many orders below them (a = -30: `||dg||` ~ 1e-12 from O(1) terms), so a
    /// relative error on `dg` itself measures only the cancellation. Compare `dg` with
    /// [`assert_close_to_scale`](super::tensor::assert_close_to_scale) against this scale instead
    /// (fla, too, gives dg its own tolerance).
    ///
    /// # Panics
    /// If `self` and `inputs` describe different problems.
    pub fn gate_grad_scale(&self, inputs: &Inputs) -> f64 {
        let s = inputs.shape;
        let gate_dim = self.dg.len() / (s.b * s.t * s.h);
        let mut sum_sq = 0.0;
        for b in 0..s.b {
            for h in 0..s.h {
                let mut m = gate_grad_terms(
                    &inputs.q.head_rows(b, h),
                    &self.dq.head_rows(b, h),
                    &inputs.k.head_rows(b, h),
                    &self.dk.head_rows(b, h),
                    s.dk,
                    gate_dim,
                    |qdq, kdk| qdq.abs() + kdk.abs(),
                );
                reverse_cumsum(&mut m, gate_dim);
                sum_sq += m.iter().map(|x| x * x).sum::<f64>();
            }
        }
        sum_sq.sqrt()
    }
}
