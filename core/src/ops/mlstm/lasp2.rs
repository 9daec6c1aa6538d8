//! The mLSTM's LASP-2 forward across PEs ([`MlstmLasp2Forward`]; kernels:
//! kernels/cuda/mlstm/lasp2_forward.cu, call order in `lasp/mlstm/lasp2_params.h`).
//!
//! PE `w` holds the `w`-th slice of every sequence. Each PE computes its shard's summary (the
//! stabilised state `(C, n, m)` it reaches from the empty state and its summed log forget gate
//! `F`), sends it along the exchange's chain ([`crate::exchange`]; in
//! [`ExchangeMode::Overlapped`] from the device, with a signal) to every later PE, folds the
//! earlier PEs' summaries onto the initial state in rank order (both states rescaled to the larger
//! stabiliser) and runs the single-GPU forward's output pass on its shard from that state. The
//! sequential modes put a host all-gather between the same kernels; [`ExchangeMode::NoComm`]
//! drops the exchange (timing). The fold is the same in every mode, so outputs are bit-identical
//! across modes. On one PE nothing is exchanged: every mode runs the single-GPU forward (and
//! advances the exchange's epoch). Over packed documents (`documents` in [`MlstmArgs`]) a shard
//! holding a start sends its last document's state with `F = -inf`, which the fold takes as it is.
//! The documents' final states (`document_final_states`) come from the output pass, which runs
//! from the whole prefix: a document that began on an earlier PE needs no exchange of its own.

use super::document_states::DocumentEntries;
use super::forward::{call_params, ChunkForm, ChunkKernels, MlstmArgs};
use super::{Mlstm, MlstmBoundaryMut, MlstmPlan, MlstmStateMut};
use crate::error::Result;
use crate::exchange::chain::StateChain;
use crate::exchange::{Direction, ExchangeMode, Lasp2Layout};
use crate::kernel::Kernel;
use crate::ops::documents::masked::StartWords;
use crate::ops::documents::LoopOrder;
use crate::ops::Scope;
use crate::ops::StreamOrder;
use crate::runtime::Runtime;
use cudarc::driver::{CudaSlice, CudaStream};
use lasp_shmem_kernels::params as header;
use std::sync::Arc;

/// The C struct `lasp_mlstm_lasp2_params`, passed by value to the LASP-2 kernels (the chunk
/// passes take its `fwd`).
pub type Lasp2Params = header::lasp_mlstm_lasp2_params;

const OP: &str = "mLSTM LASP-2 forward";

/// The mLSTM's LASP-2 forward on one PE: its exchange (collective to create and to switch
/// modes), its kernels and its workspace.
pub struct MlstmLasp2Forward {
    chain: StateChain<Mlstm>,
    kernels: ChunkKernels,
    words: StartWords,
    /// The LASP-2 fold (the earlier PEs' summaries, then the shard's segments).
    fold: Kernel,
    workspace: Option<CudaSlice<u8>>,
    sm_count: u32,
    force_segments: Option<u32>,
    force_splits: Option<u32>,
    entries: DocumentEntries,
}

crate::exchange::chain_methods!(MlstmLasp2Forward);

impl MlstmLasp2Forward {
    /// Sets up the exchange for `layout` on every PE (collective; every PE must pass the same
    /// layout and mode).
    pub fn new(runtime: &Runtime, layout: Lasp2Layout, mode: ExchangeMode) -> Result<Self> {
        let kernels = ChunkKernels::new(runtime, OP, ChunkForm::Forward)?;
        let fold = runtime.module().kernel("lasp_mlstm_lasp2_fold")?;
        let chain = StateChain::new(runtime, layout, mode, Direction::Ascending, OP)?;
        Ok(MlstmLasp2Forward {
            sm_count: crate::ops::sm_count(runtime.context())?,
            chain,
            kernels,
            words: StartWords::new(runtime)?,
            fold,
            workspace: None,
            force_segments: None,
            force_splits: None,
            entries: DocumentEntries::new(runtime)?,
        })
    }

