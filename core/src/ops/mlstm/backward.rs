//! [`MlstmBackward`]: mlstm_kernels' (TFLA's) mLSTM gradient on one GPU, from the rows the
//! forward saved ([`MlstmSavedMut`](super::MlstmSavedMut)).
//!
//! The maths and the call order are in `lasp/mlstm/backward_params.h`: the stabilisers and the
//! denominators are the forward's constants, so the gradient is three runs of the forward's
//! chunk passes in their gradient build (no normaliser; rows scaled and dotted) with the roles
//! of the tensors exchanged: dq in order, dv and dk with time reversed. Around them,
//! `kernels/cuda/mlstm/backward.cu` prepares the operands (each row's weight `e^{-m_t} / den_t`,
//! or `dh / den` in bf16 where dh is the dv pass's value; the reversed passes' gates and start
//! states) and finishes the gates' and the initial state's
//! gradients.

use super::forward::{
    chunk_params, validate_gates, ChunkForm, ChunkKernels, ChunkOperands, MlstmSavedRef,
};
use super::{MlstmPlan, MlstmStateRef};
use crate::error::Result;
use crate::kernel::{Kernel, LaunchShape};
use crate::ops::documents::masked::{refuse_states, StartWords};
use crate::ops::documents::{Documents, LoopOrder};
use crate::ops::scalar_decay::{ForwardShape, TensorChecks};
use crate::ops::{bf16, DeviceMut, DeviceRef, Scope, StreamOrder};
use crate::runtime::Runtime;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use lasp_shmem_kernels::params as header;
use std::sync::Arc;

const OP: &str = "mLSTM backward";

/// The parameter struct of `kernels/cuda/mlstm/backward.cu` (`lasp/mlstm/backward_params.h`).
pub type MlstmBwdParams = header::lasp_mlstm_bwd_params;

/// The cotangent of the final state that the backward takes: `dL/dC_T [B, H, Dk, Dv]`, and the
/// forward's `m_T [B, H]` at which `C_T` was stabilised (fp32, 8-byte aligned). mlstm_kernels'
/// gradient ignores `dn_T` and `dm_T`.
#[derive(Clone, Copy, Debug)]
pub struct MlstmFinalCotangent<'a> {
    pub d_c: DeviceRef<'a, f32>,
    pub m: DeviceRef<'a, f32>,
}

/// The tensors of one backward call (layouts as [`super::MlstmArgs`]); views in the runtime's GPU
/// context.
#[derive(Debug)]
pub struct MlstmBackwardArgs<'a> {
    /// The forward's dimensions (Dk and Dv 64 or 128).
    pub shape: ForwardShape,
    pub q: DeviceRef<'a, bf16>,
    pub k: DeviceRef<'a, bf16>,
    pub v: DeviceRef<'a, bf16>,
    pub i_gate: DeviceRef<'a, f32>,
    pub f_gate: DeviceRef<'a, f32>,
    /// The forward's initial state (its `n` is not read), or `None` for the zero state.
    pub initial_state: Option<MlstmStateRef<'a>>,
    /// The rows the forward saved for this call.
    pub saved: MlstmSavedRef<'a>,
    /// `dL/dh [B, T, H, Dv]`, bf16, 16-byte aligned.
    pub d_h: DeviceRef<'a, bf16>,
    /// The final state's cotangent, or `None` for zero.
    pub d_final: Option<MlstmFinalCotangent<'a>>,
    /// Gradients `[B, T, H, Dk]`, `[B, T, H, Dk]`, `[B, T, H, Dv]`, bf16, 16-byte aligned.
    pub dq: DeviceMut<'a, bf16>,
    pub dk: DeviceMut<'a, bf16>,
    pub dv: DeviceMut<'a, bf16>,
    /// Gradients of the gate pre-activations `[B, T, H]`, fp32.
    pub d_i_gate: DeviceMut<'a, f32>,
    pub d_f_gate: DeviceMut<'a, f32>,
    /// `dL/dC_0 [B, H, Dk, Dv]` (of the initial state, or of the zero state), or `None` to skip
    /// it; `dn_0 = dm_0 = 0` under this gradient.
    pub d_initial_c: Option<DeviceMut<'a, f32>>,
    /// The forward's `sigma`; `None` for `Dk^-1/2`.
    pub scale: Option<f32>,
    /// The forward's packed documents: no gradient crosses a start, and a start's own forget
    /// gate gets 0. With documents `initial_state`, `d_final` and `d_initial_c` must be `None`.
    pub documents: Option<Documents<'a>>,
}

