//! [`GatedDeltaForward`]: the Gated DeltaNet forward's kernels, workspace and launches, and the
//! checks of one call's tensors ([`GatedDeltaArgs`]) before anything is launched.

use super::GatedDeltaParams;
use crate::error::Result;
use crate::kernel::{width_index, Kernel, LaunchShape};
use crate::ops::documents::final_states::DocumentEntries;
use crate::ops::scalar_decay::{geometry, ForwardShape, TensorChecks};
use crate::ops::{
    bf16, check_forced_segments, require_shared_memory, DeviceMut, DeviceRef, Scope, StreamOrder,
};
use crate::runtime::Runtime;
use crate::tensor_map;
use cudarc::driver::{sys, CudaContext, CudaSlice, CudaStream};
use lasp_shmem_kernels::{instances, params as header};
use std::sync::Arc;

const OP: &str = "Gated DeltaNet forward";
const CHUNK: u32 = header::LASP_SD_CHUNK;

/// The tensors of one call; views from cudarc buffers ([`DeviceRef::new`], [`DeviceMut::new`])
/// or raw pointers, all in the runtime's GPU context.
#[derive(Debug)]
pub struct GatedDeltaArgs<'a> {
    /// The dimensions every tensor must agree with (Dk 64 or 128, Dv a multiple of 64).
    pub shape: ForwardShape,
    /// Queries `[B, T, H, Dk]`, bf16, contiguous, 16-byte aligned.
    pub q: DeviceRef<'a, bf16>,
    /// Keys `[B, T, H, Dk]`, bf16, contiguous, 16-byte aligned (l2-normalised where the model
    /// normalises them: the kernels take them as given).
    pub k: DeviceRef<'a, bf16>,
    /// Values `[B, T, H, Dv]`, bf16, contiguous, 16-byte aligned.
    pub v: DeviceRef<'a, bf16>,
    /// Log-decays `[B, T, H]`, fp32, finite and `<= 0` (the caller's contract).
    pub g: DeviceRef<'a, f32>,
    /// Write strengths `[B, T, H]`, fp32, finite (usually in `[0, 1]`, a sigmoid's output).
    pub beta: DeviceRef<'a, f32>,
    /// Initial state `[B, H, Dk, Dv]` fp32, 8-byte aligned; `None` for zero.
    pub h0: Option<DeviceRef<'a, f32>>,
    /// Output `[B, T, H, Dv]`, bf16, 16-byte aligned; every element is written.
    pub o: DeviceMut<'a, bf16>,
    /// Final state `[B, H, Dk, Dv]` fp32, 8-byte aligned; `None` to skip it.
    pub ht: Option<DeviceMut<'a, f32>>,
    /// `sigma` in `o_t = sigma q_t S_t`; `None` for `Dk^-1/2`.
    pub scale: Option<f32>,
}

impl<'a> GatedDeltaArgs<'a> {
    /// The streams of the buffers the views come from ([`crate::ops`], "Ordering").
    pub(super) fn homes(&self) -> [Option<&'a Arc<CudaStream>>; 8] {
        [
            self.q.home(),
            self.k.home(),
            self.v.home(),
            self.g.home(),
            self.beta.home(),
            self.h0.and_then(|h0| h0.home()),
            self.o.home(),
            self.ht.as_ref().and_then(DeviceMut::home),
        ]
    }

    /// Checks the shape, then lengths, alignment, scale and overlaps against it; returns the
    /// scale to use.
    pub(super) fn check(&self, op: &str) -> Result<f32> {
        self.check_saving(op, None)
    }

