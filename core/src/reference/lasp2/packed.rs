//! LASP-2 over packed documents (scalar and vector gates): each rank owns a contiguous slice of
//! the packed sequence, and a document may start, end or span any number of shards.
//!
//! A shard splits at its document starts into runs. Only the first run, when the shard does not
//! open with a document start, continues a document from earlier ranks; only the last run, when
//! the shard ends mid-document, continues into later ranks. Hence the summary of rank w:
//! * `M_w`: the state at the shard's end from the last document start in it (from that
//!   document's `h0`), or from a zero state at the shard's start if it holds none;
//! * the carry of the state entering the shard to its end: `e^{Lambda_w}` with `Lambda_w` the
//!   shard's gate total when no document starts in the shard, and exactly zero
//!   ([`Carry::Forget`], `Lambda_w = -inf`) when one does.
//!
//! The fold is unchanged, `P_0 = 0`, `P_{u+1} = e^{Lambda_u} (.) P_u + M_u` in ascending u, with
//! `e^{-inf} (.) P_u` taken as the zero state rather than evaluated (so no `0 * inf` can arise).
//! `P_w` corrects only the first run's outputs, and a document's final state is that of the run
//! ending it, plus `e^{Lambda_run} (.) P_w` when that run is the first one and continues a
//! document. Backward mirrors it: `dM_w` is the first run's gradient with respect to its zero
//! start when it continues a document (zero otherwise), `D_u = carry_{u+1}(D_{u+1}) + dM_{u+1}`
//! with `D_{W-1} = 0` (the last token always ends a document, whose `d_ht` is local), so a
//! gradient reaches earlier ranks only until a document start; `D_w` reaches only a last run that
//! ends mid-document, and a document's `dh0` is found on the rank holding its first token.

use super::decay::{add_prefix_term, decay_rows, log_decay, Boundary, Decay};
use super::{concat_grads, fold_prefix_states, fold_suffix_states, ShardMap};
use crate::reference::error::ReferenceError;
use crate::reference::inputs::{Inputs, Shape};
use crate::reference::outputs::Grads;
use crate::reference::packed::{document_state, set_document_state, shard_runs, PackedInputs, Run};
use crate::reference::tensor::Tensor;
use crate::reference::validate::{
    check_cotangents, check_finite, check_shape, check_shard_lengths,
};

/// How the state entering a shard reaches the shard's end.
#[derive(Clone, Debug, PartialEq)]
pub enum Carry {
    /// No document starts in the shard: the entering state decays by `e^{Lambda}`, with
    /// `Lambda = sum_{t in w} a_t`, `[B, H]` (scalar gates) or `[B, H, Dk]` (vector gates).
    Decay {
        /// The shard's log-decay.
        lambda: Tensor,
    },
    /// A document starts in the shard: the entering state is forgotten (`Lambda = -inf`,
    /// `e^{Lambda} = 0`).
    Forget,
}

/// What rank w exchanges in the packed forward.
#[derive(Clone, Debug, PartialEq)]
pub struct PackedShardSummary {
    /// `M_w` `[B, H, Dk, Dv]`: the state at the shard's end from its last document start (from
    /// that document's `h0`), or from zero at the shard's start when no document starts in it.
    pub m: Tensor,
    /// How the state entering the shard reaches its end.
    pub carry: Carry,
}

impl ShardMap for PackedShardSummary {
    fn end_state(&self) -> &Tensor {
        &self.m
    }

    fn carry(&self, x: &Tensor) -> Tensor {
        match &self.carry {
            Carry::Decay { lambda } => decay_rows(x, lambda),
            Carry::Forget => Tensor::zeros(x.shape()),
        }
    }

    /// A diagonal decay (or zero) is its own adjoint.
    fn carry_back(&self, x: &Tensor) -> Tensor {
        self.carry(x)
    }
}

/// One rank's share of the packed forward.
#[derive(Clone, Debug, PartialEq)]
pub struct PackedRankForward {
    /// The local pass, `[B, T_w, H, Dv]`: every run from its document's `h0`, or from zero for a
    /// run continuing a document from earlier ranks.
    pub o_local: Tensor,
    /// The rank's final output `[B, T_w, H, Dv]`, equal to the packed sequence's tokens.
    pub o: Tensor,
    /// `(n, S_n)` for every document n whose last token the rank holds, `S_n` `[B, H, Dk, Dv]`.
    pub final_states: Vec<(usize, Tensor)>,
}

/// The packed LASP-2 forward over W ranks, with every exchanged and folded intermediate.
#[derive(Clone, Debug, PartialEq)]
pub struct PackedLasp2Forward {
    /// What rank w all-gathers; W entries.
    pub summaries: Vec<PackedShardSummary>,
    /// `P_0 = 0` through `P_W`, each `[B, H, Dk, Dv]`: `P_w` is the packed sequence's state after
    /// the token before rank w (the end state of the previous document when rank w opens with a
    /// document start); W + 1 entries.
    pub prefixes: Vec<Tensor>,
    /// Per-rank outputs; W entries.
    pub ranks: Vec<PackedRankForward>,
    /// The ranks' outputs concatenated along time, `[B, T, H, Dv]`.
    pub o: Tensor,
    /// Each document's final state, `[B, N, H, Dk, Dv]`, gathered from the ranks.
    pub final_states: Tensor,
}

