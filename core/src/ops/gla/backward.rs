//! [`GlaBackward`]: the GLA backward's kernels, workspace and launches, its plan
//! ([`GlaBackwardPlan`]), and the checks of one call's tensors ([`GlaBackwardArgs`]) before
//! anything is launched.
//!
//! The maths, the call sequence and every launch and workspace formula are those of
//! `kernels/cuda/include/lasp/gla/backward_params.h`; the shared-memory formulas are ported here.

use super::forward::{check_inputs, check_measured, validate_gates_of};
use super::plan::{chunk_states_len, validate_as, CHUNK, CHUNK_STATES_LAYOUT};
use super::GlaBackwardParams;
use crate::error::Result;
use crate::kernel::{width_index, Kernel, LaunchShape};
use crate::ops::documents::masked::{refuse_states, StartWords, Twins};
use crate::ops::documents::Documents;
use crate::ops::documents::LoopOrder;
use crate::ops::scalar_decay::{ForwardShape, TensorChecks};
use crate::ops::WORKSPACE_PART_ALIGN;
use crate::ops::{
    bf16, check_forced_segments, require_shared_memory, split_into_segments, DeviceMut, DeviceRef,
    StreamOrder,
};
use crate::runtime::Runtime;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use lasp_shmem_kernels::{instances, params as header};
use std::sync::Arc;

const OP: &str = "GLA backward";
const FOLD_THREADS: u32 = header::LASP_GLA_BWD_FOLD_THREADS;
/// The most segments per sequence (the walk's grid y).
const MAX_SEGMENTS: usize = 65_535;
/// The share of the SMs that walks of one segment per (b, h) must fill for the plan to take one
/// segment.
const ONE_SEGMENT_FILL: f64 = 0.45;
/// The tensors of one backward call: the forward's inputs, the gradients of its outputs, and the
/// gradients to write. Views from cudarc buffers ([`DeviceRef::new`], [`DeviceMut::new`]) or raw
/// pointers, all in the runtime's GPU context.
#[derive(Debug)]
pub struct GlaBackwardArgs<'a> {
    /// The dimensions every tensor must agree with (Dk and Dv 64 or 128).
    pub shape: ForwardShape,
    /// The forward's queries `[B, T, H, Dk]`, bf16, contiguous, 16-byte aligned.
    pub q: DeviceRef<'a, bf16>,
    /// The forward's keys `[B, T, H, Dk]`, bf16, contiguous, 16-byte aligned.
    pub k: DeviceRef<'a, bf16>,
    /// The forward's values `[B, T, H, Dv]`, bf16, contiguous, 16-byte aligned.
    pub v: DeviceRef<'a, bf16>,
    /// The forward's log-decays `[B, T, H, Dk]`, fp32, 16-byte aligned, finite and `<= 0` (the
    /// caller's contract: checked in debug builds).
    pub g: DeviceRef<'a, f32>,
    /// The forward's initial state `[B, H, Dk, Dv]` fp32, 8-byte aligned; `None` for zero.
    pub h0: Option<DeviceRef<'a, f32>>,
    /// The state entering every chunk, as the forward wrote it
    /// ([`super::GlaArgs::chunk_states`]): `[B*H, ceil(T / 64), Dk, Dv]` bf16, 16-byte aligned.
    pub chunk_states: DeviceRef<'a, bf16>,
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
    /// Gradient of g `[B, T, H, Dk]`, fp32, 16-byte aligned; every element is written.
    pub dg: DeviceMut<'a, f32>,
    /// Gradient of h0 `[B, H, Dk, Dv]` fp32, 8-byte aligned; `None` to skip it.
    pub dh0: Option<DeviceMut<'a, f32>>,
    /// The forward's `sigma`; `None` for `Dk^-1/2`.
    pub scale: Option<f32>,
    /// The forward's packed documents ([`super::GlaArgs::documents`]); with documents `h0`,
    /// `dht` and `dh0` must be `None`. The gradient of a start's own gate is 0 (nothing reads it).
    pub documents: Option<Documents<'a>>,
}