    /// Forces the number of segments of this PE's shard (tests and tuning), or restores the
    /// automatic plan with `None`.
    pub fn set_num_segments(&mut self, segments: Option<u32>) {
        self.force_segments = segments;
    }

    /// Forces the number of pieces the states pass cuts each segment into (tests and tuning),
    /// or restores the automatic choice with `None`.
    pub fn set_states_splits(&mut self, splits: Option<u32>) {
        self.force_splits = splits;
    }

    /// Enqueues one call on `stream`: `args` holds this PE's shard (T = its T_local; shards may
    /// differ in length), `initial_state` the sequence's (the same on every PE) and
    /// `final_state` only on the last PE. Everything is validated before the first launch.
    /// Expired waits are reported by [`MlstmLasp2Forward::finish`]. Returns the plan of the
    /// shard's chunk passes.
    pub fn forward(&mut self, stream: &Arc<CudaStream>, args: MlstmArgs<'_>) -> Result<MlstmPlan> {
        self.forward_saving(stream, args, None)
    }

    /// [`MlstmLasp2Forward::forward`], also writing the shard's `boundary`: the state entering
    /// it and the state leaving it, what [`super::MlstmLasp2Backward`] takes on every PE (on the
    /// last PE the state leaving the shard is the sequence's final state; `final_state` there,
    /// if given, receives a copy).
    pub fn forward_saving(
        &mut self,
        stream: &Arc<CudaStream>,
        args: MlstmArgs<'_>,
        boundary: Option<MlstmBoundaryMut<'_>>,
    ) -> Result<MlstmPlan> {
        let mut homes = args.homes();
        if let Some(b) = &boundary {
            homes.extend(b.homes());
        }
        StreamOrder::around(stream, homes, OP, || self.enqueue(stream, args, boundary))
    }