impl<'a> MlstmBackwardArgs<'a> {
    pub(super) fn homes(&self) -> Vec<Option<&'a Arc<CudaStream>>> {
        let mut homes = vec![
            self.q.home(),
            self.k.home(),
            self.v.home(),
            self.i_gate.home(),
            self.f_gate.home(),
            self.saved.m.home(),
            self.saved.den.home(),
            self.d_h.home(),
            self.dq.home(),
            self.dk.home(),
            self.dv.home(),
            self.d_i_gate.home(),
            self.d_f_gate.home(),
            self.documents.and_then(|d| d.cu_seqlens.home()),
        ];
        if let Some(s) = &self.initial_state {
            homes.extend([s.c.home(), s.m.home()]);
        }
        if let Some(d) = &self.d_final {
            homes.extend([d.d_c.home(), d.m.home()]);
        }
        if let Some(d) = &self.d_initial_c {
            homes.push(d.home());
        }
        homes
    }

    /// Checks lengths, alignment, scale and overlaps; returns the scale.
    pub(super) fn check(&self) -> Result<f32> {
        refuse_states(
            OP,
            self.documents.as_ref(),
            &[("initial_state", self.initial_state.is_some())],
        )?;
        self.check_as(OP)
    }

    /// [`MlstmBackwardArgs::check`] with errors naming operation `op`, but for the initial
    /// state with documents (LASP-2 passes the state entering a shard as it).
    pub(super) fn check_as(&self, op: &str) -> Result<f32> {
        let s = &self.shape;
        refuse_states(
            op,
            self.documents.as_ref(),
            &[
                ("d_final", self.d_final.is_some()),
                ("d_initial_c", self.d_initial_c.is_some()),
            ],
        )?;
        let checks = TensorChecks::new(op, s);
        let per_token = s.b * s.t * s.h;
        let (qk, v) = ("[B, T, H, Dk]", "[B, T, H, Dv]");
        let mut inputs = Vec::new();
        for (name, x, layout, want) in [
            ("q", self.q, qk, s.qk_len()),
            ("k", self.k, qk, s.qk_len()),
            ("v", self.v, v, s.v_len()),
            ("d_h", self.d_h, v, s.v_len()),
        ] {
            checks.tensor(name, layout, (x.len(), want), x.addr(), 16)?;
            inputs.push((name, x.byte_range()));
        }
        for (name, x) in [
            ("i_gate", self.i_gate),
            ("f_gate", self.f_gate),
            ("saved.m", self.saved.m),
            ("saved.den", self.saved.den),
        ] {
            checks.tensor(name, "[B, T, H]", (x.len(), per_token), x.addr(), 4)?;
            inputs.push((name, x.byte_range()));
        }
        let mut states = Vec::new();
        if let Some(st) = &self.initial_state {
            states.extend([("c0", st.c, s.state_len()), ("m0", st.m, s.b * s.h)]);
        }
        if let Some(d) = &self.d_final {
            states.extend([
                ("d_final.d_c", d.d_c, s.state_len()),
                ("d_final.m", d.m, s.b * s.h),
            ]);
        }
        for (name, x, want) in states {
            let layout = if want == s.b * s.h {
                "[B, H]"
            } else {
                "[B, H, Dk, Dv]"
            };
            checks.tensor(name, layout, (x.len(), want), x.addr(), 8)?;
            inputs.push((name, x.byte_range()));
        }
        for (name, x, layout, want) in [
            ("dq", &self.dq, qk, s.qk_len()),
            ("dk", &self.dk, qk, s.qk_len()),
            ("dv", &self.dv, v, s.v_len()),
        ] {
            checks.tensor(name, layout, (x.len(), want), x.addr(), 16)?;
        }
        for (name, x) in [("d_i_gate", &self.d_i_gate), ("d_f_gate", &self.d_f_gate)] {
            checks.tensor(name, "[B, T, H]", (x.len(), per_token), x.addr(), 4)?;
        }
        if let Some(x) = &self.d_initial_c {
            checks.tensor(
                "d_initial_c",
                "[B, H, Dk, Dv]",
                (x.len(), s.state_len()),
                x.addr(),
                8,
            )?;
        }
        checks.disjoint(&inputs, &self.output_ranges())?;
        checks.scale(self.scale, s)
    }

    /// The gradients' byte ranges, by name.
    pub(super) fn output_ranges(&self) -> Vec<(&'static str, (u64, u64))> {
        let mut outputs = vec![
            ("dq", self.dq.byte_range()),
            ("dk", self.dk.byte_range()),
            ("dv", self.dv.byte_range()),
            ("d_i_gate", self.d_i_gate.byte_range()),
            ("d_f_gate", self.d_f_gate.byte_range()),
        ];
        if let Some(x) = &self.d_initial_c {
            outputs.push(("d_initial_c", x.byte_range()));
        }
        outputs
    }
}