impl<'a> GlaBackwardArgs<'a> {
    /// The streams of the buffers the views come from ([`crate::ops`], "Ordering").
    pub(crate) fn homes(&self) -> [Option<&'a Arc<CudaStream>>; 14] {
        [
            self.q.home(),
            self.k.home(),
            self.v.home(),
            self.g.home(),
            self.h0.and_then(|h0| h0.home()),
            self.chunk_states.home(),
            self.d_o.home(),
            self.dht.and_then(|d| d.home()),
            self.dq.home(),
            self.dk.home(),
            self.dv.home(),
            self.dg.home(),
            self.dh0.as_ref().and_then(DeviceMut::home),
            self.documents.and_then(|d| d.cu_seqlens.home()),
        ]
    }

    /// Checks lengths, alignment, scale and overlaps against the (validated) shape; returns the
    /// scale to use. `op` names the operation in errors.
    pub(crate) fn check(&self, op: &str) -> Result<f32> {
        let s = &self.shape;
        refuse_states(
            op,
            self.documents.as_ref(),
            &[
                ("h0", self.h0.is_some()),
                ("dht", self.dht.is_some()),
                ("dh0", self.dh0.is_some()),
            ],
        )?;
        let checks = TensorChecks::new(op, s);
        let mut inputs = check_inputs(&checks, s, [self.q, self.k, self.v], self.g, self.h0)?;
        let (qk, v, state) = ("[B, T, H, Dk]", "[B, T, H, Dv]", "[B, H, Dk, Dv]");
        check_measured(
            &checks,
            &[
                ("d_o", self.d_o.len(), v, s.v_len(), self.d_o.addr()),
                (
                    "chunk_states",
                    self.chunk_states.len(),
                    CHUNK_STATES_LAYOUT,
                    chunk_states_len(s),
                    self.chunk_states.addr(),
                ),
                ("dq", self.dq.len(), qk, s.qk_len(), self.dq.addr()),
                ("dk", self.dk.len(), qk, s.qk_len(), self.dk.addr()),
                ("dv", self.dv.len(), v, s.v_len(), self.dv.addr()),
                ("dg", self.dg.len(), qk, s.qk_len(), self.dg.addr()),
            ],
            self.dht
                .map(|d| ("dht", d.len(), state, s.state_len(), d.addr()))
                .into_iter()
                .chain(
                    self.dh0
                        .as_ref()
                        .map(|d| ("dh0", d.len(), state, s.state_len(), d.addr())),
                ),
        )?;
        let scale = checks.scale(self.scale, s)?;
        inputs.push(("d_o", self.d_o.byte_range()));
        inputs.push(("chunk_states", self.chunk_states.byte_range()));
        inputs.extend(self.dht.map(|d| ("dht", d.byte_range())));
        let mut outputs = vec![
            ("dq", self.dq.byte_range()),
            ("dk", self.dk.byte_range()),
            ("dv", self.dv.byte_range()),
            ("dg", self.dg.byte_range()),
        ];
        outputs.extend(self.dh0.as_ref().map(|d| ("dh0", d.byte_range())));
        checks.disjoint(&inputs, &outputs)?;
        Ok(scale)
    }
}

/// Threads of the walk and the summary kernel (`lasp_gla_walk_threads`): a warpgroup per 64
/// columns of Dv.
pub(crate) fn walk_threads(dv: usize) -> u32 {
    128 * (dv as u32 / 64)
}

/// Shared-memory bytes of the walk and the summary kernel (`lasp_gla_walk_smem_bytes`).
pub(crate) fn walk_smem_bytes(dk: usize, dv: usize) -> u32 {
    let (c, dk, dv_) = (CHUNK as u32, dk as u32, dv as u32);
    let stage = c * dk * 2 + c * dv_ * 2 + c * dk * 4;
    header::LASP_GLA_WALK_STAGES * stage + 8 * walk_threads(dv)
}

