//! LASP-2 for scalar and vector (GLA) gates: summaries `(M_w, Lambda_w)`, the prefix and suffix
//! folds, and the epilogue terms that turn each rank's local pass into its share of the single
//! sequence.

use super::{add, fold_prefix_states, fold_suffix_states, local_passes, state_shape};
use super::{split_shards, split_time, Lasp2Backward, Lasp2Forward, RankForward, ShardMap};
use crate::reference::error::ReferenceError;
use crate::reference::gates::{shard_cumsum, suffix_sums, total};
use crate::reference::head::Head;
use crate::reference::inputs::{Family, Inputs};
use crate::reference::linalg::{axpy, mat_vec_add, vec_mat_add};
use crate::reference::outputs::{Forward, Grads};
use crate::reference::recurrent::decay_gate_grad;
use crate::reference::tensor::Tensor;
use crate::reference::validate::{check_chunk, check_cotangents, check_shape};
use crate::reference::{gla, scalar_decay};

/// Which decayed family the ranks run, with its local chunking.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decay {
    /// Scalar decay ([`scalar_decay`]), gates `[B, T, H]`.
    Scalar,
    /// Vector gates ([`gla`]), gates `[B, T, H, Dk]`, with the local pass's secondary chunk size.
    Vector {
        /// Sub-chunk size of [`gla::chunkwise_forward`].
        sub_chunk: usize,
    },
}

impl Decay {
    pub(super) fn family(self) -> Family {
        match self {
            Decay::Scalar => Family::ScalarDecay,
            Decay::Vector { .. } => Family::Gla,
        }
    }

    pub(super) fn check(self, chunk: usize) -> Result<(), ReferenceError> {
        check_chunk("chunk", chunk)?;
        match self {
            Decay::Scalar => Ok(()),
            Decay::Vector { sub_chunk } => check_chunk("sub_chunk", sub_chunk),
        }
    }

    pub(super) fn local_forward(
        self,
        shard: &Inputs,
        chunk: usize,
    ) -> Result<Forward, ReferenceError> {
        match self {
            Decay::Scalar => scalar_decay::chunkwise_forward(shard, chunk),
            Decay::Vector { sub_chunk } => gla::chunkwise_forward(shard, chunk, sub_chunk),
        }
    }

    /// The local backward with the gradient `d_end` with respect to the state leaving the tokens
    /// (what is known before the exchange: a packed document's `d_ht`, or nothing).
    pub(super) fn local_backward(
        self,
        shard: &Inputs,
        chunk: usize,
        d_o: &Tensor,
        d_end: Option<&Tensor>,
    ) -> Result<Grads, ReferenceError> {
        match self {
            Decay::Scalar => scalar_decay::backward(shard, chunk, d_o, d_end),
            Decay::Vector { sub_chunk } => gla::backward(shard, chunk, sub_chunk, d_o, d_end),
        }
    }
}

/// What rank w exchanges in the forward.
#[derive(Clone, Debug, PartialEq)]
pub struct ShardSummary {
    /// `M_w` `[B, H, Dk, Dv]`: the shard's end state from a zero start.
    pub m: Tensor,
    /// `Lambda_w = sum_{t in w} a_t`: `[B, H]` (scalar gates) or `[B, H, Dk]` (vector gates).
    pub lambda: Tensor,
}

/// The local summary `(M_w, Lambda_w)` of one shard (from [`super::split_shards`]); any `h0` of
/// the shard is ignored, since `M_w` is defined from a zero state.
pub fn local_state(
    shard: &Inputs,
    decay: Decay,
    chunk: usize,
) -> Result<ShardSummary, ReferenceError> {
    decay.check(chunk)?;
    Ok(local_pass(shard, decay, chunk)?.1)
}

/// The zero-state local pass and its summary.
fn local_pass(
    shard: &Inputs,
    decay: Decay,
    chunk: usize,
) -> Result<(Tensor, ShardSummary), ReferenceError> {
    let zero_start = Inputs {
        h0: None,
        ..shard.clone()
    };
    let local = decay.local_forward(&zero_start, chunk)?;
    Ok((
        local.o,
        ShardSummary {
            m: local.final_state,
            lambda: log_decay(shard, decay),
        },
    ))
}

