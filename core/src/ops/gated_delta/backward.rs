//! [`GatedDeltaBackward`]: the Gated DeltaNet backward's kernels, workspace and launches, its plan
//! ([`GatedDeltaBackwardPlan`]), and the checks of one call's tensors
//! ([`GatedDeltaBackwardArgs`]) before anything is launched.
//!
//! The maths, the call sequence and every launch and workspace formula are those of
//! `kernels/cuda/include/lasp/gated_delta/backward_params.h`; the shared-memory and workspace
//! formulas are ported here.

use super::forward::{
    check_inputs, input_params, summary_kernels, summary_smem_bytes, wy_smem_bytes, GatedDeltaPlan,
};
use super::GatedDeltaBackwardParams;
use crate::error::Result;
use crate::kernel::{width_index, Kernel, LaunchShape};
use crate::ops::scalar_decay::{ForwardShape, TensorChecks};
use crate::ops::WORKSPACE_PART_ALIGN;
use crate::ops::{
    bf16, check_forced_segments, require_shared_memory, DeviceMut, DeviceRef, Scope, StreamOrder,
};
use crate::runtime::Runtime;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use lasp_shmem_kernels::{instances, params as header};
use std::sync::Arc;

const OP: &str = "Gated DeltaNet backward";
const CHUNK: u32 = header::LASP_SD_CHUNK;
/// The tensors of one backward call: the forward's inputs, the gradients of its outputs, and the
/// gradients to write. Views from cudarc buffers ([`DeviceRef::new`], [`DeviceMut::new`]) or raw
/// pointers, all in the runtime's GPU context.
#[derive(Debug)]
pub struct GatedDeltaBackwardArgs<'a> {
    /// The dimensions every tensor must agree with (Dk 64 or 128, Dv a multiple of 64).
    pub shape: ForwardShape,
    /// The forward's queries `[B, T, H, Dk]`, bf16, contiguous, 16-byte aligned.
    pub q: DeviceRef<'a, bf16>,
    /// The forward's keys `[B, T, H, Dk]`, bf16, contiguous, 16-byte aligned (as the forward got
    /// them: l2-normalised by the caller where the model normalises them).
    pub k: DeviceRef<'a, bf16>,
    /// The forward's values `[B, T, H, Dv]`, bf16, contiguous, 16-byte aligned.
    pub v: DeviceRef<'a, bf16>,
    /// The forward's log-decays `[B, T, H]`, fp32, finite and `<= 0` (the caller's contract).
    pub g: DeviceRef<'a, f32>,
    /// The forward's write strengths `[B, T, H]`, fp32, finite.
    pub beta: DeviceRef<'a, f32>,
    /// The forward's initial state `[B, H, Dk, Dv]` fp32, 8-byte aligned; `None` for zero.
    pub h0: Option<DeviceRef<'a, f32>>,
    /// The gradient of o `[B, T, H, Dv]`, bf16, contiguous, 16-byte aligned.
    pub d_o: DeviceRef<'a, bf16>,
    /// The gradient of the final state `[B, H, Dk, Dv]` fp32, 8-byte aligned; `None` for zero.
    pub dht: Option<DeviceRef<'a, f32>>,
    /// Gradient of q `[B, T, H, Dk]`, bf16, 16-byte aligned; every element is written.
    pub dq: DeviceMut<'a, bf16>,
    /// Gradient of k `[B, T, H, Dk]`, bf16, 16-byte aligned; every element is written.
    pub dk: DeviceMut<'a, bf16>,
    /// Gradient of v `[B, T, H, Dv]`, bf16, 16-byte aligned; every element is written.
    pub dv: DeviceMut<'a, bf16>,
    /// Gradient of g `[B, T, H]`, fp32, 4-byte aligned; every element is written.
    pub dg: DeviceMut<'a, f32>,
    /// Gradient of beta `[B, T, H]`, fp32, 4-byte aligned; every element is written.
    pub dbeta: DeviceMut<'a, f32>,
    /// Gradient of h0 `[B, H, Dk, Dv]` fp32, 8-byte aligned; `None` to skip it.
    pub dh0: Option<DeviceMut<'a, f32>>,
    /// The forward's `sigma`; `None` for `Dk^-1/2`.
    pub scale: Option<f32>,
}

