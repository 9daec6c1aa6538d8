//! Final states of packed documents for the mLSTM ([`MlstmArgs::document_final_states`](super::MlstmArgs)):
//! one stabilised state `(C, n, m)` per document, as each document alone from mlstm_kernels' zero
//! state ends, on one GPU and on LASP-2 shards, written by the forward itself.
//!
//! The state after document n's last token is the state entering the chunk of 64 tokens that
//! holds that token, rescaled to the document's own final stabiliser, plus the document's tokens
//! of that chunk. The forward's packed output loop, in instances of their own, stores that
//! entering state into n's slots where n began before the chunk (C and n into the caller's
//! tensors, m into a workspace; a table per chunk names the document,
//! `lasp_document_entry_slots`); on LASP-2 that loop runs from the prefix of every earlier PE, so a
//! document that began on an earlier PE needs no exchange of its own. Then one CTA per document,
//! head and 64 columns of Dv takes the stabiliser `m = max(m_entry + F, max_j (i_j + F_j))` over
//! the chunk's part of the document and adds its tokens on the CUDA cores, in fp32, every exponent
//! <= 0 (`kernels/cuda/mlstm/document_states.cu`). A document that does not end in the shard gets
//! zeros (C, n and m), so every PE writes the whole of each tensor and their sum holds every
//! document's final state. The grids are fixed by the capacity of `cu_seqlens`, so a captured CUDA
//! graph replays with other documents written into the same buffer. The gradient with respect to
//! these states is not built (`kernels/docs/packed.md`, "Per-document states").

use super::forward::{MlstmArgs, MlstmStateMut};
use super::MlstmParams;
use crate::error::Result;
use crate::ops::documents::final_states::{
    documents_of_states, DocumentTails, Stabilised, StatesInputs,
};
use crate::ops::documents::{document_states_len, Documents};
use crate::ops::scalar_decay::{ForwardShape, TensorChecks};
use crate::ops::WORKSPACE_PART_ALIGN;
use crate::runtime::Runtime;
use cudarc::driver::CudaStream;
use lasp_shmem_kernels::instances;
use std::sync::Arc;

/// Checks a call's per-document final states against its documents and shape; returns their
/// names and byte ranges for the overlap checks.
pub(super) fn check_document_final_states(
    checks: &TensorChecks<'_>,
    op: &str,
    shape: &ForwardShape,
    documents: Option<&Documents<'_>>,
    states: &MlstmStateMut<'_>,
) -> Result<[(&'static str, (u64, u64)); 3]> {
    let documents = documents_of_states(op, "document_final_states", "final_state", documents)?;
    let c_len = document_states_len(shape, documents);
    let per_row = shape.b * documents.cu_seqlens.len().saturating_sub(1) * shape.h; // B * N * H
    let parts = [
        (
            "document_final_states.c",
            "[B, N, H, Dk, Dv] (N = cu_seqlens.len() - 1)",
            &states.c,
            c_len,
        ),
        (
            "document_final_states.n",
            "[B, N, H, Dk]",
            &states.n,
            per_row * shape.dk,
        ),
        ("document_final_states.m", "[B, N, H]", &states.m, per_row),
    ];
    for (name, layout, x, want) in parts {
        checks.tensor(name, layout, (x.len(), want), x.addr(), 8)?;
    }
    Ok(parts.map(|(name, _, x, _)| (name, x.byte_range())))
}

/// What the forwards add for the documents' final states beyond their output kernels that store
/// the entering states (`ChunkKernels`' entry outputs): the shared [`DocumentTails`] (the entry
/// slots and the states kernel).
pub(super) struct DocumentEntries {
    tails: DocumentTails,
}

/// Where one call's output loop stores the entering states (none without the documents' final
/// states): the fields of `lasp_mlstm_params` it fills, and the workspace bytes the entering
/// stabilisers take.
#[derive(Clone, Copy, Debug)]
pub(super) struct EntryTargets(Option<Targets>);

#[derive(Clone, Copy, Debug)]
struct Targets {
    slots: u64,
    c: u64,
    n: u64,
    documents: usize,
    /// fp32 `[B, N, H]`.
    stabiliser_bytes: u64,
}

impl DocumentEntries {
    pub(super) fn new(runtime: &Runtime) -> Result<Self> {
        Ok(DocumentEntries {
            tails: DocumentTails::new(runtime, instances::MLSTM_DOCUMENT_STATES)?,
        })
    }

    /// Where `args` asks for the documents' final states, writes on `stream` the entry slots of
    /// its documents and returns where the output loop stores. The caller orders `stream` after
    /// the offsets' buffer; `args` was checked.
    pub(super) fn targets(
        &mut self,
        stream: &Arc<CudaStream>,
        args: &MlstmArgs<'_>,
        op: &str,
    ) -> Result<EntryTargets> {
        let (Some(states), Some(documents)) = (&args.document_final_states, args.documents) else {
            return Ok(EntryTargets(None));
        };
        let entries = self
            .tails
            .entries(stream, documents, args.shape.t, &states.c, op)?;
        Ok(EntryTargets(Some(Targets {
            slots: entries.slots,
            c: entries.states,
            n: states.n.addr(),
            documents: entries.documents,
            stabiliser_bytes: (states.m.len() * std::mem::size_of::<f32>()) as u64,
        })))
    }

    /// Where `args` asks for the documents' final states, enqueues the states kernel after the
    /// output loop.
    ///
    /// # Safety
    /// `args` passed [`MlstmArgs::check`] and its tensors stay live until the work on `stream`
    /// completes; the output loop that stores the entering states where this call's
    /// [`DocumentEntries::targets`] names them, with the stabilisers at device address
    /// `stabilisers` (inside the call's workspace, [`EntryTargets::workspace_parts`]), was
    /// enqueued before on `stream`.
    pub(super) unsafe fn launch_tails(
        &self,
        stream: &Arc<CudaStream>,
        args: &MlstmArgs<'_>,
        stabilisers: u64,
    ) -> Result<()> {
        let (Some(states), Some(documents)) = (&args.document_final_states, args.documents) else {
            return Ok(());
        };
        let inputs = StatesInputs {
            shape: args.shape,
            documents,
            k: args.k,
            v: args.v,
            g: args.f_gate,
            beta: None,
        };
        let rest = Stabilised {
            i_gate: args.i_gate,
            n: &states.n,
            m: &states.m,
            entry_m: stabilisers,
        };
        // SAFETY: the caller's contract.
        unsafe {
            self.tails
                .launch_stabilised(stream, &inputs, &states.c, &rest)
        }
    }
}

impl EntryTargets {
    /// The workspace bytes of a call whose own parts take `parts` bytes, and the offset of the
    /// entering stabilisers after them.
    pub(super) fn workspace_parts(&self, parts: u64) -> (u64, u64) {
        match &self.0 {
            None => (parts, 0),
            Some(t) => {
                let at = parts.next_multiple_of(WORKSPACE_PART_ALIGN);
                (at + t.stabiliser_bytes, at)
            }
        }
    }

    /// `params` with the output loop's stores into these targets, the stabilisers at device
    /// address `stabilisers`.
    pub(super) fn apply(&self, params: MlstmParams, stabilisers: u64) -> MlstmParams {
        let Some(t) = &self.0 else { return params };
        MlstmParams {
            entry_slots: t.slots as _,
            document_c: t.c as _,
            document_n: t.n as _,
            entry_m: stabilisers as _,
            documents: t.documents as i32,
            ..params
        }
    }
}
