//! [`GlaForward`]: the GLA forward's kernels, workspace and launches, and the checks of one
//! call's tensors ([`GlaArgs`]) before anything is launched.

use super::document_states::{check_document_ht, EntryOutputs};
use super::plan::{chunk_states_len, output_smem_bytes, states_smem_bytes, CHUNK_STATES_LAYOUT};
use super::{GlaParams, GlaPlan};
use crate::error::{Error, Result};
use crate::kernel::{width_index, Kernel};
use crate::ops::documents::final_states::{DocumentTails, StatesInputs};
use crate::ops::documents::masked::{refuse_states, StartWords, Twins};
use crate::ops::documents::Documents;
use crate::ops::documents::LoopOrder;
use crate::ops::scalar_decay::{ForwardShape, TensorChecks};
use crate::ops::{
    bf16, check_forced_segments, require_shared_memory, DeviceMut, DeviceRef, StreamOrder,
};
use crate::runtime::Runtime;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use lasp_shmem_kernels::instances;
use std::sync::Arc;

const OP: &str = "GLA forward";

/// The tensors of one call; views from cudarc buffers ([`DeviceRef::new`], [`DeviceMut::new`])
/// or raw pointers, all in the runtime's GPU context.
#[derive(Debug)]
pub struct GlaArgs<'a> {
    /// The dimensions every tensor must agree with (Dk and Dv 64 or 128).
    pub shape: ForwardShape,
    /// Queries `[B, T, H, Dk]`, bf16, contiguous, 16-byte aligned.
    pub q: DeviceRef<'a, bf16>,
    /// Keys `[B, T, H, Dk]`, bf16, contiguous, 16-byte aligned.
    pub k: DeviceRef<'a, bf16>,
    /// Values `[B, T, H, Dv]`, bf16, contiguous, 16-byte aligned.
    pub v: DeviceRef<'a, bf16>,
    /// Log-decays per key dimension `[B, T, H, Dk]`, fp32, 16-byte aligned, finite and `<= 0`
    /// (the caller's contract: checked in debug builds and by [`GlaForward::validate_gates`]).
    pub g: DeviceRef<'a, f32>,
    /// Initial state `[B, H, Dk, Dv]` fp32, 8-byte aligned; `None` for zero.
    pub h0: Option<DeviceRef<'a, f32>>,
    /// Output `[B, T, H, Dv]`, bf16, 16-byte aligned; every element is written.
    pub o: DeviceMut<'a, bf16>,
    /// Final state `[B, H, Dk, Dv]` fp32, 8-byte aligned; `None` to skip it.
    pub ht: Option<DeviceMut<'a, f32>>,
    /// The state entering every chunk of 64 tokens, `[B*H, ceil(T / 64), Dk, Dv]` bf16
    /// ([`chunk_states_len`] elements), 16-byte aligned, each row scaled by the chunk's reference
    /// decay (`kernels/docs/gla.md`): what the backward takes
    /// ([`super::GlaBackwardArgs::chunk_states`]). `None` where no backward follows.
    pub chunk_states: Option<DeviceMut<'a, bf16>>,
    /// `sigma` in `o_t = sigma q_t S_t`; `None` for `Dk^-1/2`.
    pub scale: Option<f32>,
    /// Packed documents: the state restarts from zero at every document start in the shard, and
    /// no score crosses one. With documents `h0` and `ht` must be `None`.
    pub documents: Option<Documents<'a>>,
    /// With documents: every document's final state, `[B, N, H, Dk, Dv]` fp32 (N =
    /// `cu_seqlens.len() - 1`, [`crate::ops::documents::document_states_len`]), 8-byte aligned,
    /// fla's `output_final_state` with `cu_seqlens`: document n's state after its last token
    /// where that token is in this shard, zeros for the others (so the sum over LASP-2's PEs holds
    /// every document's). Every element is written. `None` to skip them.
    pub document_ht: Option<DeviceMut<'a, f32>>,
}

impl<'a> GlaArgs<'a> {
    /// The streams of the buffers the views come from ([`crate::ops`], "Ordering").
    pub(crate) fn homes(&self) -> [Option<&'a Arc<CudaStream>>; 10] {
        [
            self.q.home(),
            self.k.home(),
            self.v.home(),
            self.g.home(),
            self.h0.and_then(|h0| h0.home()),
            self.o.home(),
            self.ht.as_ref().and_then(DeviceMut::home),
            self.chunk_states.as_ref().and_then(DeviceMut::home),
            self.documents.and_then(|d| d.cu_seqlens.home()),
            self.document_ht.as_ref().and_then(DeviceMut::home),
        ]
    }