    /// [`GatedDeltaArgs::check`] with one more output, the state entering a LASP-2 shard
    /// (`[B, H, Dk, Dv]` fp32, 8-byte aligned), where the call saves it.
    pub(super) fn check_saving(
        &self,
        op: &str,
        start_state: Option<&DeviceMut<'_, f32>>,
    ) -> Result<f32> {
        let s = &self.shape;
        s.validate_as(op)?;
        let checks = TensorChecks::new(op, s);
        let inputs = check_inputs(
            &checks,
            s,
            [self.q, self.k, self.v],
            [self.g, self.beta],
            self.h0,
        )?;
        let (v, state) = ("[B, T, H, Dv]", "[B, H, Dk, Dv]");
        checks.tensor("o", v, (self.o.len(), s.v_len()), self.o.addr(), 16)?;
        if let Some(ht) = &self.ht {
            checks.tensor("ht", state, (ht.len(), s.state_len()), ht.addr(), 8)?;
        }
        let scale = checks.scale(self.scale, s)?;
        if let Some(saved) = start_state {
            checks.tensor(
                "start_state",
                state,
                (saved.len(), s.state_len()),
                saved.addr(),
                8,
            )?;
        }
        let mut outputs = vec![("o", self.o.byte_range())];
        outputs.extend(self.ht.as_ref().map(|ht| ("ht", ht.byte_range())));
        outputs.extend(start_state.map(|saved| ("start_state", saved.byte_range())));
        checks.disjoint(&inputs, &outputs)?;
        Ok(scale)
    }
}

