//! The LASP-2 decomposition of the mLSTM over W simulated ranks, forward and backward (module doc,
//! "LASP-2" and "LASP-2 backward").

use super::super::error::ReferenceError;
use super::super::inputs::Shape;
use super::super::linalg::axpy;
use super::super::tensor::Tensor;
use super::super::validate::{check_chunk, check_finite, check_shape, check_shard_lengths};
use super::chunk_backward::backward_from;
use super::chunkwise::{advance, forward_from};
use super::gradient::MlstmGradient;
use super::head::{
    assemble_state, backward_heads, head_state, initial_head_state, HeadGrads, HeadState, MlstmHead,
};
use super::inputs::{check_state, MlstmCotangents, MlstmGrads, MlstmInputs, MlstmState};

/// What rank w all-gathers: its shard's own contribution, stabilised on its own, and its total
/// log forget gate.
#[derive(Clone, Debug, PartialEq)]
pub struct ShardSummary {
    /// `(C_w [B, H, Dk, Dv], n_w [B, H, Dk], m_w [B, H])`: the state the shard reaches from the
    /// empty state (`m = -inf`).
    pub state: MlstmState,
    /// `F_w = sum_{t in shard} logsigmoid(f_t)`, `[B, H]`.
    pub log_forget_total: Tensor,
}

/// Everything the decomposition computes, per rank.
#[derive(Clone, Debug, PartialEq)]
pub struct MlstmLasp2 {
    /// The summary of every rank's shard.
    pub summaries: Vec<ShardSummary>,
    /// The state entering every rank's shard: `P_0` = the initial state, `P_{w+1}` =
    /// [`fold`]`(P_w, summary_w)`.
    pub prefixes: Vec<MlstmState>,
    /// The hidden states of the whole sequence, `[B, T, H, Dv]` (the ranks' outputs concatenated).
    pub h: Tensor,
    /// The state after the last shard, `P_W`.
    pub final_state: MlstmState,
}

/// Everything the backward computes, per rank.
#[derive(Clone, Debug, PartialEq)]
pub struct MlstmLasp2Backward {
    /// `E_w`: the gradient of rank w's own outputs with respect to the state entering it, `P_w`
    /// (its local backward from `P_w` with no exit cotangent): what rank w all-gathers.
    pub output_state_grads: Vec<MlstmState>,
    /// `D_w = dL/dP_{w+1}`: the gradient with respect to the state leaving rank w, from the suffix
    /// fold `D_{W-1} = dL/d(final state)`, `D_{w-1} = E_w + ` [`fold_backward`]`(P_w, summary_w,
    /// D_w).d_prefix`.
    pub exit_state_grads: Vec<MlstmState>,
    /// The gradients of the whole sequence.
    pub grads: MlstmGrads,
}

/// The cotangents of [`fold`]'s arguments.
#[derive(Clone, Debug, PartialEq)]
pub struct FoldCotangents {
    /// `dL/dP`, `(C [B, H, Dk, Dv], n [B, H, Dk], m [B, H])`.
    pub d_prefix: MlstmState,
    /// `dL/d(C_w, n_w, m_w)` and `dL/dF_w`, shaped like the summary.
    pub d_summary: ShardSummary,
}

