//! Final states of packed documents for scalar decay ([`ScalarDecayDocumentStates`]): fla's
//! `output_final_state` with `cu_seqlens`, one state per document, on one GPU and on LASP-2
//! shards.
//!
//! The state after document n's last token `e_n - 1` is the state entering the block of
//! `LASP_SD_BLOCK_CHUNKS` chunks that holds that token, decayed to it, plus the document's tokens
//! of the block. A walk of the shard (the forward's chunk loop without outputs, from the state
//! entering the shard) writes the state entering every block; one CTA per document, head and 64
//! columns of Dv then adds the block's tokens on the CUDA cores, in fp32, each weight one
//! exponential of a sum of log-decays inside the document
//! (`kernels/cuda/scalar_decay/document_states.cu`). A document that does not end in this shard
//! gets zeros, so every PE writes the whole `[B, N, H, Dk, Dv]` and their sum holds every
//! document's final state. The grid is fixed by the capacity of `cu_seqlens`, so a captured CUDA
//! graph replays with other documents written into the same buffer.
//!
//! On one GPU the forward itself can write the block states
//! ([`ScalarDecayDocumentStates::launch_forward`]: its output kernel's block-states instance),
//! so that only the second kernel is added to it.
//!
//! On LASP-2 the walk starts from the state the forward saved as entering the shard
//! ([`super::lasp2::Lasp2Forward::forward_saving`]), which holds every earlier PE's prefix: the
//! final state of a document that began on an earlier PE is exact here without an exchange of its
//! own. The gradient with respect to these states is not built: the backward takes no per-document
//! final-state cotangent (`kernels/docs/packed.md`, "Per-document states").

use super::forward::BlockStatesWalk;
use super::{check_args, ForwardArgs, ForwardShape, ScalarDecayForward};
use crate::error::{Error, Result};
use crate::kernel::{width_index, Kernel, LaunchShape};
use crate::ops::documents::{check, Documents, GateShape};
use crate::ops::{bf16, ranges_overlap, DeviceMut, DeviceRef, StreamOrder};
use crate::runtime::Runtime;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use lasp_shmem_kernels::instances;
use lasp_shmem_kernels::params::{lasp_sd_document_states_params, LASP_SD_DOCUMENT_STATES_THREADS};
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
    /// Log-decays `[B, T, H]`, fp32: the ones the forward took
    /// ([`crate::ops::documents::DocumentStarts::forgetting_gates`]) or the caller's (every sum
    /// the states take lies inside one document, so both give the same states).
    pub g: DeviceRef<'a, f32>,
    /// The state entering the shard `[B, H, Dk, Dv]` fp32: on LASP-2 the start state the forward
    /// saved; `None` for zero (one GPU, and the first PE).
    pub h0: Option<DeviceRef<'a, f32>>,
    /// The packed documents and this shard's place among them.
    pub documents: Documents<'a>,
    /// `[B, N, H, Dk, Dv]` fp32 (N = `cu_seqlens.len() - 1`, [`document_states_len`]), 4-byte
    /// aligned: document n's state after its last token where that token is in this shard, zeros
    /// for the others. Every element is written.
    pub ht: DeviceMut<'a, f32>,
}

/// Elements of the final states of `documents` over `shape`: `B * N * H * Dk * Dv`.
pub fn document_states_len(shape: &ForwardShape, documents: &Documents<'_>) -> usize {
    let docs = documents.cu_seqlens.len().saturating_sub(1);
    shape.b * docs * shape.h * shape.dk * shape.dv
}

/// The final states of packed documents for scalar decay (see the module documentation): its
/// kernels and its workspace (the block states, grown on demand and freed after a context
/// synchronisation when it is dropped).
pub struct ScalarDecayDocumentStates {
    ctx: Arc<CudaContext>,
    /// The walk's states pass, fold and kernel, with a workspace of their own.
    walk: ScalarDecayForward,
    /// Indexed by Dk: [64, 128].
    states: [Kernel; 2],
    block_states: Option<CudaSlice<u8>>,
}

impl ScalarDecayDocumentStates {
    pub fn new(runtime: &Runtime) -> Result<Self> {
        Ok(ScalarDecayDocumentStates {
            ctx: runtime.context().clone(),
            walk: ScalarDecayForward::new(runtime)?,
            states: runtime
                .module()
                .kernels_per_width(instances::SD_DOCUMENT_STATES)?,
            block_states: None,
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
            let block_states = self.block_states(stream, &args.shape)?;
            let walk = BlockStatesWalk {
                shape: args.shape,
                k: args.k,
                v: args.v,
                g: args.g,
                h0: args.h0,
            };
            // SAFETY: the block states are this object's workspace of the walk's size for the
            // shape, freed only after a context synchronisation; k, v, g and h0 were checked
            // against the shape and are kept live by their views' contracts until the work on
            // `stream` completes.
            unsafe {
                self.walk
                    .launch_block_states_walk(stream, &walk, block_states)
            }?;
            self.enqueue_states(stream, &args, block_states)
        })
    }