/// The backward's plans: one per gradient pass (the dq and dk passes run with Dk and Dv
/// exchanged), and its workspace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MlstmBackwardPlan {
    pub dq: MlstmPlan,
    /// In scope [`Scope::Shard`] under LASP-2: its summary crosses GPUs.
    pub dv: MlstmPlan,
    pub dk: MlstmPlan,
    pub workspace_bytes: u64,
}

/// Byte offsets of the backward's workspace parts (each 256-byte aligned;
/// `lasp_mlstm_bwd_params` names the backward's own): the dv pass's workspace first, then the
/// one the dq and dk passes share in turn (under LASP-2 the dq pass runs while the dv pass's
/// pieces wait for the exchange), then the backward's own parts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Offsets {
    pub(super) dq_dk_passes: u64,
    pub(super) d_h_scaled: u64,
    pub(super) row_log_weight: u64,
    pub(super) neg_m: u64,
    pub(super) f_next: u64,
    pub(super) q_dots: u64,
    pub(super) k_dots: u64,
    pub(super) tile_sums: u64,
    pub(super) c0_t: u64,
    pub(super) rev_c: u64,
    pub(super) rev_c_t: u64,
    pub(super) end_c: u64,
    pub(super) rev_m: u64,
    pub(super) end_m: u64,
    pub(super) end_n: u64,
    pub(super) zero_n: u64,
    pub(super) lasp2_m: u64,
    pub(super) decay_dot: u64,
    pub(super) lf_carry: u64,
    pub(super) end: u64,
}

impl MlstmBackwardPlan {
    /// The plans for `shape` with the dv pass in `dv_scope` (a LASP-2 shard's summarises every
    /// segment).
    pub(super) fn new(
        shape: &ForwardShape,
        dv_scope: Scope,
        sm_count: u32,
        force_segments: Option<u32>,
    ) -> Result<Self> {
        super::plan::validate_for(OP, shape)?;
        let swapped = ForwardShape {
            dk: shape.dv,
            dv: shape.dk,
            ..*shape
        };
        let pass =
            |s: &ForwardShape, scope| MlstmPlan::new(s, scope, sm_count, force_segments, None);
        let (dq, dv, dk) = (
            pass(&swapped, Scope::SingleGpu)?,
            pass(shape, dv_scope)?,
            pass(&swapped, Scope::SingleGpu)?,
        );
        let mut plan = MlstmBackwardPlan {
            dq,
            dv,
            dk,
            workspace_bytes: 0,
        };
        plan.workspace_bytes = plan.offsets().end;
        Ok(plan)
    }

    pub(super) fn offsets(&self) -> Offsets {
        let s = &self.dv.shape;
        let (tokens, bh) = ((s.b * s.t * s.h) as u64, (s.b * s.h) as u64);
        let state = bh * (s.dk * s.dv * 4) as u64;
        let mut end = self.dv.workspace_bytes;
        let mut part = |bytes: u64| {
            let at = end.next_multiple_of(256);
            end = at + bytes;
            at
        };
        let dots = tokens * (s.dk / 64) as u64 * 4;
        Offsets {
            dq_dk_passes: part(self.dq.workspace_bytes.max(self.dk.workspace_bytes)),
            d_h_scaled: part(tokens * s.dv as u64 * 2),
            row_log_weight: part(tokens * 4),
            neg_m: part(tokens * 4),
            f_next: part(tokens * 4),
            q_dots: part(dots),
            k_dots: part(dots),
            tile_sums: part(bh * scan_tiles(s) as u64 * 8),
            c0_t: part(state),
            rev_c: part(state),
            rev_c_t: part(state),
            end_c: part(state),
            rev_m: part(bh * 4),
            end_m: part(bh * 4),
            end_n: part(bh * s.dk as u64 * 4),
            zero_n: part(bh * s.dk.max(s.dv) as u64 * 4),
            lasp2_m: part(bh * 4),
            decay_dot: part(bh * 4),
            lf_carry: part(bh * 8),
            end,
        }
    }
}