/// LASP-2 on `shard_lengths.len()` ranks (ragged lengths summing to T, none empty): each rank
/// summarises its shard chunkwise (chunk size `chunk`), every rank folds the summaries of the
/// ranks before it in rank order onto the initial state, and computes its outputs chunkwise from
/// that prefix.
pub fn lasp2_forward(
    inputs: &MlstmInputs,
    shard_lengths: &[usize],
    chunk: usize,
) -> Result<MlstmLasp2, ReferenceError> {
    inputs.validate()?;
    check_chunk("chunk", chunk)?;
    check_shard_lengths(shard_lengths, inputs.shape.t)?;
    let s = inputs.shape;
    let ranks = shard_lengths.len();
    let mut summaries = vec![Vec::with_capacity(s.b * s.h); ranks];
    let mut totals = vec![Tensor::zeros(&[s.b, s.h]); ranks];
    let mut prefixes = vec![Vec::with_capacity(s.b * s.h); ranks + 1];
    let mut outputs: Vec<Tensor> = shard_lengths
        .iter()
        .map(|&len| Tensor::zeros(&[s.b, len, s.h, s.dv]))
        .collect();
    for b in 0..s.b {
        for h in 0..s.h {
            let head = MlstmHead::gather(inputs, b, h);
            let ex = Exchanged::new(
                &head,
                initial_head_state(inputs, b, h),
                shard_lengths,
                chunk,
            );
            for (w, ((_, shard), prefix)) in ex.shards.iter().zip(&ex.prefixes).enumerate() {
                let (rows, _) = forward_from(shard, prefix.clone(), chunk);
                outputs[w].set_head_rows(b, h, &rows);
            }
            for (w, prefix) in ex.prefixes.into_iter().enumerate() {
                prefixes[w].push(prefix);
            }
            for (w, (summary, total)) in ex.summaries.into_iter().enumerate() {
                summaries[w].push(summary);
                totals[w].block_mut(b, h)[0] = total;
            }
        }
    }
    let mut prefixes: Vec<MlstmState> = prefixes
        .iter()
        .map(|heads| assemble_state(&s, heads))
        .collect();
    let final_state = prefixes.pop().expect("ranks + 1 prefixes");
    Ok(MlstmLasp2 {
        summaries: summaries
            .iter()
            .zip(totals)
            .map(|(heads, log_forget_total)| ShardSummary {
                state: assemble_state(&s, heads),
                log_forget_total,
            })
            .collect(),
        prefixes,
        h: Tensor::concat_time(&outputs),
        final_state,
    })
}

/// One fold step, per head: `m = max(F_w + m_P, m_w)`,
/// `C = e^{F_w + m_P - m} C_P + e^{m_w - m} C_w` (`n` likewise): the prefix decayed across the
/// shard and the shard's contribution, both rescaled to the larger stabiliser. The states are
/// checked against `s`.
pub fn fold(
    s: Shape,
    prefix: &MlstmState,
    summary: &ShardSummary,
) -> Result<MlstmState, ReferenceError> {
    check_fold_arguments(&s, prefix, summary)?;
    let heads: Vec<HeadState> = (0..s.b * s.h)
        .map(|index| {
            let (b, h) = (index / s.h, index % s.h);
            let mut p = head_state(prefix, b, h);
            let w = head_state(&summary.state, b, h);
            let total = summary.log_forget_total.block(b, h)[0];
            p.combine(p.m + total, &w, w.m);
            p
        })
        .collect();
    Ok(assemble_state(&s, &heads))
}

/// Checks [`fold`]'s states and the summary's `F_w` against `s`.
fn check_fold_arguments(
    s: &Shape,
    prefix: &MlstmState,
    summary: &ShardSummary,
) -> Result<(), ReferenceError> {
    check_state("prefix", s, prefix)?;
    check_state("summary", s, &summary.state)?;
    check_shape(
        "log_forget_total",
        "[B, H]",
        vec![s.b, s.h],
        &summary.log_forget_total,
    )?;
    check_finite("log_forget_total", &summary.log_forget_total)
}

/// The transpose of [`fold`] at the same `prefix` and `summary`: from the cotangent `d_folded` of
/// its result, those of the prefix and of the summary (module doc, "LASP-2 backward"). The states
/// are checked against `s`.
pub fn fold_backward(
    s: Shape,
    prefix: &MlstmState,
    summary: &ShardSummary,
    d_folded: &MlstmState,
) -> Result<FoldCotangents, ReferenceError> {
    check_fold_arguments(&s, prefix, summary)?;
    check_state("d_folded", &s, d_folded)?;
    let mut d_prefixes = Vec::with_capacity(s.b * s.h);
    let mut d_states = Vec::with_capacity(s.b * s.h);
    let mut d_totals = Tensor::zeros(&[s.b, s.h]);
    for index in 0..s.b * s.h {
        let (b, h) = (index / s.h, index % s.h);
        let (d_prefix, d_summary, d_total) = fold_head_backward(
            &head_state(prefix, b, h),
            &head_state(&summary.state, b, h),
            summary.log_forget_total.block(b, h)[0],
            &head_state(d_folded, b, h),
        );
        d_prefixes.push(d_prefix);
        d_states.push(d_summary);
        d_totals.block_mut(b, h)[0] = d_total;
    }
    Ok(FoldCotangents {
        d_prefix: assemble_state(&s, &d_prefixes),
        d_summary: ShardSummary {
            state: assemble_state(&s, &d_states),
            log_forget_total: d_totals,
        },
    })
}

