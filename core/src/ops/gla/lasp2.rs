//! GLA's LASP-2 forward across PEs ([`GlaLasp2Forward`]; kernels: kernels/cuda/gla/lasp2_forward.cu,
//! call order in `lasp/gla/lasp2_params.h`).
//!
//! PE `w` holds the `w`-th slice of every sequence. Each PE computes its shard's summary (M from
//! a zero start, Λ per key dimension), sends it along the exchange's chain
//! ([`crate::exchange`]; in [`ExchangeMode::Overlapped`] from the device, with a signal) to every
//! later PE, folds the earlier PEs' summaries `P = diag(e^{Λ_u}) P + M_u` in rank order and runs
//! the single-GPU chunk loop of its shard from that prefix. The sequential modes put a host
//! all-gather between the same kernels; [`ExchangeMode::NoComm`] drops the exchange (timing). The
//! fold is the same in every mode, so outputs are bit-identical across modes.

use super::document_states::EntryOutputs;
use super::forward::{chunk_kernels, ChunkKernels};
use super::plan::{output_smem_bytes, output_threads, states_smem_bytes, CHUNK};
use super::{Gla, GlaArgs};
use crate::error::Result;
use crate::exchange::chain::StateChain;
use crate::exchange::{Direction, ExchangeMode, Lasp2Layout};
use crate::kernel::{width_index, LaunchShape};
use crate::ops::documents::final_states::{DocumentTails, StatesInputs};
use crate::ops::documents::masked::{StartWords, Twins};
use crate::ops::documents::LoopOrder;
use crate::ops::StreamOrder;
use crate::runtime::Runtime;
use cudarc::driver::{CudaSlice, CudaStream};
use lasp_shmem_kernels::{instances, params as header};
use std::sync::Arc;

/// The C struct `lasp_gla_lasp2_params`, passed by value to every kernel of the operation.
pub type Lasp2Params = header::lasp_gla_lasp2_params;

const OP: &str = "GLA LASP-2 forward";

/// How one call cuts its shard: S segments (one output CTA per SM), R states pieces per segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct ShardPlan {
    pub(super) segments: usize,
    pub(super) chunks_per_segment: usize,
    pub(super) splits: usize,
}

impl ShardPlan {
    pub(super) fn new(b: usize, h: usize, t: usize, dv: usize, sm_count: usize) -> Self {
        let chunks = t.div_ceil(CHUNK);
        let want = (sm_count / (b * h)).clamp(1, chunks);
        let chunks_per_segment = chunks.div_ceil(want);
        let segments = chunks.div_ceil(chunks_per_segment);
        let splits = (2 * sm_count / (dv / 64 * segments * b * h)).clamp(1, chunks_per_segment);
        ShardPlan {
            segments,
            chunks_per_segment,
            splits,
        }
    }
}

/// GLA's LASP-2 forward on one PE: its exchange (collective to create and to switch modes), its
/// kernels and its workspace.
pub struct GlaLasp2Forward {
    chain: StateChain<Gla>,
    /// The states kernels (indexed by Dk: [64, 128]) and the output kernels (by [Dv][Dk]).
    chunks: Twins<ChunkKernels>,
    words: StartWords,
    workspace: Option<CudaSlice<u8>>,
    sm_count: usize,
    tails: DocumentTails,
    entry_outputs: EntryOutputs,
}

crate::exchange::chain_methods!(GlaLasp2Forward);

impl GlaLasp2Forward {
    /// Sets up the exchange for `layout` on every PE (collective; every PE must pass the same
    /// layout and mode).
    pub fn new(runtime: &Runtime, layout: Lasp2Layout, mode: ExchangeMode) -> Result<Self> {
        let chunks = chunk_kernels(
            runtime,
            OP,
            (
                instances::GLA_LASP2_STATES,
                [
                    instances::GLA_LASP2_OUTPUT_DV64,
                    instances::GLA_LASP2_OUTPUT_DV128,
                ],
            ),
            (
                instances::GLA_LASP2_STATES_PACKED,
                [
                    instances::GLA_LASP2_OUTPUT_DV64_PACKED,
                    instances::GLA_LASP2_OUTPUT_DV128_PACKED,
                ],
            ),
        )?;
        let chain = StateChain::new(runtime, layout, mode, Direction::Ascending, OP)?;
        Ok(GlaLasp2Forward {
            sm_count: crate::ops::sm_count(runtime.context())? as usize,
            chain,
            chunks,
            words: StartWords::new(runtime)?,
            workspace: None,
            tails: DocumentTails::new(runtime, instances::GLA_DOCUMENT_STATES)?,
            entry_outputs: EntryOutputs::new(
                runtime,
                [
                    instances::GLA_LASP2_OUTPUT_DV64_ENTRIES,
                    instances::GLA_LASP2_OUTPUT_DV128_ENTRIES,
                ],
            )?,
        })
    }