/// Threads of the grads kernel (`lasp_gla_bwd_grads_threads`): a warpgroup per 64 columns of
/// max(Dk, Dv).
pub(crate) fn grads_threads(dk: usize, dv: usize) -> u32 {
    128 * (dk.max(dv) as u32 / 64)
}

/// Shared-memory bytes of the grads kernel (`lasp_gla_bwd_grads_smem_bytes`); its twin for packed
/// documents takes one more 1024-byte aligned `[64 x Dk]` bf16 tile.
pub(crate) fn grads_smem_bytes(dk: usize, dv: usize, packed: bool) -> u32 {
    let (c, k, v) = (CHUNK as u32, dk as u32, dv as u32);
    let tiles = 2 * c * k * 2 + 2 * c * v * 2 + 2 * k * v * 2;
    let bytes = tiles + c * k * 4 + c * c * 4 + 11 * k * 4 + 8 * grads_threads(dk, dv);
    if packed {
        bytes.next_multiple_of(1024) + c * k * 2
    } else {
        bytes
    }
}

/// Byte offsets of the workspace's parts that only a backward of several segments per sequence
/// has (after `dh`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SegmentOffsets {
    /// The reverse summaries of segments 1..S-1, fp32 `[B*H, S-1, Dk, Dv]`.
    pub ws_m: u64,
    /// The gradient leaving segments 0..S-2, fp32 `[B*H, S-1, Dk, Dv]`.
    pub ws_p: u64,
    /// The summaries' log-decays, fp32 `[B*H, S-1, Dk]`.
    pub ws_lambda: u64,
}

/// How one GLA backward call runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GlaBackwardPlan {
    /// The shape the plan is for.
    pub shape: ForwardShape,
    /// Segments per (b, h) that the walk cuts each sequence into, S >= 1; none is empty.
    pub num_segments: u32,
    /// Chunks of 64 tokens per segment (the last segment may hold fewer).
    pub chunks_per_segment: u32,
    /// Workspace bytes: `dh` at 0, bf16 `[B*H, N, Dk, Dv]`, then the [`SegmentOffsets`] parts
    /// when S > 1.
    pub workspace_bytes: u64,
    /// Byte offsets of `ws_m`, `ws_p`, `ws_lambda` (only when S > 1).
    pub segment_offsets: Option<SegmentOffsets>,
    /// The summary kernel's launch (only when S > 1).
    pub summary: Option<LaunchShape>,
    /// The fold kernel's launch (only when S > 1).
    pub fold: Option<LaunchShape>,
    /// The walk's launch: every segment.
    pub walk: LaunchShape,
    /// The grads kernel's launch: one CTA per (chunk, b*H+h).
    pub grads: LaunchShape,
}

fn align_part(bytes: u64) -> u64 {
    bytes.div_ceil(WORKSPACE_PART_ALIGN) * WORKSPACE_PART_ALIGN
}

