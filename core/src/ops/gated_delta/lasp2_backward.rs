//! Gated DeltaNet's LASP-2 backward across PEs ([`GatedDeltaLasp2Backward`]; kernels: the
//! single-GPU backward's, the LASP-2 forward's summary kernel and
//! kernels/cuda/gated_delta/lasp2_backward.cu, call order in `lasp/gated_delta/lasp2_params.h`).
//!
//! PE `w`'s gradients are the single-GPU backward of its shard from the state entering it (which
//! its [`super::GatedDeltaLasp2Forward`] call saved) and `E_w`, the gradient of the state leaving
//! it. `E_w` comes down the chain from the later PEs: the dS chain is affine, `dS entering shard u
//! = A_u^T E_u + c_u`, so each PE sends its shard's `c_u` (its dS chain from zero, with dht folded
//! in on the last PE) and `A_u` to every earlier PE ([`Direction::Descending`]), which folds them
//! in chain order. The single-GPU backward's passes then run on the shard with `E_w` as their dht;
//! the forward's chain again, which needs no summary, runs while the other PEs' summaries arrive.
//! The fold is the same in every mode, so gradients are bit-identical across modes.

use super::backward::{bwd_call_params, BackwardKernels, GatedDeltaBackwardPlan};
use super::lasp2::relay_scratch;
use super::{GatedDelta, GatedDeltaBackwardArgs, Lasp2Params};
use crate::error::Result;
use crate::exchange::chain::StateChain;
use crate::exchange::{Direction, ExchangeMode, Lasp2Layout};
use crate::kernel::{width_index, Kernel};
use crate::ops::Scope;
use crate::ops::StreamOrder;
use crate::runtime::Runtime;
use cudarc::driver::{CudaSlice, CudaStream};
use lasp_shmem_kernels::instances;
use std::sync::Arc;

const OP: &str = "Gated DeltaNet LASP-2 backward";

/// Gated DeltaNet's LASP-2 backward on one PE: its exchange (collective to create and to switch
/// modes), its kernels and its workspace.
pub struct GatedDeltaLasp2Backward {
    /// First: fields drop in order, and the chain's drop waits for every call before the
    /// workspace (used on the callers' streams) is freed.
    chain: StateChain<GatedDelta>,
    kernels: BackwardKernels,
    /// Indexed by Dk: [64, 128].
    fold: [Kernel; 2],
    workspace: Option<CudaSlice<u8>>,
    /// The pipelined chain's scratch for the composed A (`ws_relay_a`), allocated on first use.
    relay_scratch: Option<CudaSlice<u8>>,
    sm_count: u32,
}

crate::exchange::chain_methods!(GatedDeltaLasp2Backward);

impl GatedDeltaLasp2Backward {
    /// Sets up the exchange for `layout` on every PE (collective; every PE must pass the same
    /// layout and mode).
    pub fn new(runtime: &Runtime, layout: Lasp2Layout, mode: ExchangeMode) -> Result<Self> {
        let kernels = BackwardKernels::new(runtime, OP)?;
        let fold = runtime
            .module()
            .kernels_per_width(instances::GDN_LASP2_BWD_FOLD)?;
        let chain = StateChain::new(runtime, layout, mode, Direction::Descending, OP)?;
        Ok(GatedDeltaLasp2Backward {
            sm_count: crate::ops::sm_count(runtime.context())?,
            chain,
            kernels,
            fold,
            workspace: None,
            relay_scratch: None,
        })
    }

    /// Enqueues the backward of this PE's shard on `stream` in the current mode. With
    /// `args.shape.t` this PE's shard length: `q, k, v, g, beta` the shard's forward inputs; `h0`
    /// the state entering the shard that this PE's forward call saved (`start_state`; on PE 0 the
    /// sequence's h0, `None` for zero, and required on every other PE); `d_o` the gradient of the
    /// shard's output; `dht`, the gradient of the sequence's final state, on the last PE only;
    /// `dq, dk, dv, dg, dbeta` receive the shard's gradients; `dh0`, the gradient of the
    /// sequence's initial state, is written on PE 0 only. Everything is validated before the
    /// first launch; expired waits are reported by [`GatedDeltaLasp2Backward::finish`]. Returns
    /// the plan of the shard's passes.
    pub fn backward(
        &mut self,
        stream: &Arc<CudaStream>,
        args: GatedDeltaBackwardArgs<'_>,
    ) -> Result<GatedDeltaBackwardPlan> {
        StreamOrder::around(stream, args.homes(), OP, || self.enqueue(stream, args))
    }