impl<'a> GatedDeltaBackwardArgs<'a> {
    /// The streams of the buffers the views come from ([`crate::ops`], "Ordering").
    pub(super) fn homes(&self) -> [Option<&'a Arc<CudaStream>>; 14] {
        [
            self.q.home(),
            self.k.home(),
            self.v.home(),
            self.g.home(),
            self.beta.home(),
            self.h0.and_then(|h0| h0.home()),
            self.d_o.home(),
            self.dht.and_then(|d| d.home()),
            self.dq.home(),
            self.dk.home(),
            self.dv.home(),
            self.dg.home(),
            self.dbeta.home(),
            self.dh0.as_ref().and_then(DeviceMut::home),
        ]
    }

    /// Checks the shape, then lengths, alignment, scale and overlaps against it; returns the
    /// scale to use. `op` names the operation in errors.
    pub(super) fn check(&self, op: &str) -> Result<f32> {
        let s = &self.shape;
        s.validate_as(op)?;
        let checks = TensorChecks::new(op, s);
        let mut inputs = check_inputs(
            &checks,
            s,
            [self.q, self.k, self.v],
            [self.g, self.beta],
            self.h0,
        )?;
        let (qk, v, gates, state) = (
            "[B, T, H, Dk]",
            "[B, T, H, Dv]",
            "[B, T, H]",
            "[B, H, Dk, Dv]",
        );
        checks.tensor("d_o", v, (self.d_o.len(), s.v_len()), self.d_o.addr(), 16)?;
        if let Some(dht) = self.dht {
            checks.tensor("dht", state, (dht.len(), s.state_len()), dht.addr(), 8)?;
        }
        checks.tensor("dq", qk, (self.dq.len(), s.qk_len()), self.dq.addr(), 16)?;
        checks.tensor("dk", qk, (self.dk.len(), s.qk_len()), self.dk.addr(), 16)?;
        checks.tensor("dv", v, (self.dv.len(), s.v_len()), self.dv.addr(), 16)?;
        checks.tensor(
            "dg",
            gates,
            (self.dg.len(), s.gate_len()),
            self.dg.addr(),
            4,
        )?;
        checks.tensor(
            "dbeta",
            gates,
            (self.dbeta.len(), s.gate_len()),
            self.dbeta.addr(),
            4,
        )?;
        if let Some(dh0) = &self.dh0 {
            checks.tensor("dh0", state, (dh0.len(), s.state_len()), dh0.addr(), 8)?;
        }
        let scale = checks.scale(self.scale, s)?;
        inputs.push(("d_o", self.d_o.byte_range()));
        inputs.extend(self.dht.map(|d| ("dht", d.byte_range())));
        let mut outputs = vec![
            ("dq", self.dq.byte_range()),
            ("dk", self.dk.byte_range()),
            ("dv", self.dv.byte_range()),
            ("dg", self.dg.byte_range()),
            ("dbeta", self.dbeta.byte_range()),
        ];
        outputs.extend(self.dh0.as_ref().map(|d| ("dh0", d.byte_range())));
        checks.disjoint(&inputs, &outputs)?;
        Ok(scale)
    }
}

/// Elements of the workspace's token rows of width `d` (`lasp_gdn_bwd_rows_elems`): 64 rows per
/// chunk and b*H+h, those of a ragged chunk's virtual tokens included.
pub(super) fn rows_elems(s: &ForwardShape, d: usize) -> u64 {
    (s.b * s.h * s.t.div_ceil(CHUNK as usize)) as u64 * u64::from(CHUNK) * d as u64
}