/// `Lambda = sum_t a_t` over all the tokens of `tokens`: `[B, H]` (scalar gates) or
/// `[B, H, Dk]` (vector gates).
pub(super) fn log_decay(tokens: &Inputs, decay: Decay) -> Tensor {
    let s = tokens.shape;
    let gate_shape = match decay {
        Decay::Scalar => vec![s.b, s.h],
        Decay::Vector { .. } => vec![s.b, s.h, s.dk],
    };
    let mut lambda = Tensor::zeros(&gate_shape);
    for b in 0..s.b {
        for h in 0..s.h {
            let gd = lambda.block(b, h).len();
            lambda
                .block_mut(b, h)
                .copy_from_slice(&total(&tokens.g.head_rows(b, h), gd));
        }
    }
    lambda
}

/// Checks that every summary has the first one's shapes, `M [B, H, Dk, Dv]` and
/// `Lambda [B, H]` or `[B, H, Dk]`, and returns the state shape.
fn summary_shape(summaries: &[ShardSummary]) -> Result<Vec<usize>, ReferenceError> {
    let first = summaries.first().ok_or(ReferenceError::NoShards)?;
    let state = state_shape("M_w", &first.m)?;
    let scalar = vec![state[0], state[1]];
    let lambda = if first.lambda.shape() == scalar.as_slice() {
        scalar
    } else {
        state[..3].to_vec()
    };
    for s in summaries {
        check_shape("M_w", "[B, H, Dk, Dv]", state.clone(), &s.m)?;
        check_shape(
            "Lambda_w",
            "[B, H] or [B, H, Dk]",
            lambda.clone(),
            &s.lambda,
        )?;
    }
    Ok(state)
}

impl ShardMap for ShardSummary {
    fn end_state(&self) -> &Tensor {
        &self.m
    }

    fn carry(&self, x: &Tensor) -> Tensor {
        decay_rows(x, &self.lambda)
    }

    /// A diagonal decay is its own adjoint.
    fn carry_back(&self, x: &Tensor) -> Tensor {
        decay_rows(x, &self.lambda)
    }
}

/// `e^{Lambda} (.) x`, row-wise for a vector Lambda, on `[B, H, Dk, Dv]`.
pub(super) fn decay_rows(x: &Tensor, lambda: &Tensor) -> Tensor {
    let mut x = x.clone();
    let (bs, hs, dv) = (x.shape()[0], x.shape()[1], x.shape()[3]);
    for b in 0..bs {
        for h in 0..hs {
            let lam = lambda.block(b, h).to_vec();
            for (i, row) in x.block_mut(b, h).chunks_mut(dv).enumerate() {
                let f = lam[if lam.len() == 1 { 0 } else { i }].exp();
                row.iter_mut().for_each(|v| *v *= f);
            }
        }
    }
    x
}

/// The prefix fold in ascending rank order: `P_0 = h0` (zero if `None`),
/// `P_{u+1} = e^{Lambda_u} (.) P_u + M_u`. Returns `P_0 ..= P_W` (W + 1 states); `P_w` is what
/// rank w adds in its epilogue and `P_W` is the final state.
pub fn fold_prefixes(
    summaries: &[ShardSummary],
    h0: Option<&Tensor>,
) -> Result<Vec<Tensor>, ReferenceError> {
    fold_prefix_states(summaries, &summary_shape(summaries)?, h0)
}

/// The state entering the rank after the given ones: the last entry of [`fold_prefixes`], i.e.
/// `P_w` for `summaries` = ranks `0..w`.
pub fn fold_prefix(
    summaries: &[ShardSummary],
    h0: Option<&Tensor>,
) -> Result<Tensor, ReferenceError> {
    Ok(fold_prefixes(summaries, h0)?
        .pop()
        .expect("fold_prefixes returns W + 1 >= 2 states"))
}

/// The suffix fold in descending rank order: `D_{W-1} = d_ht` (zero if `None`),
/// `D_u = dM_{u+1} + e^{Lambda_{u+1}} (.) D_{u+1}`. Returns `D_0 .. D_{W-1}`; `D_w` is the
/// gradient with respect to the state leaving rank w.
pub fn fold_suffixes(
    summaries: &[ShardSummary],
    d_m: &[Tensor],
    d_ht: Option<&Tensor>,
) -> Result<Vec<Tensor>, ReferenceError> {
    fold_suffix_states(summaries, &summary_shape(summaries)?, d_m, d_ht)
}

