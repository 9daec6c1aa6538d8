//! Packed documents (fla's `cu_seqlens`) for the mLSTM: each document runs from its own initial
//! state `(C_0, n_0, m_0)` (mlstm_kernels' zero state, `m_0 = 0`, where none is given), and
//! nothing flows across a document start.
//!
//! LASP-2 over packed documents has the runs of [`crate::reference::lasp2::packed_forward`] with
//! the stabilised summary. A shard holding a document start forgets the state entering it
//! ([`MlstmCarry::Forget`]: `F_w = -inf`, the prefix rescaled by `e^{-inf} = 0`), and its summary
//! is the end state of its last run, from that document's initial state; a shard inside one
//! document has the unpacked summary, its state from the empty state (`m = -inf`) and its total
//! log forget gate `F_w`, folded by [`super::fold`]. Only a run that continues a document from
//! earlier ranks starts from the prefix `P_w`. The first rank opens with document 0, so the prefix
//! starts at `P_1`.

use std::ops::Range;

use super::super::error::ReferenceError;
use super::super::inputs::Shape;
use super::super::packed::{check_cu_seqlens, runs, shard_ranges};
use super::super::tensor::Tensor;
use super::super::validate::{check_chunk, check_shard_lengths};
use super::inputs::check_state;
use super::{chunkwise_forward, fold, lasp2_forward, recurrent_forward, ShardSummary};
use super::{MlstmInputs, MlstmState};

/// A packed sequence of documents for the mLSTM.
#[derive(Clone, Debug, PartialEq)]
pub struct MlstmPackedInputs {
    /// The tokens of all documents; its `initial_state` must be `None` (they are per document).
    pub inputs: MlstmInputs,
    /// Document start offsets, fla's convention: `[0, l_1, l_1 + l_2, ..., T]`.
    pub cu_seqlens: Vec<usize>,
    /// One initial state per document (each `[B, H, ...]`); `None`: every document from the zero
    /// state.
    pub initial_states: Option<Vec<MlstmState>>,
}

impl MlstmPackedInputs {
    /// The number of documents N.
    pub fn documents(&self) -> usize {
        self.cu_seqlens.len().saturating_sub(1)
    }

    /// Checks the tokens, that `inputs.initial_state` is unset, `cu_seqlens` and one valid
    /// initial state per document where given.
    pub fn validate(&self) -> Result<(), ReferenceError> {
        self.inputs.validate()?;
        if self.inputs.initial_state.is_some() {
            return Err(ReferenceError::InitialStateNotPerDocument);
        }
        check_cu_seqlens(&self.cu_seqlens, self.inputs.shape.t)?;
        if let Some(states) = &self.initial_states {
            if states.len() != self.documents() {
                return Err(ReferenceError::DocumentStateCount {
                    got: states.len(),
                    documents: self.documents(),
                });
            }
            for state in states {
                check_state("initial_states", &self.inputs.shape, state)?;
            }
        }
        Ok(())
    }

    /// Tokens `range` as unpacked inputs entered from `start`.
    fn tokens(&self, range: Range<usize>, start: Option<MlstmState>) -> MlstmInputs {
        let (first, len) = (range.start, range.len());
        let x = &self.inputs;
        MlstmInputs {
            shape: Shape { t: len, ..x.shape },
            q: x.q.slice_time(first, len),
            k: x.k.slice_time(first, len),
            v: x.v.slice_time(first, len),
            input_gate: x.input_gate.slice_time(first, len),
            forget_gate: x.forget_gate.slice_time(first, len),
            initial_state: start,
            scale: x.scale,
            eps: x.eps,
        }
    }

    /// Document n's initial state (`None`: the zero state).
    fn document_start(&self, n: usize) -> Option<MlstmState> {
        self.initial_states.as_ref().map(|states| states[n].clone())
    }
}

/// The packed forward: the hidden states and every document's final state.
#[derive(Clone, Debug, PartialEq)]
pub struct MlstmPackedForward {
    /// `[B, T, H, Dv]`.
    pub h: Tensor,
    /// One per document: its state after its last token.
    pub final_states: Vec<MlstmState>,
}

/// The stabilised recurrence over packed documents: each document on its own, from its initial
/// state.
pub fn packed_recurrent_forward(
    packed: &MlstmPackedInputs,
) -> Result<MlstmPackedForward, ReferenceError> {
    packed.validate()?;
    let mut h = Vec::with_capacity(packed.documents());
    let mut final_states = Vec::with_capacity(packed.documents());
    for (n, doc) in packed.cu_seqlens.windows(2).enumerate() {
        let forward = recurrent_forward(&packed.tokens(doc[0]..doc[1], packed.document_start(n)))?;
        h.push(forward.h);
        final_states.push(forward.final_state);
    }
    Ok(MlstmPackedForward {
        h: Tensor::concat_time(&h),
        final_states,
    })
}

