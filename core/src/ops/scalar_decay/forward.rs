//! [`ScalarDecayForward`]: the forward's kernels, its plan policy and workspace, and its
//! launches: the forward itself, the passes the backward runs through it (reversed, writing
//! block states) and the output probes.

use super::{
    check_args, check_gate_values, geometry, invalid, roles_params, ForwardArgs, ForwardPlan,
    ForwardShape, OutputProbe, RolesParams, ScalarDecayParams,
};
use crate::error::{Error, Result};
use crate::kernel::{width_index, Kernel, LaunchShape};
use crate::ops::documents::final_states::DocumentEntries;
use crate::ops::{DeviceRef, StreamOrder};
use crate::runtime::Runtime;
use cudarc::driver::{sys, CudaContext, CudaSlice, CudaStream};
use lasp_shmem_kernels::instances;
use std::sync::Arc;

/// The scalar-decay forward: its kernels, its launch plan policy and its workspace.
///
/// One instance may be launched many times on one stream. Its workspace is shared by the
/// launches: launches of one instance on different streams must be ordered by the caller (or
/// use one instance per stream). The workspace grows on demand (a context synchronisation then)
/// and is freed when the instance is dropped (after a context synchronisation).
pub struct ScalarDecayForward {
    runtime: Runtime,
    ctx: Arc<CudaContext>,
    /// Indexed by Dk: [64, 128].
    states: [Kernel; 2],
    output: [Kernel; 2],
    /// The time-reversed states and output kernels of the backward's dk and dv passes (Dk-indexed).
    states_reversed: [Kernel; 2],
    output_reversed: [Kernel; 2],
    /// The output kernels that also write the states at the block boundaries, for the backward's
    /// dq pass (in order; two-role where `output_roles` is there) and dv pass (reversed).
    output_block_states: [Kernel; 2],
    output_roles_block_states: Option<[Kernel; 2]>,
    output_reversed_block_states: [Kernel; 2],
    /// The output kernels that also write the states entering the chunks the documents' final
    /// states start from, and the walk that writes only those ([`super::document_states`]).
    output_document_entries: [Kernel; 2],
    output_roles_document_entries: Option<[Kernel; 2]>,
    document_entries_walk: [Kernel; 2],
    /// The two-role output kernels, for plans with one segment (None where this GPU has no Tensor
    /// Memory Accelerator or cannot give a block their shared memory: such plans use `output`).
    output_roles: Option<[Kernel; 2]>,
    fold: Kernel,
    /// The probe kernels (Memory, Compute, NoExp; each indexed by Dk), looked up on the first
    /// [`ScalarDecayForward::launch_output_probe`].
    probes: Option<[[Kernel; 2]; 3]>,
    sm_count: u32,
    /// Override of the plan's CTA target (None: geometry::target_ctas).
    target_ctas: Option<u32>,
    force_segments: Option<u32>,
    /// False: plans with one segment use the one-warpgroup output kernel too (tests, tuning).
    two_role_output: bool,
    workspace: Option<CudaSlice<u8>>,
}

/// Where a reversed pass's segments start when the caller computed the starts
/// ([`ScalarDecayForward::launch_reversed_output`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct SegmentStarts {
    /// Segments per sequence, S.
    pub(crate) segments: u32,
    /// Device address of the starts of segments 1 .. S-1, fp32 `[B*H][S-1][Dk][Dv]` (Dk, Dv of
    /// the pass's shape); unused (0 is fine) when S = 1.
    pub(crate) prefixes: u64,
}

/// The tensors of [`ScalarDecayForward::launch_document_entries_walk`], checked against `shape` by
/// whoever builds it (the walk reads k, v and g, and starts from h0).
pub(crate) struct EntriesWalk<'a> {
    pub(crate) shape: ForwardShape,
    pub(crate) k: DeviceRef<'a, crate::ops::bf16>,
    pub(crate) v: DeviceRef<'a, crate::ops::bf16>,
    pub(crate) g: DeviceRef<'a, f32>,
    pub(crate) h0: Option<DeviceRef<'a, f32>>,
}