/// LASP-2 forward over ranks with the given shard lengths (summing to T, each >= 1), each rank
/// running the chunkwise local pass with chunk size `chunk`.
pub fn forward(
    inputs: &Inputs,
    decay: Decay,
    shard_lengths: &[usize],
    chunk: usize,
) -> Result<Lasp2Forward<ShardSummary>, ReferenceError> {
    decay.check(chunk)?;
    let shards = split_shards(inputs, decay.family(), shard_lengths)?;
    let (locals, summaries) = local_passes(&shards, |shard| local_pass(shard, decay, chunk))?;
    let prefixes = fold_prefixes(&summaries, inputs.h0.as_ref())?;
    let ranks: Vec<RankForward> = shards
        .iter()
        .zip(locals)
        .zip(&prefixes)
        .map(|((shard, o_local), p)| {
            let mut o = o_local.clone();
            add_prefix_term(shard, p, chunk, &mut o);
            RankForward { o_local, o }
        })
        .collect();
    Ok(Lasp2Forward::from_ranks(summaries, prefixes, ranks))
}

/// The epilogue: `o_t += sigma (q_t (.) e^{G_t}) P_w`.
pub(super) fn add_prefix_term(shard: &Inputs, p: &Tensor, chunk: usize, o: &mut Tensor) {
    let s = shard.shape;
    for b in 0..s.b {
        for h in 0..s.h {
            let head = Head::gather(shard, b, h);
            let gd = head.gate_dim;
            let big_g = shard_cumsum(&head.g, gd, chunk);
            let mut rows = o.head_rows(b, h);
            for (t, out) in rows.chunks_mut(s.dv).enumerate() {
                let qg = decayed(head.q(t), &big_g[t * gd..(t + 1) * gd]);
                vec_mat_add(out, head.scale, &qg, p.block(b, h));
            }
            o.set_head_rows(b, h, &rows);
        }
    }
}

/// `x (.) e^{log_decay}` with a scalar or per-element log-decay (`<= 0`).
fn decayed(x: &[f64], log_decay: &[f64]) -> Vec<f64> {
    let at = |i: usize| log_decay[if log_decay.len() == 1 { 0 } else { i }];
    x.iter().enumerate().map(|(i, v)| v * at(i).exp()).collect()
}

/// LASP-2 backward: the gradients of `L = sum(o * d_o) + <S_T, d_ht>` assembled from each rank's
/// zero-state local backward, the exchanged `dM_w` and the boundary terms.
pub fn backward(
    inputs: &Inputs,
    decay: Decay,
    shard_lengths: &[usize],
    chunk: usize,
    d_o: &Tensor,
    d_ht: Option<&Tensor>,
) -> Result<Lasp2Backward, ReferenceError> {
    decay.check(chunk)?;
    inputs.validate(decay.family())?;
    check_cotangents(&inputs.shape, d_o, d_ht)?;
    let fwd = forward(inputs, decay, shard_lengths, chunk)?;
    let shards = split_shards(inputs, decay.family(), shard_lengths)?;
    let d_os = split_time(d_o, shard_lengths)?;
    let mut ranks = Vec::with_capacity(shards.len());
    for (shard, d_o_w) in shards.iter().zip(&d_os) {
        ranks.push(decay.local_backward(shard, chunk, d_o_w, None)?);
    }
    let d_m: Vec<Tensor> = ranks.iter().map(|g| g.dh0.clone()).collect();
    let suffixes = fold_suffixes(&fwd.summaries, &d_m, d_ht)?;
    for (w, grads) in ranks.iter_mut().enumerate() {
        let boundary = Boundary {
            incoming: Some(&fwd.prefixes[w]),
            outgoing: Some((&suffixes[w], &fwd.summaries[w].lambda)),
            d_end: None,
        };
        boundary.add_terms(&shards[w], chunk, &d_os[w], grads);
    }
    Ok(Lasp2Backward::from_ranks(d_m, suffixes, ranks))
}