/// One head's transposed fold step: the cotangents of the prefix, of the summary's state and of
/// its total log forget gate `F`. The prefix's log-weight `m_P + F` carries both `m_P` and `F`,
/// so they get the same gradient.
fn fold_head_backward(
    prefix: &HeadState,
    summary: &HeadState,
    total: f64,
    d_folded: &HeadState,
) -> (HeadState, HeadState, f64) {
    let (d_prefix, d_summary) =
        prefix.combine_backward(prefix.m + total, summary, summary.m, d_folded);
    let d_total = d_prefix.m;
    (d_prefix, d_summary, d_total)
}

/// LASP-2 backward on `shard_lengths.len()` ranks (as [`lasp2_forward`]; module doc, "LASP-2
/// backward"): the gradients of [`MlstmForward::loss`](super::MlstmForward::loss), with the
/// exchanged `E_w` and the folded `D_w`.
pub fn lasp2_backward(
    inputs: &MlstmInputs,
    shard_lengths: &[usize],
    chunk: usize,
    cot: &MlstmCotangents,
) -> Result<MlstmLasp2Backward, ReferenceError> {
    check_chunk("chunk", chunk)?;
    check_shard_lengths(shard_lengths, inputs.shape.t)?;
    let s = inputs.shape;
    let ranks = shard_lengths.len();
    let mut exchanged = vec![Vec::with_capacity(s.b * s.h); ranks];
    let mut exits = vec![Vec::with_capacity(s.b * s.h); ranks];
    let grads = backward_heads(inputs, cot, |head, initial, d_h, d_final| {
        let head_backward =
            HeadLasp2Backward::run(head, initial, shard_lengths, chunk, d_h, d_final);
        for (w, rank) in head_backward.ranks.into_iter().enumerate() {
            exchanged[w].push(rank.output_state_grad);
            exits[w].push(rank.exit_state_grad);
        }
        head_backward.grads
    })?;
    let assemble = |heads: Vec<Vec<HeadState>>| -> Vec<MlstmState> {
        heads.iter().map(|h| assemble_state(&s, h)).collect()
    };
    Ok(MlstmLasp2Backward {
        output_state_grads: assemble(exchanged),
        exit_state_grads: assemble(exits),
        grads,
    })
}

/// One rank's part of one head's backward: `E_w` and `D_w`.
struct RankBackward {
    output_state_grad: HeadState,
    exit_state_grad: HeadState,
}

/// One head's LASP-2 backward: every rank's `E_w`, `D_w` and the head's gradients.
struct HeadLasp2Backward {
    ranks: Vec<RankBackward>,
    grads: HeadGrads,
}

