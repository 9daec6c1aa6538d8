//! [`MlstmForward`]: the mLSTM forward's kernels, workspace and launches, and the checks of one
//! call's tensors ([`MlstmArgs`]) before anything is launched.

use super::document_states::{check_document_final_states, DocumentEntries};
use super::plan::{output_smem_bytes, states_smem_bytes};
use super::{MlstmParams, MlstmPlan};
use crate::error::{Error, Result};
use crate::kernel::{width_index, Kernel};
use crate::ops::documents::masked::{refuse_states, StartWords, Twins};
use crate::ops::documents::{Documents, LoopOrder};
use crate::ops::scalar_decay::{ForwardShape, TensorChecks};
use crate::ops::Scope;
use crate::ops::{bf16, require_shared_memory, DeviceMut, DeviceRef, StreamOrder};
use crate::runtime::Runtime;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use lasp_shmem_kernels::instances;
use std::sync::Arc;

const OP: &str = "mLSTM forward";

/// mlstm_kernels' default denominator epsilon.
pub const DEFAULT_EPS: f32 = 1e-6;

/// A stabilised state `(C, n, m)` an operation reads: `c [B, H, Dk, Dv]`, `n [B, H, Dk]`,
/// `m [B, H]`, fp32, each 8-byte aligned. It stands for the unstabilised `(e^m C, e^m n)`.
#[derive(Clone, Copy, Debug)]
pub struct MlstmStateRef<'a> {
    pub c: DeviceRef<'a, f32>,
    pub n: DeviceRef<'a, f32>,
    pub m: DeviceRef<'a, f32>,
}

/// A stabilised state `(C, n, m)` an operation writes (layouts as [`MlstmStateRef`]).
#[derive(Debug)]
pub struct MlstmStateMut<'a> {
    pub c: DeviceMut<'a, f32>,
    pub n: DeviceMut<'a, f32>,
    pub m: DeviceMut<'a, f32>,
}

/// A LASP-2 shard's boundary states, written by
/// [`MlstmLasp2Forward::forward_saving`](super::MlstmLasp2Forward::forward_saving): the state
/// entering the shard (PE 0: the sequence's initial state) and the state leaving it (the last PE:
/// the sequence's final state), layouts as [`MlstmStateRef`].
#[derive(Debug)]
pub struct MlstmBoundaryMut<'a> {
    pub entry: MlstmStateMut<'a>,
    pub exit: MlstmStateMut<'a>,
}

/// The boundary states [`MlstmBoundaryMut`] holds, as [`super::MlstmLasp2Backward`] reads them.
#[derive(Clone, Copy, Debug)]
pub struct MlstmBoundaryRef<'a> {
    pub entry: MlstmStateRef<'a>,
    pub exit: MlstmStateRef<'a>,
}

