//! The LASP-2 decomposition of the mLSTM over W simulated ranks (module doc, "LASP-2").

use super::super::error::ReferenceError;
use super::super::inputs::Shape;
use super::super::tensor::Tensor;
use super::super::validate::{check_chunk, check_finite, check_shape, check_shard_lengths};
use super::chunkwise::{advance, forward_from};
use super::head::{assemble_state, head_state, initial_head_state, HeadState, MlstmHead};
use super::inputs::{check_state, MlstmInputs, MlstmState};

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
            let mut prefix = initial_head_state(inputs, b, h);
            let mut start = 0;
            for (w, &len) in shard_lengths.iter().enumerate() {
                let shard = head.tokens(start, len);
                let (summary, total) = summarise(&shard, chunk);
                let (rows, _) = forward_from(&shard, prefix.clone(), chunk);
                outputs[w].set_head_rows(b, h, &rows);
                prefixes[w].push(prefix.clone());
                prefix.combine(prefix.m + total, &summary, summary.m);
                summaries[w].push(summary);
                totals[w].block_mut(b, h)[0] = total;
                start += len;
            }
            prefixes[ranks].push(prefix);
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
    check_state("prefix", &s, prefix)?;
    check_state("summary", &s, &summary.state)?;
    check_shape(
        "log_forget_total",
        "[B, H]",
        vec![s.b, s.h],
        &summary.log_forget_total,
    )?;
    check_finite("log_forget_total", &summary.log_forget_total)?;
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