/// `lasp_mlstm_bwd_prepare_rows`' grid: a thread per 8 elements of dh, whole rows per CTA.
fn rows_blocks(s: &ForwardShape) -> u32 {
    let rows_per_block = header::LASP_MLSTM_BWD_THREADS as usize / (s.dv / 8);
    (s.b * s.t * s.h).div_ceil(rows_per_block) as u32
}

/// The gate gradient's tiles per head (`LASP_MLSTM_BWD_SCAN_TILE` tokens each).
fn scan_tiles(s: &ForwardShape) -> u32 {
    s.t.div_ceil(header::LASP_MLSTM_BWD_SCAN_TILE as usize) as u32
}

/// The backward's own kernels (`kernels/cuda/mlstm/backward.cu`).
pub(super) struct BackwardKernels {
    prepare_rows: Kernel,
    prepare_states: Kernel,
    initial_state: Kernel,
    gate_tiles: Kernel,
    gates: Kernel,
    lasp2_exit: Kernel,
}

/// The loop orders of the backward's start words (packed documents): the in-order pass's (dq),
/// then the reversed passes' (dv, dk, and the gate gradient's scan).
pub(super) const PASS_ORDERS: [LoopOrder; 2] = [LoopOrder::InOrder, LoopOrder::Reversed];

/// One call's parameters: the backward's own kernels' struct, each gradient pass's operands
/// (`lasp/mlstm/backward_params.h`: the roles of the tensors exchanged) and the launches.
pub(super) struct BackwardCall {
    pub(super) bwd: MlstmBwdParams,
    pub(super) dq: ChunkOperands,
    pub(super) dv: ChunkOperands,
    pub(super) dk: ChunkOperands,
    /// The workspace of the dq and dk passes (the dv pass's is at the call's base).
    pub(super) dq_dk_base: u64,
    rows: LaunchShape,
    states: LaunchShape,
    scan: LaunchShape,
}

impl BackwardCall {
    /// The call of `plan` over checked `args` (scale from [`MlstmBackwardArgs::check`]) with the
    /// workspace at device address `base` and the start words of packed documents at `words`, in
    /// [`PASS_ORDERS`] (zeros without documents).
    pub(super) fn new(
        args: &MlstmBackwardArgs<'_>,
        plan: &MlstmBackwardPlan,
        base: u64,
        scale: f32,
        [in_order, reversed]: [u64; 2],
    ) -> Self {
        let ws = plan.offsets();
        let at = |offset: u64| base + offset;
        let s = args.shape;
        let bwd = MlstmBwdParams {
            i_gate: args.i_gate.addr() as _,
            f_gate: args.f_gate.addr() as _,
            row_m: args.saved.m.addr() as _,
            row_den: args.saved.den.addr() as _,
            c0: args.initial_state.map_or(0, |x| x.c.addr()) as _,
            m0: args.initial_state.map_or(0, |x| x.m.addr()) as _,
            dc_t: args.d_final.map_or(0, |x| x.d_c.addr()) as _,
            m_t: args.d_final.map_or(0, |x| x.m.addr()) as _,
            d_h: args.d_h.addr() as _,
            d_h_scaled: at(ws.d_h_scaled) as _,
            row_log_weight: at(ws.row_log_weight) as _,
            neg_m: at(ws.neg_m) as _,
            f_next: at(ws.f_next) as _,
            c0_t: at(ws.c0_t) as _,
            rev_c: at(ws.rev_c) as _,
            rev_c_t: at(ws.rev_c_t) as _,
            rev_m: at(ws.rev_m) as _,
            zero_n: at(ws.zero_n) as _,
            end_c: at(ws.end_c) as _,
            end_m: at(ws.end_m) as _,
            q_dots: at(ws.q_dots) as _,
            k_dots: at(ws.k_dots) as _,
            tile_sums: at(ws.tile_sums) as _,
            starts: in_order as _,
            rev_starts: reversed as _,
            d_i: args.d_i_gate.addr() as _,
            d_f: args.d_f_gate.addr() as _,
            dc0: args.d_initial_c.as_ref().map_or(0, |x| x.addr()) as _,
            B: s.b as i32,
            T: s.t as i32,
            H: s.h as i32,
            Dk: s.dk as i32,
            Dv: s.dv as i32,
            scale,
            ..Default::default()
        };
        let (d_h, row_log_weight) = (args.d_h.addr(), at(ws.row_log_weight));
        let zero_n = at(ws.zero_n);
        let dq = ChunkOperands {
            q: d_h,
            k: args.v.addr(),
            v: args.k.addr(),
            i_gate: args.i_gate.addr(),
            f_gate: args.f_gate.addr(),
            o: args.dq.addr(),
            c0: args.initial_state.map_or(0, |_| at(ws.c0_t)),
            n0: args.initial_state.map_or(0, |_| zero_n),
            m0: args.initial_state.map_or(0, |x| x.m.addr()),
            row_log_scale: row_log_weight,
            row_dot_with: args.q.addr(),
            row_dots: at(ws.q_dots),
            starts: in_order,
            ..Default::default()
        };
        let reversed = ChunkOperands {
            f_gate: at(ws.f_next),
            n0: zero_n,
            m0: at(ws.rev_m),
            row_log_scale: args.i_gate.addr(),
            reversed: true,
            starts: reversed,
            ..Default::default()
        };
        let dv = ChunkOperands {
            q: args.k.addr(),
            k: args.q.addr(),
            v: at(ws.d_h_scaled),
            i_gate: at(ws.neg_m),
            o: args.dv.addr(),
            c0: at(ws.rev_c),
            c_t: at(ws.end_c),
            n_t: at(ws.end_n),
            m_t: at(ws.end_m),
            ..reversed
        };
        let dk = ChunkOperands {
            q: args.v.addr(),
            k: d_h,
            i_gate: row_log_weight,
            v: args.q.addr(),
            o: args.dk.addr(),
            c0: at(ws.rev_c_t),
            row_dot_with: args.k.addr(),
            row_dots: at(ws.k_dots),
            ..reversed
        };
        let (bh, threads) = ((s.b * s.h) as u32, header::LASP_MLSTM_BWD_THREADS);
        let rows = LaunchShape {
            grid: (rows_blocks(&s), 1, 1),
            block: (threads, 1, 1),
            shared_bytes: 0,
        };
        BackwardCall {
            bwd,
            dq,
            dv,
            dk,
            dq_dk_base: at(ws.dq_dk_passes),
            rows,
            states: LaunchShape {
                grid: ((s.dk * s.dv).div_ceil(threads as usize) as u32, bh, 1),
                ..rows
            },
            scan: LaunchShape {
                grid: (scan_tiles(&s), bh, 1),
                ..rows
            },
        }
    }
}

