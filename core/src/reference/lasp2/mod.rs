//! The LASP-2 decomposition over W simulated ranks (kernels/docs/maths.md, "LASP-2: forward"
//! and "LASP-2: backward"): what each GPU computes, what it exchanges, and how the pieces
//! recombine into the single-sequence result.
//!
//! Rank w owns tokens `[sum_{u<w} T_u, sum_{u<=w} T_u)` of every sequence; shards may have
//! different lengths and need not be multiples of the chunk size.
//!
//! Scalar and vector gates ([`forward`], [`backward`]):
//! * local pass from a zero state: output `o_local` and end state `M_w`; shard log-decay
//!   `Lambda_w = sum_{t in w} a_t` ([`local_state`]);
//! * exchange `(M_w, Lambda_w)`; fold `P_0 = h0`, `P_{u+1} = e^{Lambda_u} (.) P_u + M_u` in
//!   ascending u ([`fold_prefixes`]);
//! * output `o_t = o_local_t + sigma (q_t (.) e^{G_t}) P_w`, `G_t` the shard-local inclusive cumsum;
//! * backward: `dM_w` = local `dh0` with zero `d_ht`; exchange toward earlier ranks; fold
//!   `D_{W-1} = d_ht`, `D_u = dM_{u+1} + e^{Lambda_{u+1}} (.) D_{u+1}` ([`fold_suffixes`]); add
//!   `sigma e^{G_t} (.) (P_w d_o_t^T)` to dq, `e^{Lambda_w - G_t} (.) (D_w v_t^T)` to dk,
//!   `(k_t (.) e^{Lambda_w - G_t}) D_w` to dv, the boundary term
//!   `<e^{Lambda_w} (.) P_w + M_w, D_w>` (= `<P_{w+1}, D_w>`, row-wise for vector gates) at the
//!   shard's last token, and reverse-cumsum the gate terms within the shard.
//!
//! Delta rule ([`delta_forward`], [`delta_backward`]): the summary is affine, `(A_w, h_w)` with
//! `S_out = A_w S_in + h_w` ([`local_affine`]); `P_{u+1} = A_u P_u + h_u`
//! ([`fold_affine_prefixes`]); `D_u = dM_{u+1} + A_{u+1}^T D_{u+1}` ([`fold_affine_suffixes`]).
//! Because the correction of the output is `sigma q_t Phi_t P_w` with a full matrix `Phi_t`, the
//! reference reruns each rank's local pass from `P_w` (forward) and with `(P_w, D_w)` (backward)
//! instead of adding a rank-1 epilogue term.
//!
//! Packed documents ([`packed_forward`], [`packed_backward`]; scalar and vector gates): a shard
//! holding a document start forgets the state entering it (`Lambda_w = -inf`, [`Carry::Forget`]),
//! and `P_w` and `D_w` reach only the tokens before the shard's first document start and after its
//! last one; the module's header has the details. The delta rule's packed forward and backward
//! ([`packed_delta_forward`], [`packed_delta_backward`]) have the same runs with the affine
//! summary: `A_w = 0` ([`AffineCarry::Forget`]) where a document starts in the shard.
//!
//! Compare per-token tensors against the single sequence, never per-chunk states: shard cuts move
//! chunk boundaries (fla `tests/context_parallel/debug.md`).

mod decay;
mod delta;
mod packed;
mod packed_delta;

pub use decay::{
    backward, fold_prefix, fold_prefixes, fold_suffixes, forward, local_state, Decay, ShardSummary,
};
pub use delta::{
    delta_backward, delta_forward, fold_affine_prefixes, fold_affine_suffixes, local_affine,
    AffineSummary,
};
pub use packed::{
    packed_backward, packed_forward, Carry, PackedLasp2Backward, PackedLasp2Forward,
    PackedRankBackward, PackedRankForward, PackedShardSummary,
};
pub use packed_delta::{
    packed_delta_backward, packed_delta_forward, AffineCarry, PackedAffineSummary,
    PackedDeltaBackward, PackedDeltaForward,
};

use super::error::ReferenceError;
use super::inputs::{Family, Inputs, Shape};
use super::outputs::Grads;
use super::tensor::Tensor;
use super::validate::{check_shape, check_shard_lengths};

/// One rank's forward output.
#[derive(Clone, Debug, PartialEq)]
pub struct RankForward {
    /// The local pass from a zero state, `[B, T_w, H, Dv]` (what the rank can compute before any
    /// exchange).
    pub o_local: Tensor,
    /// The rank's final output `[B, T_w, H, Dv]`, equal to the single sequence's tokens.
    pub o: Tensor,
}