    /// The forward `forward` of one GPU (its log-decays `g` the forgetting ones), whose output
    /// kernel also writes the block states, then the final states of `documents` into `ht` (as
    /// [`DocumentStatesArgs::ht`]): the forward's outputs as [`ScalarDecayForward::launch`]'s,
    /// with one kernel added. Everything is checked before the first launch.
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
            let block_states = self.block_states(stream, &args.shape)?;
            // SAFETY: the block states are this object's workspace of the size the forward's
            // block-states pass writes for the shape, freed only after a context
            // synchronisation.
            unsafe {
                self.walk
                    .launch_writing_block_states(stream, forward, block_states)
            }?;
            self.enqueue_states(stream, &args, block_states)
        })
    }

    /// The checks of a call's shape, documents and tensors.
    fn check(&self, stream: &Arc<CudaStream>, args: &DocumentStatesArgs<'_>) -> Result<()> {
        let s = args.shape;
        s.validate()?;
        let gates = GateShape {
            b: s.b,
            t: s.t,
            h: s.h,
        };
        let checks = check(OP, &args.documents, gates)?;
        checks.tensor(
            "k",
            "[B, T, H, Dk]",
            (args.k.len(), s.qk_len()),
            args.k.addr(),
            16,
        )?;
        checks.tensor(
            "v",
            "[B, T, H, Dv]",
            (args.v.len(), s.v_len()),
            args.v.addr(),
            16,
        )?;
        checks.tensor(
            "g",
            "[B, T, H]",
            (args.g.len(), s.gate_len()),
            args.g.addr(),
            4,
        )?;
        if let Some(h0) = &args.h0 {
            checks.tensor(
                "h0",
                "[B, H, Dk, Dv]",
                (h0.len(), s.state_len()),
                h0.addr(),
                8,
            )?;
        }
        let want = document_states_len(&s, &args.documents);
        checks.tensor(
            "ht",
            "[B, N, H, Dk, Dv]",
            (args.ht.len(), want),
            args.ht.addr(),
            4,
        )?;
        let mut inputs = vec![
            ("k", args.k.byte_range()),
            ("v", args.v.byte_range()),
            ("g", args.g.byte_range()),
        ];
        if let Some(h0) = &args.h0 {
            inputs.push(("h0", h0.byte_range()));
        }
        checks.disjoint(&inputs, &[("ht", args.ht.byte_range())])?;
        crate::ops::require_runtime_stream(stream, &self.ctx, OP)
    }

    /// The address of the block states' workspace, grown for `shape`.
    fn block_states(&mut self, stream: &Arc<CudaStream>, shape: &ForwardShape) -> Result<u64> {
        let bytes =
            super::geometry::num_blocks(shape.t as i32) as u64 * shape.state_len() as u64 * 4;
        crate::ops::ensure_workspace(&self.ctx, stream, &mut self.block_states, bytes, OP)
    }

    /// The kernel that adds each document's tokens of its last block to the state entering the
    /// block, from the block states at `block_states` (written before on `stream`); the call is
    /// checked and its buffers' streams ordered.
    fn enqueue_states(
        &mut self,
        stream: &Arc<CudaStream>,
        args: &DocumentStatesArgs<'_>,
        block_states: u64,
    ) -> Result<()> {
        let s = args.shape;
        let (b, t, h, dk, dv) = (s.b as i32, s.t as i32, s.h as i32, s.dk as i32, s.dv as i32);
        let docs = args.documents;
        let p = lasp_sd_document_states_params {
            cu_seqlens: docs.cu_seqlens.addr() as _,
            offsets_are_int64: i32::from(docs.cu_seqlens.is_int64()),
            num_offsets: docs.cu_seqlens.len() as i32,
            shard_start: docs.shard_start as i64,
            k: args.k.addr() as _,
            v: args.v.addr() as _,
            g: args.g.addr() as _,
            block_states: block_states as _,
            ht: args.ht.addr() as _,
            B: b,
            T: t,
            H: h,
            Dk: dk,
            Dv: dv,
        };
        let launch = LaunchShape {
            grid: (
                (docs.cu_seqlens.len() - 1) as u32,
                (b * h) as u32,
                (dv / 64) as u32,
            ),
            block: (LASP_SD_DOCUMENT_STATES_THREADS, 1, 1),
            shared_bytes: 0,
        };
        self.ctx.bind_to_thread()?;
        // SAFETY: `p` is the kernel's lasp_sd_document_states_params, generated from its header;
        // the offsets, k, v, g and ht have the lengths and alignment checked in `launch` and stay
        // live by their views' contracts; the block states were written by the walk before this
        // launch on the same stream.
        unsafe { self.states[width_index(s.dk)].launch(stream, launch, &p) }
    }
}
