//! LASP-2 over packed documents for the delta rule (Gated DeltaNet): the runs of
//! [`super::packed`] with the affine summary. A shard holding a document start forgets the state
//! entering it (`A_w = 0`, [`AffineCarry::Forget`]); one inside a single document carries it by
//! its transition `A_w`. `M_w` is the end state of the shard's last run: from that document's
//! `h0` when the run starts it, from zero otherwise. The fold is the unpacked one,
//! `P_{u+1} = A_u P_u + M_u` from `P_0 = 0`, and only a run that continues a document from
//! earlier ranks starts from `P_w`; as in [`super::delta_forward`], the reference reruns that run
//! from `P_w` instead of adding the full-matrix correction. The backward mirrors it
//! ([`packed_delta_backward`]): `dM_w` is the gradient with respect to the state entering a shard
//! whose first run continues a document (zero otherwise), `D_{u} = A_{u+1}^T D_{u+1} + dM_{u+1}`
//! with `D_{W-1} = 0`, and a run's exit cotangent is its document's `d_ht` where it ends the
//! document, `D_w` where it continues into later ranks.

use super::delta::{apply, local_affine};
use super::packed::run_inputs;
use super::{fold_prefix_states, fold_suffix_states, ShardMap};
use crate::reference::delta_rule;
use crate::reference::error::ReferenceError;
use crate::reference::inputs::Family;
use crate::reference::outputs::Grads;
use crate::reference::packed::{document_state, set_document_state, shard_runs, PackedInputs, Run};
use crate::reference::tensor::Tensor;
use crate::reference::validate::{check_chunk, check_shape, check_shard_lengths};

/// How the state entering a shard reaches the shard's end.
#[derive(Clone, Debug, PartialEq)]
pub enum AffineCarry {
    /// No document starts in the shard: `A_w` `[B, H, Dk, Dk]`, the product of its transitions
    /// (later tokens on the left).
    Transition(Tensor),
    /// A document starts in the shard: the entering state is forgotten (`A_w = 0`).
    Forget,
}

/// What rank w exchanges in the packed delta-rule forward.
#[derive(Clone, Debug, PartialEq)]
pub struct PackedAffineSummary {
    /// `M_w` `[B, H, Dk, Dv]`: the end state of the shard's last run.
    pub m: Tensor,
    /// How the state entering the shard reaches its end.
    pub carry: AffineCarry,
}

impl ShardMap for PackedAffineSummary {
    fn end_state(&self) -> &Tensor {
        &self.m
    }

    fn carry(&self, x: &Tensor) -> Tensor {
        match &self.carry {
            AffineCarry::Transition(a) => apply(a, x, false),
            AffineCarry::Forget => Tensor::zeros(x.shape()),
        }
    }

    fn carry_back(&self, x: &Tensor) -> Tensor {
        match &self.carry {
            AffineCarry::Transition(a) => apply(a, x, true),
            AffineCarry::Forget => Tensor::zeros(x.shape()),
        }
    }
}

/// The packed delta-rule LASP-2 forward over W ranks.
#[derive(Clone, Debug, PartialEq)]
pub struct PackedDeltaForward {
    /// What rank w exchanges; W entries.
    pub summaries: Vec<PackedAffineSummary>,
    /// `P_0 = 0` through `P_W`, each `[B, H, Dk, Dv]`: the packed sequence's state after the token
    /// before rank w; W + 1 entries.
    pub prefixes: Vec<Tensor>,
    /// The ranks' outputs concatenated along time, `[B, T, H, Dv]`.
    pub o: Tensor,
    /// Each document's final state, `[B, N, H, Dk, Dv]`, from the rank holding its last token.
    pub final_states: Tensor,
}

/// Packed delta-rule LASP-2 forward over ranks with the given shard lengths (summing to T, each
/// >= 1), every run by the chunkwise form with chunk size `chunk`.
pub fn packed_delta_forward(
    packed: &PackedInputs,
    shard_lengths: &[usize],
    chunk: usize,
) -> Result<PackedDeltaForward, ReferenceError> {
    check_chunk("chunk", chunk)?;
    packed.validate(Family::DeltaRule)?;
    check_shard_lengths(shard_lengths, packed.inputs.shape.t)?;
    let shards = shard_runs(&packed.cu_seqlens, shard_lengths);
    let mut summaries = Vec::with_capacity(shards.len());
    for shard in &shards {
        let last = shard.last().expect("a shard holds at least one token");
        let m = delta_rule::chunkwise_forward(&run_inputs(last, packed), chunk)?.final_state;
        let carry = if shard.iter().any(|r| r.starts_document) {
            AffineCarry::Forget
        } else {
            AffineCarry::Transition(local_affine(&run_inputs(&shard[0], packed), chunk)?.a)
        };
        summaries.push(PackedAffineSummary { m, carry });
    }
    let prefixes = fold_prefix_states(&summaries, &packed.inputs.shape.state(), None)?;
    let mut final_states = Tensor::zeros(&packed.document_states_shape());
    let mut o = Vec::new();
    for (shard, p) in shards.iter().zip(&prefixes) {
        for run in shard {
            let mut from = run_inputs(run, packed);
            if !run.starts_document {
                from.h0 = Some(p.clone());
            }
            let pass = delta_rule::chunkwise_forward(&from, chunk)?;
            if run.ends_document {
                set_document_state(&mut final_states, run.document, &pass.final_state);
            }
            o.push(pass.o);
        }
    }
    Ok(PackedDeltaForward {
        summaries,
        prefixes,
        o: Tensor::concat_time(&o),
        final_states,
    })
}