    /// Enqueues one call on `stream`: `args` holds this PE's shard (T = its T_local; shards may
    /// differ in length), h0 the global initial state (the same on every PE), ht only on the last
    /// PE, and `chunk_states`, where a backward ([`super::GlaLasp2Backward`]) follows, the shard's
    /// chunk states. Everything is validated before the first launch. Expired waits are reported by
    /// [`GlaLasp2Forward::finish`].
    pub fn forward(&mut self, stream: &Arc<CudaStream>, args: GlaArgs<'_>) -> Result<()> {
        StreamOrder::around(stream, args.homes(), OP, || self.enqueue(stream, args))
    }

    fn enqueue(&mut self, stream: &Arc<CudaStream>, args: GlaArgs<'_>) -> Result<()> {
        let s = args.shape;
        super::plan::validate(&s)?;
        self.chain.check_call(stream, s.layout())?;
        let scale = args.check(OP)?;
        let (me, npes) = (self.chain.runtime().pe(), self.chain.runtime().npes());
        let last = me + 1 == npes;
        self.chain.check_final_state(args.ht.is_some())?;
        let plan = ShardPlan::new(s.b, s.h, s.t, s.dv, self.sm_count);
        let pieces = plan.segments * plan.splits;
        let bh = s.b * s.h;
        let m_bytes = (bh * pieces * s.dk * s.dv * 4) as u64;
        // The start words (packed documents) after M and Lambda.
        let (ws, [starts]) = self.words.workspace(
            self.chain.context(),
            stream,
            &mut self.workspace,
            m_bytes + (bh * pieces * s.dk * 4) as u64,
            args.documents,
            s.t,
            [LoopOrder::InOrder],
            OP,
        )?;
        let entries = match (&args.document_ht, args.documents) {
            (Some(ht), Some(docs)) => Some(self.tails.entries(stream, docs, s.t, ht, OP)?),
            _ => None,
        };
        let params = Lasp2Params {
            q: args.q.addr() as _,
            k: args.k.addr() as _,
            v: args.v.addr() as _,
            g: args.g.addr() as _,
            o: args.o.addr() as _,
            h0: args.h0.map_or(0, |x| x.addr()) as _,
            ht: args.ht.as_ref().map_or(0, |x| x.addr()) as _,
            chunk_states: args.chunk_states.as_ref().map_or(0, |x| x.addr()) as _,
            starts: starts as _,
            entry_slots: entries.map_or(0, |e| e.slots) as _,
            document_states: entries.map_or(0, |e| e.states) as _,
            documents: entries.map_or(0, |e| e.documents) as i32,
            ws_m: ws as _,
            ws_lambda: (ws + m_bytes) as _,
            T: s.t as i32,
            num_segments: plan.segments as i32,
            chunks_per_segment: plan.chunks_per_segment as i32,
            states_splits: plan.splits as i32,
            scale,
            write_final_state: (last && args.ht.is_some()) as i32,
            ..self.chain.base_params(stream)
        };
        let (i, j) = (width_index(s.dk), width_index(s.dv));
        let (states_kernels, output_kernels) = self.chunks.get(args.documents.is_some());
        let states = LaunchShape {
            grid: ((s.dv / 64) as u32, pieces as u32, bh as u32),
            block: (header::LASP_GLA_STATES_THREADS, 1, 1),
            shared_bytes: states_smem_bytes(s.dk),
        };
        let output = LaunchShape {
            grid: (1, plan.segments as u32, bh as u32),
            block: (output_threads(s.dv), 1, 1),
            shared_bytes: output_smem_bytes(s.dk, s.dv),
        };
        // SAFETY: Lasp2Params is lasp_gla_lasp2_params, generated from the header; the shape,
        // lengths, alignment and overlaps were checked above; the views borrow their buffers for
        // the call; the symmetric buffers, epoch, diagnostics and workspace are owned by self. The
        // summary kernel reads the workspace its states kernel wrote, which it follows; the next
        // call's states kernel follows the end of this call.
        unsafe {
            states_kernels[i].launch(stream, states, &params)?;
            // The output CTAs take a whole SM each (shared memory and registers): the summary
            // runs beside them only where they leave at least half the SMs free.
            let beside = 2 * plan.segments * bh <= self.sm_count;
            self.chain
                .launch_summary(stream, 0, bh as i32, &params, beside)?;
        }
        self.chain.gather_slots(stream)?;
        let output_kernel = match entries {
            Some(_) => self.entry_outputs.get(&s),
            None => &output_kernels[j][i],
        };
        // SAFETY: as above.
        unsafe { output_kernel.launch(stream, output, &params)? };
        if let (Some(ht), Some(documents)) = (&args.document_ht, args.documents) {
            let inputs = StatesInputs {
                shape: s,
                k: args.k,
                v: args.v,
                g: args.g,
                documents,
                beta: None,
            };
            // SAFETY: as above; the output kernel, which stores the entering states, precedes it
            // on `stream`.
            unsafe { self.tails.launch(stream, &inputs, ht)? };
        }
        self.chain.end_call(stream, &params)
    }
}