/// What a run of a rank's tokens learns from the other ranks after both exchanges: the state
/// entering it and the gradient leaving it. Unpacked, the run is the whole shard and both are
/// exchanged; packed, a run ends at a document start or the shard's end, and only the run before
/// the shard's first document start is entered from earlier ranks, only a run that ends
/// mid-document at the shard's end sends its gradient on to later ranks.
pub(super) struct Boundary<'a> {
    /// `P_w`, the state entering the run from earlier ranks; `None` when the run starts a
    /// document (entered from its own `h0`, already in the local pass).
    pub(super) incoming: Option<&'a Tensor>,
    /// `(D_w, Lambda)`: the gradient with respect to the state leaving the run toward later ranks
    /// and the run's log-decay; `None` when the run ends a document.
    pub(super) outgoing: Option<(&'a Tensor, &'a Tensor)>,
    /// The gradient with respect to the state leaving the run known before the exchange (a
    /// packed document's `d_ht`), already in the local backward; `None` for zero.
    pub(super) d_end: Option<&'a Tensor>,
}

impl Boundary<'_> {
    /// Adds to a run's local backward (entered from `run.h0`, zero if `None`, and left with
    /// `d_end`) the terms from `P_w` to dq and from `D_w` to dk and dv, and
    /// `e^{Lambda} (.) D_w` to `dh0` (making it the gradient with respect to the true incoming
    /// state); the gate gradient is the run's straddling pairs from its true incoming state and
    /// outgoing gradient ([`decay_gate_grad`], exact where the decay is strong).
    pub(super) fn add_terms(&self, run: &Inputs, chunk: usize, d_o: &Tensor, grads: &mut Grads) {
        let s = run.shape;
        let (dk, dv) = (s.dk, s.dv);
        let zero_state = vec![0.0; dk * dv];
        for b in 0..s.b {
            for h in 0..s.h {
                let head = Head::gather(run, b, h);
                let gd = head.gate_dim;
                let big_g = shard_cumsum(&head.g, gd, chunk);
                // Lambda - G_t as a direct suffix sum, so the exponent is exactly <= 0.
                let rest = suffix_sums(&head.g, gd);
                let d_o_rows = d_o.head_rows(b, h);
                let mut ddq = vec![0.0; s.t * dk];
                let mut ddk = vec![0.0; s.t * dk];
                let mut dv_rows = grads.dv.head_rows(b, h);
                for t in 0..s.t {
                    let (gt, rt) = (&big_g[t * gd..(t + 1) * gd], &rest[t * gd..(t + 1) * gd]);
                    if let Some(p) = self.incoming {
                        let mut pd = vec![0.0; dk];
                        mat_vec_add(
                            &mut pd,
                            head.scale,
                            p.block(b, h),
                            &d_o_rows[t * dv..(t + 1) * dv],
                        );
                        ddq[t * dk..(t + 1) * dk].copy_from_slice(&decayed(&pd, gt));
                    }
                    if let Some((d, _)) = self.outgoing {
                        let d = d.block(b, h);
                        let mut dvv = vec![0.0; dk];
                        mat_vec_add(&mut dvv, 1.0, d, head.v(t));
                        ddk[t * dk..(t + 1) * dk].copy_from_slice(&decayed(&dvv, rt));
                        vec_mat_add(
                            &mut dv_rows[t * dv..(t + 1) * dv],
                            1.0,
                            &decayed(head.k(t), rt),
                            d,
                        );
                    }
                }
                let add_rows = |t: &mut Tensor, extra: &[f64]| {
                    let mut rows = t.head_rows(b, h);
                    axpy(&mut rows, 1.0, extra);
                    t.set_head_rows(b, h, &rows);
                };
                add_rows(&mut grads.dq, &ddq);
                add_rows(&mut grads.dk, &ddk);
                grads.dv.set_head_rows(b, h, &dv_rows);
                let d_leaving = match (self.outgoing, self.d_end) {
                    (Some((d, _)), _) | (None, Some(d)) => d.block(b, h),
                    (None, None) => zero_state.as_slice(),
                };
                let entered = Head {
                    h0: self
                        .incoming
                        .map_or(head.h0.clone(), |p| p.block(b, h).to_vec()),
                    ..head
                };
                grads
                    .dg
                    .set_head_rows(b, h, &decay_gate_grad(&entered, &d_o_rows, d_leaving));
            }
        }
        if let Some((d, lambda)) = self.outgoing {
            add(&mut grads.dh0, &decay_rows(d, lambda));
        }
    }
}
