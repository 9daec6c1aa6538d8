//! Final states of packed documents for GLA ([`GlaArgs::document_ht`](super::GlaArgs)): fla's
//! `output_final_state` with `cu_seqlens`, one state per document, on one GPU and on LASP-2
//! shards, written by the forward itself.
//!
//! The state after document n's last token is the state entering the chunk of 64 tokens that
//! holds that token, decayed to it row by row, plus the document's tokens of that chunk. The
//! forward's packed output loop, in instances of their own ([`EntryOutputs`]), stores that
//! entering state into n's slot
//! where n began before the chunk (a table per chunk names the document,
//! `lasp_document_entry_slots`); on LASP-2 that loop runs from the prefix of every earlier PE, so
//! a document that began on an earlier PE needs no exchange of its own. Then one CTA per
//! document, head and 64 columns of Dv adds the chunk's tokens on the CUDA cores, in fp32, each
//! weight one exponential of a sum of log-decays inside the document
//! (`kernels/cuda/gla/document_states.cu`). A document that does not end in the shard gets zeros,
//! so every PE writes the whole `[B, N, H, Dk, Dv]` and their sum holds every document's final
//! state. The grids are fixed by the capacity of `cu_seqlens`, so a captured CUDA graph replays
//! with other documents written into the same buffer. The gradient with respect to these states
//! is not built (`kernels/docs/packed.md`, "Per-document states").

use super::plan::output_smem_bytes;
use crate::error::Result;
use crate::kernel::{width_index, Kernel};
use crate::ops::documents::final_states::documents_of_states;
use crate::ops::documents::{document_states_len, Documents};
use crate::ops::scalar_decay::{ForwardShape, TensorChecks};
use crate::ops::DeviceMut;
use crate::runtime::Runtime;

/// The layout of [`GlaArgs::document_ht`](super::GlaArgs), as the checks name it.
const LAYOUT: &str = "[B, N, H, Dk, Dv] (N = cu_seqlens.len() - 1)";

/// Checks a call's per-document final states against its documents and shape; returns their
/// byte range for the overlap checks.
pub(super) fn check_document_ht(
    checks: &TensorChecks<'_>,
    op: &str,
    shape: &ForwardShape,
    documents: Option<&Documents<'_>>,
    ht: &DeviceMut<'_, f32>,
) -> Result<(u64, u64)> {
    let documents = documents_of_states(op, "document_ht", "ht", documents)?;
    let want = document_states_len(shape, documents);
    checks.tensor("document_ht", LAYOUT, (ht.len(), want), ht.addr(), 8)?;
    Ok(ht.byte_range())
}

/// GLA's packed output kernels that also store the states entering the documents' last chunks
/// (instances of their own, so that the packed loop without final states stays as it was); the
/// forward adds the shared [`crate::ops::documents::final_states::DocumentTails`] for the rest.
pub(super) struct EntryOutputs {
    /// By [Dv][Dk].
    kernels: [[Kernel; 2]; 2],
}

impl EntryOutputs {
    /// `names`: the forward's output kernels with the stores, by Dv (rows by Dk).
    pub(super) fn new(runtime: &Runtime, names: [[&'static str; 2]; 2]) -> Result<Self> {
        let module = runtime.module();
        let kernels = [
            module.kernels_per_width(names[0])?,
            module.kernels_per_width(names[1])?,
        ];
        for (j, dv) in [64, 128].into_iter().enumerate() {
            for (i, dk) in [64, 128].into_iter().enumerate() {
                kernels[j][i].set_max_dynamic_shared_bytes(output_smem_bytes(dk, dv))?;
            }
        }
        Ok(EntryOutputs { kernels })
    }

    /// The output kernel for `shape`.
    pub(super) fn get(&self, shape: &ForwardShape) -> &Kernel {
        &self.kernels[width_index(shape.dv)][width_index(shape.dk)]
    }
}
