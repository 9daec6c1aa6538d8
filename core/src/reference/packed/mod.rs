//! Packed documents (fla's `cu_seqlens`): pretraining concatenates documents into one sequence,
//! and the state must not carry from one document into the next.
//!
//! `cu_seqlens = [0, l_1, l_1 + l_2, ..., T]` lists the document starts in the packed sequence
//! (strictly increasing, first 0, last T); document n owns tokens `[cu_n, cu_{n+1})`. Every batch
//! row is packed with the same documents (fla packs with B = 1; B stays general here).
//!
//! Within a document the recurrence is the unpacked one; at its first token the state entering is
//! the document's own initial state (zero if none), never the previous document's end state. As in
//! fla, initial and final states are one per document, laid out `[B, N, H, Dk, Dv]`
//! (with B = 1 this is fla's `[N, H, Dk, Dv]`).
//!
//! * [`PackedInputs`]: the packed tokens, `cu_seqlens` and the per-document initial states.
//! * [`recurrent_forward`], [`recurrent_backward`]: the token-by-token reference with resets.
//! * [`crate::reference::lasp2::packed_forward`] and [`crate::reference::lasp2::packed_backward`]:
//!   its LASP-2 decomposition.

mod recurrent;

pub use recurrent::{recurrent_backward, recurrent_forward};

use std::ops::Range;

use super::error::ReferenceError;
use super::inputs::{Family, Inputs};
use super::tensor::Tensor;
use super::validate::{check_finite, check_shape};

/// A packed sequence of documents: the tokens of all of them, where they start, and their initial
/// states.
#[derive(Clone, Debug, PartialEq)]
pub struct PackedInputs {
    /// q, k, v, g and the scale of the whole packed sequence. Its `h0` must be `None`: initial
    /// states are per document, in [`PackedInputs::h0`].
    pub inputs: Inputs,
    /// Document start offsets, fla's convention: `[0, l_1, l_1 + l_2, ..., T]`.
    pub cu_seqlens: Vec<usize>,
    /// One initial state per document, `[B, N, H, Dk, Dv]`; `None` means zero for every document.
    pub h0: Option<Tensor>,
}

impl PackedInputs {
    /// The number of documents N.
    pub fn documents(&self) -> usize {
        self.cu_seqlens.len().saturating_sub(1)
    }

    /// The token range of document n.
    ///
    /// # Panics
    /// If `n >= N`.
    pub fn document(&self, n: usize) -> Range<usize> {
        self.cu_seqlens[n]..self.cu_seqlens[n + 1]
    }

    /// The layout of per-document states (initial, final and their gradients):
    /// `[B, N, H, Dk, Dv]`.
    pub fn document_states_shape(&self) -> Vec<usize> {
        let s = self.inputs.shape;
        vec![s.b, self.documents(), s.h, s.dk, s.dv]
    }

    /// Checks the tokens as `family` ([`Inputs::validate`]), that `inputs.h0` is unset, that
    /// `cu_seqlens` is a valid list of document starts for T tokens, and the shape and
    /// finiteness of the per-document initial states.
    pub fn validate(&self, family: Family) -> Result<(), ReferenceError> {
        self.inputs.validate(family)?;
        if self.inputs.h0.is_some() {
            return Err(ReferenceError::InitialStateNotPerDocument);
        }
        check_cu_seqlens(&self.cu_seqlens, self.inputs.shape.t)?;
        if let Some(h0) = &self.h0 {
            check_shape("h0", "[B, N, H, Dk, Dv]", self.document_states_shape(), h0)?;
            check_finite("h0", h0)?;
        }
        Ok(())
    }
}

/// Checks fla's `cu_seqlens` convention for a packed sequence of `t` tokens: at least one
/// document, first entry 0, last entry T, strictly increasing (no empty document).
pub(crate) fn check_cu_seqlens(cu_seqlens: &[usize], t: usize) -> Result<(), ReferenceError> {
    let (&first, &last) = match (cu_seqlens.first(), cu_seqlens.last()) {
        (Some(first), Some(last)) if cu_seqlens.len() >= 2 => (first, last),
        _ => {
            return Err(ReferenceError::CuSeqlensTooShort {
                len: cu_seqlens.len(),
            })
        }
    };
    if first != 0 {
        return Err(ReferenceError::CuSeqlensFirst { first });
    }
    if let Some(index) = cu_seqlens.windows(2).position(|w| w[1] <= w[0]) {
        return Err(ReferenceError::CuSeqlensNotIncreasing {
            index: index + 1,
            previous: cu_seqlens[index],
            value: cu_seqlens[index + 1],
        });
    }
    if last != t {
        return Err(ReferenceError::CuSeqlensLast { last, t });
    }
    Ok(())
}