    /// Checks lengths, alignment, scale and overlaps against the (validated) shape; returns the
    /// scale to use. `op` names the operation in errors.
    pub(crate) fn check(&self, op: &str) -> Result<f32> {
        let s = &self.shape;
        refuse_states(
            op,
            self.documents.as_ref(),
            &[("h0", self.h0.is_some()), ("ht", self.ht.is_some())],
        )?;
        let checks = TensorChecks::new(op, s);
        let inputs = check_inputs(&checks, s, [self.q, self.k, self.v], self.g, self.h0)?;
        checks.length("o", "[B, T, H, Dv]", self.o.len(), s.v_len())?;
        checks.aligned("o", self.o.addr(), 16)?;
        if let Some(ht) = &self.ht {
            checks.length("ht", "[B, H, Dk, Dv]", ht.len(), s.state_len())?;
            checks.aligned("ht", ht.addr(), 8)?;
        }
        if let Some(states) = &self.chunk_states {
            checks.length(
                "chunk_states",
                CHUNK_STATES_LAYOUT,
                states.len(),
                chunk_states_len(s),
            )?;
            checks.aligned("chunk_states", states.addr(), 16)?;
        }
        let scale = checks.scale(self.scale, s)?;
        let mut outputs = vec![("o", self.o.byte_range())];
        outputs.extend(self.ht.as_ref().map(|ht| ("ht", ht.byte_range())));
        outputs.extend(
            self.chunk_states
                .as_ref()
                .map(|x| ("chunk_states", x.byte_range())),
        );
        if let Some(ht) = &self.document_ht {
            let range = check_document_ht(&checks, op, s, self.documents.as_ref(), ht)?;
            outputs.push(("document_ht", range));
        }
        checks.disjoint(&inputs, &outputs)?;
        Ok(scale)
    }
}

/// A tensor's name, its length and layout as [`TensorChecks`] names them, and its address.
type Measured<'n> = (&'n str, usize, &'n str, usize, u64);

/// The lengths and alignment of the inputs GLA's forward and backward share (q, k, v
/// 16-byte aligned bf16, g 16-byte aligned fp32, h0 8-byte aligned fp32), against the shape;
/// returns their byte ranges by name, for the overlap check.
pub(crate) fn check_inputs(
    checks: &TensorChecks<'_>,
    s: &ForwardShape,
    [q, k, v]: [DeviceRef<'_, bf16>; 3],
    g: DeviceRef<'_, f32>,
    h0: Option<DeviceRef<'_, f32>>,
) -> Result<Vec<(&'static str, (u64, u64))>> {
    let wide: [Measured<'_>; 4] = [
        ("q", q.len(), "[B, T, H, Dk]", s.qk_len(), q.addr()),
        ("k", k.len(), "[B, T, H, Dk]", s.qk_len(), k.addr()),
        ("v", v.len(), "[B, T, H, Dv]", s.v_len(), v.addr()),
        ("g", g.len(), "[B, T, H, Dk]", s.qk_len(), g.addr()),
    ];
    let state = h0.map(|h0| ("h0", h0.len(), "[B, H, Dk, Dv]", s.state_len(), h0.addr()));
    check_measured(checks, &wide, state)?;
    let mut ranges = vec![
        ("q", q.byte_range()),
        ("k", k.byte_range()),
        ("v", v.byte_range()),
        ("g", g.byte_range()),
    ];
    ranges.extend(h0.map(|h0| ("h0", h0.byte_range())));
    Ok(ranges)
}

/// Checks every tensor's length and alignment, in order: those in `wide` 16-byte aligned (the
/// kernels move them in 16-byte vectors), those in `states` (fp32 states) 8-byte aligned.
pub(crate) fn check_measured<'n>(
    checks: &TensorChecks<'_>,
    wide: &[Measured<'n>],
    states: impl IntoIterator<Item = Measured<'n>>,
) -> Result<()> {
    let aligned = wide
        .iter()
        .map(|m| (*m, 16))
        .chain(states.into_iter().map(|m| (m, 8)));
    for ((name, len, layout, want, addr), to) in aligned {
        checks.tensor(name, layout, (len, want), addr, to)?;
    }
    Ok(())
}

fn invalid(msg: String) -> Error {
    Error::InvalidArgument(msg)
}

/// The first gate that breaks the contract (finite and `<= 0`), as an error naming
/// `[b, t, h, d]`.
pub fn check_gate_values(g: &[f32], shape: &ForwardShape) -> Result<()> {
    check_gate_values_of(OP, g, shape)
}

/// [`check_gate_values`] with `op` naming the operation in the error.
pub(crate) fn check_gate_values_of(op: &str, g: &[f32], shape: &ForwardShape) -> Result<()> {
    let Some(pos) = g.iter().position(|x| !(x.is_finite() && *x <= 0.0)) else {
        return Ok(());
    };
    let (dk, h, t) = (shape.dk.max(1), shape.h.max(1), shape.t.max(1));
    let (d, rest) = (pos % dk, pos / dk);
    let (hh, rest) = (rest % h, rest / h);
    let (tt, b) = (rest % t, rest / t);
    Err(invalid(format!(
        "{op}: gate g[b={b}, t={tt}, h={hh}, d={d}] = {} must be finite and <= 0: gates are \
         natural-log decays (e.g. logsigmoid(x) / 16 as fla's GLA layer makes them), not decay \
         factors",
        g[pos]
    )))
}

/// [`GlaForward::validate_gates`] for GLA's operations, `op` naming the operation in errors.
pub(crate) fn validate_gates_of(
    op: &str,
    ctx: &CudaContext,
    stream: &Arc<CudaStream>,
    g: DeviceRef<'_, f32>,
    shape: &ForwardShape,
) -> Result<()> {
    if g.len() != shape.qk_len() {
        return Err(invalid(format!(
            "{op}: g has {} elements but [B, T, H, Dk] needs {}",
            g.len(),
            shape.qk_len()
        )));
    }
    check_gate_values_of(op, &crate::ops::copy_to_host(ctx, stream, g)?, shape)
}

/// The GLA forward: its kernels and its workspace.
///
/// One instance may be launched many times on one stream; launches of one instance on different
/// streams must be ordered by the caller (they share the workspace). The workspace grows on
/// demand (a context synchronisation then) and is freed when the instance is dropped.
pub struct GlaForward {
    ctx: Arc<CudaContext>,
    /// The states kernels (indexed by Dk: [64, 128]) and the output kernels (by [Dv][Dk]).
    chunks: Twins<ChunkKernels>,
    fold: Kernel,
    sm_count: u32,
    force_segments: Option<u32>,
    force_splits: Option<u32>,
    words: StartWords,
    workspace: Option<CudaSlice<u8>>,
    tails: DocumentTails,
    entry_outputs: EntryOutputs,
}

/// The states kernels (by Dk) and output kernels (by Dv, then Dk) of one of GLA's forwards.
pub(crate) type ChunkKernels = ([Kernel; 2], [[Kernel; 2]; 2]);

/// The instances' names of a forward's [`ChunkKernels`]: the states row, the output rows by Dv.
pub(crate) type ChunkNames = ([&'static str; 2], [[&'static str; 2]; 2]);