impl<'a> MlstmBoundaryMut<'a> {
    pub(super) fn homes(&self) -> Vec<Option<&'a Arc<CudaStream>>> {
        let (i, o) = (&self.entry, &self.exit);
        vec![
            i.c.home(),
            i.n.home(),
            i.m.home(),
            o.c.home(),
            o.n.home(),
            o.m.home(),
        ]
    }

    /// Checks lengths and alignment against `args`' shape, and that the boundary overlaps none of
    /// `args`' tensors nor itself.
    pub(super) fn check(&self, args: &MlstmArgs<'_>) -> Result<()> {
        const LASP2_OP: &str = "mLSTM LASP-2 forward";
        let s = &args.shape;
        let checks = TensorChecks::new(LASP2_OP, s);
        let layouts = [
            ("[B, H, Dk, Dv]", s.state_len()),
            ("[B, H, Dk]", s.b * s.h * s.dk),
            ("[B, H]", s.b * s.h),
        ];
        let mut outputs = vec![("h", args.h.byte_range())];
        if let Some(st) = &args.final_state {
            outputs.extend([
                ("c_t", st.c.byte_range()),
                ("n_t", st.n.byte_range()),
                ("m_t", st.m.byte_range()),
            ]);
        }
        if let Some(saved) = &args.saved {
            outputs.extend([
                ("saved.m", saved.m.byte_range()),
                ("saved.den", saved.den.byte_range()),
            ]);
        }
        if let Some(st) = &args.document_final_states {
            outputs.extend([
                ("document_final_states.c", st.c.byte_range()),
                ("document_final_states.n", st.n.byte_range()),
                ("document_final_states.m", st.m.byte_range()),
            ]);
        }
        let names = [
            ["entry.c", "entry.n", "entry.m"],
            ["exit.c", "exit.n", "exit.m"],
        ];
        for (st, names) in [&self.entry, &self.exit].into_iter().zip(names) {
            for ((name, x), (layout, want)) in
                names.into_iter().zip([&st.c, &st.n, &st.m]).zip(layouts)
            {
                checks.tensor(name, layout, (x.len(), want), x.addr(), 8)?;
                outputs.push((name, x.byte_range()));
            }
        }
        let mut inputs = vec![
            ("q", args.q.byte_range()),
            ("k", args.k.byte_range()),
            ("v", args.v.byte_range()),
            ("i_gate", args.i_gate.byte_range()),
            ("f_gate", args.f_gate.byte_range()),
        ];
        if let Some(st) = &args.initial_state {
            inputs.extend([
                ("c0", st.c.byte_range()),
                ("n0", st.n.byte_range()),
                ("m0", st.m.byte_range()),
            ]);
        }
        checks.disjoint(&inputs, &outputs)?;
        Ok(())
    }
}

/// What the forward saves for [`super::MlstmBackward`]: every token's stabiliser `m_t` and
/// denominator `max(|sigma q_t . n_t|, e^{-m_t}) + eps`, each `[B, T, H]` fp32, 4-byte aligned.
#[derive(Debug)]
pub struct MlstmSavedMut<'a> {
    pub m: DeviceMut<'a, f32>,
    pub den: DeviceMut<'a, f32>,
}

/// The rows [`MlstmSavedMut`] holds, as the backward reads them.
#[derive(Clone, Copy, Debug)]
pub struct MlstmSavedRef<'a> {
    pub m: DeviceRef<'a, f32>,
    pub den: DeviceRef<'a, f32>,
}

/// The tensors of one call; views from cudarc buffers ([`DeviceRef::new`], [`DeviceMut::new`])
/// or raw pointers, all in the runtime's GPU context.
#[derive(Debug)]
pub struct MlstmArgs<'a> {
    /// The dimensions every tensor must agree with (Dk and Dv 64 or 128).
    pub shape: ForwardShape,
    /// Queries `[B, T, H, Dk]`, bf16, contiguous, 16-byte aligned.
    pub q: DeviceRef<'a, bf16>,
    /// Keys `[B, T, H, Dk]`, bf16, contiguous, 16-byte aligned.
    pub k: DeviceRef<'a, bf16>,
    /// Values `[B, T, H, Dv]`, bf16, contiguous, 16-byte aligned.
    pub v: DeviceRef<'a, bf16>,
    /// Input-gate pre-activations `i [B, T, H]`, fp32, finite (the gate is `e^i`).
    pub i_gate: DeviceRef<'a, f32>,
    /// Forget-gate pre-activations `f [B, T, H]`, fp32, finite (the gate is `sigmoid(f)`).
    pub f_gate: DeviceRef<'a, f32>,
    /// The state before token 0; `None` for mlstm_kernels' zero state `(0, 0, 0)`.
    pub initial_state: Option<MlstmStateRef<'a>>,
    /// Output `h [B, T, H, Dv]`, bf16, 16-byte aligned; every element is written.
    pub h: DeviceMut<'a, bf16>,
    /// The state after the last token; `None` to skip it.
    pub final_state: Option<MlstmStateMut<'a>>,
    /// What the backward needs of this forward; `None` to skip it (inference).
    pub saved: Option<MlstmSavedMut<'a>>,
    /// `sigma`, the query scale; `None` for `Dk^-1/2`.
    pub scale: Option<f32>,
    /// The denominator's epsilon, added after the max; `None` for [`DEFAULT_EPS`].
    pub eps: Option<f32>,
    /// Packed documents: every document starts from mlstm_kernels' zero state and no score
    /// crosses a start. With documents `initial_state` and `final_state` must be `None`.
    pub documents: Option<Documents<'a>>,
    /// With documents: every document's final state, `c [B, N, H, Dk, Dv]`, `n [B, N, H, Dk]`,
    /// `m [B, N, H]` fp32 (N = `cu_seqlens.len() - 1`), each 8-byte aligned: document n's state
    /// after its last token where that token is in this shard, as the document alone from the zero
    /// state ends, and zeros (C, n and m) for the others, so that the sum over LASP-2's PEs holds
    /// every document's. Every element is written. `None` to skip them.
    pub document_final_states: Option<MlstmStateMut<'a>>,
}