    fn enqueue(
        &mut self,
        stream: &Arc<CudaStream>,
        args: GatedDeltaBackwardArgs<'_>,
    ) -> Result<GatedDeltaBackwardPlan> {
        let s = args.shape;
        let scale = args.check(OP)?;
        self.chain.check_call(stream, s.layout())?;
        let me = self.chain.runtime().pe();
        self.chain
            .check_boundary_gradients(args.dht.is_some(), args.dh0.is_some())?;
        if args.h0.is_none() && me != 0 {
            return Err(self.chain.invalid(format!(
                "PE {me} needs the state entering its shard as h0: pass the start_state that its \
                 GatedDeltaLasp2Forward::forward_saving call wrote"
            )));
        }
        // One PE has no other shard: the single-GPU backward from the saved start state.
        let one_pe = self.chain.runtime().npes() == 1;
        let scope = if one_pe {
            Scope::SingleGpu
        } else {
            Scope::Shard
        };
        let plan = GatedDeltaBackwardPlan::new(&s, self.sm_count, None, scope);
        let ws = crate::ops::ensure_workspace(
            self.chain.context(),
            stream,
            &mut self.workspace,
            plan.workspace_bytes,
            OP,
        )?;
        if one_pe {
            let params = bwd_call_params(&args, &plan, ws, scale);
            self.chain.context().bind_to_thread()?;
            // SAFETY: `params` made by bwd_call_params for this single-GPU plan from arguments
            // checked above; the views borrow their buffers for the call; the workspace, sized
            // by the plan, is owned by self.
            unsafe { self.kernels.launch_single_gpu(stream, &plan, &params)? };
            self.chain
                .end_call(stream, &self.chain.base_params(stream))?;
            return Ok(plan);
        }
        let (ws_ds, ws_e) = (
            ws + plan.ws_ds.expect("a shard's plan has ws_ds"),
            ws + plan.ws_e.expect("a shard's plan has ws_e"),
        );
        // The single-GPU passes take the gradient leaving the shard, E_me, as their dht.
        let mut bwd = bwd_call_params(&args, &plan, ws, scale);
        bwd.dht = ws_e as _;
        let relay = relay_scratch(&self.chain, stream, &mut self.relay_scratch, OP)?;
        let params = Lasp2Params {
            fwd: bwd.fwd,
            dht: args.dht.map_or(0, |d| d.addr()) as _,
            ws_ds: ws_ds as _,
            ws_e: ws_e as _,
            ws_relay_a: relay as _,
            ..self.chain.base_params(stream)
        };
        let summary = plan
            .forward
            .summary
            .expect("a shard's plan summarises every segment");
        let fold = plan.forward.fold.expect("a shard's plan folds");
        let ds_summary = plan
            .dh_summary
            .expect("a shard's plan summarises the dS chain");
        let ds_fold = plan.dh_fold.expect("a shard's plan folds the dS chain");
        let (i, k) = (width_index(s.dk), &self.kernels);
        self.chain.context().bind_to_thread()?;
        // SAFETY: GatedDeltaBackwardParams is lasp_gated_delta_bwd_params and Lasp2Params
        // lasp_gated_delta_lasp2_params, generated from the headers, made by bwd_call_params for
        // this plan from arguments checked above (shape, lengths, alignment, overlaps); the views
        // borrow their buffers for the call; the symmetric buffers, epoch, diagnostics and the
        // workspace (every part at the plan's offsets) are owned by self. Each kernel reads what
        // the ones before it on the stream wrote.
        unsafe {
            k.wy[i].launch(stream, plan.wy, &bwd)?;
            k.summary[i].launch(stream, summary, &bwd.fwd)?;
            k.dh_summary[i].launch(stream, ds_summary, &bwd)?;
            // On this stream, not the exchange's: beside the states kernel the summary's CTAs
            // slowed it more than the summary costs here (kernels/docs/gated-delta.md). The
            // other PEs' summaries still land while the states kernel runs.
            self.chain
                .launch_summary(stream, 0, (s.b * s.h) as i32, &params, false)?;
        }
        self.chain.gather_slots(stream)?;
        // SAFETY: as above. The forward's chain again (fold, states) needs no summary: it runs
        // while the other PEs' summaries arrive.
        unsafe {
            k.fold[i].launch(stream, fold, &bwd.fwd)?;
            k.states[i].launch(stream, plan.states, &bwd)?;
            self.fold[i].launch(stream, ds_fold, &params)?;
            k.dh[i].launch(stream, plan.dh, &bwd)?;
            k.grads[i].launch(stream, plan.grads, &bwd)?;
        }
        self.chain.end_call(stream, &params)?;
        Ok(plan)
    }
}