/// Elements of the workspace's states (`lasp_gdn_bwd_states_elems`): one `[Dk, Dv]` state per
/// chunk and b*H+h.
pub(super) fn states_elems(s: &ForwardShape) -> u64 {
    (s.b * s.h * s.t.div_ceil(CHUNK as usize)) as u64 * (s.dk * s.dv) as u64
}

/// Shared-memory bytes of the backward's WY kernel (`lasp_gdn_bwd_wy_smem_bytes`): the forward's,
/// then from the next 1024-byte boundary `(I + L)^{-1}` as a bf16 tile.
pub(super) fn backward_wy_smem_bytes(dk: usize) -> u32 {
    wy_smem_bytes(dk).next_multiple_of(1024) + CHUNK * CHUNK * 2
}

/// Shared-memory bytes of the dS pass (`lasp_gdn_bwd_dh_smem_bytes`): two stages of Q, K, W
/// `[64 x Dk]`, dO `[64 x 64]` and 1024 bytes of gates; two bf16 copies of dS' `[Dk x 64]`; the
/// du tile.
pub(super) fn dh_smem_bytes(dk: usize) -> u32 {
    let dk = dk as u32;
    let stage = 3 * CHUNK * dk * 2 + CHUNK * 64 * 2 + 1024;
    2 * stage + 2 * dk * 64 * 2 + CHUNK * 64 * 2
}

/// Shared-memory bytes of the gradient kernel (`lasp_gdn_bwd_grads_smem_bytes`): Q, K, W, dW
/// `[64 x Dk]`; `(I + L)^{-1}`, dP and a scratch tile; two sets of 64 columns of Dv (dO, u, du, V
/// and S_n, dS' `[Dk x 64]`); the chunk's gates and betas and the row sums.
pub(super) fn grads_smem_bytes(dk: usize) -> u32 {
    let dk = dk as u32;
    4 * CHUNK * dk * 2
        + 3 * CHUNK * 64 * 2
        + 2 * (4 * CHUNK * 64 * 2 + 2 * dk * 64 * 2)
        + 1024
        + 3072
}

/// The forward's summary launch as the backward runs it, where `forward` (which summarises every
/// segment) has one: every column tile of segments 0..S-2, then only A's `Dk/64` of segment S-1.
/// The summary kernel takes its CTAs in grid order (x, then y) as the summaries' tiles, segment by
/// segment, A's first, so a grid with fewer CTAs in x leaves out the last tiles: b_{S-1}'s `Dv/64`.
/// Nothing in the backward reads b_{S-1}: the fold takes b_s of segments 0..S-2, and the dS
/// chain's folds and the LASP-2 shard summary take A_s and c_s only (at S = 1 and Dk = Dv, half
/// the CTAs are left out).
pub(super) fn summary_without_last_b(
    s: &ForwardShape,
    forward: &GatedDeltaPlan,
) -> Option<LaunchShape> {
    let full = forward.summary?;
    debug_assert_eq!(forward.num_summaries, forward.num_segments);
    let (a_tiles, tiles) = ((s.dk / 64) as u32, ((s.dk + s.dv) / 64) as u32);
    Some(LaunchShape {
        grid: (
            tiles * (forward.num_summaries - 1) + a_tiles,
            1,
            full.grid.2,
        ),
        ..full
    })
}