impl<'a> MlstmArgs<'a> {
    /// The streams of the buffers the views come from ([`crate::ops`], "Ordering").
    pub(super) fn homes(&self) -> Vec<Option<&'a Arc<CudaStream>>> {
        let mut homes = vec![
            self.q.home(),
            self.k.home(),
            self.v.home(),
            self.i_gate.home(),
            self.f_gate.home(),
            self.h.home(),
            self.documents.and_then(|d| d.cu_seqlens.home()),
        ];
        if let Some(s) = &self.initial_state {
            homes.extend([s.c.home(), s.n.home(), s.m.home()]);
        }
        if let Some(s) = &self.final_state {
            homes.extend([s.c.home(), s.n.home(), s.m.home()]);
        }
        if let Some(s) = &self.saved {
            homes.extend([s.m.home(), s.den.home()]);
        }
        if let Some(s) = &self.document_final_states {
            homes.extend([s.c.home(), s.n.home(), s.m.home()]);
        }
        homes
    }

    /// Checks lengths, alignment, scale, eps and overlaps against the (validated) shape; returns
    /// the scale and eps to use.
    pub(super) fn check(&self) -> Result<(f32, f32)> {
        let s = &self.shape;
        refuse_states(
            OP,
            self.documents.as_ref(),
            &[
                ("initial_state", self.initial_state.is_some()),
                ("final_state", self.final_state.is_some()),
            ],
        )?;
        let checks = TensorChecks::new(OP, s);
        let per_token = s.b * s.t * s.h;
        let (c_len, n_len, m_len) = (s.state_len(), s.b * s.h * s.dk, s.b * s.h);
        let bf16_tensors = [
            ("q", self.q, "[B, T, H, Dk]", s.qk_len()),
            ("k", self.k, "[B, T, H, Dk]", s.qk_len()),
            ("v", self.v, "[B, T, H, Dv]", s.v_len()),
        ];
        for (name, x, layout, want) in bf16_tensors {
            checks.tensor(name, layout, (x.len(), want), x.addr(), 16)?;
        }
        for (name, x) in [("i_gate", self.i_gate), ("f_gate", self.f_gate)] {
            checks.tensor(name, "[B, T, H]", (x.len(), per_token), x.addr(), 4)?;
        }
        let mut inputs = vec![
            ("q", self.q.byte_range()),
            ("k", self.k.byte_range()),
            ("v", self.v.byte_range()),
            ("i_gate", self.i_gate.byte_range()),
            ("f_gate", self.f_gate.byte_range()),
        ];
        let state_layouts = [
            ("[B, H, Dk, Dv]", c_len),
            ("[B, H, Dk]", n_len),
            ("[B, H]", m_len),
        ];
        if let Some(st) = &self.initial_state {
            let parts = [("c0", st.c), ("n0", st.n), ("m0", st.m)];
            for ((name, x), (layout, want)) in parts.into_iter().zip(state_layouts) {
                checks.tensor(name, layout, (x.len(), want), x.addr(), 8)?;
                inputs.push((name, x.byte_range()));
            }
        }
        checks.tensor(
            "h",
            "[B, T, H, Dv]",
            (self.h.len(), s.v_len()),
            self.h.addr(),
            16,
        )?;
        let mut outputs = vec![("h", self.h.byte_range())];
        if let Some(st) = &self.final_state {
            let parts = [("c_t", &st.c), ("n_t", &st.n), ("m_t", &st.m)];
            for ((name, x), (layout, want)) in parts.into_iter().zip(state_layouts) {
                checks.tensor(name, layout, (x.len(), want), x.addr(), 8)?;
                outputs.push((name, x.byte_range()));
            }
        }
        if let Some(saved) = &self.saved {
            for (name, x) in [("saved.m", &saved.m), ("saved.den", &saved.den)] {
                checks.tensor(name, "[B, T, H]", (x.len(), per_token), x.addr(), 4)?;
                outputs.push((name, x.byte_range()));
            }
        }
        if let Some(states) = &self.document_final_states {
            let documents = self.documents.as_ref();
            outputs.extend(check_document_final_states(
                &checks, OP, s, documents, states,
            )?);
        }
        checks.disjoint(&inputs, &outputs)?;
        let scale = checks.scale(self.scale, s)?;
        let eps = self.eps.unwrap_or(DEFAULT_EPS);
        if !(eps.is_finite() && eps >= 0.0) {
            return Err(Error::InvalidArgument(format!(
                "{OP}: eps = {eps} must be finite and >= 0; pass None for mlstm_kernels' 1e-6"
            )));
        }
        Ok((scale, eps))
    }
}

