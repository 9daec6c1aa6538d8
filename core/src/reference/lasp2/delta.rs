//! LASP-2 for the delta rule: the affine shard summary `(A_w, h_w)`, its folds, and the
//! per-rank passes.

use super::{fold_prefix_states, fold_suffix_states, local_passes, state_shape};
use super::{split_shards, split_time, Lasp2Backward, Lasp2Forward, RankForward, ShardMap};
use crate::reference::delta_rule::{self, transition_head};
use crate::reference::error::ReferenceError;
use crate::reference::head::Head;
use crate::reference::inputs::{Family, Inputs};
use crate::reference::linalg::{matmul, matmul_tn};
use crate::reference::tensor::Tensor;
use crate::reference::validate::{check_chunk, check_cotangents, check_shape};

/// What rank w exchanges in the delta-rule forward: the affine map `S_out = A_w S_in + h_w` of its
/// shard.
#[derive(Clone, Debug, PartialEq)]
pub struct AffineSummary {
    /// `A_w` `[B, H, Dk, Dk]`, the product of the shard's transitions (later tokens on the left).
    pub a: Tensor,
    /// `h_w` `[B, H, Dk, Dv]`, the shard's end state from a zero start.
    pub h: Tensor,
}

/// The affine summary of one shard (from [`super::split_shards`]); any `h0` of the shard is
/// ignored.
pub fn local_affine(shard: &Inputs, chunk: usize) -> Result<AffineSummary, ReferenceError> {
    check_chunk("chunk", chunk)?;
    Ok(local_pass(shard, chunk)?.1)
}

/// The zero-state local pass (output) and the shard's affine summary.
fn local_pass(shard: &Inputs, chunk: usize) -> Result<(Tensor, AffineSummary), ReferenceError> {
    let zero_start = Inputs {
        h0: None,
        ..shard.clone()
    };
    let local = delta_rule::chunkwise_forward(&zero_start, chunk)?;
    let s = shard.shape;
    let mut a = Tensor::zeros(&[s.b, s.h, s.dk, s.dk]);
    for b in 0..s.b {
        for h in 0..s.h {
            a.block_mut(b, h)
                .copy_from_slice(&transition_head(&Head::gather(shard, b, h), chunk));
        }
    }
    Ok((
        local.o,
        AffineSummary {
            a,
            h: local.final_state,
        },
    ))
}

/// Checks that every summary has the first one's shapes and returns the state shape.
fn summary_shape(summaries: &[AffineSummary]) -> Result<Vec<usize>, ReferenceError> {
    let first = summaries.first().ok_or(ReferenceError::NoShards)?;
    let state = state_shape("h_w", &first.h)?;
    let transition = vec![state[0], state[1], state[2], state[2]];
    for s in summaries {
        check_shape("h_w", "[B, H, Dk, Dv]", state.clone(), &s.h)?;
        check_shape("A_w", "[B, H, Dk, Dk]", transition.clone(), &s.a)?;
    }
    Ok(state)
}

/// Per head, `m x` for `m` `[B, H, Dk, Dk]` and `x` `[B, H, Dk, Dv]`; with `transpose`, `m^T x`.
pub(super) fn apply(m: &Tensor, x: &Tensor, transpose: bool) -> Tensor {
    let mut out = x.clone();
    let dk = m.shape()[2];
    for b in 0..x.shape()[0] {
        for h in 0..x.shape()[1] {
            let y = if transpose {
                matmul_tn(m.block(b, h), x.block(b, h), dk)
            } else {
                matmul(m.block(b, h), x.block(b, h), dk)
            };
            out.block_mut(b, h).copy_from_slice(&y);
        }
    }
    out
}

impl ShardMap for AffineSummary {
    fn end_state(&self) -> &Tensor {
        &self.h
    }

    fn carry(&self, x: &Tensor) -> Tensor {
        apply(&self.a, x, false)
    }

    fn carry_back(&self, x: &Tensor) -> Tensor {
        apply(&self.a, x, true)
    }
}

