//! The LASP-2 backward (kernels/cuda/scalar_decay/lasp2_backward.cu, the chain kernels of exchange/chain.cu, and the
//! single-GPU backward of the shard).
//!
//! PE `w`'s gradients are exactly the single-GPU backward of its shard
//! ([`ScalarDecayBackward`]) started from the two states at the shard's ends: `P_w`, the state
//! entering it (what [`Lasp2Forward::forward_saving`](super::Lasp2Forward::forward_saving) wrote
//! as `start_state`), and `D_w`, the gradient with respect to the state leaving it. `D_w` comes
//! down the chain from the later PEs (kernels/docs/maths.md, "LASP-2: backward",
//! `reference::lasp2::backward`):
//! `D_{W-1} = dht`, `D_{u-1} = e^{Λ_u} D_u + dM_u`, where
//! `dM_u = σ e^{a_0} Σ_t e^{G_t - G_0} q_t^T do_t` is the gradient with respect to the state
//! entering shard `u` from its own tokens and `Λ_u` the shard's log-decay. `dM_u` is the forward's
//! state recurrence over the shard's tokens from last to first with `Q, dO` in the roles of
//! `K, V`, so the forward's states kernel computes it in its time-reversed build, and the
//! forward's exchange moves it: the chain runs from the last PE down ([`Direction::Descending`]).
//!
//! Per call, on each PE (the overlapped mode):
//! ```text
//! main stream:      reversed states (Q, dO) ─ev─ h0^T, dq pass ─ carry_in (waits) ─ starts, dv, dk passes, dg, dh0 ─ join ─ advance
//! exchange stream:                   fold_put: dM_w, puts to every earlier PE ────────────────────────────────────┘
//! ```
//! so the puts travel while the dq pass, which needs only `P_w`, runs. The sequential modes run
//! fold_put on the caller's stream and gather the slots before the dq pass.
//!
//! The reversed states pass walks the shard's tokens from last to first in S segments with `Q, dO`
//! in the roles the shard's dv pass gives them, so its segment states are the ones the shard's
//! reversed passes would compute again: the shard's backward starts them from these
//! ([`ReversedStates`]), folded from `D_w / σ`, and runs no reversed states pass of its own.

use super::forward::CallPlan;
use super::{geometry, ExchangeMode, Lasp2Layout, Lasp2Params, Lasp2Tuning};
use crate::error::Result;
use crate::exchange::chain::StateChain;
use crate::exchange::Direction;
use crate::kernel::{width_index, Kernel, LaunchShape};
use crate::ops::scalar_decay::backward::{
    check_backward_args, BackwardArgs, ReversedStates, ScalarDecayBackward,
};
use crate::ops::scalar_decay::geometry as sd;
use crate::ops::scalar_decay::{ScalarDecay, TensorChecks};
use crate::ops::sm_count;
use crate::ops::{DeviceRef, StreamOrder};
use crate::runtime::Runtime;
use cudarc::driver::{CudaSlice, CudaStream};
use lasp_shmem_kernels::instances;
use std::sync::Arc;

/// The LASP-2 backward on one PE: its chain's symmetric buffers, the epoch counter, the
/// single-GPU backward it runs on the shard, and a workspace for the reversed segment states and
/// the carried gradient `D_w`. Creating it and switching modes are collective; calls are not.
pub struct Lasp2Backward {
    /// First: fields drop in order, and the chain's drop waits for every call before the
    /// workspace (used on the callers' streams) is freed.
    chain: StateChain<ScalarDecay>,
    /// `lasp_lasp2_states_reversed_dk{64,128}`.
    states: [Kernel; 2],
    /// `lasp_lasp2_carry_in_dk{64,128}`.
    carry_in: [Kernel; 2],
    shard: ScalarDecayBackward,
    /// Reversed segment states and decays (the forward's ws_m and ws_lambda layout), then `D_w`
    /// where the forward keeps ws_p.
    workspace: Option<CudaSlice<u8>>,
    sm_count: u32,
}

crate::exchange::chain_methods!(Lasp2Backward);

impl Lasp2Backward {
    /// Allocates the symmetric buffers, checks that every PE has the same layout and sets the
    /// exchange mode (collective). Dv must be 64 or 128, as for [`ScalarDecayBackward`].
    pub fn new(runtime: &Runtime, layout: Lasp2Layout, mode: ExchangeMode) -> Result<Self> {
        let chain = StateChain::new(
            runtime,
            layout,
            mode,
            Direction::Descending,
            "LASP-2 backward",
        )?;
        if layout.dv != 64 && layout.dv != 128 {
            return Err(chain.invalid(format!(
                "Dv = {} is not supported (the shard's dq and dk passes use Dv as their key \
                 width, built for 64 and 128); split v into blocks of 64 or 128 columns",
                layout.dv
            )));
        }
        let shard = ScalarDecayBackward::new(runtime)?;
        let module = runtime.module();
        let states = module.kernels_per_width(instances::SD_LASP2_STATES_REVERSED)?;
        let carry_in = module.kernels_per_width(instances::SD_LASP2_CARRY_IN)?;
        for (i, dk) in [64, 128].into_iter().enumerate() {
            states[i].set_max_dynamic_shared_bytes(sd::states_smem_bytes(dk))?;
            carry_in[i].set_max_dynamic_shared_bytes(geometry::carry_in_smem_bytes(dk))?;
        }
        let sm_count = sm_count(runtime.context())?;
        Ok(Lasp2Backward {
            chain,
            states,
            carry_in,
            shard,
            workspace: None,
            sm_count,
        })
    }

