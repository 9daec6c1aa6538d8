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
//!
//! The backward ([`packed_lasp2_backward`], the full gradient) folds the state gradients down the
//! ranks: `D_{W-1} = 0`; `D_{w-1}` is the gradient of rank w's first run with respect to the state
//! entering it when that run continues a document (its outputs, and its document's final-state
//! cotangent where it ends it), plus, where rank w forgets nothing, [`super::fold_backward`]'s
//! prefix cotangent of `D_w`; zero when rank w opens with a document start. Every run's backward
//! then starts from the state entering it, with its document's final-state cotangent at its exit
//! where it ends the document and `D_w` where it continues into later ranks.

use std::ops::Range;

use super::super::error::ReferenceError;
use super::super::inputs::Shape;
use super::super::packed::{check_cu_seqlens, shard_runs, Run};
use super::super::tensor::Tensor;
use super::super::validate::{check_chunk, check_shape, check_shard_lengths};
use super::inputs::check_state;
use super::{chunkwise_forward, fold, fold_backward, lasp2_forward, recurrent_backward};
use super::{normaliser_conditioning, recurrent_forward, ShardSummary};
use super::{MlstmCotangents, MlstmGradient, MlstmGrads, MlstmInputs, MlstmState};

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

/// [`super::normaliser_conditioning`] over packed documents: each document on its own, from its
/// initial state.
pub fn packed_normaliser_conditioning(
    packed: &MlstmPackedInputs,
) -> Result<Tensor, ReferenceError> {
    packed.validate()?;
    let parts = packed
        .cu_seqlens
        .windows(2)
        .enumerate()
        .map(|(n, doc)| {
            normaliser_conditioning(&packed.tokens(doc[0]..doc[1], packed.document_start(n)))
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Tensor::concat_time(&parts))
}

/// The gradients of a packed sequence, each document by its own reverse sweep.
#[derive(Clone, Debug, PartialEq)]
pub struct MlstmPackedGrads {
    /// The token gradients; its `d_initial_state` is unused (zero): see `d_initial_states`.
    pub grads: MlstmGrads,
    /// One per document: the gradient with respect to its initial state.
    pub d_initial_states: Vec<MlstmState>,
    /// The scale the gate gradients' sums cancel at: the root of the documents' squared
    /// [`MlstmGrads::gate_grad_scale`]s (each document's suffix sums run over it alone).
    pub gate_scale: f64,
}

/// The backward of [`packed_recurrent_forward`] under `gradient`, each document's reverse sweep
/// on its own: `L = sum(h * d_h) + sum_n <S_n, dS_n>` with `d_h [B, T, H, Dv]` and one
/// final-state cotangent per document (`None`: zero).
pub fn packed_recurrent_backward(
    packed: &MlstmPackedInputs,
    d_h: &Tensor,
    d_final_states: Option<&[MlstmState]>,
    gradient: MlstmGradient,
) -> Result<MlstmPackedGrads, ReferenceError> {
    packed.validate()?;
    check_shape("d_h", "[B, T, H, Dv]", packed.inputs.shape.v(), d_h)?;
    if let Some(states) = d_final_states {
        if states.len() != packed.documents() {
            return Err(ReferenceError::DocumentStateCount {
                got: states.len(),
                documents: packed.documents(),
            });
        }
    }
    let mut parts = Vec::with_capacity(packed.documents());
    let mut d_initial_states = Vec::with_capacity(packed.documents());
    let mut gate_sum_sq = 0.0;
    for (n, doc) in packed.cu_seqlens.windows(2).enumerate() {
        let tokens = packed.tokens(doc[0]..doc[1], packed.document_start(n));
        let cot = MlstmCotangents {
            d_h: d_h.slice_time(doc[0], doc[1] - doc[0]),
            d_final_state: d_final_states.map(|states| states[n].clone()),
        };
        let grads = recurrent_backward(&tokens, &cot, gradient)?;
        gate_sum_sq += grads.gate_grad_scale(&tokens).powi(2);
        d_initial_states.push(grads.d_initial_state.clone());
        parts.push(grads);
    }
    Ok(MlstmPackedGrads {
        grads: concat_grads(&parts, d_initial_states[0].clone()),
        d_initial_states,
        gate_scale: gate_sum_sq.sqrt(),
    })
}

/// The token gradients of consecutive runs, concatenated in time, with `d_initial_state`.
fn concat_grads(parts: &[MlstmGrads], d_initial_state: MlstmState) -> MlstmGrads {
    let cat = |f: fn(&MlstmGrads) -> &Tensor| {
        Tensor::concat_time(&parts.iter().map(|g| f(g).clone()).collect::<Vec<_>>())
    };
    MlstmGrads {
        dq: cat(|g| &g.dq),
        dk: cat(|g| &g.dk),
        dv: cat(|g| &g.dv),
        d_input_gate: cat(|g| &g.d_input_gate),
        d_forget_gate: cat(|g| &g.d_forget_gate),
        d_initial_state,
    }
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
    let shards = shard_runs(&packed.cu_seqlens, shard_lengths);
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

/// The packed LASP-2 backward: the gradients of every token and of every document's initial
/// state.
#[derive(Clone, Debug, PartialEq)]
pub struct MlstmPackedBackward {
    /// `D_w`, the gradient with respect to the state leaving rank w toward later ranks; W
    /// entries, the last zero.
    pub exit_state_grads: Vec<MlstmState>,
    /// The token gradients; its `d_initial_state` is unused (zero): see `d_initial_states`.
    pub grads: MlstmGrads,
    /// One per document: the gradient with respect to its initial state (its zero state where
    /// none was given).
    pub d_initial_states: Vec<MlstmState>,
}

/// Packed LASP-2 backward (the full gradient) of `L = sum(h * d_h) + sum_n <S_n, dS_n>` with
/// `d_h [B, T, H, Dv]` and one final-state cotangent per document (`None`: zero).
pub fn packed_lasp2_backward(
    packed: &MlstmPackedInputs,
    shard_lengths: &[usize],
    chunk: usize,
    d_h: &Tensor,
    d_final_states: Option<&[MlstmState]>,
) -> Result<MlstmPackedBackward, ReferenceError> {
    let forward = packed_lasp2_forward(packed, shard_lengths, chunk)?;
    let s = packed.inputs.shape;
    check_shape("d_h", "[B, T, H, Dv]", s.v(), d_h)?;
    if let Some(states) = d_final_states {
        if states.len() != packed.documents() {
            return Err(ReferenceError::DocumentStateCount {
                got: states.len(),
                documents: packed.documents(),
            });
        }
    }
    let zero = MlstmState {
        c: Tensor::zeros(&s.state()),
        n: Tensor::zeros(&[s.b, s.h, s.dk]),
        m: Tensor::zeros(&[s.b, s.h]),
    };
    let shards = shard_runs(&packed.cu_seqlens, shard_lengths);
    let document_grad = |n: usize| d_final_states.map(|states| states[n].clone());
    let run_backward = |run: &Run, w: usize, exit: Option<MlstmState>| {
        let start = if run.starts_document {
            packed.document_start(run.document)
        } else {
            Some(forward.prefixes[w - 1].clone())
        };
        let cot = MlstmCotangents {
            d_h: d_h.slice_time(run.range.start, run.range.len()),
            d_final_state: exit,
        };
        recurrent_backward(
            &packed.tokens(run.range.clone(), start),
            &cot,
            MlstmGradient::Full,
        )
    };
    let mut exits = vec![zero.clone(); shards.len()];
    for w in (1..shards.len()).rev() {
        let first = &shards[w][0];
        exits[w - 1] = if first.starts_document {
            zero.clone()
        } else {
            let own = if first.ends_document {
                document_grad(first.document)
            } else {
                None
            };
            let outputs = run_backward(first, w, own)?.d_initial_state;
            let summary = &forward.summaries[w];
            match &summary.carry {
                MlstmCarry::Forget => outputs,
                MlstmCarry::LogForget(total) => {
                    let through = fold_backward(
                        s,
                        &forward.prefixes[w - 1],
                        &ShardSummary {
                            state: summary.state.clone(),
                            log_forget_total: total.clone(),
                        },
                        &exits[w],
                    )?
                    .d_prefix;
                    add_states(&outputs, &through)
                }
            }
        };
    }
    let mut parts = Vec::new();
    let mut d_initial_states = vec![zero.clone(); packed.documents()];
    for (w, shard) in shards.iter().enumerate() {
        for run in shard {
            let exit = if run.ends_document {
                document_grad(run.document)
            } else {
                Some(exits[w].clone())
            };
            let grads = run_backward(run, w, exit)?;
            if run.starts_document {
                d_initial_states[run.document] = grads.d_initial_state.clone();
            }
            parts.push(grads);
        }
    }
    Ok(MlstmPackedBackward {
        exit_state_grads: exits,
        grads: concat_grads(&parts, zero),
        d_initial_states,
    })
}

/// `a + b`, element by element.
fn add_states(a: &MlstmState, b: &MlstmState) -> MlstmState {
    let add = |x: &Tensor, y: &Tensor| {
        let data = x.data().iter().zip(y.data()).map(|(x, y)| x + y).collect();
        Tensor::from_vec(x.shape(), data).expect("same shape")
    };
    MlstmState {
        c: add(&a.c, &b.c),
        n: add(&a.n, &b.n),
        m: add(&a.m, &b.m),
    }
}