/// How one Gated DeltaNet backward call runs: the forward's plan, whose summary kernel and fold
/// it reruns, and its own launches and workspace (byte offsets of its parts).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GatedDeltaBackwardPlan {
    /// The forward's plan for the same shape (one GPU): the segments, the summary and fold
    /// launches (where S > 1, with a summary for every segment: the dS chain takes `A_s^T` of
    /// segments 1..S-1), and the workspace's first parts (`(I + L)^{-1}` at 0, then the
    /// summaries and prefixes where S > 1). Its summary launch leaves out the last segment's b,
    /// which nothing in the backward reads (`summary_without_last_b`). Its output grid is the
    /// states kernel's; it never takes the output kernel with roles.
    pub forward: GatedDeltaPlan,
    /// The WY kernel: `(I + L)^{-1}` and W of every chunk.
    pub wy: LaunchShape,
    /// The states kernel: the forward's chain again, storing the state entering every chunk and
    /// u.
    pub states: LaunchShape,
    /// Where S > 1 (in a LASP-2 shard, always): the dS chain of segments `ds_summary_from..S`
    /// from zero at their ends (`c_s`), and the fold of the dS entering every segment (`A_s^T`
    /// down the segments; in a shard, the LASP-2 fold's, after the later PEs' summaries).
    pub dh_summary: Option<LaunchShape>,
    pub dh_fold: Option<LaunchShape>,
    /// The first segment whose `c_s` the summary kernel computes: 1 on one GPU (the dS entering
    /// the sequence needs no summary), 0 in a LASP-2 shard (its summary composes every segment's).
    pub ds_summary_from: u32,
    /// The dS pass, per segment: du and the state gradient of every chunk, from the last to the
    /// first, and dh0.
    pub dh: LaunchShape,
    /// The gradient kernel: one CTA per (chunk, b*H+h).
    pub grads: LaunchShape,
    /// Byte offset of ws_w, bf16 `[B*H, N*64, Dk]` (W of every chunk).
    pub ws_w: u64,
    /// Byte offset of ws_u, bf16 `[B*H, N*64, Dv]` (u of every chunk).
    pub ws_u: u64,
    /// Byte offset of ws_du, bf16 `[B*H, N*64, Dv]` (the gradient of u).
    pub ws_du: u64,
    /// Byte offset of ws_h, bf16 `[B*H, N, Dk, Dv]` (the state entering every chunk).
    pub ws_h: u64,
    /// Byte offset of ws_dh, bf16 `[B*H, N, Dk, Dv]` (the gradient of the state leaving every
    /// chunk).
    pub ws_dh: u64,
    /// Where S > 1 (in a shard, always): byte offset of ws_ds, fp32 `[B*H, S, Dk, Dv]` (the
    /// gradient of the state entering every segment).
    pub ws_ds: Option<u64>,
    /// In a LASP-2 shard: byte offset of ws_e, fp32 `[B*H, Dk, Dv]` (the gradient of the state
    /// leaving the shard, the LASP-2 fold's, which the dS pass takes as its dht).
    pub ws_e: Option<u64>,
    /// Workspace bytes: the forward's parts, then ws_w, ws_u, ws_du, ws_h, ws_dh (and ws_ds, ws_e),
    /// each 256-byte aligned.
    pub workspace_bytes: u64,
}

