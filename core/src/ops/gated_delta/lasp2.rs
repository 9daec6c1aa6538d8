//! Gated DeltaNet's LASP-2 forward across PEs ([`GatedDeltaLasp2Forward`]; kernels:
//! kernels/cuda/gated_delta/lasp2_forward.cu, call order in `lasp/gated_delta/lasp2_params.h`).
//!
//! PE `w` holds the `w`-th slice of every sequence. Each PE computes its shard's affine summary
//! (`A_w`, the product of its chunks' transitions, and `b_w`, its end state from zero), sends it
//! along the exchange's chain ([`crate::exchange`]; in [`ExchangeMode::Overlapped`] from the
//! device, with a signal) to every later PE, folds the earlier PEs' summaries `P = A_u P + b_u` in
//! rank order and runs the single-GPU forward's output pass on its shard from that prefix (which
//! it saves, where asked, for [`super::GatedDeltaLasp2Backward`]). The
//! sequential modes put a host all-gather between the same kernels; [`ExchangeMode::NoComm`]
//! drops the exchange (timing). The fold is the same in every mode, so outputs are bit-identical
//! across modes.

use super::forward::{call_params, ChunkKernels, GatedDeltaPlan};
use super::{GatedDelta, GatedDeltaArgs};
use crate::error::Result;
use crate::exchange::chain::StateChain;
use crate::exchange::{Direction, ExchangeMode, Lasp2Layout};
use crate::kernel::{width_index, Kernel};
use crate::ops::Scope;
use crate::ops::{DeviceMut, DeviceRef, StreamOrder};
use crate::runtime::Runtime;
use cudarc::driver::{CudaSlice, CudaStream};
use lasp_shmem_kernels::{instances, params as header};
use std::sync::Arc;

/// The C struct `lasp_gated_delta_lasp2_params`, passed by value to the LASP-2 kernels (the chunk
/// passes take its `fwd`).
pub type Lasp2Params = header::lasp_gated_delta_lasp2_params;

const OP: &str = "Gated DeltaNet LASP-2 forward";

/// Gated DeltaNet's LASP-2 forward on one PE: its exchange (collective to create and to switch
/// modes), its kernels and its workspace.
pub struct GatedDeltaLasp2Forward {
    chain: StateChain<GatedDelta>,
    kernels: ChunkKernels,
    /// Indexed by Dk: [64, 128].
    fold: [Kernel; 2],
    workspace: Option<CudaSlice<u8>>,
    /// The pipelined chain's scratch for the composed A (`ws_relay_a`), allocated on first use.
    relay_scratch: Option<CudaSlice<u8>>,
    sm_count: u32,
}

crate::exchange::chain_methods!(GatedDeltaLasp2Forward);

impl GatedDeltaLasp2Forward {
    /// Sets up the exchange for `layout` on every PE (collective; every PE must pass the same
    /// layout and mode).
    pub fn new(runtime: &Runtime, layout: Lasp2Layout, mode: ExchangeMode) -> Result<Self> {
        let kernels = ChunkKernels::new(runtime, OP)?;
        let fold = runtime
            .module()
            .kernels_per_width(instances::GDN_LASP2_FOLD)?;
        let chain = StateChain::new(runtime, layout, mode, Direction::Ascending, OP)?;
        Ok(GatedDeltaLasp2Forward {
            sm_count: crate::ops::sm_count(runtime.context())?,
            chain,
            kernels,
            fold,
            workspace: None,
            relay_scratch: None,
        })
    }

    /// Enqueues one call on `stream`: `args` holds this PE's shard (T = its T_local; shards may
    /// differ in length), h0 the global initial state (the same on every PE) and ht only on the
    /// last PE. Everything is validated before the first launch. Expired waits are reported by
    /// [`GatedDeltaLasp2Forward::finish`]. Returns the plan of the shard's chunk passes.
    pub fn forward(
        &mut self,
        stream: &Arc<CudaStream>,
        args: GatedDeltaArgs<'_>,
    ) -> Result<GatedDeltaPlan> {
        self.forward_saving(stream, args, None)
    }

    /// [`GatedDeltaLasp2Forward::forward`], also writing `start_state` `[B, H, Dk, Dv]` fp32
    /// (8-byte aligned): the state this PE's shard starts from (h0 folded with the earlier PEs'
    /// summaries), which [`super::GatedDeltaLasp2Backward`] takes as the shard's h0.
    pub fn forward_saving(
        &mut self,
        stream: &Arc<CudaStream>,
        args: GatedDeltaArgs<'_>,
        start_state: Option<DeviceMut<'_, f32>>,
    ) -> Result<GatedDeltaPlan> {
        let saved_home = start_state.as_ref().and_then(DeviceMut::home);
        let homes = args.homes().into_iter().chain([saved_home]);
        StreamOrder::around(stream, homes, OP, || {
            self.enqueue(stream, args, start_state)
        })
    }

