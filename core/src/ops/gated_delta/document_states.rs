//! Final states of packed documents for Gated DeltaNet ([`GatedDeltaDocumentStates`]): fla's
//! `output_final_state` with `cu_seqlens`, one state per document `[B, N, H, Dk, Dv]`, on one GPU
//! and on LASP-2 shards.
//!
//! As scalar decay's ([`crate::ops::scalar_decay::ScalarDecayDocumentStates`]): a table names,
//! per chunk of 64 tokens, the document that began before the chunk and ends in it
//! (`crate::ops::documents::final_states`); a walk of the shard (the forward's WY kernel,
//! summaries and fold, then its chunk loop without outputs) stores the state entering each such
//! chunk in that document's slot; then one CTA per document, head and 64 columns of Dv runs the
//! delta rule's steps over the document's tokens of its last chunk, in fp32
//! (`kernels/cuda/gated_delta/document_states.cu`). Documents that end on another PE get zeros.
//! On LASP-2 the walk starts from the state the forward saved as entering the shard. No gradient
//! flows from these states (`kernels/docs/packed.md`, "Per-document states").

use super::forward::EntriesWalk;
use super::GatedDeltaForward;
use crate::error::Result;
use crate::ops::documents::final_states::{check_final_states, DocumentTails, StatesInputs};
use crate::ops::documents::Documents;
use crate::ops::scalar_decay::ForwardShape;
use crate::ops::{bf16, DeviceMut, DeviceRef, StreamOrder};
use crate::runtime::Runtime;
use cudarc::driver::{CudaContext, CudaStream};
use lasp_shmem_kernels::instances;
use std::sync::Arc;

const OP: &str = "Gated DeltaNet document states";

/// The tensors of one call: a shard's keys, values, log-decays and write strengths, the state
/// entering it, its documents, and where their final states go.
#[derive(Debug)]
pub struct GatedDeltaDocumentStatesArgs<'a> {
    /// The shard's dimensions (T: this PE's tokens).
    pub shape: ForwardShape,
    /// Keys `[B, T, H, Dk]`, bf16, 16-byte aligned, as the forward took them.
    pub k: DeviceRef<'a, bf16>,
    /// Values `[B, T, H, Dv]`, bf16, 16-byte aligned.
    pub v: DeviceRef<'a, bf16>,
    /// Log-decays `[B, T, H]`, fp32: the forgetting ones the forward took
    /// ([`crate::ops::documents::DocumentStarts::forgetting_gates`]), through which the walk's
    /// chain forgets at every document start.
    pub g: DeviceRef<'a, f32>,
    /// Write strengths `[B, T, H]`, fp32.
    pub beta: DeviceRef<'a, f32>,
    /// The state entering the shard `[B, H, Dk, Dv]` fp32: on LASP-2 the start state the forward
    /// saved; `None` for zero (one GPU, and the first PE).
    pub h0: Option<DeviceRef<'a, f32>>,
    /// The packed documents and this shard's place among them.
    pub documents: Documents<'a>,
    /// `[B, N, H, Dk, Dv]` fp32 (N = `cu_seqlens.len() - 1`,
    /// [`crate::ops::documents::document_states_len`]), 8-byte aligned: document n's state after
    /// its last token where that token is in this shard, zeros for the others.
    pub ht: DeviceMut<'a, f32>,
}

/// The final states of packed documents for Gated DeltaNet (see the module documentation).
pub struct GatedDeltaDocumentStates {
    ctx: Arc<CudaContext>,
    /// The forward whose chain the walk runs, with a workspace of its own.
    walk: GatedDeltaForward,
    tails: DocumentTails,
}

impl GatedDeltaDocumentStates {
    pub fn new(runtime: &Runtime) -> Result<Self> {
        Ok(GatedDeltaDocumentStates {
            ctx: runtime.context().clone(),
            walk: GatedDeltaForward::new(runtime)?,
            tails: DocumentTails::new(runtime, instances::GDN_DOCUMENT_STATES)?,
        })
    }

    /// Enqueues the final states of `args.documents` on `stream` (a stream of the runtime's
    /// context). Everything is checked before the first launch.
    pub fn launch(
        &mut self,
        stream: &Arc<CudaStream>,
        args: GatedDeltaDocumentStatesArgs<'_>,
    ) -> Result<()> {
        let rows = [("g", args.g), ("beta", args.beta)];
        let (shape, docs) = (&args.shape, &args.documents);
        check_final_states(OP, shape, docs, args.k, args.v, &rows, args.h0, &args.ht)?;
        crate::ops::require_runtime_stream(stream, &self.ctx, OP)?;
        let homes = [
            args.documents.cu_seqlens.home(),
            args.k.home(),
            args.v.home(),
            args.g.home(),
            args.beta.home(),
            args.h0.and_then(|h0| h0.home()),
            args.ht.home(),
        ];
        StreamOrder::around(stream, homes, OP, || {
            let entries = self
                .tails
                .entries(stream, args.documents, args.shape.t, &args.ht, OP)?;
            let walk = EntriesWalk {
                shape: args.shape,
                k: args.k,
                v: args.v,
                g: args.g,
                beta: args.beta,
                h0: args.h0,
            };
            // SAFETY: the slots were written above on `stream`; the states are `args.ht`, checked
            // against the documents and the shape; k, v, g, beta and h0 were checked against the
            // shape and are kept live by their views' contracts until the work completes.
            unsafe {
                self.walk
                    .launch_document_entries_walk(stream, &walk, entries)
            }?;
            self.enqueue_states(stream, &args)
        })
    }

    /// The kernel that runs each document's steps over its last chunk from the state the walk
    /// stored in `args.ht` before on `stream`.
    fn enqueue_states(
        &mut self,
        stream: &Arc<CudaStream>,
        args: &GatedDeltaDocumentStatesArgs<'_>,
    ) -> Result<()> {
        let inputs = StatesInputs {
            shape: args.shape,
            documents: args.documents,
            k: args.k,
            v: args.v,
            g: args.g,
            beta: Some(args.beta),
        };
        // SAFETY: the offsets, k, v, g, beta and ht have the lengths and alignment checked in
        // `launch` and stay live by their views' contracts; the entering states were stored in ht
        // before this launch on the same stream.
        unsafe { self.tails.launch(stream, &inputs, &args.ht) }
    }
}