/// How the state entering a shard reaches the shard's end.
#[derive(Clone, Debug, PartialEq)]
pub enum MlstmCarry {
    /// No document starts in the shard: the prefix decays by `F_w = sum log sigmoid(f_t)`,
    /// `[B, H]`.
    LogForget(Tensor),
    /// A document starts in the shard: the entering state is forgotten (`F_w = -inf`).
    Forget,
}

/// What rank w exchanges in the packed forward.
#[derive(Clone, Debug, PartialEq)]
pub struct PackedMlstmSummary {
    /// With [`MlstmCarry::Forget`], the end state of the shard's last run; otherwise the state the
    /// shard reaches from the empty state.
    pub state: MlstmState,
    pub carry: MlstmCarry,
}

/// The packed LASP-2 forward over W ranks.
#[derive(Clone, Debug, PartialEq)]
pub struct MlstmPackedLasp2 {
    /// What rank w exchanges; W entries.
    pub summaries: Vec<PackedMlstmSummary>,
    /// `P_1` through `P_W`: the packed sequence's state after the token before rank w.
    pub prefixes: Vec<MlstmState>,
    /// `[B, T, H, Dv]`, the ranks' outputs concatenated.
    pub h: Tensor,
    /// One per document, from the rank holding its last token.
    pub final_states: Vec<MlstmState>,
}

/// Packed LASP-2 forward over ranks with the given shard lengths (summing to T, each >= 1), every
/// run by the chunkwise form with chunk size `chunk`.
pub fn packed_lasp2_forward(
    packed: &MlstmPackedInputs,
    shard_lengths: &[usize],
    chunk: usize,
) -> Result<MlstmPackedLasp2, ReferenceError> {
    packed.validate()?;
    check_chunk("chunk", chunk)?;
    check_shard_lengths(shard_lengths, packed.inputs.shape.t)?;
    let s = packed.inputs.shape;
    let shards: Vec<_> = shard_ranges(shard_lengths)
        .into_iter()
        .map(|tokens| runs(&packed.cu_seqlens, tokens))
        .collect();
    let mut summaries = Vec::with_capacity(shards.len());
    for shard in &shards {
        let last = shard.last().expect("a shard holds at least one token");
        summaries.push(if last.starts_document {
            // Every run after a shard's first starts its document: this one holds a start.
            let run = packed.tokens(last.range.clone(), packed.document_start(last.document));
            PackedMlstmSummary {
                state: chunkwise_forward(&run, chunk)?.final_state,
                carry: MlstmCarry::Forget,
            }
        } else {
            let run = packed.tokens(last.range.clone(), None);
            let ShardSummary {
                state,
                log_forget_total,
            } = lasp2_forward(&run, &[last.range.len()], chunk)?
                .summaries
                .remove(0);
            PackedMlstmSummary {
                state,
                carry: MlstmCarry::LogForget(log_forget_total),
            }
        });
    }
    // P_1 from rank 0, which opens with document 0's start; then the fold.
    let mut prefixes = vec![summaries[0].state.clone()];
    for summary in summaries.iter().skip(1) {
        let p = prefixes.last().expect("P_1 is in");
        prefixes.push(match &summary.carry {
            MlstmCarry::Forget => summary.state.clone(),
            MlstmCarry::LogForget(total) => fold(
                s,
                p,
                &ShardSummary {
                    state: summary.state.clone(),
                    log_forget_total: total.clone(),
                },
            )?,
        });
    }
    let mut h = Vec::new();
    let mut final_states = vec![None; packed.documents()];
    for (w, shard) in shards.iter().enumerate() {
        for run in shard {
            let start = if run.starts_document {
                packed.document_start(run.document)
            } else {
                Some(prefixes[w - 1].clone())
            };
            let forward = chunkwise_forward(&packed.tokens(run.range.clone(), start), chunk)?;
            h.push(forward.h);
            if run.ends_document {
                final_states[run.document] = Some(forward.final_state);
            }
        }
    }
    Ok(MlstmPackedLasp2 {
        summaries,
        prefixes,
        h: Tensor::concat_time(&h),
        final_states: final_states
            .into_iter()
            .map(|s| s.expect("every document ends on some rank"))
            .collect(),
    })
}