    fn enqueue(
        &mut self,
        stream: &Arc<CudaStream>,
        args: GatedDeltaArgs<'_>,
        start_state: Option<DeviceMut<'_, f32>>,
    ) -> Result<GatedDeltaPlan> {
        let s = args.shape;
        let scale = args.check_saving(OP, start_state.as_ref())?;
        self.chain.check_call(stream, s.layout())?;
        self.chain.check_final_state(args.ht.is_some())?;
        // One PE has no other shard to fold: the single-GPU plan, without the shard's summary.
        let one_pe = self.chain.runtime().npes() == 1;
        let scope = if one_pe {
            Scope::SingleGpu
        } else {
            Scope::Shard
        };
        let plan = self
            .kernels
            .choose_output(GatedDeltaPlan::new(&s, self.sm_count, None, scope), &s);
        let ws = crate::ops::ensure_workspace(
            self.chain.context(),
            stream,
            &mut self.workspace,
            plan.workspace_bytes,
            OP,
        )?;
        let relay = relay_scratch(&self.chain, stream, &mut self.relay_scratch, OP)?;
        let params = Lasp2Params {
            fwd: call_params(&args, &plan, ws, scale),
            start_state: start_state.as_ref().map_or(0, DeviceMut::addr) as _,
            ws_relay_a: relay as _,
            ..self.chain.base_params(stream)
        };
        self.chain.context().bind_to_thread()?;
        if one_pe {
            return self.enqueue_one_pe(stream, &plan, &params, args.h0, start_state);
        }
        let fold = plan.fold.expect("a shard's plan always folds");
        // SAFETY: Lasp2Params is lasp_gated_delta_lasp2_params, generated from the header, its
        // `fwd` made by call_params for this plan from arguments checked above (shape, lengths,
        // alignment, overlaps); the views borrow their buffers for the call; the symmetric
        // buffers, epoch, diagnostics and workspace are owned by self. Each kernel reads what the
        // one before it on the stream wrote; the summary, where it runs on the exchange's
        // stream, follows them through the chain's event.
        unsafe {
            self.kernels.launch_summaries(stream, &plan, &params.fwd)?;
            self.chain
                .launch_summary(stream, 0, (s.b * s.h) as i32, &params, true)?;
        }
        self.chain.gather_slots(stream)?;
        // SAFETY: as above.
        unsafe {
            self.fold[width_index(s.dk)].launch(stream, fold, &params)?;
            self.kernels.launch_output(stream, &plan, &params.fwd)?;
        }
        self.chain.end_call(stream, &params)?;
        Ok(plan)
    }

    /// The call on one PE: the single-GPU forward from h0, whose fold kernel is the LASP-2 one
    /// (it waits for nothing and writes `start_state`) where the plan has segments; without
    /// them the state entering the shard is h0 (or zero), copied.
    fn enqueue_one_pe(
        &mut self,
        stream: &Arc<CudaStream>,
        plan: &GatedDeltaPlan,
        params: &Lasp2Params,
        h0: Option<DeviceRef<'_, f32>>,
        start_state: Option<DeviceMut<'_, f32>>,
    ) -> Result<GatedDeltaPlan> {
        // SAFETY: as in `enqueue`, whose checks made `params` for this plan; the fold kernel's
        // summaries are the plan's (segments 0..S-2, as the single-GPU fold reads them).
        unsafe {
            self.kernels.launch_summaries(stream, plan, &params.fwd)?;
            if let Some(fold) = plan.fold {
                self.fold[width_index(params.Dk as usize)].launch(stream, fold, params)?;
            }
        }
        if let (None, Some(start_state)) = (plan.fold, &start_state) {
            crate::ops::copy_or_zero(stream, h0, start_state)?;
        }
        // SAFETY: as above.
        unsafe { self.kernels.launch_output(stream, plan, &params.fwd)? };
        self.chain.end_call(stream, params)?;
        Ok(*plan)
    }
}

/// Under the pipelined chain, the address of the summary kernel's scratch for every column block of
/// the composed A (`ws_relay_a`: one copy per (head, Dv tile), allocated on first use); 0 in the
/// other modes, which fold no relayed prefix.
pub(super) fn relay_scratch(
    chain: &StateChain<GatedDelta>,
    stream: &Arc<CudaStream>,
    scratch: &mut Option<CudaSlice<u8>>,
    op: &str,
) -> Result<u64> {
    if chain.mode() != ExchangeMode::PipelinedChain {
        return Ok(0);
    }
    let l = chain.layout();
    let bytes = (l.b * l.h * (l.dv / 64) * l.dk * l.dk * 4) as u64;
    crate::ops::ensure_workspace(chain.context(), stream, scratch, bytes, op)
}