/// Checks the lengths and alignment of the forward's inputs (`q, k, v`, `g, beta`, `h0`), which
/// the backward reads too, against the (validated) shape; returns their byte ranges by name, for
/// the overlap check with the outputs.
pub(super) fn check_inputs(
    checks: &TensorChecks<'_>,
    s: &ForwardShape,
    [q, k, v]: [DeviceRef<'_, bf16>; 3],
    [g, beta]: [DeviceRef<'_, f32>; 2],
    h0: Option<DeviceRef<'_, f32>>,
) -> Result<Vec<(&'static str, (u64, u64))>> {
    let (qk, values, gates, state) = (
        "[B, T, H, Dk]",
        "[B, T, H, Dv]",
        "[B, T, H]",
        "[B, H, Dk, Dv]",
    );
    checks.tensor("q", qk, (q.len(), s.qk_len()), q.addr(), 16)?;
    checks.tensor("k", qk, (k.len(), s.qk_len()), k.addr(), 16)?;
    checks.tensor("v", values, (v.len(), s.v_len()), v.addr(), 16)?;
    checks.tensor("g", gates, (g.len(), s.gate_len()), g.addr(), 4)?;
    checks.tensor("beta", gates, (beta.len(), s.gate_len()), beta.addr(), 4)?;
    if let Some(h0) = h0 {
        checks.tensor("h0", state, (h0.len(), s.state_len()), h0.addr(), 8)?;
    }
    let mut ranges = vec![
        ("q", q.byte_range()),
        ("k", k.byte_range()),
        ("v", v.byte_range()),
        ("g", g.byte_range()),
        ("beta", beta.byte_range()),
    ];
    ranges.extend(h0.map(|h0| ("h0", h0.byte_range())));
    Ok(ranges)
}

/// Shared-memory bytes of the WY kernel (`lasp_gdn_wy_smem_bytes`): the K tile, the chunk's gates
/// and betas, `(I + L)^{-1}` transposed in fp32.
pub(super) fn wy_smem_bytes(dk: usize) -> u32 {
    CHUNK * dk as u32 * 2 + 2 * CHUNK * 4 + CHUNK * header::LASP_GDN_TRI_PITCH * 4
}

/// Shared-memory bytes of a loop of `loop_bytes` with the values step (`lasp_gdn_values_smem_bytes`):
/// from the next 1024-byte boundary, the values step's tiles and betas.
fn with_values_step(loop_bytes: u32) -> u32 {
    let tile = CHUNK * CHUNK * 2;
    loop_bytes.next_multiple_of(1024)
        + header::LASP_SD_STAGES * tile
        + tile
        + header::LASP_SD_STAGES * CHUNK * 4
}

/// Shared-memory bytes of the output kernel (`lasp_gdn_output_smem_bytes`): scalar decay's
/// output loop with the values step.
pub(super) fn output_smem_bytes(dk: usize) -> u32 {
    with_values_step(geometry::output_smem_bytes(dk as i32))
}

/// Shared-memory bytes of the summary kernel (`lasp_gdn_summary_smem_bytes`): the loop without Q
/// with the values step, small enough for two CTAs per SM.
pub(super) fn summary_smem_bytes(dk: usize) -> u32 {
    with_values_step(geometry::update_smem_bytes(dk as i32))
}

/// Shared-memory bytes of the output kernel with roles (`lasp_gdn_roles_smem_bytes`): scalar
/// decay's two-role loop at LASP_GDN_ROLES_STAGES stages with an mbarrier each, then the WY form's
/// tiles: three (I + L)^{-1} slots, T_u and the scaled u (bf16 64 x 64 each), -W (bf16 64 x Dk)
/// and three slots of betas.
pub(super) fn roles_smem_bytes(dk: usize) -> u32 {
    let (stages, dk) = (header::LASP_GDN_ROLES_STAGES, dk as u32);
    let tile = CHUNK * CHUNK * 2;
    let stage = 2 * CHUNK * dk * 2 + CHUNK * 64 * 2;
    let looped = stages * stage + 2 * dk * 64 * 2 + stages * CHUNK * 4 + 8 * stages;
    looped.next_multiple_of(1024)
        + 6 * tile
        + CHUNK * dk * 2
        + 3 * CHUNK * 4
        + stages * CHUNK * header::LASP_GDN_GATE_BOX_HEADS * 4
}

/// How a call runs: S segments of `chunks_per_segment` chunks per sequence (no segment empty),
/// the launches and the workspace (byte offsets of its parts).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GatedDeltaPlan {
    pub num_segments: u32,
    pub chunks_per_segment: u32,
    /// Segments with an affine summary in the workspace (S - 1 on one GPU, S in LASP-2).
    pub num_summaries: u32,
    pub wy: LaunchShape,
    /// The summary launch (where `num_summaries > 0`) and the fold's (where a fold runs).
    pub summary: Option<LaunchShape>,
    pub fold: Option<LaunchShape>,
    pub output: LaunchShape,
    /// Whether the output pass is the roles kernel (the WY form in three warpgroups, where the
    /// GPU runs it and the instance allows it), with its launch; else `output`.
    pub output_roles: Option<LaunchShape>,
    pub workspace_bytes: u64,
    /// Offsets of ws_a, ws_b and ws_p (after the `(I + L)^{-1}` tiles at 0), where a fold runs.
    pub summary_offsets: Option<(u64, u64, u64)>,
}

impl GatedDeltaPlan {
    /// The plan of a validated `shape` on `sm_count` SMs: enough segments that the output pass's
    /// CTAs, (Dv / 64) x S x B*H, fill the SMs once (at most one per chunk), or `forced`.
    pub(super) fn new(
        s: &ForwardShape,
        sm_count: u32,
        forced: Option<u32>,
        scope: Scope,
    ) -> GatedDeltaPlan {
        let chunks = s.t.div_ceil(CHUNK as usize) as u64;
        let bh = (s.b * s.h) as u64;
        let tiles = (s.dv / 64) as u64;
        let wanted = forced.map_or_else(|| (u64::from(sm_count) / (bh * tiles)).max(1), u64::from);
        let chunks_per_segment = chunks.div_ceil(wanted.clamp(1, chunks));
        let segments = chunks.div_ceil(chunks_per_segment);
        let (summaries, folds) = match scope {
            Scope::SingleGpu => (segments - 1, segments > 1),
            Scope::Shard => (segments, true),
        };
        let tile_bytes = u64::from(CHUNK * CHUNK) * 2;
        let tri = bh * chunks * tile_bytes;
        let (a_bytes, b_bytes, p_bytes) = (
            bh * summaries * (s.dk * s.dk) as u64 * 4,
            bh * summaries * (s.dk * s.dv) as u64 * 4,
            bh * segments * (s.dk * s.dv) as u64 * 4,
        );
        let ws_a = tri.next_multiple_of(256);
        let (ws_b, ws_p) = (ws_a + a_bytes, ws_a + a_bytes + b_bytes);
        let bh = bh as u32;
        GatedDeltaPlan {
            num_segments: segments as u32,
            chunks_per_segment: chunks_per_segment as u32,
            num_summaries: summaries as u32,
            wy: LaunchShape {
                grid: (chunks as u32, bh, 1),
                block: (header::LASP_GDN_WY_THREADS, 1, 1),
                shared_bytes: wy_smem_bytes(s.dk),
            },
            summary: (summaries > 0).then_some(LaunchShape {
                grid: (((s.dk + s.dv) / 64) as u32, summaries as u32, bh),
                block: (header::LASP_SD_THREADS, 1, 1),
                shared_bytes: summary_smem_bytes(s.dk),
            }),
            fold: folds.then_some(LaunchShape {
                grid: ((s.dv / 64) as u32, bh, 1),
                block: (header::LASP_GDN_FOLD_THREADS, 1, 1),
                shared_bytes: 0,
            }),
            output: LaunchShape {
                grid: ((s.dv / 64) as u32, segments as u32, bh),
                block: (header::LASP_SD_THREADS, 1, 1),
                shared_bytes: output_smem_bytes(s.dk),
            },
            output_roles: None,
            workspace_bytes: if folds { ws_p + p_bytes } else { tri },
            summary_offsets: folds.then_some((ws_a, ws_b, ws_p)),
        }
    }
}

/// The kernels of the forward's chunk passes (WY, segment summaries, output), per Dk, shared by the
/// single-GPU forward and the LASP-2 forward, which differ only in their fold.
pub(super) struct ChunkKernels {
    /// Indexed by Dk: [64, 128].
    wy: [Kernel; 2],
    summary: [Kernel; 2],
    output: [Kernel; 2],
    /// The output kernels with roles, where the GPU runs them (sm_90 and its shared memory).
    output_roles: Option<[Kernel; 2]>,
    /// The walks that store the states the documents' final states start from.
    entries_walk: [Kernel; 2],
    /// Whether plans take them (tests run the one-warpgroup kernel too).
    use_roles: bool,
}

impl ChunkKernels {
    /// Looks up the kernels in the runtime's module and raises their shared-memory limits; an
    /// error if this GPU cannot give a block that much shared memory.
    pub(super) fn new(runtime: &Runtime, op: &str) -> Result<Self> {
        require_shared_memory(runtime, op, output_smem_bytes(128))?;
        let module = runtime.module();
        let ctx = runtime.context();
        let optin = ctx.attribute(
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
        )? as u32;
        let (major, _) = ctx.compute_capability()?;
        let output_roles = if major >= 9 && optin >= roles_smem_bytes(128) {
            let kernels = module.kernels_per_width(instances::GDN_OUTPUT_ROLES)?;
            for (i, dk) in [64, 128].into_iter().enumerate() {
                kernels[i].set_max_dynamic_shared_bytes(roles_smem_bytes(dk))?;
            }
            Some(kernels)
        } else {
            None
        };
        let kernels = ChunkKernels {
            wy: module.kernels_per_width(instances::GDN_WY)?,
            summary: summary_kernels(runtime)?,
            output: module.kernels_per_width(instances::GDN_OUTPUT)?,
            output_roles,
            entries_walk: module.kernels_per_width(instances::GDN_DOCUMENT_ENTRIES_WALK)?,
            use_roles: true,
        };
        for (i, dk) in [64, 128].into_iter().enumerate() {
            kernels.wy[i].set_max_dynamic_shared_bytes(wy_smem_bytes(dk))?;
            kernels.output[i].set_max_dynamic_shared_bytes(output_smem_bytes(dk))?;
            kernels.entries_walk[i].set_max_dynamic_shared_bytes(summary_smem_bytes(dk))?;
        }
        Ok(kernels)
    }

    /// `plan` with the roles kernel as its output pass where the kernels allow it.
    pub(super) fn choose_output(
        &self,
        mut plan: GatedDeltaPlan,
        s: &ForwardShape,
    ) -> GatedDeltaPlan {
        if self.output_roles.is_some() && self.use_roles {
            plan.output_roles = Some(LaunchShape {
                grid: plan.output.grid,
                block: (header::LASP_GDN_ROLES_THREADS, 1, 1),
                shared_bytes: roles_smem_bytes(s.dk),
            });
        }
        plan
    }

    /// The WY kernel, then the segments' summaries where the plan has any.
    ///
    /// # Safety
    /// `params` comes from [`call_params`] for `plan` with checked arguments whose buffers stay
    /// valid until the kernels complete, and a workspace of `plan.workspace_bytes` that no other
    /// stream uses meanwhile.
    pub(super) unsafe fn launch_summaries(
        &self,
        stream: &Arc<CudaStream>,
        plan: &GatedDeltaPlan,
        params: &GatedDeltaParams,
    ) -> Result<()> {
        let i = width_index(params.Dk as usize);
        // SAFETY: the caller's contract.
        unsafe {
            self.wy[i].launch(stream, plan.wy, params)?;
            if let Some(summary) = plan.summary {
                self.summary[i].launch(stream, summary, params)?;
            }
        }
        Ok(())
    }

    /// The walk that stores the states `params`' entries name (after the fold, where the plan
    /// has one): the output pass's grid without O, in the summary's shared memory.
    ///
    /// # Safety
    /// As [`ChunkKernels::launch_summaries`]; `params`' entries address live buffers of their
    /// sizes, the slots written before on `stream`.
    pub(super) unsafe fn launch_entries_walk(
        &self,
        stream: &Arc<CudaStream>,
        plan: &GatedDeltaPlan,
        params: &GatedDeltaParams,
    ) -> Result<()> {
        let shape = LaunchShape {
            shared_bytes: summary_smem_bytes(params.Dk as usize),
            ..plan.output
        };
        // SAFETY: the caller's contract.
        unsafe { self.entries_walk[width_index(params.Dk as usize)].launch(stream, shape, params) }
    }

    /// The output kernel (after the fold, where the plan has one).
    ///
    /// # Safety
    /// As [`ChunkKernels::launch_summaries`].
    pub(super) unsafe fn launch_output(
        &self,
        stream: &Arc<CudaStream>,
        plan: &GatedDeltaPlan,
        params: &GatedDeltaParams,
    ) -> Result<()> {
        let i = width_index(params.Dk as usize);
        match (plan.output_roles, &self.output_roles) {
            (Some(shape), Some(roles)) => {
                let s = plan_shape(params);
                let map = |what: &str, addr: u64, width: usize| {
                    tensor_map::bf16_token_tiles(what, addr, [width, s.h, s.t, s.b])
                };
                // The gates come with each chunk's tiles where a box of GATE_BOX_HEADS heads can
                // map them (its rows are 16 bytes); else each role reads them from memory.
                let g = params.g as u64;
                let gates = (s.h % GATE_BOX_HEADS == 0 && g % 16 == 0)
                    .then(|| {
                        tensor_map::f32_token_boxes(
                            "Gated DeltaNet forward, g",
                            g,
                            [s.h, s.t, s.b],
                            GATE_BOX_HEADS as u32,
                        )
                    })
                    .transpose()?;
                let roles_params = RolesParams {
                    p: *params,
                    q: map("Gated DeltaNet forward, q", params.q as u64, s.dk)?,
                    k: map("Gated DeltaNet forward, k", params.k as u64, s.dk)?,
                    v: map("Gated DeltaNet forward, v", params.v as u64, s.dv)?,
                    o: map("Gated DeltaNet forward, o", params.o as u64, s.dv)?,
                    gates_by_tma: i32::from(gates.is_some()),
                    g: gates.unwrap_or_default(),
                    // The padding bindgen spells out between `p` and the 128-byte-aligned maps.
                    ..Default::default()
                };
                // SAFETY: the caller's contract; the maps describe the same tensors as `params`.
                unsafe { roles[i].launch(stream, shape, &roles_params) }
            }
            // SAFETY: the caller's contract.
            _ => unsafe { self.output[i].launch(stream, plan.output, params) },
        }
    }
}

/// The summary kernels, per Dk (the forward's, and the backward's where it has segments), with
/// their shared-memory limits raised.
pub(super) fn summary_kernels(runtime: &Runtime) -> Result<[Kernel; 2]> {
    let summary = runtime.module().kernels_per_width(instances::GDN_SUMMARY)?;
    for (i, dk) in [64, 128].into_iter().enumerate() {
        summary[i].set_max_dynamic_shared_bytes(summary_smem_bytes(dk))?;
        // Two of its CTAs share an SM only with the largest carveout: one's chain of dependent
        // products then runs while the other's waits.
        summary[i].prefer_max_shared_memory()?;
    }
    Ok(summary)
}

/// The dimensions `params` carries.
fn plan_shape(params: &GatedDeltaParams) -> ForwardShape {
    ForwardShape {
        b: params.B as usize,
        t: params.T as usize,
        h: params.H as usize,
        dk: params.Dk as usize,
        dv: params.Dv as usize,
    }
}

/// The C struct `lasp_gdn_roles_params`: the forward's parameters, the tensor maps of q, k, v, o
/// and where it fits g's.
type RolesParams = header::lasp_gdn_roles_params;

/// Heads per box of the roles kernel's gate copies.
const GATE_BOX_HEADS: usize = header::LASP_GDN_GATE_BOX_HEADS as usize;

/// The kernels' parameters for one call of `args` (checked) under `plan`, with the workspace at
/// device address `workspace` (at least `plan.workspace_bytes`).
pub(super) fn call_params(
    args: &GatedDeltaArgs<'_>,
    plan: &GatedDeltaPlan,
    workspace: u64,
    scale: f32,
) -> GatedDeltaParams {
    GatedDeltaParams {
        o: args.o.addr() as _,
        ht: args.ht.as_ref().map_or(0, |x| x.addr()) as _,
        ..input_params(
            &args.shape,
            [args.q, args.k, args.v],
            [args.g, args.beta],
            args.h0,
            plan,
            workspace,
            scale,
        )
    }
}

/// The kernels' parameters for the checked inputs of one call of `shape` under `plan`, with the
/// workspace at device address `workspace`, and no outputs (o and ht NULL): what the backward
/// runs the forward's summary kernel and fold with.
pub(super) fn input_params(
    shape: &ForwardShape,
    [q, k, v]: [DeviceRef<'_, bf16>; 3],
    [g, beta]: [DeviceRef<'_, f32>; 2],
    h0: Option<DeviceRef<'_, f32>>,
    plan: &GatedDeltaPlan,
    workspace: u64,
    scale: f32,
) -> GatedDeltaParams {
    let (ws_a, ws_b, ws_p) = plan.summary_offsets.map_or((0, 0, 0), |(a, b, p)| {
        (workspace + a, workspace + b, workspace + p)
    });
    GatedDeltaParams {
        q: q.addr() as _,
        k: k.addr() as _,
        v: v.addr() as _,
        g: g.addr() as _,
        beta: beta.addr() as _,
        o: std::ptr::null_mut(),
        h0: h0.map_or(0, |x| x.addr()) as _,
        ht: std::ptr::null_mut(),
        ws_tri: workspace as _,
        ws_a: ws_a as _,
        ws_b: ws_b as _,
        ws_p: ws_p as _,
        entry_slots: std::ptr::null(),
        document_states: std::ptr::null_mut(),
        documents: 0,
        B: shape.b as i32,
        T: shape.t as i32,
        H: shape.h as i32,
        Dk: shape.dk as i32,
        Dv: shape.dv as i32,
        num_segments: plan.num_segments as i32,
        chunks_per_segment: plan.chunks_per_segment as i32,
        num_summaries: plan.num_summaries as i32,
        scale,
    }
}

/// The Gated DeltaNet forward: its kernels, its plan policy and its workspace.
///
/// One instance may be launched many times on one stream; launches of one instance on different
/// streams must be ordered by the caller (they share the workspace). The workspace grows on
/// demand (a context synchronisation then) and is freed when the instance is dropped.
pub struct GatedDeltaForward {
    ctx: Arc<CudaContext>,
    kernels: ChunkKernels,
    /// Indexed by Dk: [64, 128].
    fold: [Kernel; 2],
    sm_count: u32,
    force_segments: Option<u32>,
    workspace: Option<CudaSlice<u8>>,
}

impl GatedDeltaForward {
    /// Looks up the kernels in the runtime's module and raises their shared-memory limits; an
    /// error if this GPU cannot give a block that much shared memory.
    pub fn new(runtime: &Runtime) -> Result<Self> {
        let kernels = ChunkKernels::new(runtime, OP)?;
        let fold = runtime.module().kernels_per_width(instances::GDN_FOLD)?;
        let ctx = runtime.context().clone();
        Ok(GatedDeltaForward {
            sm_count: crate::ops::sm_count(&ctx)?,
            ctx,
            kernels,
            fold,
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
    pub fn plan(&self, shape: &ForwardShape) -> Result<GatedDeltaPlan> {
        shape.validate_as(OP)?;
        let plan = GatedDeltaPlan::new(shape, self.sm_count, self.force_segments, Scope::SingleGpu);
        Ok(self.kernels.choose_output(plan, shape))
    }

    /// Whether plans run the output kernel with roles (the default, where the GPU runs it) or the
    /// one-warpgroup one (tests run both).
    pub fn set_two_role_output(&mut self, enabled: bool) {
        self.kernels.use_roles = enabled;
    }

    /// Enqueues the forward on `stream` (a stream of the runtime's context) and returns the plan
    /// it used. Everything is validated before the first launch.
    pub fn launch(
        &mut self,
        stream: &Arc<CudaStream>,
        args: GatedDeltaArgs<'_>,
    ) -> Result<GatedDeltaPlan> {
        StreamOrder::around(stream, args.homes(), OP, || self.enqueue(stream, args))
    }

    /// The plan for `shape` and its workspace's address, grown for it on `stream` (a stream of
    /// the runtime's context, checked).
    fn plan_on(
        &mut self,
        stream: &Arc<CudaStream>,
        shape: &ForwardShape,
    ) -> Result<(GatedDeltaPlan, u64)> {
        let plan = self.plan(shape)?;
        crate::ops::require_runtime_stream(stream, &self.ctx, OP)?;
        let base = crate::ops::ensure_workspace(
            &self.ctx,
            stream,
            &mut self.workspace,
            plan.workspace_bytes,
            OP,
        )?;
        Ok((plan, base))
    }

    fn enqueue(
        &mut self,
        stream: &Arc<CudaStream>,
        args: GatedDeltaArgs<'_>,
    ) -> Result<GatedDeltaPlan> {
        let scale = args.check(OP)?;
        let (plan, base) = self.plan_on(stream, &args.shape)?;
        let params = call_params(&args, &plan, base, scale);
        self.ctx.bind_to_thread()?;
        // SAFETY: GatedDeltaParams is lasp_gated_delta_params, generated from the header; the
        // shape is supported and every tensor has the length, alignment and non-overlap the
        // kernels need (checked above); the views borrow their buffers for the call and their
        // contracts keep the memory valid until the kernels complete; the workspace is owned by
        // self, sized by the plan, and freed only after a context synchronisation.
        unsafe {
            self.launch_segment_starts(stream, &plan, &params)?;
            self.kernels.launch_output(stream, &plan, &params)?;
        }
        Ok(plan)
    }
}

/// The tensors of [`GatedDeltaForward::launch_document_entries_walk`], checked against `shape` by
/// whoever builds it (the walk reads k, v, g and beta, and starts from h0).
pub(super) struct EntriesWalk<'a> {
    pub(super) shape: ForwardShape,
    pub(super) k: DeviceRef<'a, bf16>,
    pub(super) v: DeviceRef<'a, bf16>,
    pub(super) g: DeviceRef<'a, f32>,
    pub(super) beta: DeviceRef<'a, f32>,
    pub(super) h0: Option<DeviceRef<'a, f32>>,
}

impl GatedDeltaForward {
    /// The forward's chain over `walk`'s tokens from its `h0` without outputs, storing the states
    /// `entries` names: the WY kernel, the segments' summaries and the fold where the plan has
    /// them, then the walk. On LASP-2 shards, after the forward, from the state it saved as
    /// entering the shard.
    ///
    /// # Safety
    /// `entries` addresses live device buffers of its sizes for the shape, the slots written
    /// before on `stream`; nothing else uses the states until the kernels complete.
    pub(super) unsafe fn launch_document_entries_walk(
        &mut self,
        stream: &Arc<CudaStream>,
        walk: &EntriesWalk<'_>,
        entries: DocumentEntries,
    ) -> Result<()> {
        let (plan, base) = self.plan_on(stream, &walk.shape)?;
        // q is never read (the walk has no O): k stands in for it, of the same length.
        let params = GatedDeltaParams {
            entry_slots: entries.slots as _,
            document_states: entries.states as _,
            documents: entries.documents as i32,
            ..input_params(
                &walk.shape,
                [walk.k, walk.k, walk.v],
                [walk.g, walk.beta],
                walk.h0,
                &plan,
                base,
                1.0,
            )
        };
        self.ctx.bind_to_thread()?;
        // SAFETY: GatedDeltaParams is lasp_gated_delta_params, generated from the header; the
        // caller checked the tensors against the shape (EntriesWalk's contract) and keeps them
        // live until the kernels complete; the workspace is owned by self, sized by the plan, and
        // freed only after a context synchronisation; the entries are this function's contract.
        unsafe {
            self.launch_segment_starts(stream, &plan, &params)?;
            self.kernels.launch_entries_walk(stream, &plan, &params)
        }
    }

    /// The WY kernel, the segments' summaries and the fold where the plan has them: what every
    /// pass of the chain needs before it walks its segments from their start states.
    ///
    /// # Safety
    /// As [`ChunkKernels::launch_summaries`].
    unsafe fn launch_segment_starts(
        &self,
        stream: &Arc<CudaStream>,
        plan: &GatedDeltaPlan,
        params: &GatedDeltaParams,
    ) -> Result<()> {
        // SAFETY: the caller's contract; the fold reads what the summaries wrote.
        unsafe {
            self.kernels.launch_summaries(stream, plan, params)?;
            if let Some(fold) = plan.fold {
                self.fold[width_index(params.Dk as usize)].launch(stream, fold, params)?;
            }
        }
        Ok(())
    }
}

impl Drop for GatedDeltaForward {
    fn drop(&mut self) {
        // Earlier launches may still read the workspace.
        if self.workspace.is_some() {
            let _ = self.ctx.synchronize();
        }
    }
}