/// The first gate pre-activation that is not finite, as an error naming `which` gate and
/// `[b, t, h]`.
pub fn check_gate_values(which: &str, gate: &[f32], shape: &ForwardShape) -> Result<()> {
    let Some(pos) = gate.iter().position(|x| !x.is_finite()) else {
        return Ok(());
    };
    let (h, t) = (shape.h.max(1), shape.t.max(1));
    let (hh, rest) = (pos % h, pos / h);
    let (tt, b) = (rest % t, rest / t);
    Err(Error::InvalidArgument(format!(
        "{OP}: {which}[b={b}, t={tt}, h={hh}] = {} must be finite: gates are pre-activations \
         (the input gate is e^i, the forget gate sigmoid(f)); clamp them before the call",
        gate[pos]
    )))
}

/// [`MlstmForward::validate_gates`], for the forward and the backward (in their debug builds).
pub(super) fn validate_gates(
    ctx: &Arc<CudaContext>,
    stream: &Arc<CudaStream>,
    i_gate: DeviceRef<'_, f32>,
    f_gate: DeviceRef<'_, f32>,
    shape: &ForwardShape,
) -> Result<()> {
    let want = shape.b * shape.t * shape.h;
    for (which, gate) in [("i_gate", i_gate), ("f_gate", f_gate)] {
        if gate.len() != want {
            return Err(Error::InvalidArgument(format!(
                "{OP}: {which} has {} elements but [B, T, H] needs {want}",
                gate.len()
            )));
        }
        check_gate_values(which, &crate::ops::copy_to_host(ctx, stream, gate)?, shape)?;
    }
    Ok(())
}

/// Which build of the chunk kernels: the forward's, or the backward's gradient passes' (no
/// normaliser; rows scaled and dotted: `lasp/mlstm/backward_params.h`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum ChunkForm {
    Forward,
    Gradient,
}

/// The states and output kernels of one build per (Dv, Dk), their shared-memory limits raised.
struct ChunkTables {
    /// Indexed by [Dv][Dk]: 64, 128 each.
    states: [[Kernel; 2]; 2],
    output: [[Kernel; 2]; 2],
}

