//! The mLSTM's LASP-2 backward across PEs ([`MlstmLasp2Backward`]; maths and call order:
//! `lasp/mlstm/backward_params.h`, "LASP-2"; the f64 decomposition it follows:
//! `reference::mlstm::lasp2_backward_tfla`).
//!
//! PE `w`'s gradients are mlstm_kernels' single-GPU gradient of its shard from the state entering
//! it, with `D_w`, the cotangent of the state leaving it, as the exit cotangent, and every log
//! forget gate's gradient raised by the later shards' share. `D_w` comes down the chain from the
//! later PEs as the dv pass's state: each PE's dv pass (time reversed) summarises its shard from
//! the empty state, the last PE folds in `dC_T`, and the forward's exchange kernels carry the
//! summaries to every earlier PE ([`Direction::Descending`]), which folds them in chain order into
//! its dv pass's start. The dq pass needs nothing from the other PEs: it runs while the summaries
//! travel. The fold is the same in every mode, so gradients are bit-identical across modes. On one
//! PE nothing is exchanged: every mode runs the single-GPU backward (and advances the epoch).
//! Over packed documents the reversed passes restart at every document's last token; a shard
//! whose successor opens with a start masks the state coming down from it (its reversed words
//! mark its last token), so the exchange itself is unchanged.

use super::backward::{
    BackwardCall, BackwardKernels, MlstmBackwardArgs, MlstmBackwardPlan, PASS_ORDERS,
};
use super::forward::{chunk_params, ChunkForm, ChunkKernels, ChunkOperands};
use super::{Lasp2Params, Mlstm, MlstmBoundaryRef};
use crate::error::{Error, Result};
use crate::exchange::chain::StateChain;
use crate::exchange::{Direction, ExchangeMode, Lasp2Layout};
use crate::kernel::Kernel;
use crate::ops::documents::masked::StartWords;
use crate::ops::scalar_decay::TensorChecks;
use crate::ops::{Scope, StreamOrder};
use crate::runtime::Runtime;
use cudarc::driver::{CudaSlice, CudaStream};
use std::sync::Arc;

const OP: &str = "mLSTM LASP-2 backward";

/// The mLSTM's LASP-2 backward on one PE: its exchange (collective to create and to switch
/// modes), its kernels and its workspace.
pub struct MlstmLasp2Backward {
    /// First: fields drop in order, and the chain's drop waits for every call before the
    /// workspace (used on the callers' streams) is freed.
    chain: StateChain<Mlstm>,
    passes: ChunkKernels,
    kernels: BackwardKernels,
    words: StartWords,
    /// The LASP-2 fold (the later PEs' summaries, then the dv pass's segments).
    fold: Kernel,
    workspace: Option<CudaSlice<u8>>,
    sm_count: u32,
    force_segments: Option<u32>,
}

crate::exchange::chain_methods!(MlstmLasp2Backward);

impl MlstmLasp2Backward {
    /// Sets up the exchange for `layout` on every PE (collective; every PE must pass the same
    /// layout and mode).
    pub fn new(runtime: &Runtime, layout: Lasp2Layout, mode: ExchangeMode) -> Result<Self> {
        let chain = StateChain::new(runtime, layout, mode, Direction::Descending, OP)?;
        Ok(MlstmLasp2Backward {
            passes: ChunkKernels::new(runtime, OP, ChunkForm::Gradient)?,
            kernels: BackwardKernels::new(runtime)?,
            words: StartWords::new(runtime)?,
            fold: runtime.module().kernel("lasp_mlstm_lasp2_fold")?,
            sm_count: crate::ops::sm_count(runtime.context())?,
            chain,
            workspace: None,
            force_segments: None,
        })
    }

    /// Forces the number of segments of every gradient pass over this PE's shard (tests and
    /// tuning), or restores the automatic plans with `None`.
    pub fn set_num_segments(&mut self, segments: Option<u32>) {
        self.force_segments = segments;
    }