/// `params` with the chunk loop's stores of the states the documents' final states start from.
fn with_entries(params: ScalarDecayParams, entries: DocumentEntries) -> ScalarDecayParams {
    ScalarDecayParams {
        entry_slots: entries.slots as _,
        document_states: entries.states as _,
        documents: entries.documents as i32,
        ..params
    }
}

/// An output-kernel launch with the parameters of its kind.
enum OutputLaunch {
    TwoRole(Kernel, LaunchShape, Box<RolesParams>),
    OneWarpgroup(Kernel, LaunchShape, ScalarDecayParams),
}

impl OutputLaunch {
    /// # Safety
    /// As for [`Kernel::launch`]: the parameters describe tensors that stay valid, and are used
    /// by nothing else in a conflicting way, until the kernel completes.
    unsafe fn enqueue(&self, stream: &CudaStream) -> Result<()> {
        // SAFETY: each kernel gets the parameter struct of its C signature; the caller's contract
        // covers the tensors.
        unsafe {
            match self {
                OutputLaunch::TwoRole(kernel, shape, params) => {
                    kernel.launch(stream, *shape, params.as_ref())
                }
                OutputLaunch::OneWarpgroup(kernel, shape, params) => {
                    kernel.launch(stream, *shape, params)
                }
            }
        }
    }
}