impl GlaBackwardPlan {
    /// The plan for `shape` on a GPU of `sm_count` multiprocessors, or with `force_segments`
    /// segments per sequence (clamped to one chunk each at least and rounded so that none is
    /// empty).
    pub fn new(shape: &ForwardShape, sm_count: u32, force_segments: Option<u32>) -> Result<Self> {
        validate_as(
            shape,
            OP,
            "split v, d_o and dht into blocks of 128 columns, run one call per block with the \
             same q, k, g, and add the blocks' dq, dk and dg",
        )?;
        let (b, t, h, dk, dv) = (shape.b, shape.t, shape.h, shape.dk, shape.dv);
        let chunks = t.div_ceil(CHUNK);
        let bh = b * h;
        // A walk CTA takes a whole SM. Walks on about half the SMs already draw most of the
        // memory's bandwidth, and a segment after the first costs its summary's reads too: one
        // segment unless B*H walks would leave more of the SMs idle, else as many as give every
        // SM a walk (H100, B=4 T=8K H=16: one segment 0.05 ms faster than two; B=1 T=32K:
        // eight 0.17 ms faster than four).
        let auto = if bh as f64 >= ONE_SEGMENT_FILL * sm_count as f64 {
            1
        } else {
            sm_count as usize / bh
        };
        let (segments, per_segment) =
            split_into_segments(chunks, force_segments, auto, MAX_SEGMENTS, OP)?;
        let many = segments > 1;
        let states = (bh * chunks * dk * dv * 2) as u64;
        let after_dh = align_part(states);
        let boundaries = (bh * (segments - 1)) as u64;
        let summaries = boundaries * (dk * dv * 4) as u64;
        let segment_offsets = many.then(|| {
            let ws_p = after_dh + align_part(summaries);
            SegmentOffsets {
                ws_m: after_dh,
                ws_p,
                ws_lambda: ws_p + align_part(summaries),
            }
        });
        let workspace_bytes = match segment_offsets {
            Some(o) => o.ws_lambda + boundaries * (dk * 4) as u64,
            None => states,
        };
        let (bh, segments) = (bh as u32, segments as u32);
        let walk_kernel = |y| LaunchShape {
            grid: (1, y, bh),
            block: (walk_threads(dv), 1, 1),
            shared_bytes: walk_smem_bytes(dk, dv),
        };
        Ok(GlaBackwardPlan {
            shape: *shape,
            num_segments: segments,
            chunks_per_segment: per_segment as u32,
            workspace_bytes,
            segment_offsets,
            summary: many.then(|| walk_kernel(segments - 1)),
            fold: many.then_some(LaunchShape {
                grid: (((dk * dv) as u32).div_ceil(FOLD_THREADS), bh, 1),
                block: (FOLD_THREADS, 1, 1),
                shared_bytes: 0,
            }),
            walk: walk_kernel(segments),
            grads: LaunchShape {
                grid: (chunks as u32, bh, 1),
                block: (grads_threads(dk, dv), 1, 1),
                shared_bytes: grads_smem_bytes(dk, dv, false),
            },
        })
    }
}

/// The params of `args`'s tensors and shape, with `dh` at `dh` and the start words at `starts`
/// (0 without documents), for one segment per sequence and no segment workspace: what the grads
/// kernel reads (the walk's own fields are set by callers).
pub(crate) fn chunk_params(
    args: &GlaBackwardArgs<'_>,
    scale: f32,
    dh: u64,
    starts: u64,
) -> GlaBackwardParams {
    let s = &args.shape;
    GlaBackwardParams {
        q: args.q.addr() as _,
        k: args.k.addr() as _,
        v: args.v.addr() as _,
        g: args.g.addr() as _,
        d_o: args.d_o.addr() as _,
        h0: args.h0.map_or(0, |x| x.addr()) as _,
        dht: args.dht.map_or(0, |x| x.addr()) as _,
        dq: args.dq.addr() as _,
        dk: args.dk.addr() as _,
        dv: args.dv.addr() as _,
        dg: args.dg.addr() as _,
        dh0: args.dh0.as_ref().map_or(0, |x| x.addr()) as _,
        chunk_states: args.chunk_states.addr() as _,
        starts: starts as _,
        dh: dh as _,
        ws_m: std::ptr::null_mut(),
        ws_p: std::ptr::null_mut(),
        ws_lambda: std::ptr::null_mut(),
        B: s.b as i32,
        T: s.t as i32,
        H: s.h as i32,
        Dk: s.dk as i32,
        Dv: s.dv as i32,
        num_segments: 1,
        chunks_per_segment: s.t.div_ceil(CHUNK) as i32,
        scale,
    }
}