/// One rank's share of the packed backward.
#[derive(Clone, Debug, PartialEq)]
pub struct PackedRankBackward {
    /// The gradients over the rank's tokens; `dh0` is the gradient with respect to the state
    /// entering the rank, `P_w` (zero when the rank opens with a document start).
    pub grads: Grads,
    /// `(n, dL/dh0_n)` for every document n whose first token the rank holds.
    pub dh0: Vec<(usize, Tensor)>,
}

/// The packed LASP-2 backward over W ranks.
#[derive(Clone, Debug, PartialEq)]
pub struct PackedLasp2Backward {
    /// `dM_w` `[B, H, Dk, Dv]`: the gradient with respect to the state entering rank w from the
    /// rank's own tokens (zero when it opens with a document start); what rank w all-gathers.
    pub d_m: Vec<Tensor>,
    /// `D_w` `[B, H, Dk, Dv]`: the gradient with respect to the state leaving rank w toward later
    /// ranks, folded from their `dM`.
    pub suffixes: Vec<Tensor>,
    /// Per-rank gradients.
    pub ranks: Vec<PackedRankBackward>,
    /// The ranks' gradients concatenated along time; `dh0` is per document, `[B, N, H, Dk, Dv]`.
    pub grads: Grads,
}

/// A run as unpacked inputs: its tokens, entered from its document's `h0` when it starts the
/// document, from zero otherwise.
pub(super) fn run_inputs(run: &Run, packed: &PackedInputs) -> Inputs {
    let (start, len) = (run.range.start, run.range.len());
    let all = &packed.inputs;
    Inputs {
        shape: Shape {
            t: len,
            ..all.shape
        },
        q: all.q.slice_time(start, len),
        k: all.k.slice_time(start, len),
        v: all.v.slice_time(start, len),
        g: all.g.slice_time(start, len),
        beta: all.beta.as_ref().map(|beta| beta.slice_time(start, len)),
        h0: packed
            .h0
            .as_ref()
            .filter(|_| run.starts_document)
            .map(|h0| document_state(h0, run.document)),
        scale: all.scale,
    }
}

/// Checks everything the packed decomposition assumes, before any arithmetic.
fn check_problem(
    packed: &PackedInputs,
    decay: Decay,
    shard_lengths: &[usize],
    chunk: usize,
) -> Result<(), ReferenceError> {
    decay.check(chunk)?;
    packed.validate(decay.family())?;
    check_shard_lengths(shard_lengths, packed.inputs.shape.t)
}

/// Packed LASP-2 forward over ranks with the given shard lengths (summing to T, each >= 1), each
/// run of each rank computed by the chunkwise local pass with chunk size `chunk`.
pub fn packed_forward(
    packed: &PackedInputs,
    decay: Decay,
    shard_lengths: &[usize],
    chunk: usize,
) -> Result<PackedLasp2Forward, ReferenceError> {
    check_problem(packed, decay, shard_lengths, chunk)?;
    let shards = shard_runs(&packed.cu_seqlens, shard_lengths);
    // Local passes, before any exchange.
    let mut locals = Vec::with_capacity(shards.len());
    let mut summaries = Vec::with_capacity(shards.len());
    for shard in &shards {
        let mut passes = Vec::with_capacity(shard.len());
        for run in shard {
            passes.push(decay.local_forward(&run_inputs(run, packed), chunk)?);
        }
        let carry = if shard.iter().any(|r| r.starts_document) {
            Carry::Forget
        } else {
            Carry::Decay {
                lambda: log_decay(&run_inputs(&shard[0], packed), decay),
            }
        };
        let m = passes[passes.len() - 1].final_state.clone();
        summaries.push(PackedShardSummary { m, carry });
        locals.push(passes);
    }
    let prefixes = fold_prefix_states(&summaries, &packed.inputs.shape.state(), None)?;
    // Epilogues: the first run's correction from P_w and the documents' final states.
    let mut final_states = Tensor::zeros(&packed.document_states_shape());
    let mut ranks = Vec::with_capacity(shards.len());
    for ((shard, passes), p) in shards.iter().zip(locals).zip(&prefixes) {
        let mut o_runs = Vec::with_capacity(shard.len());
        let mut rank_finals = Vec::new();
        for (run, pass) in shard.iter().zip(passes) {
            let mut o = pass.o.clone();
            let mut end = pass.final_state;
            if !run.starts_document {
                let inputs = run_inputs(run, packed);
                add_prefix_term(&inputs, p, chunk, &mut o);
                let carried = decay_rows(p, &log_decay(&inputs, decay));
                end.data_mut()
                    .iter_mut()
                    .zip(carried.data())
                    .for_each(|(x, c)| *x += c);
            }
            if run.ends_document {
                set_document_state(&mut final_states, run.document, &end);
                rank_finals.push((run.document, end));
            }
            o_runs.push((pass.o, o));
        }
        let (o_local, o): (Vec<Tensor>, Vec<Tensor>) = o_runs.into_iter().unzip();
        ranks.push(PackedRankForward {
            o_local: Tensor::concat_time(&o_local),
            o: Tensor::concat_time(&o),
            final_states: rank_finals,
        });
    }
    let o = Tensor::concat_time(&ranks.iter().map(|r| r.o.clone()).collect::<Vec<_>>());
    Ok(PackedLasp2Forward {
        summaries,
        prefixes,
        ranks,
        o,
        final_states,
    })
}