impl BackwardKernels {
    pub(super) fn new(runtime: &Runtime) -> Result<Self> {
        let module = runtime.module();
        Ok(BackwardKernels {
            prepare_rows: module.kernel("lasp_mlstm_bwd_prepare_rows")?,
            prepare_states: module.kernel("lasp_mlstm_bwd_prepare_states")?,
            initial_state: module.kernel("lasp_mlstm_bwd_initial_state")?,
            gate_tiles: module.kernel("lasp_mlstm_bwd_gate_tiles")?,
            gates: module.kernel("lasp_mlstm_bwd_gates")?,
            lasp2_exit: module.kernel("lasp_mlstm_bwd_lasp2_exit")?,
        })
    }

    /// The passes' operands: dh / den, the row weights and shifted gates, the start states.
    ///
    /// # Safety
    /// `call` made by [`BackwardCall::new`] from checked arguments whose buffers, and the
    /// workspace, stay alive until the kernels complete.
    pub(super) unsafe fn prepare(
        &self,
        stream: &Arc<CudaStream>,
        call: &BackwardCall,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe {
            self.prepare_rows.launch(stream, call.rows, &call.bwd)?;
            self.prepare_states.launch(stream, call.states, &call.bwd)
        }
    }

    /// LASP-2's exit kernel, after the exchange's fold wrote the dv pass's start state.
    ///
    /// # Safety
    /// As [`BackwardKernels::prepare`], with the LASP-2 fields of `call.bwd` set.
    pub(super) unsafe fn lasp2_exit(
        &self,
        stream: &Arc<CudaStream>,
        call: &BackwardCall,
    ) -> Result<()> {
        let heads = LaunchShape {
            grid: (call.states.grid.1, 1, 1),
            ..call.rows
        };
        // SAFETY: the caller's contract.
        unsafe { self.lasp2_exit.launch(stream, heads, &call.bwd) }
    }

    /// After the passes: dC_0 where asked for, then the gates' gradients.
    ///
    /// # Safety
    /// As [`BackwardKernels::prepare`], after the three passes.
    pub(super) unsafe fn finish(
        &self,
        stream: &Arc<CudaStream>,
        call: &BackwardCall,
    ) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe {
            if !call.bwd.dc0.is_null() {
                self.initial_state.launch(stream, call.states, &call.bwd)?;
            }
            self.gate_tiles.launch(stream, call.scan, &call.bwd)?;
            self.gates.launch(stream, call.scan, &call.bwd)
        }
    }
}