    /// Enqueues the backward of this PE's shard on `stream` in the current mode. With
    /// `args.shape.t` this PE's shard length:
    /// - `q, k, v, g` are the shard's forward inputs and `d_o` the gradient of its output;
    /// - `h0` is the state the shard started from: the `start_state` that
    ///   [`Lasp2Forward::forward_saving`](super::Lasp2Forward::forward_saving) wrote on this PE
    ///   (`None` only where it is zero, e.g. on PE 0 without an initial state);
    /// - `d_ht`, the gradient of the sequence's final state, is given on the last PE only;
    /// - `dq, dk, dv, dg` receive the shard's gradients; `dh0`, the gradient of the sequence's
    ///   initial state, is written on PE 0 only.
    ///
    /// Everything is validated before the first launch.
    pub fn backward(&mut self, stream: &Arc<CudaStream>, args: BackwardArgs<'_>) -> Result<()> {
        StreamOrder::around(stream, args.homes(), "LASP-2 backward", || {
            self.enqueue(stream, args)
        })
    }

    /// The body of [`Lasp2Backward::backward`], with the buffers' streams already ordered.
    fn enqueue(&mut self, stream: &Arc<CudaStream>, args: BackwardArgs<'_>) -> Result<()> {
        let s = args.shape;
        s.validate()?;
        self.chain.check_call(stream, s.layout())?;
        let l = self.layout();
        let scale = check_backward_args(&args)?;
        if let Some(d_ht) = &args.d_ht {
            // fold_put reads it in 16-byte vectors (the single-GPU backward needs 8 bytes).
            TensorChecks::new("LASP-2 backward", &s).aligned("d_ht", d_ht.addr(), 16)?;
        }
        self.chain
            .check_boundary_gradients(args.d_ht.is_some(), args.dh0.is_some())?;
        let (b, h, dk, dv) = l.dims();
        let t = s.t as i32;
        let heads = b * h;
        // One head group: the dq pass, not the next group's states, hides the exchange.
        let plan = CallPlan::new(heads, t, dv, self.sm_count, Lasp2Tuning::default());
        let segments = plan.segments;
        let carry_offset = geometry::ws_p_offset(b, h, segments, dk, dv);
        let ws = crate::ops::ensure_workspace(
            self.chain.context(),
            stream,
            &mut self.workspace,
            carry_offset + 4 * s.state_len() as u64,
            "LASP-2 backward",
        )?;
        let carry = ws + carry_offset;
        let params = Lasp2Params {
            // The reversed states pass: Q and dO in the roles of K and V.
            k: args.q.addr() as _,
            v: args.d_o.addr() as _,
            g: args.g.addr() as _,
            // The chain's start, folded into the last PE's tile and carried in there.
            h0: args.d_ht.map_or(0, |x| x.addr()) as _,
            ws_m: ws as _,
            ws_lambda: (ws + geometry::ws_m_bytes(b, h, segments, dk, dv)) as _,
            start_state: carry as _,
            T: t,
            num_segments: segments,
            chunks_per_segment: plan.chunks_per_segment,
            scale,
            ..self.chain.base_params(stream)
        };
        let i = width_index(l.dk);
        self.chain.context().bind_to_thread()?;
        // SAFETY: Lasp2Params is lasp_lasp2_params, generated from the header; q, d_o, g and d_ht
        // were checked (lengths, alignment) above and are borrowed for the call; the workspace,
        // symmetric buffers, epoch and diag are owned by self. fold_put reads the workspace the
        // states kernel wrote, which it follows.
        unsafe {
            self.states[i].launch(
                stream,
                LaunchShape {
                    grid: geometry::segments_grid(heads, dv, segments),
                    block: (sd::THREADS, 1, 1),
                    shared_bytes: sd::states_smem_bytes(dk),
                },
                &params,
            )?;
            self.chain.launch_summary(stream, 0, heads, &params, true)?;
        }
        self.chain.gather_slots(stream)?;
        // SAFETY: the carry is a [B, H, Dk, Dv] fp32 part of the workspace owned by self, written
        // by carry_in before the shard's backward reads it on this stream.
        let carried = unsafe { DeviceRef::<f32>::from_raw(carry, s.state_len()) };
        let reversed = ReversedStates {
            segments: segments as u32,
            m: params.ws_m as u64,
            lambda: params.ws_lambda as u64,
            slots: segments as u32,
        };
        let carry_in = &self.carry_in[i];
        let enqueue_carry_in = || {
            // SAFETY: as for the states kernel; carry_in reads the slots (after the bounded waits
            // in the overlapped mode) and d_ht, and writes the carry.
            unsafe {
                carry_in.launch(
                    stream,
                    LaunchShape {
                        grid: crate::exchange::geometry::tile_grid(heads, dv),
                        block: (sd::THREADS, 1, 1),
                        shared_bytes: geometry::carry_in_smem_bytes(dk),
                    },
                    &params,
                )
            }
        };
        let shard_args = BackwardArgs {
            d_ht: Some(carried),
            ..args
        };
        // SAFETY: `reversed` addresses ws_m and ws_lambda of the workspace owned by self, sized
        // for `segments` and written by the states kernel above on this stream; the next call's
        // states kernel rewrites them only after this call's kernels on the same stream.
        unsafe {
            self.shard
                .launch_with(stream, shard_args, Some(reversed), enqueue_carry_in)?
        };
        self.chain.end_call(stream, &params)
    }
}
