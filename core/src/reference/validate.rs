//! Input validation. Every public entry point runs these checks before any arithmetic, so bad
//! inputs fail with a message instead of producing NaNs or a silently wrong oracle.

use super::error::ReferenceError;
use super::inputs::{Family, GateKind, Inputs, Shape};
use super::tensor::Tensor;

/// Rejects a zero dimension: there is nothing to compare on an empty problem, and a zero Dk would
/// make the default scale infinite.
pub(crate) fn check_dims(shape: &Shape) -> Result<(), ReferenceError> {
    for (name, n) in [
        ("B", shape.b),
        ("T", shape.t),
        ("H", shape.h),
        ("Dk", shape.dk),
        ("Dv", shape.dv),
    ] {
        if n == 0 {
            return Err(ReferenceError::ZeroDimension { name });
        }
    }
    Ok(())
}

/// Rejects a zero chunk or sub-chunk size (a chunk loop with step 0 never ends).
pub(crate) fn check_chunk(parameter: &'static str, size: usize) -> Result<(), ReferenceError> {
    if size == 0 {
        return Err(ReferenceError::ZeroChunk { parameter });
    }
    Ok(())
}

pub(crate) fn check_shape(
    tensor: &'static str,
    layout: &'static str,
    expected: Vec<usize>,
    t: &Tensor,
) -> Result<(), ReferenceError> {
    if t.shape() != expected.as_slice() {
        return Err(ReferenceError::ShapeMismatch {
            tensor,
            layout,
            expected,
            got: t.shape().to_vec(),
        });
    }
    Ok(())
}

pub(crate) fn check_finite(tensor: &'static str, t: &Tensor) -> Result<(), ReferenceError> {
    match t.first_non_finite() {
        Some((index, value)) => Err(ReferenceError::NonFinite {
            tensor,
            index,
            value,
        }),
        None => Ok(()),
    }
}

/// Checks the upstream gradients against the problem shape.
pub(crate) fn check_cotangents(
    shape: &Shape,
    d_o: &Tensor,
    d_ht: Option<&Tensor>,
) -> Result<(), ReferenceError> {
    check_shape("d_o", "[B, T, H, Dv]", shape.v(), d_o)?;
    check_finite("d_o", d_o)?;
    if let Some(d_ht) = d_ht {
        check_shape("d_ht", "[B, H, Dk, Dv]", shape.state(), d_ht)?;
        check_finite("d_ht", d_ht)?;
    }
    Ok(())
}

/// Checks LASP-2 shard lengths: at least one shard, none empty, summing to T.
pub(crate) fn check_shard_lengths(lengths: &[usize], t: usize) -> Result<(), ReferenceError> {
    if lengths.is_empty() {
        return Err(ReferenceError::NoShards);
    }
    if let Some(rank) = lengths.iter().position(|&n| n == 0) {
        return Err(ReferenceError::ZeroLengthShard { rank });
    }
    let sum = lengths.iter().sum();
    if sum != t {
        return Err(ReferenceError::ShardLengthSum { sum, t });
    }
    Ok(())
}

impl Inputs {
    /// Checks everything the family's maths assumes: no zero dimension; q, k, v, g (and beta,
    /// h0) shaped as `self.shape` says, with the family's gate kind; all values finite; every
    /// gate `<= 0` (a positive log-decay makes states grow exponentially, fla #215); the scale
    /// finite; beta present for the delta rule. Errors name the first offending tensor and index.
    pub fn validate(&self, family: Family) -> Result<(), ReferenceError> {
        let s = &self.shape;
        check_dims(s)?;
        check_shape("q", "[B, T, H, Dk]", s.qk(), &self.q)?;
        check_shape("k", "[B, T, H, Dk]", s.qk(), &self.k)?;
        check_shape("v", "[B, T, H, Dv]", s.v(), &self.v)?;
        let gate_layout = match family.gate_kind() {
            GateKind::Scalar => "[B, T, H] (scalar gates)",
            GateKind::Vector => "[B, T, H, Dk] (vector gates)",
        };
        check_shape("g", gate_layout, s.gate(family.gate_kind()), &self.g)?;
        if let Some(h0) = &self.h0 {
            check_shape("h0", "[B, H, Dk, Dv]", s.state(), h0)?;
        }
        if family == Family::DeltaRule {
            let beta = self.beta.as_ref().ok_or(ReferenceError::MissingBeta)?;
            check_shape("beta", "[B, T, H]", s.per_token(), beta)?;
            check_finite("beta", beta)?;
        }
        check_finite("q", &self.q)?;
        check_finite("k", &self.k)?;
        check_finite("v", &self.v)?;
        check_finite("g", &self.g)?;
        if let Some(h0) = &self.h0 {
            check_finite("h0", h0)?;
        }
        if let Some(pos) = self.g.data().iter().position(|&a| a > 0.0) {
            return Err(ReferenceError::PositiveGate {
                index: self.g.unravel(pos),
                value: self.g.data()[pos],
            });
        }
        if !self.scale.is_finite() {
            return Err(ReferenceError::InvalidScale { value: self.scale });
        }
        Ok(())
    }
}