/// The Dk-indexed (`[64, 128]`) states and output kernels of a chunkwise family (the single-GPU
/// forward, LASP-2), with their dynamic shared-memory limits raised to what the plans launch with;
/// an error if this GPU cannot give a block that much shared memory.
pub(crate) fn segment_kernels(
    runtime: &Runtime,
    states: [&'static str; 2],
    output: [&'static str; 2],
) -> Result<([Kernel; 2], [Kernel; 2])> {
    let ctx = runtime.context();
    ctx.bind_to_thread()?;
    let optin = ctx
        .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?
        as u32;
    let need = geometry::output_smem_bytes(128);
    if optin < need {
        return Err(Error::Launch(format!(
            "the chunkwise kernels need {need} bytes of shared memory per block but this GPU ({}) \
             allows {optin}; run on an H100/H200 (sm_90)",
            ctx.name().unwrap_or_default()
        )));
    }
    let module = runtime.module();
    let states = [module.kernel(states[0])?, module.kernel(states[1])?];
    let output = [module.kernel(output[0])?, module.kernel(output[1])?];
    for (i, dk) in [64, 128].into_iter().enumerate() {
        states[i].set_max_dynamic_shared_bytes(geometry::states_smem_bytes(dk))?;
        output[i].set_max_dynamic_shared_bytes(geometry::output_smem_bytes(dk))?;
    }
    Ok((states, output))
}

impl ScalarDecayForward {
    /// Looks up the kernels in the runtime's module and raises their shared-memory limits.
    pub fn new(runtime: &Runtime) -> Result<Self> {
        let ctx = runtime.context().clone();
        let (states, output) =
            segment_kernels(runtime, instances::SD_STATES, instances::SD_OUTPUT)?;
        let (states_reversed, output_reversed) = segment_kernels(
            runtime,
            instances::SD_STATES_REVERSED,
            instances::SD_OUTPUT_REVERSED,
        )?;
        let (_, output_block_states) = segment_kernels(
            runtime,
            instances::SD_STATES,
            instances::SD_OUTPUT_BLOCK_STATES,
        )?;
        let (_, output_reversed_block_states) = segment_kernels(
            runtime,
            instances::SD_STATES_REVERSED,
            instances::SD_OUTPUT_REVERSED_BLOCK_STATES,
        )?;
        let module = runtime.module();
        let (_, output_document_entries) = segment_kernels(
            runtime,
            instances::SD_STATES,
            instances::SD_OUTPUT_DOCUMENT_ENTRIES,
        )?;
        let document_entries_walk =
            module.kernels_per_width(instances::SD_DOCUMENT_ENTRIES_WALK)?;
        for (i, dk) in [64, 128].into_iter().enumerate() {
            document_entries_walk[i]
                .set_max_dynamic_shared_bytes(geometry::update_smem_bytes(dk))?;
        }
        let optin = ctx.attribute(
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
        )? as u32;
        let (major, _) = ctx.compute_capability()?;
        let roles = |names: [&'static str; 2]| -> Result<[Kernel; 2]> {
            let kernels = module.kernels_per_width(names)?;
            for (i, dk) in [64, 128].into_iter().enumerate() {
                kernels[i].set_max_dynamic_shared_bytes(geometry::roles_smem_bytes(dk))?;
            }
            Ok(kernels)
        };
        let (output_roles, output_roles_block_states, output_roles_document_entries) =
            if major >= 9 && optin >= geometry::roles_smem_bytes(128) {
                (
                    Some(roles(instances::SD_OUTPUT_ROLES)?),
                    Some(roles(instances::SD_OUTPUT_ROLES_BLOCK_STATES)?),
                    Some(roles(instances::SD_OUTPUT_ROLES_DOCUMENT_ENTRIES)?),
                )
            } else {
                (None, None, None)
            };
        let fold = module.kernel("lasp_scalar_decay_fold")?;
        let sm_count = crate::ops::sm_count(&ctx)?;
        Ok(ScalarDecayForward {
            runtime: runtime.clone(),
            ctx,
            states,
            output,
            states_reversed,
            output_reversed,
            output_block_states,
            output_roles_block_states,
            output_reversed_block_states,
            output_document_entries,
            output_roles_document_entries,
            document_entries_walk,
            output_roles,
            fold,
            probes: None,
            sm_count,
            target_ctas: None,
            force_segments: None,
            two_role_output: true,
            workspace: None,
        })
    }

    /// The GPU's multiprocessor count.
    pub fn sm_count(&self) -> u32 {
        self.sm_count
    }

    /// The CTA count the plan of `shape` fills: the override, else [`geometry::target_ctas`].
    pub fn target_ctas(&self, shape: &ForwardShape) -> u32 {
        self.target_ctas.unwrap_or_else(|| {
            geometry::target_ctas(
                shape.b as i32,
                shape.h as i32,
                shape.t.min(i32::MAX as usize) as i32,
                shape.dv as i32,
                self.sm_count as i32,
            )
            .max(1) as u32
        })
    }

    /// Overrides the CTA count the automatic plan fills (tuning). At least 1.
    pub fn set_target_ctas(&mut self, ctas: u32) -> Result<()> {
        if ctas == 0 {
            return Err(invalid(
                "scalar-decay forward: target CTAs must be at least 1 (default: the SM count)"
                    .into(),
            ));
        }
        self.target_ctas = Some(ctas);
        Ok(())
    }

    /// Forces the number of segments per sequence (tests and tuning; see [`ForwardPlan::new`]
    /// for the rounding), or restores the automatic plan with `None`.
    pub fn set_num_segments(&mut self, segments: Option<u32>) -> Result<()> {
        if segments == Some(0) {
            return Err(invalid(
                "scalar-decay forward: a forced segment count must be at least 1 (use None for \
                 the automatic plan)"
                    .into(),
            ));
        }
        self.force_segments = segments;
        Ok(())
    }

    /// Whether plans with one segment run the two-role output kernel (the default) or the
    /// one-warpgroup one (tests compare the two; both give the same bits).
    pub fn set_two_role_output(&mut self, enabled: bool) {
        self.two_role_output = enabled;
    }

    /// The plan a launch of `shape` would use (validates the shape).
    pub fn plan(&self, shape: &ForwardShape) -> Result<ForwardPlan> {
        let plan = ForwardPlan::new(shape, self.target_ctas(shape), self.force_segments)?;
        Ok(if self.output_roles.is_some() && self.two_role_output {
            plan
        } else {
            plan.with_one_warpgroup_output()
        })
    }

    /// Copies `g` to the host (synchronising `stream`) and checks that every gate is finite and
    /// `<= 0`; the error names the first offending `[b, t, h]`.
    pub fn validate_gates(
        &self,
        stream: &Arc<CudaStream>,
        g: DeviceRef<'_, f32>,
        shape: &ForwardShape,
    ) -> Result<()> {
        if g.len() != shape.gate_len() {
            return Err(invalid(format!(
                "scalar-decay forward: g has {} elements but [B, T, H] = [{}, {}, {}] needs {}",
                g.len(),
                shape.b,
                shape.t,
                shape.h,
                shape.gate_len()
            )));
        }
        check_gate_values(&crate::ops::copy_to_host(&self.ctx, stream, g)?, shape)
    }

    /// Validates a call (shape, tensors, stream, in debug builds the gates), makes the workspace
    /// large enough for `plan`, and returns it with the kernels' params.
    fn prepare_plan(
        &mut self,
        stream: &Arc<CudaStream>,
        args: &ForwardArgs<'_>,
        plan: ForwardPlan,
    ) -> Result<(ForwardPlan, ScalarDecayParams)> {
        let scale = check_args(args)?;
        crate::ops::require_runtime_stream(stream, &self.ctx, "scalar-decay forward")?;
        if cfg!(debug_assertions) {
            self.validate_gates(stream, args.g, &args.shape)?;
        }
        let params = ScalarDecayParams {
            q: args.q.addr() as _,
            k: args.k.addr() as _,
            v: args.v.addr() as _,
            g: args.g.addr() as _,
            o: args.o.addr() as _,
            h0: args.h0.map_or(0, |x| x.addr()) as _,
            ht: args.ht.as_ref().map_or(0, |x| x.addr()) as _,
            scale,
            ..self.plan_params(stream, &plan, "scalar-decay forward")?
        };
        self.ctx.bind_to_thread()?;
        Ok((plan, params))
    }

    /// The kernels' params of `plan` (its shape, segments and workspace parts, the workspace grown
    /// for it), with no tensor, no scale and nothing for the backward or the documents: what every
    /// launch of a plan starts from.
    fn plan_params(
        &mut self,
        stream: &Arc<CudaStream>,
        plan: &ForwardPlan,
        op: &str,
    ) -> Result<ScalarDecayParams> {
        let base = crate::ops::ensure_workspace(
            &self.ctx,
            stream,
            &mut self.workspace,
            plan.workspace_bytes,
            op,
        )?;
        let (ws_m, ws_p, ws_lambda) = if plan.num_segments > 1 {
            let (p, lambda) = plan.workspace_offsets();
            (base, base + p, base + lambda)
        } else {
            (0, 0, 0)
        };
        let s = &plan.shape;
        Ok(ScalarDecayParams {
            ws_m: ws_m as _,
            ws_p: ws_p as _,
            ws_lambda: ws_lambda as _,
            B: s.b as i32,
            T: s.t as i32,
            H: s.h as i32,
            Dk: s.dk as i32,
            Dv: s.dv as i32,
            num_segments: plan.num_segments as i32,
            chunks_per_segment: plan.chunks_per_segment as i32,
            ..Default::default()
        })
    }

    /// Enqueues the forward on `stream` (a stream of the runtime's context) and returns the plan
    /// it used. Everything is validated before the first launch; in debug builds the gates are
    /// checked too, which synchronises `stream`.
    pub fn launch(
        &mut self,
        stream: &Arc<CudaStream>,
        args: ForwardArgs<'_>,
    ) -> Result<ForwardPlan> {
        StreamOrder::around(stream, args.homes(), "scalar-decay forward", || {
            self.enqueue(stream, args)
        })
    }

    /// The body of [`ScalarDecayForward::launch`], with the buffers' streams already ordered.
    fn enqueue(&mut self, stream: &Arc<CudaStream>, args: ForwardArgs<'_>) -> Result<ForwardPlan> {
        let plan = self.plan(&args.shape)?;
        let (plan, params) = self.prepare_plan(stream, &args, plan)?;
        let output = self.output_launch(&plan, &params)?;
        // SAFETY: ScalarDecayParams is lasp_scalar_decay_params, generated from the header;
        // RolesParams is lasp_sd_roles_params, with maps of the same tensors; the shape is
        // supported, every tensor has the length, alignment and non-overlap the kernels need
        // (checked in prepare_plan), the views borrow their buffers for the call and their
        // contracts keep the memory valid until the kernels complete; the workspace is owned by
        // self and freed only after a context synchronisation.
        unsafe {
            if let (Some(states_shape), Some(fold)) = (plan.states, plan.fold) {
                self.states[width_index(args.shape.dk)].launch(stream, states_shape, &params)?;
                self.fold.launch(stream, fold, &params)?;
            }
            output.enqueue(stream)?;
        }
        Ok(plan)
    }

    /// [`ScalarDecayForward::launch`] with the output kernel that also writes the state entering
    /// every block (`geometry::num_blocks`) to `block_states`, `4 Dk Dv` bytes per head and block
    /// (bf16 hi + lo tiles, `lasp::sd::state_store_tiles`; the backward's dq pass, for the gate
    /// gradient).
    ///
    /// # Safety
    /// `block_states` must address a live device buffer of that size, used by nothing else until
    /// the kernels complete.
    pub(crate) unsafe fn launch_writing_block_states(
        &mut self,
        stream: &Arc<CudaStream>,
        args: ForwardArgs<'_>,
        block_states: u64,
    ) -> Result<ForwardPlan> {
        let kernels = (self.output_block_states, self.output_roles_block_states);
        // SAFETY: the output kernels also write the block states, which this function's contract
        // sizes.
        unsafe {
            self.launch_with_outputs(stream, args, kernels, |params| ScalarDecayParams {
                block_states: block_states as _,
                ..params
            })
        }
    }

    /// [`ScalarDecayForward::launch`] with the output kernel that also writes the states
    /// `entries` names (the final states of packed documents start from them).
    ///
    /// # Safety
    /// `entries` addresses live device buffers of its sizes for the shape, the slots written
    /// before on `stream`; nothing else uses the states until the kernels complete.
    pub(crate) unsafe fn launch_writing_document_entries(
        &mut self,
        stream: &Arc<CudaStream>,
        args: ForwardArgs<'_>,
        entries: DocumentEntries,
    ) -> Result<ForwardPlan> {
        let kernels = (
            self.output_document_entries,
            self.output_roles_document_entries,
        );
        // SAFETY: the output kernels also write the entry states, which this function's
        // contract sizes.
        unsafe {
            self.launch_with_outputs(stream, args, kernels, |params| {
                with_entries(params, entries)
            })
        }
    }

    /// [`ScalarDecayForward::launch`] with other output kernels (one-warpgroup, two-role) whose
    /// parameters `extra` completes.
    ///
    /// # Safety
    /// Whatever `extra` adds to the parameters addresses live device buffers of the sizes the
    /// kernels write, used by nothing else until they complete.
    unsafe fn launch_with_outputs(
        &mut self,
        stream: &Arc<CudaStream>,
        args: ForwardArgs<'_>,
        (one_warpgroup, two_role): ([Kernel; 2], Option<[Kernel; 2]>),
        extra: impl FnOnce(ScalarDecayParams) -> ScalarDecayParams,
    ) -> Result<ForwardPlan> {
        let plan = self.plan(&args.shape)?;
        let (plan, params) = self.prepare_plan(stream, &args, plan)?;
        let params = extra(params);
        let i = width_index(args.shape.dk);
        let output = match two_role {
            Some(roles) if plan.output_roles => OutputLaunch::TwoRole(
                roles[i],
                plan.output,
                Box::new(roles_params(params, &plan.shape)?),
            ),
            _ => OutputLaunch::OneWarpgroup(one_warpgroup[i], plan.output, params),
        };
        // SAFETY: as in `launch`; what `extra` adds is this function's contract.
        unsafe {
            if let (Some(states_shape), Some(fold)) = (plan.states, plan.fold) {
                self.states[i].launch(stream, states_shape, &params)?;
                self.fold.launch(stream, fold, &params)?;
            }
            output.enqueue(stream)?;
        }
        Ok(plan)
    }

    /// The in-order walk of `walk`'s tokens from its `h0` that writes the states `entries` names
    /// and no output: the states pass and the fold first where the plan has segments (two CTAs per
    /// SM, as the reversed passes'). On LASP-2 shards, after the forward, from the state it saved
    /// as entering the shard.
    ///
    /// # Safety
    /// As [`ScalarDecayForward::launch_writing_document_entries`].
    pub(crate) unsafe fn launch_document_entries_walk(
        &mut self,
        stream: &Arc<CudaStream>,
        walk: &EntriesWalk<'_>,
        entries: DocumentEntries,
    ) -> Result<()> {
        let s = &walk.shape;
        let op = "scalar-decay document states";
        crate::ops::require_runtime_stream(stream, &self.ctx, op)?;
        let target = self.target_ctas.unwrap_or(2 * self.sm_count);
        let plan = ForwardPlan::new(s, target, self.force_segments)?;
        // q is never read (the walk has no O): k stands in for it, of the same length.
        let params = ScalarDecayParams {
            q: walk.k.addr() as _,
            k: walk.k.addr() as _,
            v: walk.v.addr() as _,
            g: walk.g.addr() as _,
            h0: walk.h0.map_or(0, |x| x.addr()) as _,
            scale: 1.0,
            ..self.plan_params(stream, &plan, op)?
        };
        let params = with_entries(params, entries);
        let walk_shape = LaunchShape {
            block: (geometry::THREADS, 1, 1),
            shared_bytes: geometry::update_smem_bytes(s.dk as i32),
            ..plan.output
        };
        let i = width_index(s.dk);
        self.ctx.bind_to_thread()?;
        // SAFETY: ScalarDecayParams is lasp_scalar_decay_params, generated from the header; the
        // caller checked k, v, g and h0 against the shape (EntriesWalk's contract) and keeps
        // them live until the kernels complete; the states kernel and the walk read no q (the walk
        // runs without O, and q points at k, of the same length); the workspace is owned by self
        // and freed only after a context synchronisation; the entries are this function's
        // contract.
        unsafe {
            if let (Some(states_shape), Some(fold)) = (plan.states, plan.fold) {
                self.states[i].launch(stream, states_shape, &params)?;
                self.fold.launch(stream, fold, &params)?;
            }
            self.document_entries_walk[i].launch(stream, walk_shape, &params)
        }
    }

    /// The segments both reversed passes of the backward run in: they run the one-warpgroup
    /// kernel, whose plans fill two CTAs per SM, and share one states pass (the overrides of
    /// [`ScalarDecayForward::set_target_ctas`] and [`ScalarDecayForward::set_num_segments`]
    /// apply).
    pub(crate) fn reversed_segments(&self, shape: &ForwardShape) -> Result<u32> {
        let target = self.target_ctas.unwrap_or(2 * self.sm_count);
        Ok(ForwardPlan::new(shape, target, self.force_segments)?.num_segments)
    }

    /// The one-warpgroup plan of `shape` in exactly `segments` segments, without a workspace of
    /// this forward's (the caller's buffers hold the segment states and starts).
    fn reversed_plan(shape: &ForwardShape, segments: u32) -> Result<ForwardPlan> {
        let plan = ForwardPlan::new(shape, 1, Some(segments))?.with_one_warpgroup_output();
        if plan.num_segments != segments {
            return Err(invalid(format!(
                "scalar-decay reversed pass: {segments} segments do not cut T = {} into \
                 non-empty segments of whole chunks ({} would); use that count",
                shape.t, plan.num_segments
            )));
        }
        Ok(ForwardPlan {
            workspace_bytes: 0,
            ..plan
        })
    }

    /// The states kernel of a reversed pass alone: the end states from zero of segments
    /// 0 .. S-2 (tokens from last to first) into `m` (fp32 `[B*H][S-1][Dk][Dv]`) and their
    /// log-decays into `lambda` (`[B*H][S-1]`). Nothing to do when S = 1.
    ///
    /// # Safety
    /// `m` and `lambda` must address live device buffers of those sizes (B, H, Dk, Dv of
    /// `args.shape`), used by nothing else until the kernel completes.
    pub(crate) unsafe fn launch_reversed_states(
        &mut self,
        stream: &Arc<CudaStream>,
        args: &ForwardArgs<'_>,
        segments: u32,
        (m, lambda): (u64, u64),
    ) -> Result<()> {
        let plan = Self::reversed_plan(&args.shape, segments)?;
        let (plan, params) = self.prepare_plan(stream, args, plan)?;
        let Some(states) = plan.states else {
            return Ok(());
        };
        let params = ScalarDecayParams {
            ws_m: m as _,
            ws_p: std::ptr::null_mut(),
            ws_lambda: lambda as _,
            ..params
        };
        // SAFETY: as in `launch`; the states kernel reads k, v and g (checked in prepare_plan)
        // and writes only ws_m and ws_lambda, which this function's contract sizes for the plan.
        unsafe { self.states_reversed[width_index(args.shape.dk)].launch(stream, states, &params) }
    }

    /// The output kernel of a reversed pass alone, cut into `starts.segments` segments that
    /// start from `args.h0` (segment 0) and from `starts.prefixes` (segment s > 0: slot s - 1 of
    /// a `[B*H][S-1][Dk][Dv]` fp32 buffer, the layout the fold kernel writes). With
    /// `block_states`, it also writes its state at the end of every block there (`4 Dk Dv` bytes
    /// per head and block, bf16 hi + lo tiles; the backward's dv pass, for the gate gradient).
    ///
    /// # Safety
    /// Where S > 1, `starts.prefixes` must address a live device buffer of that size, written
    /// before this launch on `stream` and not written again until the kernel completes; where
    /// given, `block_states` must address a live device buffer of its size, used by nothing else
    /// until the kernel completes.
    pub(crate) unsafe fn launch_reversed_output(
        &mut self,
        stream: &Arc<CudaStream>,
        args: ForwardArgs<'_>,
        starts: SegmentStarts,
        block_states: Option<u64>,
    ) -> Result<()> {
        let plan = Self::reversed_plan(&args.shape, starts.segments)?;
        let (plan, params) = self.prepare_plan(stream, &args, plan)?;
        let params = ScalarDecayParams {
            ws_m: std::ptr::null_mut(),
            ws_p: starts.prefixes as _,
            ws_lambda: std::ptr::null_mut(),
            block_states: block_states.unwrap_or(0) as _,
            ..params
        };
        let i = width_index(args.shape.dk);
        let kernel = match block_states {
            Some(_) => self.output_reversed_block_states[i],
            None => self.output_reversed[i],
        };
        let launch = OutputLaunch::OneWarpgroup(kernel, plan.output, params);
        // SAFETY: as in `launch`; the output kernel reads of the workspace only the segment
        // starts, which `starts.prefixes` holds for every segment s > 0 (this function's
        // contract).
        unsafe { launch.enqueue(stream) }
    }

    /// The output kernel `plan` runs, with its parameters: the two-role kernel (with the tensor
    /// maps of `params`' q, k, v) where the plan has it, else the one-warpgroup kernel.
    fn output_launch(
        &self,
        plan: &ForwardPlan,
        params: &ScalarDecayParams,
    ) -> Result<OutputLaunch> {
        let i = width_index(plan.shape.dk);
        Ok(match self.output_roles {
            Some(roles) if plan.output_roles => OutputLaunch::TwoRole(
                roles[i],
                plan.output,
                Box::new(roles_params(*params, &plan.shape)?),
            ),
            _ => OutputLaunch::OneWarpgroup(self.output[i], plan.output, *params),
        })
    }

    /// Measurement tool, not an API for users (see [`OutputProbe`]): enqueues only the output
    /// kernel, or one of its probes, exactly as [`ScalarDecayForward::launch`] would launch the
    /// output kernel for `args` (same plan, params and workspace), and returns that plan. No
    /// states pass and no fold run: the segments start from whatever prefixes the workspace
    /// holds (the last forward's, or zeros). `args.o` (and `args.ht`, if given) receive the
    /// variant's values, which are not the forward's output except for [`OutputProbe::Output`]
    /// after a forward of the same inputs.
    pub fn launch_output_probe(
        &mut self,
        stream: &Arc<CudaStream>,
        args: ForwardArgs<'_>,
        probe: OutputProbe,
    ) -> Result<ForwardPlan> {
        StreamOrder::around(stream, args.homes(), "scalar-decay output probe", || {
            self.enqueue_output_probe(stream, args, probe)
        })
    }

    /// The body of [`ScalarDecayForward::launch_output_probe`].
    fn enqueue_output_probe(
        &mut self,
        stream: &Arc<CudaStream>,
        args: ForwardArgs<'_>,
        probe: OutputProbe,
    ) -> Result<ForwardPlan> {
        let plan = self.plan(&args.shape)?;
        let (plan, params) = self.prepare_plan(stream, &args, plan)?;
        let i = width_index(args.shape.dk);
        // The probes are variants of the one-warpgroup output kernel and launch like it, also
        // where the plan runs the two-role kernel.
        let one_warpgroup = plan.with_one_warpgroup_output().output;
        let launch = match probe {
            OutputProbe::Output => self.output_launch(&plan, &params)?,
            OutputProbe::Memory => {
                OutputLaunch::OneWarpgroup(self.probe_kernels()?[0][i], one_warpgroup, params)
            }
            OutputProbe::Compute => {
                OutputLaunch::OneWarpgroup(self.probe_kernels()?[1][i], one_warpgroup, params)
            }
            OutputProbe::NoExp => {
                OutputLaunch::OneWarpgroup(self.probe_kernels()?[2][i], one_warpgroup, params)
            }
        };
        // SAFETY: as in `launch`: the probe kernels take the output kernel's params and read and
        // write only what it does (q, k, v, g, workspace prefixes; o, ht), or less.
        unsafe { launch.enqueue(stream)? };
        Ok(plan)
    }

    /// The probe kernels (Memory, Compute, NoExp), looked up and given the output kernel's
    /// shared-memory limit on first use.
    fn probe_kernels(&mut self) -> Result<[[Kernel; 2]; 3]> {
        if let Some(probes) = self.probes {
            return Ok(probes);
        }
        let module = self.runtime.module();
        let load = |probe: OutputProbe| -> Result<[Kernel; 2]> {
            let names = probe
                .probe_kernel_names()
                .expect("a probe, not the production kernel");
            let kernels = module.kernels_per_width(names)?;
            for (kernel, dk) in kernels.iter().zip([64, 128]) {
                kernel.set_max_dynamic_shared_bytes(geometry::output_smem_bytes(dk))?;
            }
            Ok(kernels)
        };
        let probes = [
            load(OutputProbe::Memory)?,
            load(OutputProbe::Compute)?,
            load(OutputProbe::NoExp)?,
        ];
        self.probes = Some(probes);
        Ok(probes)
    }
}

impl Drop for ScalarDecayForward {
    fn drop(&mut self) {
        if self.workspace.is_some() {
            // Launches in flight may still use the workspace.
            let _ = self.ctx.synchronize();
        }
    }
}
