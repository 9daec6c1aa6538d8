//! GLA's LASP-2 backward across PEs ([`GlaLasp2Backward`]; kernels: kernels/cuda/gla/lasp2_backward.cu
//! and the single-GPU grads kernel, call order in `lasp/gla/lasp2_params.h`).
//!
//! PE `w`'s gradients are the single-GPU backward of its shard from its chunk states (which the
//! LASP-2 forward saved, so they hold the earlier PEs' prefix) and `D_w`, the gradient of the
//! state leaving the shard. `D_w` comes down the chain from the later PEs: each PE walks its
//! shard's state gradient from zero for its summary `(M'_w, Λ_w)`, the last PE folds dht into its
//! own, and the forward's exchange moves the summaries to every earlier PE
//! ([`Direction::Descending`]), which folds them in chain order and walks its shard from there.
//! The fold is the same in every mode, so gradients are bit-identical across modes.

use super::backward::{
    chunk_params, grads_kernels, grads_smem_bytes, grads_threads, twins_by_width, walk_smem_bytes,
    walk_threads,
};
use super::plan::{chunk_states_len, CHUNK};
use super::{Gla, GlaBackwardArgs, Lasp2Params};
use crate::error::Result;
use crate::exchange::chain::StateChain;
use crate::exchange::{Direction, ExchangeMode, Lasp2Layout};
use crate::kernel::{width_index, Kernel, LaunchShape};
use crate::ops::documents::masked::{StartWords, Twins};
use crate::ops::documents::LoopOrder;
use crate::ops::StreamOrder;
use crate::runtime::Runtime;
use cudarc::driver::{CudaSlice, CudaStream};
use lasp_shmem_kernels::instances;
use std::sync::Arc;

const OP: &str = "GLA LASP-2 backward";

/// GLA's LASP-2 backward on one PE: its exchange (collective to create and to switch modes), its
/// kernels and its workspace (the gradient leaving every chunk, the segments' summaries).
pub struct GlaLasp2Backward {
    /// First: fields drop in order, and the chain's drop waits for every call before the
    /// workspace (used on the callers' streams) is freed.
    chain: StateChain<Gla>,
    /// Indexed by [Dv][Dk].
    states: Twins<[[Kernel; 2]; 2]>,
    /// Indexed by [Dv][Dk].
    walk: Twins<[[Kernel; 2]; 2]>,
    /// Indexed by [Dv][Dk].
    grads: Twins<[[Kernel; 2]; 2]>,
    words: StartWords,
    workspace: Option<CudaSlice<u8>>,
    sm_count: usize,
}

/// `bytes` rounded up to the workspace parts' 256-byte alignment.
fn align(bytes: u64) -> u64 {
    bytes.div_ceil(256) * 256
}

crate::exchange::chain_methods!(GlaLasp2Backward);

impl GlaLasp2Backward {
    /// Sets up the exchange for `layout` on every PE (collective; every PE must pass the same
    /// layout and mode).
    pub fn new(runtime: &Runtime, layout: Lasp2Layout, mode: ExchangeMode) -> Result<Self> {
        let chain = StateChain::new(runtime, layout, mode, Direction::Descending, OP)?;
        let states_rows = [
            instances::GLA_LASP2_BWD_STATES_DV64,
            instances::GLA_LASP2_BWD_STATES_DV128,
        ];
        let packed_states_rows = [
            instances::GLA_LASP2_BWD_STATES_DV64_PACKED,
            instances::GLA_LASP2_BWD_STATES_DV128_PACKED,
        ];
        let walk_rows = [
            instances::GLA_LASP2_BWD_WALK_DV64,
            instances::GLA_LASP2_BWD_WALK_DV128,
        ];
        let packed_walk_rows = [
            instances::GLA_LASP2_BWD_WALK_DV64_PACKED,
            instances::GLA_LASP2_BWD_WALK_DV128_PACKED,
        ];
        Ok(GlaLasp2Backward {
            states: twins_by_width(runtime, states_rows, packed_states_rows, walk_smem_bytes)?,
            walk: twins_by_width(runtime, walk_rows, packed_walk_rows, walk_smem_bytes)?,
            grads: grads_kernels(runtime)?,
            sm_count: crate::ops::sm_count(runtime.context())? as usize,
            chain,
            words: StartWords::new(runtime)?,
            workspace: None,
        })
    }