/// The instance names of one build: states, then output, each per Dv (64, 128) and Dk.
type ChunkNames = [[[&'static str; 2]; 2]; 2];

impl ChunkTables {
    fn new(runtime: &Runtime, [states, output]: ChunkNames) -> Result<Self> {
        Ok(ChunkTables {
            states: kernel_table(runtime, states, states_smem_bytes)?,
            output: kernel_table(runtime, output, output_smem_bytes)?,
        })
    }
}

/// The kernels `names` (per Dv, rows by Dk), each allowed `smem_bytes(dk, dv)` of shared memory.
fn kernel_table(
    runtime: &Runtime,
    names: [[&'static str; 2]; 2],
    smem_bytes: fn(usize, usize) -> u32,
) -> Result<[[Kernel; 2]; 2]> {
    let module = runtime.module();
    let [k64, k128] = names.map(|names| module.kernels_per_width(names));
    let kernels = [k64?, k128?];
    for (j, dv) in [64, 128].into_iter().enumerate() {
        for (i, dk) in [64, 128].into_iter().enumerate() {
            kernels[j][i].set_max_dynamic_shared_bytes(smem_bytes(dk, dv))?;
        }
    }
    Ok(kernels)
}

/// The chunk passes of every mLSTM forward (one GPU and LASP-2 shards) and of the backward's
/// gradient passes: the states and output kernels and their twins for packed documents (taken
/// where the parameters carry start words), and the single-GPU fold.
pub(super) struct ChunkKernels {
    tables: Twins<ChunkTables>,
    /// The forward's packed output kernels that also store the states entering the documents'
    /// last chunks (by [Dv][Dk]; taken where the parameters carry entry slots): instances of
    /// their own, so that the packed loop without final states stays as it was.
    entry_outputs: Option<[[Kernel; 2]; 2]>,
    single_gpu_fold: Kernel,
}

impl ChunkKernels {
    /// Looks up the kernels in the runtime's module and raises their shared-memory limits; an
    /// error if this GPU cannot give a block that much shared memory.
    pub(super) fn new(runtime: &Runtime, op: &str, form: ChunkForm) -> Result<Self> {
        require_shared_memory(runtime, op, output_smem_bytes(128, 128))?;
        use instances::*;
        let names: [ChunkNames; 2] = match form {
            ChunkForm::Forward => [
                [
                    [MLSTM_STATES_DV64, MLSTM_STATES_DV128],
                    [MLSTM_OUTPUT_DV64, MLSTM_OUTPUT_DV128],
                ],
                [
                    [MLSTM_STATES_DV64_PACKED, MLSTM_STATES_DV128_PACKED],
                    [MLSTM_OUTPUT_DV64_PACKED, MLSTM_OUTPUT_DV128_PACKED],
                ],
            ],
            ChunkForm::Gradient => [
                [
                    [MLSTM_GRAD_STATES_DV64, MLSTM_GRAD_STATES_DV128],
                    [MLSTM_GRAD_OUTPUT_DV64, MLSTM_GRAD_OUTPUT_DV128],
                ],
                [
                    [
                        MLSTM_GRAD_STATES_DV64_PACKED,
                        MLSTM_GRAD_STATES_DV128_PACKED,
                    ],
                    [
                        MLSTM_GRAD_OUTPUT_DV64_PACKED,
                        MLSTM_GRAD_OUTPUT_DV128_PACKED,
                    ],
                ],
            ],
        };
        let entry_outputs = match form {
            ChunkForm::Forward => Some(kernel_table(
                runtime,
                [MLSTM_OUTPUT_DV64_ENTRIES, MLSTM_OUTPUT_DV128_ENTRIES],
                output_smem_bytes,
            )?),
            ChunkForm::Gradient => None,
        };
        Ok(ChunkKernels {
            tables: Twins::new(names, |names| ChunkTables::new(runtime, names))?,
            entry_outputs,
            single_gpu_fold: runtime.module().kernel("lasp_mlstm_fold")?,
        })
    }

    /// The build `params` runs: the packed twins where it carries start words.
    fn tables(&self, params: &MlstmParams) -> &ChunkTables {
        self.tables.get(!params.starts.is_null())
    }

    /// The whole single-GPU forward of `plan` (scope [`Scope::SingleGpu`]): the states pass and
    /// the fold where it has segments to join, then the output pass.
    ///
    /// # Safety
    /// As [`ChunkKernels::launch_states`].
    pub(super) unsafe fn launch_single_gpu(
        &self,
        stream: &Arc<CudaStream>,
        plan: &MlstmPlan,
        params: &MlstmParams,
    ) -> Result<()> {
        // SAFETY: the caller's contract; each kernel reads what the one before it on the stream
        // wrote.
        unsafe {
            self.launch_states(stream, plan, params)?;
            if let Some(fold) = plan.fold {
                self.single_gpu_fold.launch(stream, fold, params)?;
            }
            self.launch_output(stream, plan, params)
        }
    }

    /// The states pass of `plan`, where it has one.
    ///
    /// # Safety
    /// `params` must come from [`chunk_params`] for `plan` with operands that passed their
    /// call's checks ([`MlstmArgs::check`] for the forward), their buffers and the workspace
    /// alive until the kernels complete.
    pub(super) unsafe fn launch_states(
        &self,
        stream: &Arc<CudaStream>,
        plan: &MlstmPlan,
        params: &MlstmParams,
    ) -> Result<()> {
        let s = &plan.shape;
        let Some(states) = plan.states else {
            return Ok(());
        };
        // SAFETY: the caller's contract.
        unsafe {
            self.tables(params).states[width_index(s.dv)][width_index(s.dk)]
                .launch(stream, states, params)
        }
    }

    /// The output pass of `plan`; where `params` carries entry slots (packed documents' final
    /// states), the output loop that also stores the states entering the documents' last chunks.
    ///
    /// # Safety
    /// As [`ChunkKernels::launch_states`]; the states entering the segments (`c0` and the
    /// workspace's prefixes) written before it on `stream`; entry slots, where given, written
    /// before it too and naming slots inside the checked per-document states and workspace.
    pub(super) unsafe fn launch_output(
        &self,
        stream: &Arc<CudaStream>,
        plan: &MlstmPlan,
        params: &MlstmParams,
    ) -> Result<()> {
        let s = &plan.shape;
        let (j, i) = (width_index(s.dv), width_index(s.dk));
        let kernel = match &self.entry_outputs {
            Some(entries) if !params.entry_slots.is_null() => &entries[j][i],
            _ => &self.tables(params).output[j][i],
        };
        // SAFETY: the caller's contract.
        unsafe { kernel.launch(stream, plan.output, params) }
    }
}

/// The device addresses one run of the chunk passes reads and writes (0 where a tensor is absent;
/// the fields of `lasp_mlstm_params` they fill).
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct ChunkOperands {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub i_gate: u64,
    pub f_gate: u64,
    pub o: u64,
    pub c0: u64,
    pub n0: u64,
    pub m0: u64,
    pub c_t: u64,
    pub n_t: u64,
    pub m_t: u64,
    pub row_m: u64,
    pub row_den: u64,
    pub row_log_scale: u64,
    pub row_dot_with: u64,
    pub row_dots: u64,
    pub reversed: bool,
    /// The loop's start words (packed documents), or 0.
    pub starts: u64,
}

impl ChunkOperands {
    /// The forward's operands: `args`' tensors.
    pub(super) fn of_forward(args: &MlstmArgs<'_>) -> Self {
        let state_in = args.initial_state;
        let state_out = args.final_state.as_ref();
        let saved = args.saved.as_ref();
        ChunkOperands {
            q: args.q.addr(),
            k: args.k.addr(),
            v: args.v.addr(),
            i_gate: args.i_gate.addr(),
            f_gate: args.f_gate.addr(),
            o: args.h.addr(),
            c0: state_in.map_or(0, |x| x.c.addr()),
            n0: state_in.map_or(0, |x| x.n.addr()),
            m0: state_in.map_or(0, |x| x.m.addr()),
            c_t: state_out.map_or(0, |x| x.c.addr()),
            n_t: state_out.map_or(0, |x| x.n.addr()),
            m_t: state_out.map_or(0, |x| x.m.addr()),
            row_m: saved.map_or(0, |x| x.m.addr()),
            row_den: saved.map_or(0, |x| x.den.addr()),
            ..Default::default()
        }
    }
}

/// The parameters of one call of `plan` from checked `args` (scale and eps from
/// [`MlstmArgs::check`]) with the workspace at device address `base` and the start words at
/// `starts` (0 without documents).
pub(super) fn call_params(
    args: &MlstmArgs<'_>,
    plan: &MlstmPlan,
    base: u64,
    scale: f32,
    eps: f32,
    starts: u64,
) -> MlstmParams {
    let ops = ChunkOperands {
        starts,
        ..ChunkOperands::of_forward(args)
    };
    chunk_params(&ops, plan, base, scale, eps)
}

/// The parameters of one run of `plan`'s chunk passes over `ops` with the workspace at device
/// address `base`.
pub(super) fn chunk_params(
    ops: &ChunkOperands,
    plan: &MlstmPlan,
    base: u64,
    scale: f32,
    eps: f32,
) -> MlstmParams {
    let at = |offset: u64| {
        if plan.workspace_bytes > 0 {
            base + offset
        } else {
            0
        }
    };
    let ws = plan.workspace_offsets();
    let s = &plan.shape;
    MlstmParams {
        q: ops.q as _,
        k: ops.k as _,
        v: ops.v as _,
        i_gate: ops.i_gate as _,
        f_gate: ops.f_gate as _,
        o: ops.o as _,
        c0: ops.c0 as _,
        n0: ops.n0 as _,
        m0: ops.m0 as _,
        c_t: ops.c_t as _,
        n_t: ops.n_t as _,
        m_t: ops.m_t as _,
        row_m: ops.row_m as _,
        row_den: ops.row_den as _,
        row_log_scale: ops.row_log_scale as _,
        row_dot_with: ops.row_dot_with as _,
        row_dots: ops.row_dots as _,
        reversed: i32::from(ops.reversed),
        starts: ops.starts as _,
        entry_slots: std::ptr::null(),
        document_c: std::ptr::null_mut(),
        document_n: std::ptr::null_mut(),
        entry_m: std::ptr::null_mut(),
        documents: 0,
        ws_c: at(0) as _,
        ws_pc: at(ws.pc) as _,
        ws_n: at(ws.n) as _,
        ws_pn: at(ws.pn) as _,
        ws_m: at(ws.m) as _,
        ws_f: at(ws.f) as _,
        ws_pm: at(ws.pm) as _,
        B: s.b as i32,
        T: s.t as i32,
        H: s.h as i32,
        Dk: s.dk as i32,
        Dv: s.dv as i32,
        num_segments: plan.num_segments as i32,
        chunks_per_segment: plan.chunks_per_segment as i32,
        num_summaries: plan.num_summaries as i32,
        states_splits: plan.states_splits as i32,
        scale,
        eps,
    }
}

/// The mLSTM forward: its kernels and its workspace.
///
/// One instance may be launched many times on one stream; launches of one instance on different
/// streams must be ordered by the caller (they share the workspace). The workspace grows on
/// demand (a context synchronisation then) and is freed when the instance is dropped.
pub struct MlstmForward {
    ctx: Arc<CudaContext>,
    kernels: ChunkKernels,
    words: StartWords,
    sm_count: u32,
    force_segments: Option<u32>,
    force_splits: Option<u32>,
    workspace: Option<CudaSlice<u8>>,
    entries: DocumentEntries,
}

impl MlstmForward {
    /// Looks up the kernels in the runtime's module and raises their shared-memory limits; an
    /// error if this GPU cannot give a block that much shared memory.
    pub fn new(runtime: &Runtime) -> Result<Self> {
        let ctx = runtime.context().clone();
        Ok(MlstmForward {
            kernels: ChunkKernels::new(runtime, OP, ChunkForm::Forward)?,
            words: StartWords::new(runtime)?,
            sm_count: crate::ops::sm_count(&ctx)?,
            ctx,
            force_segments: None,
            force_splits: None,
            workspace: None,
            entries: DocumentEntries::new(runtime)?,
        })
    }

    /// Forces the number of segments per sequence (tests and tuning), or restores the automatic
    /// plan with `None`.
    pub fn set_num_segments(&mut self, segments: Option<u32>) {
        self.force_segments = segments;
    }

    /// Forces the number of pieces the states pass cuts each segment into (tests and tuning),
    /// or restores the automatic choice with `None`.
    pub fn set_states_splits(&mut self, splits: Option<u32>) {
        self.force_splits = splits;
    }

    /// The plan a launch of `shape` would use (validates the shape).
    pub fn plan(&self, shape: &ForwardShape) -> Result<MlstmPlan> {
        MlstmPlan::new(
            shape,
            Scope::SingleGpu,
            self.sm_count,
            self.force_segments,
            self.force_splits,
        )
    }

    /// Copies both gates to the host (synchronising `stream`) and checks that every
    /// pre-activation is finite; the error names the first offending gate and `[b, t, h]`.
    pub fn validate_gates(
        &self,
        stream: &Arc<CudaStream>,
        i_gate: DeviceRef<'_, f32>,
        f_gate: DeviceRef<'_, f32>,
        shape: &ForwardShape,
    ) -> Result<()> {
        validate_gates(&self.ctx, stream, i_gate, f_gate, shape)
    }

    /// Enqueues the forward on `stream` (a stream of the runtime's context) and returns the plan
    /// it used. Everything is validated before the first launch; in debug builds the gates are
    /// checked too, which synchronises `stream`.
    pub fn launch(&mut self, stream: &Arc<CudaStream>, args: MlstmArgs<'_>) -> Result<MlstmPlan> {
        StreamOrder::around(stream, args.homes(), OP, || self.enqueue(stream, args))
    }

    fn enqueue(&mut self, stream: &Arc<CudaStream>, args: MlstmArgs<'_>) -> Result<MlstmPlan> {
        let plan = self.plan(&args.shape)?;
        let (scale, eps) = args.check()?;
        crate::ops::require_runtime_stream(stream, &self.ctx, OP)?;
        if cfg!(debug_assertions) {
            self.validate_gates(stream, args.i_gate, args.f_gate, &args.shape)?;
        }
        let entries = self.entries.targets(stream, &args, OP)?;
        // The documents' entering stabilisers (with their final states), then the start words
        // (packed documents), after the plan's parts.
        let (parts, stabilisers) = entries.workspace_parts(plan.workspace_bytes);
        let (base, [starts]) = self.words.workspace(
            &self.ctx,
            stream,
            &mut self.workspace,
            parts,
            args.documents,
            args.shape.t,
            [LoopOrder::InOrder],
            OP,
        )?;
        let params = entries.apply(
            call_params(&args, &plan, base, scale, eps, starts),
            base + stabilisers,
        );
        // SAFETY: MlstmParams is lasp_mlstm_params, generated from the header, made by
        // call_params for this plan; the shape is supported and every tensor has the length,
        // alignment and non-overlap the kernels need (checked above); the views borrow their
        // buffers for the call and their contracts keep the memory valid until the kernels
        // complete; the workspace is owned by self and freed only after a context
        // synchronisation. With the documents' final states the output kernel stores the
        // entering states where the slots written above name them, and the states kernel follows
        // it on `stream`.
        unsafe {
            self.kernels.launch_single_gpu(stream, &plan, &params)?;
            self.entries
                .launch_tails(stream, &args, base + stabilisers)?;
        }
        Ok(plan)
    }
}

impl Drop for MlstmForward {
    fn drop(&mut self) {
        // Earlier launches may still read the workspace.
        if self.workspace.is_some() {
            let _ = self.ctx.synchronize();
        }
    }
}
