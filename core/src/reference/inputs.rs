//! The problem description: shapes, model families and the input tensors of one layer.

use super::tensor::Tensor;

/// Problem dimensions: batch `b`, tokens `t`, heads `h`, key width `dk`, value width `dv`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    /// Batch size B.
    pub b: usize,
    /// Sequence length T (of the whole sequence, or of one shard).
    pub t: usize,
    /// Number of heads H.
    pub h: usize,
    /// Key (and query) width Dk.
    pub dk: usize,
    /// Value width Dv.
    pub dv: usize,
}

impl Shape {
    /// `[B, T, H, Dk]`: q, k and vector gates.
    pub fn qk(&self) -> Vec<usize> {
        vec![self.b, self.t, self.h, self.dk]
    }

    /// `[B, T, H, Dv]`: v, o and d_o.
    pub fn v(&self) -> Vec<usize> {
        vec![self.b, self.t, self.h, self.dv]
    }

    /// `[B, T, H]`: scalar gates and beta.
    pub fn per_token(&self) -> Vec<usize> {
        vec![self.b, self.t, self.h]
    }

    /// `[B, H, Dk, Dv]`: initial, final and exchanged states.
    pub fn state(&self) -> Vec<usize> {
        vec![self.b, self.h, self.dk, self.dv]
    }

    /// The gate shape of a gate kind: `[B, T, H]` or `[B, T, H, Dk]`.
    pub fn gate(&self, kind: GateKind) -> Vec<usize> {
        match kind {
            GateKind::Scalar => self.per_token(),
            GateKind::Vector => self.qk(),
        }
    }

    /// The default attention scale `Dk^-1/2` (fla's default).
    pub fn default_scale(&self) -> f64 {
        1.0 / (self.dk as f64).sqrt()
    }
}

/// Whether a head's log-decay is one number per token or one per key dimension.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GateKind {
    /// `g: [B, T, H]`, the state decays by `e^{a_t}` as a whole.
    Scalar,
    /// `g: [B, T, H, Dk]`, state row `i` decays by `e^{a_{t,i}}`.
    Vector,
}

/// The three model families of the reference.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// Scalar-decay linear attention (simple GLA, RetNet, Lightning): `S_t = e^{a_t} S_{t-1} + k_t^T v_t`.
    ScalarDecay,
    /// GLA with per-key vector gates: `S_t = Diag(e^{a_t}) S_{t-1} + k_t^T v_t`.
    Gla,
    /// Gated DeltaNet: `S_t = e^{a_t} S_{t-1} + beta_t k_t^T (v_t - e^{a_t} k_t S_{t-1})`.
    DeltaRule,
}

impl Family {
    /// The gate kind the family takes.
    pub fn gate_kind(self) -> GateKind {
        match self {
            Family::Gla => GateKind::Vector,
            Family::ScalarDecay | Family::DeltaRule => GateKind::Scalar,
        }
    }
}

/// The inputs of one layer, in fla's layout. All three families read `q, k, v, g, h0, scale`; only
/// the delta rule reads `beta`, the others ignore it.
///
/// Build them with [`Inputs::generate`] (the seeded generator the GPU tests share)
/// or by filling the fields from your own data; every reference function validates them
/// (shapes, finiteness, `g <= 0`) before any arithmetic.
#[derive(Clone, Debug, PartialEq)]
pub struct Inputs {
    /// The dimensions every tensor below must agree with.
    pub shape: Shape,
    /// Queries `[B, T, H, Dk]`.
    pub q: Tensor,
    /// Keys `[B, T, H, Dk]`.
    pub k: Tensor,
    /// Values `[B, T, H, Dv]`.
    pub v: Tensor,
    /// Log-decays, all `<= 0`: `[B, T, H]` (scalar decay, delta rule) or `[B, T, H, Dk]` (GLA).
    pub g: Tensor,
    /// Delta-rule write strengths `[B, T, H]`; `None` for the other families.
    pub beta: Option<Tensor>,
    /// Initial state `[B, H, Dk, Dv]`; `None` means zero.
    pub h0: Option<Tensor>,
    /// The scale `sigma` in `o_t = sigma q_t S_t`; [`Shape::default_scale`] unless a test says
    /// otherwise.
    pub scale: f64,
}

/// Upstream gradients of one layer: `d_o = dL/do` `[B, T, H, Dv]` and `d_ht = dL/dS_T`
/// `[B, H, Dk, Dv]` (`None` means zero). The backward functions return the gradient of
/// `L = sum(o * d_o) + <S_T, d_ht>` ([`Forward::loss`](super::Forward::loss)).
#[derive(Clone, Debug, PartialEq)]
pub struct Cotangents {
    /// Gradient with respect to the output, `[B, T, H, Dv]`.
    pub d_o: Tensor,
    /// Gradient with respect to the final state, `[B, H, Dk, Dv]`, or `None` for zero.
    pub d_ht: Option<Tensor>,
}