/// The prefix fold in ascending rank order: `P_0 = h0` (zero if `None`),
/// `P_{u+1} = A_u P_u + h_u`. Returns `P_0 ..= P_W`.
pub fn fold_affine_prefixes(
    summaries: &[AffineSummary],
    h0: Option<&Tensor>,
) -> Result<Vec<Tensor>, ReferenceError> {
    fold_prefix_states(summaries, &summary_shape(summaries)?, h0)
}

/// The suffix fold in descending rank order: `D_{W-1} = d_ht` (zero if `None`),
/// `D_u = dM_{u+1} + A_{u+1}^T D_{u+1}`. Returns `D_0 .. D_{W-1}`.
pub fn fold_affine_suffixes(
    summaries: &[AffineSummary],
    d_m: &[Tensor],
    d_ht: Option<&Tensor>,
) -> Result<Vec<Tensor>, ReferenceError> {
    fold_suffix_states(summaries, &summary_shape(summaries)?, d_m, d_ht)
}

/// Delta-rule LASP-2 forward: zero-state local passes give `(A_w, h_w)`, the fold gives `P_w`,
/// and each rank's output is its local pass rerun from `P_w`.
pub fn delta_forward(
    inputs: &Inputs,
    shard_lengths: &[usize],
    chunk: usize,
) -> Result<Lasp2Forward<AffineSummary>, ReferenceError> {
    check_chunk("chunk", chunk)?;
    let shards = split_shards(inputs, Family::DeltaRule, shard_lengths)?;
    let (locals, summaries) = local_passes(&shards, |shard| local_pass(shard, chunk))?;
    let prefixes = fold_affine_prefixes(&summaries, inputs.h0.as_ref())?;
    let mut ranks = Vec::with_capacity(shards.len());
    for ((shard, o_local), p) in shards.iter().zip(locals).zip(&prefixes) {
        let from_prefix = Inputs {
            h0: Some(p.clone()),
            ..shard.clone()
        };
        let o = delta_rule::chunkwise_forward(&from_prefix, chunk)?.o;
        ranks.push(RankForward { o_local, o });
    }
    Ok(Lasp2Forward::from_ranks(summaries, prefixes, ranks))
}

/// Delta-rule LASP-2 backward: `dM_w` from a zero-`d_ht` local backward (the gradient with
/// respect to a rank's incoming state does not depend on that state, the map being affine), the
/// suffix fold, then each rank's backward with incoming state `P_w` and outgoing gradient `D_w`.
pub fn delta_backward(
    inputs: &Inputs,
    shard_lengths: &[usize],
    chunk: usize,
    d_o: &Tensor,
    d_ht: Option<&Tensor>,
) -> Result<Lasp2Backward, ReferenceError> {
    check_chunk("chunk", chunk)?;
    inputs.validate(Family::DeltaRule)?;
    check_cotangents(&inputs.shape, d_o, d_ht)?;
    let fwd = delta_forward(inputs, shard_lengths, chunk)?;
    let shards = split_shards(inputs, Family::DeltaRule, shard_lengths)?;
    let d_os = split_time(d_o, shard_lengths)?;
    let mut d_m = Vec::with_capacity(shards.len());
    for (shard, d_o_w) in shards.iter().zip(&d_os) {
        d_m.push(delta_rule::recurrent_backward(shard, d_o_w, None)?.dh0);
    }
    let suffixes = fold_affine_suffixes(&fwd.summaries, &d_m, d_ht)?;
    let mut ranks = Vec::with_capacity(shards.len());
    for (w, (shard, d_o_w)) in shards.iter().zip(&d_os).enumerate() {
        let with_prefix = Inputs {
            h0: Some(fwd.prefixes[w].clone()),
            ..shard.clone()
        };
        ranks.push(delta_rule::recurrent_backward(
            &with_prefix,
            d_o_w,
            Some(&suffixes[w]),
        )?);
    }
    Ok(Lasp2Backward::from_ranks(d_m, suffixes, ranks))
}