    fn enqueue(
        &mut self,
        stream: &Arc<CudaStream>,
        args: MlstmArgs<'_>,
        boundary: Option<MlstmBoundaryMut<'_>>,
    ) -> Result<MlstmPlan> {
        let s = args.shape;
        // One PE has no other shard to fold: the single-GPU plan, without the shard's summary.
        let one_pe = self.chain.runtime().npes() == 1;
        let scope = if one_pe {
            Scope::SingleGpu
        } else {
            Scope::Shard
        };
        let plan = MlstmPlan::new(
            &s,
            scope,
            self.sm_count,
            self.force_segments,
            self.force_splits,
        )?;
        let (scale, eps) = args.check()?;
        self.chain.check_call(stream, s.layout())?;
        self.chain.check_final_state(args.final_state.is_some())?;
        if let Some(b) = &boundary {
            b.check(&args)?;
        }
        let entries = self.entries.targets(stream, &args, OP)?;
        // The documents' entering stabilisers (with their final states), then the start words
        // (packed documents), after the plan's parts.
        let (parts, stabilisers) = entries.workspace_parts(plan.workspace_bytes);
        let (base, [starts]) = self.words.workspace(
            self.chain.context(),
            stream,
            &mut self.workspace,
            parts,
            args.documents,
            s.t,
            [LoopOrder::InOrder],
            OP,
        )?;
        let stabilisers = base + stabilisers;
        let mut fwd = entries.apply(
            call_params(&args, &plan, base, scale, eps, starts),
            stabilisers,
        );
        if let Some(exit) = boundary.as_ref().map(|b| &b.exit) {
            fwd.c_t = exit.c.addr() as _;
            fwd.n_t = exit.n.addr() as _;
            fwd.m_t = exit.m.addr() as _;
        }
        if one_pe {
            if let Some(entry) = boundary.as_ref().map(|b| &b.entry) {
                // The zero state is (0, 0, m = 0).
                let initial = args.initial_state;
                crate::ops::copy_or_zero(stream, initial.map(|x| x.c), &entry.c)?;
                crate::ops::copy_or_zero(stream, initial.map(|x| x.n), &entry.n)?;
                crate::ops::copy_or_zero(stream, initial.map(|x| x.m), &entry.m)?;
            }
            let params = Lasp2Params {
                fwd,
                ..self.chain.base_params(stream)
            };
            // SAFETY: as in the shard's launches below; this plan is the single-GPU one, whose
            // fold reads the user's initial state through `fwd`.
            unsafe {
                self.kernels.launch_single_gpu(stream, &plan, &params.fwd)?;
                self.entries.launch_tails(stream, &args, stabilisers)?;
            }
            self.chain.end_call(stream, &params)?;
            copy_final_state(stream, boundary.as_ref(), args.final_state.as_ref())?;
            return Ok(plan);
        }
        // The state entering the shard: the fold writes it where the caller keeps it, if asked.
        let ws = plan.workspace_offsets();
        let (start_c, start_n, start_m) = match boundary.as_ref().map(|b| &b.entry) {
            Some(entry) => (entry.c.addr(), entry.n.addr(), entry.m.addr()),
            None => (base + ws.start_c, base + ws.start_n, base + ws.start_m),
        };
        let initial = args.initial_state;
        let params = Lasp2Params {
            fwd: header::lasp_mlstm_params {
                c0: start_c as _,
                n0: start_n as _,
                m0: start_m as _,
                ..fwd
            },
            h0_c: initial.map_or(0, |x| x.c.addr()) as _,
            h0_n: initial.map_or(0, |x| x.n.addr()) as _,
            h0_m: initial.map_or(0, |x| x.m.addr()) as _,
            start_c: start_c as _,
            start_n: start_n as _,
            start_m: start_m as _,
            ..self.chain.base_params(stream)
        };
        let fold = plan.fold.expect("a shard's plan always folds");
        // SAFETY: Lasp2Params is lasp_mlstm_lasp2_params, generated from the header, its `fwd`
        // made by call_params for this plan from arguments checked above (shape, lengths,
        // alignment, overlaps) with the start state in the workspace; the views borrow their
        // buffers for the call; the symmetric buffers, epoch, diagnostics and workspace are owned
        // by self. Each kernel reads what the one before it on the stream wrote. The summary runs
        // in line: beside it the fold's CTAs, which wait for other PEs' summaries, could hold
        // every SM.
        unsafe {
            self.kernels.launch_states(stream, &plan, &params.fwd)?;
            self.chain
                .launch_summary(stream, 0, (s.b * s.h) as i32, &params, false)?;
        }
        self.chain.gather_slots(stream)?;
        // SAFETY: as above; with the documents' final states the output kernel stores the
        // entering states where the slots written above name them, and the states kernel follows
        // it on `stream`.
        unsafe {
            self.fold.launch(stream, fold, &params)?;
            self.kernels.launch_output(stream, &plan, &params.fwd)?;
            self.entries.launch_tails(stream, &args, stabilisers)?;
        }
        self.chain.end_call(stream, &params)?;
        copy_final_state(stream, boundary.as_ref(), args.final_state.as_ref())?;
        Ok(plan)
    }
}

/// With a boundary the kernels write the state leaving the shard there; the last PE's
/// `final_state`, where also given, gets a copy.
fn copy_final_state(
    stream: &CudaStream,
    boundary: Option<&MlstmBoundaryMut<'_>>,
    final_state: Option<&MlstmStateMut<'_>>,
) -> Result<()> {
    if let (Some(b), Some(f)) = (boundary, final_state) {
        let exit = &b.exit;
        crate::ops::copy_or_zero(stream, Some(exit.c.reader()), &f.c)?;
        crate::ops::copy_or_zero(stream, Some(exit.n.reader()), &f.n)?;
        crate::ops::copy_or_zero(stream, Some(exit.m.reader()), &f.m)?;
    }
    Ok(())
}