impl HeadLasp2Backward {
    /// The whole decomposition on one head: the forward's exchange, each rank's output pass from
    /// `P_w`, the exchange of `E_w`, the suffix fold, and each rank's summary pass with the
    /// summary's cotangent.
    fn run(
        head: &MlstmHead,
        initial: HeadState,
        shard_lengths: &[usize],
        chunk: usize,
        d_h: &[f64],
        d_final: HeadState,
    ) -> HeadLasp2Backward {
        let (dk, dv) = (head.dk, head.dv);
        let Exchanged {
            shards,
            summaries,
            prefixes,
        } = Exchanged::new(head, initial, shard_lengths, chunk);
        // Each rank's outputs, from its prefix; the exit cotangent comes later, through the
        // summary, so here it is zero.
        let outputs: Vec<HeadGrads> = shards
            .iter()
            .zip(&prefixes)
            .map(|((start, shard), prefix)| {
                let rows = &d_h[start * dv..(start + shard.t) * dv];
                backward_from(
                    shard,
                    prefix.clone(),
                    chunk,
                    Some(rows),
                    HeadState::zero(dk, dv),
                    MlstmGradient::Full,
                )
            })
            .collect();
        // The suffix fold, descending: `d` is `D_w` on entry to step w and `D_{w-1}` after it.
        let mut d = d_final;
        let mut exit_grads = vec![HeadState::zero(dk, dv); shards.len()];
        let mut summary_grads = Vec::with_capacity(shards.len());
        for w in (0..shards.len()).rev() {
            let (summary, total) = &summaries[w];
            let (mut d_prefix, d_summary, d_total) =
                fold_head_backward(&prefixes[w], summary, *total, &d);
            let e = &outputs[w].d_state;
            axpy(&mut d_prefix.c, 1.0, &e.c);
            axpy(&mut d_prefix.n, 1.0, &e.n);
            d_prefix.m += e.m;
            exit_grads[w] = std::mem::replace(&mut d, d_prefix);
            summary_grads.push((d_summary, d_total));
        }
        summary_grads.reverse();
        // `d` is now the gradient of the initial state. Each rank's tokens: its output pass, its
        // summary's backward from the empty state, and `dF_w` on every log forget gate.
        let mut grads = HeadGrads::zeros(head, d);
        for ((start, shard), (output, (d_summary, d_total))) in
            shards.iter().zip(outputs.iter().zip(summary_grads))
        {
            let empty = HeadState::empty(dk, dv);
            let summary = backward_from(shard, empty, chunk, None, d_summary, MlstmGradient::Full);
            grads.add_tokens(*start, output);
            grads.add_tokens(*start, &summary);
            grads.d_log_forget[*start..start + shard.t]
                .iter_mut()
                .for_each(|x| *x += d_total);
        }
        let ranks = outputs
            .into_iter()
            .zip(exit_grads)
            .map(|(output, exit_state_grad)| RankBackward {
                output_state_grad: output.d_state,
                exit_state_grad,
            })
            .collect();
        HeadLasp2Backward { ranks, grads }
    }
}

/// What every rank knows of one head after the forward's all-gather: the shards (with the index
/// of their first token), their summaries `(state, F_w)` and the prefixes `P_0 ..= P_W`.
pub(super) struct Exchanged {
    pub(super) shards: Vec<(usize, MlstmHead)>,
    pub(super) summaries: Vec<(HeadState, f64)>,
    pub(super) prefixes: Vec<HeadState>,
}

impl Exchanged {
    pub(super) fn new(
        head: &MlstmHead,
        initial: HeadState,
        shard_lengths: &[usize],
        chunk: usize,
    ) -> Self {
        let mut start = 0;
        let shards: Vec<(usize, MlstmHead)> = shard_lengths
            .iter()
            .map(|&len| {
                start += len;
                (start - len, head.tokens(start - len, len))
            })
            .collect();
        let summaries: Vec<(HeadState, f64)> = shards
            .iter()
            .map(|(_, shard)| summarise(shard, chunk))
            .collect();
        let mut prefixes = vec![initial];
        for (summary, total) in &summaries {
            let mut next = prefixes[prefixes.len() - 1].clone();
            next.combine(next.m + total, summary, summary.m);
            prefixes.push(next);
        }
        Exchanged {
            shards,
            summaries,
            prefixes,
        }
    }
}

/// A shard's summary, chunk by chunk from the empty state, and its total log forget gate
/// (the sum of the chunk totals).
fn summarise(shard: &MlstmHead, chunk: usize) -> (HeadState, f64) {
    let mut summary = HeadState::empty(shard.dk, shard.dv);
    let total = shard
        .chunks(chunk)
        .map(|(c0, len)| advance(shard, &mut summary, c0, len))
        .sum();
    (summary, total)
}