impl GatedDeltaBackwardPlan {
    /// The plan of a validated `shape` on `sm_count` SMs: the forward's segments (enough to fill
    /// the SMs once, or `forced`), and the backward's parts of the workspace after the forward's.
    /// `Scope::Shard` plans a LASP-2 shard's: every segment summarised (A_s and c_s, which the
    /// shard's summary composes) and the gradient leaving the shard in the workspace.
    pub(super) fn new(
        s: &ForwardShape,
        sm_count: u32,
        forced: Option<u32>,
        scope: Scope,
    ) -> GatedDeltaBackwardPlan {
        let one_gpu = GatedDeltaPlan::new(s, sm_count, forced, Scope::SingleGpu);
        // With segments, or in a shard, every segment's summary: Scope::Shard's plan, whose fold
        // starts from h0 in the single-GPU fold kernel.
        let shard = scope == Scope::Shard;
        let mut forward = if shard || one_gpu.num_segments > 1 {
            GatedDeltaPlan::new(s, sm_count, forced, Scope::Shard)
        } else {
            one_gpu
        };
        forward.summary = summary_without_last_b(s, &forward);
        let segments = forward.num_segments;
        let ds_summary_from = u32::from(!shard);
        let with_ds = shard || segments > 1;
        let bf16_bytes = |elems: u64| elems * 2;
        let ws_w = forward
            .workspace_bytes
            .next_multiple_of(WORKSPACE_PART_ALIGN);
        let ws_u = (ws_w + bf16_bytes(rows_elems(s, s.dk))).next_multiple_of(WORKSPACE_PART_ALIGN);
        let ws_du = (ws_u + bf16_bytes(rows_elems(s, s.dv))).next_multiple_of(WORKSPACE_PART_ALIGN);
        let ws_h = (ws_du + bf16_bytes(rows_elems(s, s.dv))).next_multiple_of(WORKSPACE_PART_ALIGN);
        let ws_dh = (ws_h + bf16_bytes(states_elems(s))).next_multiple_of(WORKSPACE_PART_ALIGN);
        let ws_ds = (ws_dh + bf16_bytes(states_elems(s))).next_multiple_of(WORKSPACE_PART_ALIGN);
        let state_bytes = (s.b * s.h * s.dk * s.dv) as u64 * 4;
        let ws_e =
            (ws_ds + u64::from(segments) * state_bytes).next_multiple_of(WORKSPACE_PART_ALIGN);
        let chunks = s.t.div_ceil(CHUNK as usize) as u32;
        let (bh, dv_tiles) = ((s.b * s.h) as u32, (s.dv / 64) as u32);
        let dh = |segments: u32| LaunchShape {
            grid: (dv_tiles, segments, bh),
            block: (header::LASP_SD_THREADS, 1, 1),
            shared_bytes: dh_smem_bytes(s.dk),
        };
        GatedDeltaBackwardPlan {
            forward,
            wy: LaunchShape {
                grid: (chunks, bh, 1),
                block: (header::LASP_GDN_WY_THREADS, 1, 1),
                shared_bytes: backward_wy_smem_bytes(s.dk),
            },
            states: LaunchShape {
                grid: forward.output.grid,
                block: (header::LASP_SD_THREADS, 1, 1),
                shared_bytes: summary_smem_bytes(s.dk),
            },
            dh_summary: with_ds.then(|| dh(segments - ds_summary_from)),
            dh_fold: with_ds.then_some(LaunchShape {
                grid: (dv_tiles, bh, 1),
                block: (header::LASP_GDN_FOLD_THREADS, 1, 1),
                shared_bytes: 0,
            }),
            ds_summary_from,
            dh: dh(segments),
            grads: LaunchShape {
                grid: (chunks, bh, 1),
                block: (header::LASP_GDN_BWD_GRADS_THREADS, 1, 1),
                shared_bytes: grads_smem_bytes(s.dk),
            },
            ws_w,
            ws_u,
            ws_du,
            ws_h,
            ws_dh,
            ws_ds: with_ds.then_some(ws_ds),
            ws_e: shard.then_some(ws_e),
            workspace_bytes: if shard {
                ws_e + state_bytes
            } else if with_ds {
                ws_ds + u64::from(segments) * state_bytes
            } else {
                ws_dh + bf16_bytes(states_elems(s))
            },
        }
    }
}

/// The kernels' parameters for one call of `args` (checked) under `plan`, with the workspace at
/// device address `workspace` (at least `plan.workspace_bytes`): the forward's (without its
/// outputs) as `fwd`, the gradients, and the backward's parts of the workspace.
pub(super) fn bwd_call_params(
    args: &GatedDeltaBackwardArgs<'_>,
    plan: &GatedDeltaBackwardPlan,
    workspace: u64,
    scale: f32,
) -> GatedDeltaBackwardParams {
    GatedDeltaBackwardParams {
        fwd: input_params(
            &args.shape,
            [args.q, args.k, args.v],
            [args.g, args.beta],
            args.h0,
            &plan.forward,
            workspace,
            scale,
        ),
        d_o: args.d_o.addr() as _,
        dht: args.dht.map_or(0, |x| x.addr()) as _,
        dq: args.dq.addr() as _,
        dk: args.dk.addr() as _,
        dv: args.dv.addr() as _,
        dg: args.dg.addr() as _,
        dbeta: args.dbeta.addr() as _,
        dh0: args.dh0.as_ref().map_or(0, |x| x.addr()) as _,
        ws_w: (workspace + plan.ws_w) as _,
        ws_u: (workspace + plan.ws_u) as _,
        ws_du: (workspace + plan.ws_du) as _,
        ws_h: (workspace + plan.ws_h) as _,
        ws_dh: (workspace + plan.ws_dh) as _,
        ws_ds: plan.ws_ds.map_or(0, |offset| workspace + offset) as _,
        ds_summary_from: plan.ds_summary_from as i32,
    }
}