/// The [`ChunkKernels`] named by `names` and their twins for packed documents, `packed`, with
/// their shared-memory limits raised to what the plans launch with; an error (naming `op`)
/// where this GPU cannot give a block the output kernel's shared memory.
pub(crate) fn chunk_kernels(
    runtime: &Runtime,
    op: &str,
    names: ChunkNames,
    packed: ChunkNames,
) -> Result<Twins<ChunkKernels>> {
    Twins::new([names, packed], |(states, output)| {
        chunk_kernels_of(runtime, op, states, output)
    })
}

fn chunk_kernels_of(
    runtime: &Runtime,
    op: &str,
    states: [&'static str; 2],
    output: [[&'static str; 2]; 2],
) -> Result<ChunkKernels> {
    require_shared_memory(runtime, op, output_smem_bytes(128, 128))?;
    let module = runtime.module();
    let states = module.kernels_per_width(states)?;
    let output = [
        module.kernels_per_width(output[0])?,
        module.kernels_per_width(output[1])?,
    ];
    for (i, dk) in [64, 128].into_iter().enumerate() {
        states[i].set_max_dynamic_shared_bytes(states_smem_bytes(dk))?;
        for (j, dv) in [64, 128].into_iter().enumerate() {
            output[j][i].set_max_dynamic_shared_bytes(output_smem_bytes(dk, dv))?;
        }
    }
    Ok((states, output))
}

impl GlaForward {
    /// Looks up the kernels in the runtime's module and raises their shared-memory limits; an
    /// error if this GPU cannot give a block that much shared memory.
    pub fn new(runtime: &Runtime) -> Result<Self> {
        let ctx = runtime.context().clone();
        let chunks = chunk_kernels(
            runtime,
            OP,
            (
                instances::GLA_STATES,
                [instances::GLA_OUTPUT_DV64, instances::GLA_OUTPUT_DV128],
            ),
            (
                instances::GLA_STATES_PACKED,
                [
                    instances::GLA_OUTPUT_DV64_PACKED,
                    instances::GLA_OUTPUT_DV128_PACKED,
                ],
            ),
        )?;
        let module = runtime.module();
        Ok(GlaForward {
            fold: module.kernel("lasp_gla_fold")?,
            sm_count: crate::ops::sm_count(&ctx)?,
            ctx,
            chunks,
            force_segments: None,
            force_splits: None,
            words: StartWords::new(runtime)?,
            workspace: None,
            tails: DocumentTails::new(runtime, instances::GLA_DOCUMENT_STATES)?,
            entry_outputs: EntryOutputs::new(
                runtime,
                [
                    instances::GLA_OUTPUT_DV64_ENTRIES,
                    instances::GLA_OUTPUT_DV128_ENTRIES,
                ],
            )?,
        })
    }

    /// Forces the number of segments per sequence (tests and tuning), or restores the automatic
    /// plan with `None`.
    pub fn set_num_segments(&mut self, segments: Option<u32>) -> Result<()> {
        check_forced_segments(segments, OP)?;
        self.force_segments = segments;
        Ok(())
    }

    /// Forces the number of pieces the states pass cuts each segment into (tests and tuning),
    /// or restores the automatic choice with `None`.
    pub fn set_states_splits(&mut self, splits: Option<u32>) {
        self.force_splits = splits;
    }

    /// The plan a launch of `shape` would use (validates the shape).
    pub fn plan(&self, shape: &ForwardShape) -> Result<GlaPlan> {
        GlaPlan::new(shape, self.sm_count, self.force_segments, self.force_splits)
    }

    /// Copies `g` to the host (synchronising `stream`) and checks that every gate is finite and
    /// `<= 0`; the error names the first offending `[b, t, h, d]`.
    pub fn validate_gates(
        &self,
        stream: &Arc<CudaStream>,
        g: DeviceRef<'_, f32>,
        shape: &ForwardShape,
    ) -> Result<()> {
        validate_gates_of(OP, &self.ctx, stream, g, shape)
    }

    /// Enqueues the forward on `stream` (a stream of the runtime's context) and returns the plan
    /// it used. Everything is validated before the first launch; in debug builds the gates are
    /// checked too, which synchronises `stream`.
    pub fn launch(&mut self, stream: &Arc<CudaStream>, args: GlaArgs<'_>) -> Result<GlaPlan> {
        StreamOrder::around(stream, args.homes(), OP, || self.enqueue(stream, args))
    }

    fn enqueue(&mut self, stream: &Arc<CudaStream>, args: GlaArgs<'_>) -> Result<GlaPlan> {
        let plan = self.plan(&args.shape)?;
        let scale = args.check(OP)?;
        crate::ops::require_runtime_stream(stream, &self.ctx, OP)?;
        if cfg!(debug_assertions) {
            self.validate_gates(stream, args.g, &args.shape)?;
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
        let (ws_m, ws_p, ws_lambda) = if plan.num_segments > 1 {
            let (p, lambda) = plan.workspace_offsets();
            (base, base + p, base + lambda)
        } else {
            (0, 0, 0)
        };
        let s = &args.shape;
        let entries = match (&args.document_ht, args.documents) {
            (Some(ht), Some(docs)) => Some(self.tails.entries(stream, docs, s.t, ht, OP)?),
            _ => None,
        };
        let params = GlaParams {
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
            states_splits: plan.states_splits as i32,
            scale,
        };
        let (i, j) = (width_index(s.dk), width_index(s.dv));
        let (states, output) = self.chunks.get(args.documents.is_some());
        // SAFETY: GlaParams is lasp_gla_params, generated from the header; the shape is
        // supported and every tensor has the length, alignment and non-overlap the kernels need
        // (checked above); the views borrow their buffers for the call and their contracts keep
        // the memory valid until the kernels complete; the workspace is owned by self and freed
        // only after a context synchronisation. With documents' final states the output kernel
        // stores the entering states where the slots written above name them, and the tails'
        // kernel follows it on `stream`.
        unsafe {
            if let (Some(states_launch), Some(fold)) = (plan.states, plan.fold) {
                states[i].launch(stream, states_launch, &params)?;
                self.fold.launch(stream, fold, &params)?;
            }
            let output = match entries {
                Some(_) => self.entry_outputs.get(s),
                None => &output[j][i],
            };
            output.launch(stream, plan.output, &params)?;
            if let (Some(ht), Some(documents)) = (&args.document_ht, args.documents) {
                let inputs = StatesInputs {
                    shape: args.shape,
                    k: args.k,
                    v: args.v,
                    g: args.g,
                    documents,
                    beta: None,
                };
                self.tails.launch(stream, &inputs, ht)?;
            }
        }
        Ok(plan)
    }
}

impl Drop for GlaForward {
    fn drop(&mut self) {
        // Earlier launches may still read the workspace.
        if self.workspace.is_some() {
            let _ = self.ctx.synchronize();
        }
    }
}