/// The `[Dk, Dv]` block of document n, batch row b, head h of a per-document state tensor
/// `[B, N, H, Dk, Dv]`.
pub(crate) fn document_block(states: &Tensor, b: usize, n: usize, h: usize) -> &[f64] {
    let (docs, heads) = (states.shape()[1], states.shape()[2]);
    let size = states.shape()[3] * states.shape()[4];
    let start = ((b * docs + n) * heads + h) * size;
    &states.data()[start..start + size]
}

/// [`document_block`], mutably.
pub(crate) fn document_block_mut(states: &mut Tensor, b: usize, n: usize, h: usize) -> &mut [f64] {
    let (docs, heads) = (states.shape()[1], states.shape()[2]);
    let size = states.shape()[3] * states.shape()[4];
    let start = ((b * docs + n) * heads + h) * size;
    &mut states.data_mut()[start..start + size]
}

/// Document n's state `[B, H, Dk, Dv]` out of a per-document tensor `[B, N, H, Dk, Dv]`.
pub(crate) fn document_state(states: &Tensor, n: usize) -> Tensor {
    let s = states.shape();
    let mut out = Tensor::zeros(&[s[0], s[2], s[3], s[4]]);
    for b in 0..s[0] {
        for h in 0..s[2] {
            out.block_mut(b, h)
                .copy_from_slice(document_block(states, b, n, h));
        }
    }
    out
}

/// Writes document n's state `[B, H, Dk, Dv]` into a per-document tensor `[B, N, H, Dk, Dv]`.
pub(crate) fn set_document_state(states: &mut Tensor, n: usize, state: &Tensor) {
    let s = states.shape().to_vec();
    for b in 0..s[0] {
        for h in 0..s[2] {
            document_block_mut(states, b, n, h).copy_from_slice(state.block(b, h));
        }
    }
}

/// A run of a shard's tokens inside one document: a shard splits at its document starts.
pub(crate) struct Run {
    /// The tokens, in the packed sequence.
    pub(crate) range: Range<usize>,
    /// The document holding them.
    pub(crate) document: usize,
    /// Whether the run opens with the document's first token (otherwise it continues the document
    /// from earlier ranks).
    pub(crate) starts_document: bool,
    /// Whether the run closes with the document's last token (otherwise it continues into later
    /// ranks).
    pub(crate) ends_document: bool,
}

/// The runs of every shard of the given lengths (summing to T) of a sequence packed at
/// `cu_seqlens`: one list per shard, each in token order.
pub(crate) fn shard_runs(cu_seqlens: &[usize], shard_lengths: &[usize]) -> Vec<Vec<Run>> {
    shard_ranges(shard_lengths)
        .into_iter()
        .map(|tokens| runs(cu_seqlens, tokens))
        .collect()
}

/// The runs of the shard owning `tokens` of a sequence packed at `cu_seqlens`, in order.
fn runs(cu_seqlens: &[usize], tokens: Range<usize>) -> Vec<Run> {
    // The document holding the shard's first token: the last start at or before it.
    let first = cu_seqlens.partition_point(|&c| c <= tokens.start) - 1;
    let mut runs = Vec::new();
    for (n, doc) in cu_seqlens.windows(2).enumerate().skip(first) {
        let doc = doc[0]..doc[1];
        if doc.start >= tokens.end {
            break;
        }
        let range = doc.start.max(tokens.start)..doc.end.min(tokens.end);
        runs.push(Run {
            starts_document: range.start == doc.start,
            ends_document: range.end == doc.end,
            range,
            document: n,
        });
    }
    runs
}

/// The token ranges of shards of the given lengths.
pub(crate) fn shard_ranges(lengths: &[usize]) -> Vec<Range<usize>> {
    let mut start = 0;
    lengths
        .iter()
        .map(|&len| {
            start += len;
            start - len..start
        })
        .collect()
}