    /// Enqueues the backward of this PE's shard on `stream`: `args` as
    /// [`super::MlstmBackward`]'s over the shard (T = its T_local) with `initial_state` `None`,
    /// `d_final` (the sequence's final-state cotangent) on the last PE only and `d_initial_c` on
    /// PE 0 only; `boundary` what this PE's
    /// [`MlstmLasp2Forward::forward_saving`](super::MlstmLasp2Forward::forward_saving) wrote.
    /// Everything is validated before the first launch; expired waits are reported by
    /// [`MlstmLasp2Backward::finish`]. Returns the plans of the shard's passes.
    pub fn backward(
        &mut self,
        stream: &Arc<CudaStream>,
        args: MlstmBackwardArgs<'_>,
        boundary: MlstmBoundaryRef<'_>,
    ) -> Result<MlstmBackwardPlan> {
        if args.initial_state.is_some() {
            return Err(Error::InvalidArgument(format!(
                "{OP}: pass initial_state = None: the boundary's entry is the state entering the \
                 shard (on PE 0 the forward's initial state)"
            )));
        }
        let args = MlstmBackwardArgs {
            initial_state: Some(boundary.entry),
            ..args
        };
        let mut homes = args.homes();
        let exit = boundary.exit;
        homes.extend([exit.c.home(), exit.n.home(), exit.m.home()]);
        StreamOrder::around(stream, homes, OP, || self.enqueue(stream, args, boundary))
    }