/// mlstm_kernels' mLSTM gradient (`reference::mlstm::MlstmGradient::Tfla`): dq, dk, dv, the gate
/// pre-activations' gradients and `dC_0`, from the forward's inputs and the rows it saved.
///
/// One instance may be launched many times on one stream; launches on different streams must be
/// ordered by the caller (they share the workspace). The workspace grows on demand (a context
/// synchronisation then) and is freed when the instance is dropped.
pub struct MlstmBackward {
    ctx: Arc<CudaContext>,
    passes: ChunkKernels,
    kernels: BackwardKernels,
    words: StartWords,
    sm_count: u32,
    force_segments: Option<u32>,
    workspace: Option<CudaSlice<u8>>,
}

impl MlstmBackward {
    /// Looks up the kernels in the runtime's module and raises their shared-memory limits.
    pub fn new(runtime: &Runtime) -> Result<Self> {
        let ctx = runtime.context().clone();
        Ok(MlstmBackward {
            passes: ChunkKernels::new(runtime, OP, ChunkForm::Gradient)?,
            kernels: BackwardKernels::new(runtime)?,
            words: StartWords::new(runtime)?,
            sm_count: crate::ops::sm_count(&ctx)?,
            ctx,
            force_segments: None,
            workspace: None,
        })
    }

    /// Forces the number of segments per sequence of every gradient pass (tests and tuning), or
    /// restores the automatic plans with `None`.
    pub fn set_num_segments(&mut self, segments: Option<u32>) {
        self.force_segments = segments;
    }

    /// The plans a launch of `shape` would use (validates the shape).
    pub fn plan(&self, shape: &ForwardShape) -> Result<MlstmBackwardPlan> {
        MlstmBackwardPlan::new(shape, Scope::SingleGpu, self.sm_count, self.force_segments)
    }

    /// Enqueues the backward on `stream` (a stream of the runtime's context) and returns the
    /// plans it used. Everything is validated before the first launch; in debug builds the gates
    /// are checked too, which synchronises `stream`.
    pub fn launch(
        &mut self,
        stream: &Arc<CudaStream>,
        args: MlstmBackwardArgs<'_>,
    ) -> Result<MlstmBackwardPlan> {
        StreamOrder::around(stream, args.homes(), OP, || self.enqueue(stream, args))
    }

    fn enqueue(
        &mut self,
        stream: &Arc<CudaStream>,
        args: MlstmBackwardArgs<'_>,
    ) -> Result<MlstmBackwardPlan> {
        let plan = self.plan(&args.shape)?;
        let scale = args.check()?;
        crate::ops::require_runtime_stream(stream, &self.ctx, OP)?;
        if cfg!(debug_assertions) {
            validate_gates(&self.ctx, stream, args.i_gate, args.f_gate, &args.shape)?;
        }
        // The start words (packed documents) after the plan's parts.
        let (base, words) = self.words.workspace(
            &self.ctx,
            stream,
            &mut self.workspace,
            plan.workspace_bytes,
            args.documents,
            args.shape.t,
            PASS_ORDERS,
            OP,
        )?;
        let call = BackwardCall::new(&args, &plan, base, scale, words);
        // SAFETY: the params are the headers' structs, filled by BackwardCall::new from
        // arguments checked for shape, length, alignment and overlap, and from the workspace
        // this plan sized; each kernel reads what the ones before it on `stream` wrote; the views
        // borrow their buffers for the call and their contracts keep the memory valid until the
        // kernels complete; the workspace is owned by self and freed only after a context
        // synchronisation.
        unsafe {
            self.kernels.prepare(stream, &call)?;
            for (pass, ops, at) in [
                (&plan.dq, &call.dq, call.dq_dk_base),
                (&plan.dv, &call.dv, base),
                (&plan.dk, &call.dk, call.dq_dk_base),
            ] {
                let params = chunk_params(ops, pass, at, scale, 0.0);
                self.passes.launch_single_gpu(stream, pass, &params)?;
            }
            self.kernels.finish(stream, &call)?;
        }
        Ok(plan)
    }
}

impl Drop for MlstmBackward {
    fn drop(&mut self) {
        // Earlier launches may still read the workspace.
        if self.workspace.is_some() {
            let _ = self.ctx.synchronize();
        }
    }
}
