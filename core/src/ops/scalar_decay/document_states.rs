//! Final states of packed documents for scalar decay ([`ScalarDecayDocumentStates`]): fla's
//! `output_final_state` with `cu_seqlens`, one state per document, on one GPU and on LASP-2
//! shards.
//!
//! The state after document n's last token `e_n - 1` is the state entering the chunk of 64 tokens
//! that holds that token, decayed to it, plus the document's tokens of the chunk. The chunk loop
//! stores that entering state into n's slot of the output where n began before the chunk (a
//! table per chunk names the document, `lasp_document_entry_slots`); then one CTA per document,
//! head and 64 columns of Dv adds the chunk's tokens on the CUDA cores, in fp32, each weight one
//! exponential of a sum of log-decays inside the document
//! (`kernels/cuda/scalar_decay/document_states.cu`). A document that does not end in this shard
//! gets zeros, so every PE writes the whole `[B, N, H, Dk, Dv]` and their sum holds every
//! document's final state. The grids are fixed by the capacity of `cu_seqlens`, so a captured
//! CUDA graph replays with other documents written into the same buffer.
//!
//! On one GPU the forward's output kernel stores the entering states
//! ([`ScalarDecayDocumentStates::launch_forward`]): the final states add a table and one small
//! kernel to the forward. On LASP-2 a walk of the shard (the chunk loop without outputs) stores
//! them after the forward, from the state the forward saved as entering the shard
//! ([`super::lasp2::Lasp2Forward::forward_saving`]), which holds every earlier PE's prefix: a
//! document that began on an earlier PE needs no exchange of its own. The gradient with respect to
//! these states is not built: the backward takes no per-document final-state cotangent
//! (`kernels/docs/packed.md`, "Per-document states").

use super::forward::EntriesWalk;
use super::{check_args, ForwardArgs, ForwardShape, ScalarDecayForward};
use crate::error::{Error, Result};
use crate::ops::documents::final_states::{
    check_final_states, DocumentEntries, DocumentTails, StatesInputs,
};
use crate::ops::documents::Documents;
use crate::ops::{bf16, ranges_overlap, DeviceMut, DeviceRef, StreamOrder};
use crate::runtime::Runtime;
use cudarc::driver::{CudaContext, CudaStream};
use lasp_shmem_kernels::instances;
use std::sync::Arc;

const OP: &str = "scalar-decay document states";

/// The tensors of one call: a shard's keys, values and log-decays, the state entering it, its
/// documents, and where their final states go.
#[derive(Debug)]
pub struct DocumentStatesArgs<'a> {
    /// The shard's dimensions (T: this PE's tokens).
    pub shape: ForwardShape,
    /// Keys `[B, T, H, Dk]`, bf16, 16-byte aligned.
    pub k: DeviceRef<'a, bf16>,
    /// Values `[B, T, H, Dv]`, bf16, 16-byte aligned.
    pub v: DeviceRef<'a, bf16>,
    /// Log-decays `[B, T, H]`, fp32: the forgetting ones the forward took
    /// ([`crate::ops::documents::DocumentStarts::forgetting_gates`]), through which the walk's
    /// chain forgets at every document start.
    pub g: DeviceRef<'a, f32>,
    /// The state entering the shard `[B, H, Dk, Dv]` fp32: on LASP-2 the start state the forward
    /// saved; `None` for zero (one GPU, and the first PE).
    pub h0: Option<DeviceRef<'a, f32>>,
    /// The packed documents and this shard's place among them.
    pub documents: Documents<'a>,
    /// `[B, N, H, Dk, Dv]` fp32 (N = `cu_seqlens.len() - 1`,
    /// [`crate::ops::documents::document_states_len`]), 8-byte
    /// aligned: document n's state after its last token where that token is in this shard, zeros
    /// for the others. Every element is written.
    pub ht: DeviceMut<'a, f32>,
}

/// The final states of packed documents for scalar decay (see the module documentation): its
/// kernels and its workspace (the entry slots, grown on demand and freed after a context
/// synchronisation when it is dropped).
pub struct ScalarDecayDocumentStates {
    ctx: Arc<CudaContext>,
    /// The forward (one GPU) or the walk (LASP-2) that stores the entering states, with a
    /// workspace of its own.
    walk: ScalarDecayForward,
    tails: DocumentTails,
}

impl ScalarDecayDocumentStates {
    pub fn new(runtime: &Runtime) -> Result<Self> {
        Ok(ScalarDecayDocumentStates {
            ctx: runtime.context().clone(),
            walk: ScalarDecayForward::new(runtime)?,
            tails: DocumentTails::new(runtime, instances::SD_DOCUMENT_STATES)?,
        })
    }