/// The LASP-2 forward over W ranks, with every exchanged and folded intermediate.
#[derive(Clone, Debug, PartialEq)]
pub struct Lasp2Forward<S> {
    /// What rank w all-gathers: [`ShardSummary`] `(M_w, Lambda_w)` or [`AffineSummary`]
    /// `(A_w, h_w)`; W entries.
    pub summaries: Vec<S>,
    /// `P_0 = h0` (zero if absent) through `P_W = S_T`, each `[B, H, Dk, Dv]`: `P_w` is the state
    /// entering rank w; W + 1 entries.
    pub prefixes: Vec<Tensor>,
    /// Per-rank outputs; W entries.
    pub ranks: Vec<RankForward>,
    /// The ranks' outputs concatenated along time, `[B, T, H, Dv]`.
    pub o: Tensor,
    /// The final state `S_T = P_W`, `[B, H, Dk, Dv]`.
    pub final_state: Tensor,
}

impl<S> Lasp2Forward<S> {
    /// Completes the forward from what the ranks exchanged and computed: the output is the ranks'
    /// outputs along time and the final state is the last prefix.
    fn from_ranks(summaries: Vec<S>, prefixes: Vec<Tensor>, ranks: Vec<RankForward>) -> Self {
        let o = Tensor::concat_time(&ranks.iter().map(|r| r.o.clone()).collect::<Vec<_>>());
        let final_state = prefixes[prefixes.len() - 1].clone();
        Lasp2Forward {
            summaries,
            prefixes,
            ranks,
            o,
            final_state,
        }
    }
}

/// The LASP-2 backward over W ranks.
#[derive(Clone, Debug, PartialEq)]
pub struct Lasp2Backward {
    /// `dM_w` `[B, H, Dk, Dv]`: the gradient with respect to the state entering rank w from the
    /// rank's own tokens only (its local `dh0` with zero `d_ht`); what rank w all-gathers.
    pub d_m: Vec<Tensor>,
    /// `D_w` `[B, H, Dk, Dv]`: the gradient with respect to the state leaving rank w, folded from
    /// the later ranks' `dM`.
    pub suffixes: Vec<Tensor>,
    /// Per-rank gradients over the rank's tokens; `dh0` is the gradient with respect to the
    /// rank's incoming state `P_w`.
    pub ranks: Vec<Grads>,
    /// The ranks' gradients concatenated along time; `dh0` is rank 0's, i.e. `dL/dh0`.
    pub grads: Grads,
}

impl Lasp2Backward {
    /// Completes the backward from the exchanged `dM_w`, the folded `D_w` and the ranks' gradients.
    fn from_ranks(d_m: Vec<Tensor>, suffixes: Vec<Tensor>, ranks: Vec<Grads>) -> Self {
        let grads = concat_grads(&ranks);
        Lasp2Backward {
            d_m,
            suffixes,
            ranks,
            grads,
        }
    }
}

/// Runs `pass` (a shard's zero-state local pass) on every shard, in rank order: the local
/// outputs and the summaries.
fn local_passes<S>(
    shards: &[Inputs],
    pass: impl Fn(&Inputs) -> Result<(Tensor, S), ReferenceError>,
) -> Result<(Vec<Tensor>, Vec<S>), ReferenceError> {
    let mut locals = Vec::with_capacity(shards.len());
    let mut summaries = Vec::with_capacity(shards.len());
    for shard in shards {
        let (o_local, summary) = pass(shard)?;
        locals.push(o_local);
        summaries.push(summary);
    }
    Ok((locals, summaries))
}

/// What the folds need of a rank's summary: the shard maps the state entering it to
/// `S_out = carry(S_in) + end_state`.
trait ShardMap {
    /// The shard's end state from a zero start (`M_w`, `h_w`).
    fn end_state(&self) -> &Tensor;
    /// A state entering the shard carried to its end: `e^{Lambda_w} (.) x` or `A_w x`.
    fn carry(&self, x: &Tensor) -> Tensor;
    /// The adjoint of [`ShardMap::carry`], taking the gradient with respect to the state leaving
    /// the shard to the one entering it: `e^{Lambda_w} (.) x` or `A_w^T x`.
    fn carry_back(&self, x: &Tensor) -> Tensor;
}

/// The shape of a state `[B, H, Dk, Dv]` (the first summary's `tensor`), checked for its rank.
fn state_shape(tensor: &'static str, state: &Tensor) -> Result<Vec<usize>, ReferenceError> {
    let shape = state.shape().to_vec();
    if shape.len() != 4 {
        return Err(ReferenceError::WrongRank {
            tensor,
            layout: "[B, H, Dk, Dv]",
            got: shape,
        });
    }
    Ok(shape)
}