/// Packed LASP-2 backward: the gradients of `L = sum(o * d_o) + sum_n <S_n, d_ht_n>`
/// (`d_ht [B, N, H, Dk, Dv]`, `None` for zero) assembled from each run's local backward, the
/// exchanged `dM_w` and the boundary terms.
pub fn packed_backward(
    packed: &PackedInputs,
    decay: Decay,
    shard_lengths: &[usize],
    chunk: usize,
    d_o: &Tensor,
    d_ht: Option<&Tensor>,
) -> Result<PackedLasp2Backward, ReferenceError> {
    check_problem(packed, decay, shard_lengths, chunk)?;
    let shape = packed.inputs.shape;
    check_cotangents(&shape, d_o, None)?;
    if let Some(d_ht) = d_ht {
        let layout = "[B, N, H, Dk, Dv]";
        check_shape("d_ht", layout, packed.document_states_shape(), d_ht)?;
        check_finite("d_ht", d_ht)?;
    }
    let fwd = packed_forward(packed, decay, shard_lengths, chunk)?;
    let shards = shard_runs(&packed.cu_seqlens, shard_lengths);
    // Local backwards, before any exchange: each run with its document's d_ht when it ends it.
    let mut locals = Vec::with_capacity(shards.len());
    let mut d_m = Vec::with_capacity(shards.len());
    for shard in &shards {
        let mut run_grads = Vec::with_capacity(shard.len());
        for run in shard {
            let d_end = d_ht
                .filter(|_| run.ends_document)
                .map(|d| document_state(d, run.document));
            let d_o_run = d_o.slice_time(run.range.start, run.range.len());
            let inputs = run_inputs(run, packed);
            run_grads.push(decay.local_backward(&inputs, chunk, &d_o_run, d_end.as_ref())?);
        }
        d_m.push(if shard[0].starts_document {
            Tensor::zeros(&shape.state())
        } else {
            run_grads[0].dh0.clone()
        });
        locals.push(run_grads);
    }
    let suffixes = fold_suffix_states(&fwd.summaries, &shape.state(), &d_m, None)?;
    // Epilogues: P_w into the first run, D_w into a last run ending mid-document.
    let mut dh0 = Tensor::zeros(&packed.document_states_shape());
    let mut ranks = Vec::with_capacity(shards.len());
    for (w, (shard, mut run_grads)) in shards.iter().zip(locals).enumerate() {
        let last = shard.len() - 1;
        let mut rank_dh0 = Vec::new();
        for (i, (run, grads)) in shard.iter().zip(&mut run_grads).enumerate() {
            let inputs = run_inputs(run, packed);
            let lambda = log_decay(&inputs, decay);
            let d_end = d_ht
                .filter(|_| run.ends_document)
                .map(|d| document_state(d, run.document));
            let boundary = Boundary {
                incoming: (!run.starts_document).then_some(&fwd.prefixes[w]),
                outgoing: (i == last && !run.ends_document).then_some((&suffixes[w], &lambda)),
                d_end: d_end.as_ref(),
            };
            if boundary.incoming.is_some() || boundary.outgoing.is_some() {
                let d_o_run = d_o.slice_time(run.range.start, run.range.len());
                boundary.add_terms(&inputs, chunk, &d_o_run, grads);
            }
            if run.starts_document {
                set_document_state(&mut dh0, run.document, &grads.dh0);
                rank_dh0.push((run.document, grads.dh0.clone()));
            }
        }
        let mut grads = concat_grads(&run_grads);
        if shard[0].starts_document {
            grads.dh0 = Tensor::zeros(&shape.state());
        }
        ranks.push(PackedRankBackward {
            grads,
            dh0: rank_dh0,
        });
    }
    let mut grads = concat_grads(&ranks.iter().map(|r| r.grads.clone()).collect::<Vec<_>>());
    grads.dh0 = dh0;
    Ok(PackedLasp2Backward {
        d_m,
        suffixes,
        ranks,
        grads,
    })
}