    /// Enqueues the backward of this PE's shard on `stream` in the current mode. With
    /// `args.shape.t` this PE's shard length: `q, k, v, g` the shard's forward inputs, `h0` the
    /// sequence's initial state as the forward had it, `chunk_states` what this PE's
    /// [`super::GlaLasp2Forward`] call saved, `d_o` the gradient of the shard's output; `dht`, the
    /// gradient of the sequence's final state, on the last PE only; `dq, dk, dv, dg` receive the
    /// shard's gradients; `dh0`, the gradient of the sequence's initial state, is written on PE 0
    /// only. Everything is validated before the first launch; expired waits are reported by
    /// [`GlaLasp2Backward::finish`].
    pub fn backward(&mut self, stream: &Arc<CudaStream>, args: GlaBackwardArgs<'_>) -> Result<()> {
        StreamOrder::around(stream, args.homes(), OP, || self.enqueue(stream, args))
    }

    fn enqueue(&mut self, stream: &Arc<CudaStream>, args: GlaBackwardArgs<'_>) -> Result<()> {
        let s = args.shape;
        super::plan::validate_as(
            &s,
            OP,
            "split v, d_o and dht into blocks of 128 columns, run one call per block with the same \
             q, k, g, and add the blocks' dq, dk and dg",
        )?;
        self.chain.check_call(stream, s.layout())?;
        let scale = args.check(OP)?;
        self.chain
            .check_boundary_gradients(args.dht.is_some(), args.dh0.is_some())?;
        let bh = s.b * s.h;
        let chunks = s.t.div_ceil(CHUNK);
        // A walk CTA takes a whole SM: one segment per SM's worth of (b, h).
        let segments = (self.sm_count / bh).clamp(1, chunks);
        let per_segment = chunks.div_ceil(segments);
        let segments = chunks.div_ceil(per_segment);
        // The workspace: dh (as the chunk states), then the segments' summaries M' and Λ.
        let ws_m = align(2 * chunk_states_len(&s) as u64);
        let ws_lambda = ws_m + align((bh * segments * s.dk * s.dv * 4) as u64);
        // The start words (packed documents) last.
        let (ws, [starts]) = self.words.workspace(
            self.chain.context(),
            stream,
            &mut self.workspace,
            ws_lambda + (bh * segments * s.dk * 4) as u64,
            args.documents,
            s.t,
            [LoopOrder::InOrder],
            OP,
        )?;
        let params = Lasp2Params {
            q: args.q.addr() as _,
            k: args.k.addr() as _,
            v: args.v.addr() as _,
            g: args.g.addr() as _,
            d_o: args.d_o.addr() as _,
            dht: args.dht.map_or(0, |x| x.addr()) as _,
            dh0: args.dh0.as_ref().map_or(0, |x| x.addr()) as _,
            dh: ws as _,
            starts: starts as _,
            ws_m: (ws + ws_m) as _,
            ws_lambda: (ws + ws_lambda) as _,
            T: s.t as i32,
            num_segments: segments as i32,
            chunks_per_segment: per_segment as i32,
            states_splits: 1,
            scale,
            ..self.chain.base_params(stream)
        };
        // The grads kernel reads only the chunk's tensors, the chunk states and dh.
        let grads = chunk_params(&args, scale, ws, starts);
        let (i, j) = (width_index(s.dk), width_index(s.dv));
        let packed = args.documents.is_some();
        let walk = LaunchShape {
            grid: (1, segments as u32, bh as u32),
            block: (walk_threads(s.dv), 1, 1),
            shared_bytes: walk_smem_bytes(s.dk, s.dv),
        };
        let grads_launch = LaunchShape {
            grid: (chunks as u32, bh as u32, 1),
            block: (grads_threads(s.dk, s.dv), 1, 1),
            shared_bytes: grads_smem_bytes(s.dk, s.dv, packed),
        };
        // SAFETY: Lasp2Params is lasp_gla_lasp2_params and GlaBackwardParams lasp_gla_bwd_params,
        // generated from the headers; the shape, lengths, alignment and overlaps were checked
        // above; the views borrow their buffers for the call; the symmetric buffers, epoch,
        // diagnostics and workspace are owned by self. Each kernel reads what the ones before it
        // on this stream wrote; the next call's first kernel follows this call's last.
        unsafe {
            self.states.get(packed)[j][i].launch(stream, walk, &params)?;
            // The walk CTAs take a whole SM each: the summary runs beside them only where they
            // leave at least half the SMs free.
            let beside = 2 * segments * bh <= self.sm_count;
            self.chain
                .launch_summary(stream, 0, bh as i32, &params, beside)?;
        }
        self.chain.gather_slots(stream)?;
        // SAFETY: as above.
        unsafe {
            self.walk.get(packed)[j][i].launch(stream, walk, &params)?;
            self.grads.get(packed)[j][i].launch(stream, grads_launch, &grads)?;
        }
        self.chain.end_call(stream, &params)
    }
}