/// The backward's kernels, each indexed by Dk: [64, 128] (its own, and the forward's summary
/// kernel and fold), shared by the single-GPU backward and the LASP-2 backward.
pub(super) struct BackwardKernels {
    pub(super) wy: [Kernel; 2],
    pub(super) summary: [Kernel; 2],
    pub(super) fold: [Kernel; 2],
    pub(super) states: [Kernel; 2],
    pub(super) dh_summary: [Kernel; 2],
    pub(super) dh_fold: [Kernel; 2],
    pub(super) dh: [Kernel; 2],
    pub(super) grads: [Kernel; 2],
}

impl BackwardKernels {
    /// Looks up the kernels in the runtime's module and raises their shared-memory limits; an
    /// error naming `op` if this GPU cannot give a block that much shared memory.
    pub(super) fn new(runtime: &Runtime, op: &str) -> Result<Self> {
        let most = backward_wy_smem_bytes(128)
            .max(summary_smem_bytes(128))
            .max(dh_smem_bytes(128))
            .max(grads_smem_bytes(128));
        require_shared_memory(runtime, op, most)?;
        let module = runtime.module();
        let kernels = BackwardKernels {
            wy: module.kernels_per_width(instances::GDN_BWD_WY)?,
            summary: summary_kernels(runtime)?,
            fold: module.kernels_per_width(instances::GDN_FOLD)?,
            states: module.kernels_per_width(instances::GDN_BWD_STATES)?,
            dh_summary: module.kernels_per_width(instances::GDN_BWD_DH_SUMMARY)?,
            dh_fold: module.kernels_per_width(instances::GDN_BWD_FOLD)?,
            dh: module.kernels_per_width(instances::GDN_BWD_DH)?,
            grads: module.kernels_per_width(instances::GDN_BWD_GRADS)?,
        };
        for (i, dk) in [64, 128].into_iter().enumerate() {
            kernels.wy[i].set_max_dynamic_shared_bytes(backward_wy_smem_bytes(dk))?;
            kernels.states[i].set_max_dynamic_shared_bytes(summary_smem_bytes(dk))?;
            // The forward's summary loop: two CTAs per SM with the largest carveout.
            kernels.states[i].prefer_max_shared_memory()?;
            kernels.dh_summary[i].set_max_dynamic_shared_bytes(dh_smem_bytes(dk))?;
            kernels.dh[i].set_max_dynamic_shared_bytes(dh_smem_bytes(dk))?;
            kernels.grads[i].set_max_dynamic_shared_bytes(grads_smem_bytes(dk))?;
        }
        Ok(kernels)
    }

    /// The single-GPU backward's launches of `plan` (a `Scope::SingleGpu` plan), in the order of
    /// `lasp/gated_delta/backward_params.h`.
    ///
    /// # Safety
    /// `params` comes from [`bwd_call_params`] for `plan` with checked arguments whose buffers
    /// stay valid until the kernels complete, and a workspace of `plan.workspace_bytes` that no
    /// other stream uses meanwhile.
    pub(super) unsafe fn launch_single_gpu(
        &self,
        stream: &Arc<CudaStream>,
        plan: &GatedDeltaBackwardPlan,
        params: &GatedDeltaBackwardParams,
    ) -> Result<()> {
        let i = width_index(params.fwd.Dk as usize);
        // SAFETY: the caller's contract; each kernel reads what the ones before it wrote.
        unsafe {
            self.wy[i].launch(stream, plan.wy, params)?;
            if let (Some(summary), Some(fold)) = (plan.forward.summary, plan.forward.fold) {
                self.summary[i].launch(stream, summary, &params.fwd)?;
                self.fold[i].launch(stream, fold, &params.fwd)?;
            }
            self.states[i].launch(stream, plan.states, params)?;
            if let (Some(summary), Some(fold)) = (plan.dh_summary, plan.dh_fold) {
                self.dh_summary[i].launch(stream, summary, params)?;
                self.dh_fold[i].launch(stream, fold, params)?;
            }
            self.dh[i].launch(stream, plan.dh, params)?;
            self.grads[i].launch(stream, plan.grads, params)?;
        }
        Ok(())
    }
}