/// The packed delta-rule LASP-2 backward over W ranks.
#[derive(Clone, Debug, PartialEq)]
pub struct PackedDeltaBackward {
    /// `dM_w` `[B, H, Dk, Dv]`: the gradient with respect to the state entering rank w from its
    /// tokens up to its first document start (zero when it opens with one); what rank w exchanges.
    pub d_m: Vec<Tensor>,
    /// `D_w` `[B, H, Dk, Dv]`: the gradient with respect to the state leaving rank w toward later
    /// ranks.
    pub suffixes: Vec<Tensor>,
    /// The gradients of the packed sequence; `dh0` is per document, `[B, N, H, Dk, Dv]`.
    pub grads: Grads,
}

/// Packed delta-rule LASP-2 backward: the gradients of `L = sum(o * d_o) + sum_n <S_n, d_ht_n>`
/// (`d_o [B, T, H, Dv]`, `d_ht [B, N, H, Dk, Dv]` or `None` for zero), every run's backward by
/// the token-by-token reverse sweep from the state entering it and with its exit cotangent.
pub fn packed_delta_backward(
    packed: &PackedInputs,
    shard_lengths: &[usize],
    chunk: usize,
    d_o: &Tensor,
    d_ht: Option<&Tensor>,
) -> Result<PackedDeltaBackward, ReferenceError> {
    let forward = packed_delta_forward(packed, shard_lengths, chunk)?;
    let s = packed.inputs.shape;
    check_shape("d_o", "[B, T, H, Dv]", s.v(), d_o)?;
    if let Some(d_ht) = d_ht {
        check_shape(
            "d_ht",
            "[B, N, H, Dk, Dv]",
            packed.document_states_shape(),
            d_ht,
        )?;
    }
    let shards = shard_runs(&packed.cu_seqlens, shard_lengths);
    let document_grad = |n: usize| d_ht.map(|t| document_state(t, n));
    let run_d_o = |run: &Run| d_o.slice_time(run.range.start, run.range.len());
    // The state entering a run: its document's h0 where it starts the document, else the prefix.
    let entering = |run: &Run, w: usize| {
        let mut inputs = run_inputs(run, packed);
        if !run.starts_document {
            inputs.h0 = Some(forward.prefixes[w].clone());
        }
        inputs
    };
    let mut d_m = Vec::with_capacity(shards.len());
    for (w, shard) in shards.iter().enumerate() {
        let first = &shard[0];
        d_m.push(if first.starts_document {
            Tensor::zeros(&s.state())
        } else {
            // The run's own outputs, and its document's end where it holds it; what continues
            // into later ranks reaches the entering state through the carry instead.
            let exit = if first.ends_document {
                document_grad(first.document)
            } else {
                None
            };
            delta_rule::recurrent_backward(&entering(first, w), &run_d_o(first), exit.as_ref())?.dh0
        });
    }
    let suffixes = fold_suffix_states(&forward.summaries, &s.state(), &d_m, None)?;
    let mut parts = Vec::new();
    let mut dh0 = Tensor::zeros(&packed.document_states_shape());
    for (w, shard) in shards.iter().enumerate() {
        for run in shard {
            let exit = if run.ends_document {
                document_grad(run.document)
            } else {
                Some(suffixes[w].clone())
            };
            let grads =
                delta_rule::recurrent_backward(&entering(run, w), &run_d_o(run), exit.as_ref())?;
            if run.starts_document {
                set_document_state(&mut dh0, run.document, &grads.dh0);
            }
            parts.push(grads);
        }
    }
    let cat = |f: fn(&Grads) -> &Tensor| {
        Tensor::concat_time(&parts.iter().map(|g| f(g).clone()).collect::<Vec<_>>())
    };
    let dbeta = parts
        .iter()
        .map(|g| g.dbeta.clone())
        .collect::<Option<Vec<Tensor>>>()
        .map(|parts| Tensor::concat_time(&parts));
    let grads = Grads {
        dq: cat(|g| &g.dq),
        dk: cat(|g| &g.dk),
        dv: cat(|g| &g.dv),
        dg: cat(|g| &g.dg),
        dbeta,
        dh0,
    };
    Ok(PackedDeltaBackward {
        d_m,
        suffixes,
        grads,
    })
}