/// The kernels of one table row per value width (`rows[Dv index]`, each per key width), indexed
/// by [Dv][Dk], with their shared-memory limits raised to `smem(dk, dv)`.
pub(crate) fn kernels_by_width(
    runtime: &Runtime,
    rows: [[&'static str; 2]; 2],
    smem: impl Fn(usize, usize) -> u32,
) -> Result<[[Kernel; 2]; 2]> {
    let module = runtime.module();
    let kernels = [
        module.kernels_per_width(rows[0])?,
        module.kernels_per_width(rows[1])?,
    ];
    for (i, dk) in [64, 128].into_iter().enumerate() {
        for (j, dv) in [64, 128].into_iter().enumerate() {
            kernels[j][i].set_max_dynamic_shared_bytes(smem(dk, dv))?;
        }
    }
    Ok(kernels)
}

/// The kernels of the rows `names` by width ([`kernels_by_width`]) and their twins for packed
/// documents, the rows `packed`.
pub(crate) fn twins_by_width(
    runtime: &Runtime,
    names: [[&'static str; 2]; 2],
    packed: [[&'static str; 2]; 2],
    smem: fn(usize, usize) -> u32,
) -> Result<Twins<[[Kernel; 2]; 2]>> {
    Twins::new([names, packed], |rows| {
        kernels_by_width(runtime, rows, smem)
    })
}

/// The grads kernels (one GPU and LASP-2 share them), indexed by [Dv][Dk].
pub(crate) fn grads_kernels(runtime: &Runtime) -> Result<Twins<[[Kernel; 2]; 2]>> {
    let plain = [
        instances::GLA_BWD_GRADS_DV64,
        instances::GLA_BWD_GRADS_DV128,
    ];
    let packed = [
        instances::GLA_BWD_GRADS_DV64_PACKED,
        instances::GLA_BWD_GRADS_DV128_PACKED,
    ];
    Twins::new([(plain, false), (packed, true)], |(rows, packed)| {
        kernels_by_width(runtime, rows, |dk, dv| grads_smem_bytes(dk, dv, packed))
    })
}

/// The GLA backward: its kernels and its workspace (the states entering and the state gradients
/// leaving every chunk, and the segments' summaries and prefixes).
///
/// One instance may be launched many times on one stream; launches of one instance on different
/// streams must be ordered by the caller (they share the workspace). The workspace grows on
/// demand (a context synchronisation then) and is freed when the instance is dropped.
pub struct GlaBackward {
    ctx: Arc<CudaContext>,
    /// Indexed by [Dv][Dk]: Dv 64, 128.
    summary: Twins<[[Kernel; 2]; 2]>,
    /// Indexed by [Dv][Dk]: Dv 64, 128.
    walk: Twins<[[Kernel; 2]; 2]>,
    /// Indexed by [Dv][Dk]: Dv 64, 128.
    grads: Twins<[[Kernel; 2]; 2]>,
    fold: Kernel,
    sm_count: u32,
    force_segments: Option<u32>,
    words: StartWords,
    workspace: Option<CudaSlice<u8>>,
}

impl GlaBackward {
    /// Looks up the kernels in the runtime's module and raises their shared-memory limits; an
    /// error if this GPU cannot give a block that much shared memory.
    pub fn new(runtime: &Runtime) -> Result<Self> {
        require_shared_memory(
            runtime,
            OP,
            walk_smem_bytes(128, 128).max(grads_smem_bytes(128, 128, true)),
        )?;
        let walk_rows = [instances::GLA_BWD_WALK_DV64, instances::GLA_BWD_WALK_DV128];
        let packed_walk_rows = [
            instances::GLA_BWD_WALK_DV64_PACKED,
            instances::GLA_BWD_WALK_DV128_PACKED,
        ];
        let summary_rows = [
            instances::GLA_BWD_SUMMARY_DV64,
            instances::GLA_BWD_SUMMARY_DV128,
        ];
        let packed_summary_rows = [
            instances::GLA_BWD_SUMMARY_DV64_PACKED,
            instances::GLA_BWD_SUMMARY_DV128_PACKED,
        ];
        let summary = twins_by_width(runtime, summary_rows, packed_summary_rows, walk_smem_bytes)?;
        let walk = twins_by_width(runtime, walk_rows, packed_walk_rows, walk_smem_bytes)?;
        let grads = grads_kernels(runtime)?;
        let ctx = runtime.context().clone();
        Ok(GlaBackward {
            fold: runtime.module().kernel("lasp_gla_bwd_fold")?,
            sm_count: crate::ops::sm_count(&ctx)?,
            ctx,
            summary,
            walk,
            grads,
            force_segments: None,
            words: StartWords::new(runtime)?,
            workspace: None,
        })
    }

    /// Forces the number of segments per sequence of the walk (tests and tuning), or restores
    /// the automatic plan with `None`.
    pub fn set_num_segments(&mut self, segments: Option<u32>) -> Result<()> {
        check_forced_segments(segments, OP)?;
        self.force_segments = segments;
        Ok(())
    }

    /// The plan a launch of `shape` would use (validates the shape).
    pub fn plan(&self, shape: &ForwardShape) -> Result<GlaBackwardPlan> {
        GlaBackwardPlan::new(shape, self.sm_count, self.force_segments)
    }

    /// Enqueues the backward on `stream` (a stream of the runtime's context) and returns the plan
    /// it used. Everything is validated before the first launch; in debug builds the gates are
    /// checked too, which synchronises `stream`.
    pub fn launch(
        &mut self,
        stream: &Arc<CudaStream>,
        args: GlaBackwardArgs<'_>,
    ) -> Result<GlaBackwardPlan> {
        StreamOrder::around(stream, args.homes(), OP, || self.enqueue(stream, args))
    }

    fn enqueue(
        &mut self,
        stream: &Arc<CudaStream>,
        args: GlaBackwardArgs<'_>,
    ) -> Result<GlaBackwardPlan> {
        let plan = self.plan(&args.shape)?;
        let scale = args.check(OP)?;
        crate::ops::require_runtime_stream(stream, &self.ctx, OP)?;
        if cfg!(debug_assertions) {
            validate_gates_of(OP, &self.ctx, stream, args.g, &args.shape)?;
        }
        // The start words (packed documents) after the plan's parts.
        let (base, [starts]) = self.words.workspace(
            &self.ctx,
            stream,
            &mut self.workspace,
            plan.workspace_bytes,
            args.documents,
            args.shape.t,
            [LoopOrder::InOrder],
            OP,
        )?;
        let (ws_m, ws_p, ws_lambda) = plan.segment_offsets.map_or((0, 0, 0), |o| {
            (base + o.ws_m, base + o.ws_p, base + o.ws_lambda)
        });
        let s = &args.shape;
        let params = GlaBackwardParams {
            ws_m: ws_m as _,
            ws_p: ws_p as _,
            ws_lambda: ws_lambda as _,
            num_segments: plan.num_segments as i32,
            chunks_per_segment: plan.chunks_per_segment as i32,
            ..chunk_params(&args, scale, base, starts)
        };
        let (i, j) = (width_index(s.dk), width_index(s.dv));
        let packed = args.documents.is_some();
        // SAFETY: GlaBackwardParams is lasp_gla_bwd_params, generated from the header; the shape
        // is supported and every tensor has the length, alignment and non-overlap the kernels
        // need (checked above); the views borrow their buffers for the call and their contracts
        // keep the memory valid until the kernels complete; the workspace holds every part at
        // the plan's offsets (sized by the plan), is owned by self and is freed only after a
        // context synchronisation.
        unsafe {
            if let (Some(summary), Some(fold)) = (plan.summary, plan.fold) {
                self.summary.get(packed)[j][i].launch(stream, summary, &params)?;
                self.fold.launch(stream, fold, &params)?;
            }
            self.walk.get(packed)[j][i].launch(stream, plan.walk, &params)?;
            // The plan's launch, with the twin's shared memory where the call has documents.
            let grads = LaunchShape {
                shared_bytes: grads_smem_bytes(s.dk, s.dv, packed),
                ..plan.grads
            };
            self.grads.get(packed)[j][i].launch(stream, grads, &params)?;
        }
        Ok(plan)
    }
}

impl Drop for GlaBackward {
    fn drop(&mut self) {
        // Earlier launches may still use the workspace.
        if self.workspace.is_some() {
            let _ = self.ctx.synchronize();
        }
    }
}