/// The Gated DeltaNet backward: its kernels, its plan policy (the forward's) and its workspace.
///
/// One instance may be launched many times on one stream; launches of one instance on different
/// streams must be ordered by the caller (they share the workspace). The workspace grows on
/// demand (a context synchronisation then) and is freed when the instance is dropped.
pub struct GatedDeltaBackward {
    ctx: Arc<CudaContext>,
    kernels: BackwardKernels,
    sm_count: u32,
    force_segments: Option<u32>,
    workspace: Option<CudaSlice<u8>>,
}

impl GatedDeltaBackward {
    /// Looks up the kernels in the runtime's module and raises their shared-memory limits; an
    /// error if this GPU cannot give a block that much shared memory.
    pub fn new(runtime: &Runtime) -> Result<Self> {
        Ok(GatedDeltaBackward {
            kernels: BackwardKernels::new(runtime, OP)?,
            sm_count: crate::ops::sm_count(runtime.context())?,
            ctx: runtime.context().clone(),
            force_segments: None,
            workspace: None,
        })
    }

    /// Forces the number of segments per sequence (tests and tuning; rounded so that no segment
    /// is empty), or restores the automatic plan with `None`.
    pub fn set_num_segments(&mut self, segments: Option<u32>) -> Result<()> {
        check_forced_segments(segments, OP)?;
        self.force_segments = segments;
        Ok(())
    }

    /// The plan a launch of `shape` would use (validates the shape).
    pub fn plan(&self, shape: &ForwardShape) -> Result<GatedDeltaBackwardPlan> {
        shape.validate_as(OP)?;
        Ok(GatedDeltaBackwardPlan::new(
            shape,
            self.sm_count,
            self.force_segments,
            Scope::SingleGpu,
        ))
    }

    /// Enqueues the backward on `stream` (a stream of the runtime's context) and returns the plan
    /// it used. Everything is validated before the first launch.
    pub fn launch(
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
        let scale = args.check(OP)?;
        let plan = self.plan(&args.shape)?;
        crate::ops::require_runtime_stream(stream, &self.ctx, OP)?;
        let base = crate::ops::ensure_workspace(
            &self.ctx,
            stream,
            &mut self.workspace,
            plan.workspace_bytes,
            OP,
        )?;
        let params = bwd_call_params(&args, &plan, base, scale);
        self.ctx.bind_to_thread()?;
        // SAFETY: GatedDeltaBackwardParams is lasp_gated_delta_bwd_params and its `fwd`
        // lasp_gated_delta_params, both generated from the headers; the shape is supported and
        // every tensor has the length, alignment and non-overlap the kernels need (checked
        // above); the views borrow their buffers for the call and their contracts keep the
        // memory valid until the kernels complete; the workspace holds every part at the plan's
        // offsets (sized by the plan), is owned by self and is freed only after a context
        // synchronisation.
        unsafe { self.kernels.launch_single_gpu(stream, &plan, &params)? };
        Ok(plan)
    }
}

impl Drop for GatedDeltaBackward {
    fn drop(&mut self) {
        // Earlier launches may still use the workspace.
        if self.workspace.is_some() {
            let _ = self.ctx.synchronize();
        }
    }
}