    fn enqueue(
        &mut self,
        stream: &Arc<CudaStream>,
        args: MlstmBackwardArgs<'_>,
        boundary: MlstmBoundaryRef<'_>,
    ) -> Result<MlstmBackwardPlan> {
        let s = args.shape;
        let (me, npes) = (self.chain.runtime().pe(), self.chain.runtime().npes());
        let scope = if npes == 1 {
            Scope::SingleGpu
        } else {
            Scope::Shard
        };
        let plan = MlstmBackwardPlan::new(&s, scope, self.sm_count, self.force_segments)?;
        let scale = args.check_as(OP)?;
        check_exit(&args, &boundary)?;
        self.chain.check_call(stream, s.layout())?;
        self.chain
            .check_boundary_gradients(args.d_final.is_some(), args.d_initial_c.is_some())?;
        // The start words (packed documents) after the plan's parts.
        let (base, words) = self.words.workspace(
            self.chain.context(),
            stream,
            &mut self.workspace,
            plan.workspace_bytes,
            args.documents,
            s.t,
            PASS_ORDERS,
            OP,
        )?;
        let mut call = BackwardCall::new(&args, &plan, base, scale, words);
        let dq = chunk_params(&call.dq, &plan.dq, call.dq_dk_base, scale, 0.0);
        if npes == 1 {
            let dv = chunk_params(&call.dv, &plan.dv, base, scale, 0.0);
            let dk = chunk_params(&call.dk, &plan.dk, call.dq_dk_base, scale, 0.0);
            // SAFETY: as the shard's launches below, with the single-GPU backward's plans.
            unsafe {
                self.kernels.prepare(stream, &call)?;
                self.passes.launch_single_gpu(stream, &plan.dq, &dq)?;
                self.passes.launch_single_gpu(stream, &plan.dv, &dv)?;
                self.passes.launch_single_gpu(stream, &plan.dk, &dk)?;
                self.kernels.finish(stream, &call)?;
            }
            let params = Lasp2Params {
                fwd: dv,
                ..self.chain.base_params(stream)
            };
            self.chain.end_call(stream, &params)?;
            return Ok(plan);
        }
        let ws = plan.offsets();
        let dv_ws = plan.dv.workspace_offsets();
        let at = |offset: u64| base + offset;
        let last = me + 1 == npes;
        // The exit kernel: the dv pass's start from the exchange, and the later shards' share of
        // every dlf (none on the last PE).
        call.bwd.lasp2_start_c = at(dv_ws.start_c) as _;
        call.bwd.lasp2_start_m = at(dv_ws.start_m) as _;
        call.bwd.lasp2_m = at(ws.lasp2_m) as _;
        if !last {
            call.bwd.exit_c = boundary.exit.c.addr() as _;
            call.bwd.exit_m = boundary.exit.m.addr() as _;
            call.bwd.decay_dot = at(ws.decay_dot) as _;
            call.bwd.lf_carry = at(ws.lf_carry) as _;
        }
        // The dv pass starts from the fold's state; it writes its final state only where dC_0 is
        // asked for (PE 0). The dk pass starts from its transpose (the exit kernel's).
        let with_dc0 = args.d_initial_c.is_some();
        let dv_ops = ChunkOperands {
            c0: at(dv_ws.start_c),
            n0: at(dv_ws.start_n),
            m0: at(dv_ws.start_m),
            c_t: if with_dc0 { call.dv.c_t } else { 0 },
            n_t: if with_dc0 { call.dv.n_t } else { 0 },
            m_t: if with_dc0 { call.dv.m_t } else { 0 },
            ..call.dv
        };
        let dk_ops = ChunkOperands {
            m0: at(ws.lasp2_m),
            ..call.dk
        };
        let d_final = args.d_final.filter(|_| last);
        let params = Lasp2Params {
            fwd: chunk_params(&dv_ops, &plan.dv, base, scale, 0.0),
            h0_c: call.bwd.rev_c,
            h0_n: call.bwd.zero_n,
            h0_m: call.bwd.rev_m,
            start_c: at(dv_ws.start_c) as _,
            start_n: at(dv_ws.start_n) as _,
            start_m: at(dv_ws.start_m) as _,
            h0_first_pe_only: 1,
            exit_f_gate: args.f_gate.addr() as _,
            decay_c: d_final.map_or(0, |_| boundary.exit.c.addr()) as _,
            decay_dc: d_final.map_or(0, |d| d.d_c.addr()) as _,
            decay_dot: call.bwd.decay_dot as _,
            ..self.chain.base_params(stream)
        };
        let dk = chunk_params(&dk_ops, &plan.dk, call.dq_dk_base, scale, 0.0);
        let fold = plan.dv.fold.expect("a shard's plan always folds");
        // SAFETY: the params are the headers' structs, filled from arguments checked above
        // (shape, lengths, alignment, overlaps, the PEs of the boundary gradients) and from the
        // workspace this plan sized, the dv pass's and the dq and dk passes' apart (the dq pass
        // runs while the dv pass's pieces wait for the fold); the symmetric buffers, epoch and
        // diagnostics are owned by the chain. Each kernel reads what the ones before it on the
        // stream wrote. The summary runs in line: beside it the fold's CTAs, which wait for other
        // PEs' summaries, could hold every SM.
        unsafe {
            self.kernels.prepare(stream, &call)?;
            self.passes.launch_states(stream, &plan.dv, &params.fwd)?;
            self.chain
                .launch_summary(stream, 0, (s.b * s.h) as i32, &params, false)?;
        }
        self.chain.gather_slots(stream)?;
        // SAFETY: as above.
        unsafe {
            self.passes.launch_single_gpu(stream, &plan.dq, &dq)?;
            self.fold.launch(stream, fold, &params)?;
            self.kernels.lasp2_exit(stream, &call)?;
            self.passes.launch_output(stream, &plan.dv, &params.fwd)?;
            self.passes.launch_single_gpu(stream, &plan.dk, &dk)?;
            self.kernels.finish(stream, &call)?;
        }
        self.chain.end_call(stream, &params)?;
        Ok(plan)
    }
}

/// The boundary's exit (the entry is checked as the call's initial state): lengths, alignment,
/// and no overlap with the gradients.
fn check_exit(args: &MlstmBackwardArgs<'_>, boundary: &MlstmBoundaryRef<'_>) -> Result<()> {
    let s = &args.shape;
    let checks = TensorChecks::new(OP, s);
    let exit = &boundary.exit;
    let mut inputs = Vec::new();
    for (name, x, layout, want) in [
        ("exit.c", exit.c, "[B, H, Dk, Dv]", s.state_len()),
        ("exit.n", exit.n, "[B, H, Dk]", s.b * s.h * s.dk),
        ("exit.m", exit.m, "[B, H]", s.b * s.h),
    ] {
        checks.tensor(name, layout, (x.len(), want), x.addr(), 8)?;
        inputs.push((name, x.byte_range()));
    }
    checks.disjoint(&inputs, &args.output_ranges())
}