    /// Enqueues the final states of `args.documents` on `stream` (a stream of the runtime's
    /// context), after a walk of the shard from `args.h0`. Everything is checked before the first
    /// launch.
    pub fn launch(&mut self, stream: &Arc<CudaStream>, args: DocumentStatesArgs<'_>) -> Result<()> {
        self.check(stream, &args)?;
        let homes = [
            args.documents.cu_seqlens.home(),
            args.k.home(),
            args.v.home(),
            args.g.home(),
            args.h0.and_then(|h0| h0.home()),
            args.ht.home(),
        ];
        StreamOrder::around(stream, homes, OP, || {
            let entries = self.entries(stream, &args)?;
            let walk = EntriesWalk {
                shape: args.shape,
                k: args.k,
                v: args.v,
                g: args.g,
                h0: args.h0,
            };
            // SAFETY: the slots are this object's workspace, written above on `stream`; the
            // states are `args.ht`, checked against the documents and the shape; k, v, g and h0
            // were checked against the shape and are kept live by their views' contracts until
            // the work on `stream` completes.
            unsafe {
                self.walk
                    .launch_document_entries_walk(stream, &walk, entries)
            }?;
            self.enqueue_states(stream, &args)
        })
    }

    /// The forward `forward` of one GPU (its log-decays `g` the forgetting ones), whose output
    /// kernel also stores the states entering the documents' last chunks, then the final states
    /// of `documents` into `ht` (as [`DocumentStatesArgs::ht`]): the forward's outputs as
    /// [`ScalarDecayForward::launch`]'s, with a table and one small kernel added. Everything is
    /// checked before the first launch.
    pub fn launch_forward(
        &mut self,
        stream: &Arc<CudaStream>,
        forward: ForwardArgs<'_>,
        documents: Documents<'_>,
        ht: DeviceMut<'_, f32>,
    ) -> Result<()> {
        let args = DocumentStatesArgs {
            shape: forward.shape,
            k: forward.k,
            v: forward.v,
            g: forward.g,
            h0: forward.h0,
            documents,
            ht,
        };
        self.check(stream, &args)?;
        check_args(&forward)?;
        let outputs = [("o", forward.o.byte_range())]
            .into_iter()
            .chain(forward.ht.as_ref().map(|x| ("ht", x.byte_range())));
        for (name, range) in outputs {
            if ranges_overlap(range, args.ht.byte_range()) {
                return Err(Error::InvalidArgument(format!(
                    "{OP}: the documents' final states overlap the forward's {name}; give each \
                     its own buffer"
                )));
            }
        }
        let homes = forward
            .homes()
            .into_iter()
            .chain([args.documents.cu_seqlens.home(), args.ht.home()]);
        StreamOrder::around(stream, homes, OP, || {
            let entries = self.entries(stream, &args)?;
            // SAFETY: as in `launch`; the forward's tensors were checked by check_args and are
            // kept live by their views' contracts.
            unsafe {
                self.walk
                    .launch_writing_document_entries(stream, forward, entries)
            }?;
            self.enqueue_states(stream, &args)
        })
    }

    /// The checks of a call's shape, documents and tensors.
    fn check(&self, stream: &Arc<CudaStream>, args: &DocumentStatesArgs<'_>) -> Result<()> {
        check_final_states(
            OP,
            &args.shape,
            &args.documents,
            args.k,
            args.v,
            &[("g", args.g)],
            args.h0,
            &args.ht,
        )?;
        crate::ops::require_runtime_stream(stream, &self.ctx, OP)
    }

    /// The entry slots of the call's documents, written on `stream`, and where the chunk loop
    /// stores the states they name (`args.ht`).
    fn entries(
        &mut self,
        stream: &Arc<CudaStream>,
        args: &DocumentStatesArgs<'_>,
    ) -> Result<DocumentEntries> {
        self.tails
            .entries(stream, args.documents, args.shape.t, &args.ht, OP)
    }

    /// The kernel that adds each document's tokens of its last chunk to the state entering the
    /// chunk, which the chunk loop stored in `args.ht` before on `stream`; the call is checked and
    /// its buffers' streams ordered.
    fn enqueue_states(
        &mut self,
        stream: &Arc<CudaStream>,
        args: &DocumentStatesArgs<'_>,
    ) -> Result<()> {
        let inputs = StatesInputs {
            shape: args.shape,
            documents: args.documents,
            k: args.k,
            v: args.v,
            g: args.g,
            beta: None,
        };
        // SAFETY: the offsets, k, v, g and ht have the lengths and alignment checked in `launch`
        // and stay live by their views' contracts; the entering states were stored in ht before
        // this launch on the same stream.
        unsafe { self.tails.launch(stream, &inputs, &args.ht) }
    }
}