/// The prefix fold in ascending rank order over summaries already checked to have states shaped
/// `state`: `P_0 = h0` (zero if `None`), `P_{u+1} = carry_u(P_u) + end_u`. Returns `P_0 ..= P_W`
/// (W + 1 states).
fn fold_prefix_states<S: ShardMap>(
    summaries: &[S],
    state: &[usize],
    h0: Option<&Tensor>,
) -> Result<Vec<Tensor>, ReferenceError> {
    if let Some(h0) = h0 {
        check_shape("h0", "[B, H, Dk, Dv]", state.to_vec(), h0)?;
    }
    let mut prefixes = vec![h0.cloned().unwrap_or_else(|| Tensor::zeros(state))];
    for s in summaries {
        let mut next = s.carry(&prefixes[prefixes.len() - 1]);
        add(&mut next, s.end_state());
        prefixes.push(next);
    }
    Ok(prefixes)
}

/// The suffix fold in descending rank order over W >= 1 summaries already checked to have states
/// shaped `state`: `D_{W-1} = d_ht` (zero if `None`), `D_u = carry_back_{u+1}(D_{u+1}) + dM_{u+1}`.
/// Returns `D_0 .. D_{W-1}`.
fn fold_suffix_states<S: ShardMap>(
    summaries: &[S],
    state: &[usize],
    d_m: &[Tensor],
    d_ht: Option<&Tensor>,
) -> Result<Vec<Tensor>, ReferenceError> {
    check_rank_count("d_m", summaries.len(), d_m.len())?;
    for d in d_m {
        check_shape("dM_w", "[B, H, Dk, Dv]", state.to_vec(), d)?;
    }
    if let Some(d_ht) = d_ht {
        check_shape("d_ht", "[B, H, Dk, Dv]", state.to_vec(), d_ht)?;
    }
    let w = summaries.len();
    let mut suffixes = vec![d_ht.cloned().unwrap_or_else(|| Tensor::zeros(state)); w];
    for u in (0..w - 1).rev() {
        let mut d = summaries[u + 1].carry_back(&suffixes[u + 1]);
        add(&mut d, &d_m[u + 1]);
        suffixes[u] = d;
    }
    Ok(suffixes)
}

/// `x += y`.
fn add(x: &mut Tensor, y: &Tensor) {
    x.data_mut()
        .iter_mut()
        .zip(y.data())
        .for_each(|(a, b)| *a += b);
}

/// Splits validated-as-`family` inputs into per-rank shards of the given lengths. Each shard
/// carries no initial state (the local pass starts from zero) and keeps the scale.
pub fn split_shards(
    inputs: &Inputs,
    family: Family,
    lengths: &[usize],
) -> Result<Vec<Inputs>, ReferenceError> {
    inputs.validate(family)?;
    check_shard_lengths(lengths, inputs.shape.t)?;
    let mut start = 0;
    Ok(lengths
        .iter()
        .map(|&len| {
            let shard = Inputs {
                shape: Shape {
                    t: len,
                    ..inputs.shape
                },
                q: inputs.q.slice_time(start, len),
                k: inputs.k.slice_time(start, len),
                v: inputs.v.slice_time(start, len),
                g: inputs.g.slice_time(start, len),
                beta: inputs.beta.as_ref().map(|b| b.slice_time(start, len)),
                h0: None,
                scale: inputs.scale,
            };
            start += len;
            shard
        })
        .collect())
}

/// Splits a per-token tensor `[B, T, ...]` (e.g. `d_o`) into per-rank pieces.
///
/// # Panics
/// If the tensor has rank < 2.
pub fn split_time(t: &Tensor, lengths: &[usize]) -> Result<Vec<Tensor>, ReferenceError> {
    check_shard_lengths(lengths, t.shape()[1])?;
    let mut start = 0;
    Ok(lengths
        .iter()
        .map(|&len| {
            start += len;
            t.slice_time(start - len, len)
        })
        .collect())
}

/// Concatenates per-rank gradients along time; `dh0` is rank 0's.
fn concat_grads(ranks: &[Grads]) -> Grads {
    let cat = |f: fn(&Grads) -> &Tensor| {
        Tensor::concat_time(&ranks.iter().map(|g| f(g).clone()).collect::<Vec<_>>())
    };
    let dbeta = ranks[0].dbeta.as_ref().map(|_| {
        let parts: Vec<Tensor> = ranks.iter().filter_map(|g| g.dbeta.clone()).collect();
        Tensor::concat_time(&parts)
    });
    Grads {
        dq: cat(|g| &g.dq),
        dk: cat(|g| &g.dk),
        dv: cat(|g| &g.dv),
        dg: cat(|g| &g.dg),
        dbeta,
        dh0: ranks[0].dh0.clone(),
    }
}

/// Checks that a per-rank list has one entry per rank.
fn check_rank_count(what: &'static str, expected: usize, got: usize) -> Result<(), ReferenceError> {
    if expected != got {
        return Err(ReferenceError::RankCount {
            what,
            expected,
            got,
        });
    }
    Ok(())
}
