//! The exchange of one LASP-2 operation along its chain, for any [`Family`]: the schedule's
//! symmetric buffers, the epoch counter, the mode, the second stream that runs the family's
//! summary kernels beside the compute, and the sequential modes' host-driven all-gathers. A
//! family's forward and backward each own one; they differ only in the chain's direction.

use super::emulated_links::EmulatedNic;
use super::schedule::{AllGatherBuffers, Schedule};
use super::{Direction, ExchangeMode, Lasp2Layout};
use crate::diagnostics::WaitDiagnostics;
use crate::error::{Error, Result};
use crate::family::{ExchangeFields, Family};
use crate::gpu::ContextSync;
use crate::kernel::{Kernel, LaunchShape};
use crate::nccl::{NcclComm, NcclWindow};
use crate::runtime::Runtime;
use cudarc::driver::{result as cu, CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr};
use std::marker::PhantomData;
use std::sync::Arc;

/// One operation's exchange. Creating it and switching modes are collective; calls are not (in
/// the overlapped mode the PEs synchronise only through device signals).
pub(crate) struct StateChain<F: Family> {
    /// First: every call finishes before the fields below are freed (the epoch and diagnostics
    /// words and, where `free` was not called, the symmetric buffers are used on the callers'
    /// streams; a chain dropped without `free` leaks its symmetric buffers, since freeing them is
    /// collective).
    _calls_done: ContextSync,
    runtime: Runtime,
    ctx: Arc<CudaContext>,
    layout: Lasp2Layout,
    direction: Direction,
    /// The operation's name, for messages ("LASP-2 forward").
    op: &'static str,
    summary: Kernel,
    advance_epoch: Kernel,
    grant_credits: Kernel,
    buffers: AllGatherBuffers,
    epoch: CudaSlice<u64>,
    diag: CudaSlice<WaitDiagnostics>,
    /// The emulated NIC whose rate holds this exchange's puts to other emulated nodes, where the
    /// runtime emulates links.
    nic: Option<EmulatedNic>,
    nccl: Option<NcclComm>,
    /// The sequential NCCL mode's slots where NCCL could register them as a symmetric window
    /// (its all-gather then takes NCCL's symmetric kernels: NCCL at its best). NCCL does not
    /// register NVSHMEM's heap, and in the host-gathered modes only this PE's kernels read and
    /// write the slots, so these need not be symmetric NVSHMEM memory.
    nccl_window: Option<NcclWindow>,
    /// Host mirror of the device epoch (completed calls), for the parity of host-side gathers.
    calls: u64,
    mode: Option<ExchangeMode>,
    /// The second stream of the overlapped and no-communication modes: it runs each group's
    /// summary kernel (and so the puts) beside the main stream's next kernels. Highest priority, so
    /// its CTAs are placed first when an SM frees up.
    exchange_stream: Arc<CudaStream>,
    /// `tiles_ready[g]`: group g's states kernel finished (main -> exchange stream).
    tiles_ready: Vec<CudaEvent>,
    /// Every summary kernel of the call finished (exchange stream -> main, before the epoch advances).
    exchange_done: CudaEvent,
    /// Whether the current call put a summary on the exchange stream: `end_call` joins that
    /// stream back only then (waiting on a stream the call never forked from the caller's would
    /// invalidate a CUDA graph capture of the call).
    forked: bool,
    family: PhantomData<F>,
}

/// One thread: the launch of the epoch and credit kernels.
const SINGLE_THREAD: LaunchShape = LaunchShape {
    grid: (1, 1, 1),
    block: (1, 1, 1),
    shared_bytes: 0,
};

impl<F: Family> StateChain<F> {
    /// Allocates the symmetric buffers, checks that every PE set up the same layout and chain,
    /// and sets the mode (collective).
    pub(crate) fn new(
        runtime: &Runtime,
        layout: Lasp2Layout,
        mode: ExchangeMode,
        direction: Direction,
        op: &'static str,
    ) -> Result<Self> {
        F::validate_layout(&layout)?;
        let npes = runtime.npes();
        let schedule = Schedule::AllGather;
        let fingerprints =
            runtime.all_gather_u64(layout.fingerprint::<F>(npes, direction, schedule))?;
        let mine = fingerprints[runtime.pe()];
        let differ: Vec<usize> = (0..npes).filter(|&p| fingerprints[p] != mine).collect();
        if !differ.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "{op}: PEs {differ:?} set up a different layout than PE {} ({} {layout:?}, {npes} \
                 PEs, {direction:?} chain, {schedule:?}); every PE must pass the same family, B, \
                 H, Dk and Dv, and create the same LASP-2 operations in the same order",
                runtime.pe(),
                F::NAME
            )));
        }
        let ctx = runtime.context().clone();
        let module = runtime.module();
        let stream = runtime.stream();
        let (_, highest_priority) = cu::stream::get_priority_range()?;
        let mut exchange = StateChain {
            _calls_done: ContextSync(runtime.context().clone()),
            runtime: runtime.clone(),
            layout,
            direction,
            op,
            summary: module.kernel(F::SUMMARY_KERNEL)?,
            advance_epoch: module.kernel(F::ADVANCE_EPOCH_KERNEL)?,
            grant_credits: module.kernel(F::GRANT_CREDITS_KERNEL)?,
            buffers: AllGatherBuffers::new(runtime, layout, F::summary_tile_floats(&layout))?,
            epoch: stream.alloc_zeros(1)?,
            diag: stream.alloc_zeros(1)?,
            nic: runtime
                .link_emulation()
                .map(|links| EmulatedNic::new(links, stream))
                .transpose()?,
            nccl: None,
            nccl_window: None,
            calls: 0,
            mode: None,
            exchange_stream: ctx.new_stream_with_priority(highest_priority)?,
            tiles_ready: Vec::new(),
            exchange_done: ctx.new_event(None)?,
            forked: false,
            ctx,
            family: PhantomData,
        };
        stream.synchronize()?;
        exchange.set_mode(mode)?;
        Ok(exchange)
    }

    pub(crate) fn runtime(&self) -> &Runtime {
        &self.runtime
    }

    pub(crate) fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    pub(crate) fn layout(&self) -> Lasp2Layout {
        self.layout
    }

    pub(crate) fn mode(&self) -> ExchangeMode {
        self.mode.expect("set by new")
    }

    /// The checks every call of the operation starts with: the call's B, H, Dk and Dv are the
    /// layout every PE agreed on, and the stream is of the runtime's GPU. The family checks the
    /// rest of its shape.
    pub(crate) fn check_call(&self, stream: &CudaStream, call: Lasp2Layout) -> Result<()> {
        let l = self.layout;
        if call != l {
            return Err(self.invalid(format!(
                "the call's B={}, H={}, Dk={}, Dv={} differ from the layout {l:?} every PE agreed \
                 on; create another instance for another layout",
                call.b, call.h, call.dk, call.dv
            )));
        }
        if !Arc::ptr_eq(stream.context(), &self.ctx) {
            return Err(self.invalid(
                "the stream belongs to another CUDA context; use a stream of the runtime's GPU",
            ));
        }
        Ok(())
    }

    /// `InvalidArgument` with the operation's name in front.
    pub(crate) fn invalid(&self, msg: impl std::fmt::Display) -> Error {
        Error::InvalidArgument(format!("{}: {msg}", self.op))
    }

    /// Rejects a final state asked of any PE but the last, the one whose shard ends the
    /// sequence (`ht`: whether the call writes one).
    pub(crate) fn check_final_state(&self, ht: bool) -> Result<()> {
        let (me, npes) = (self.runtime.pe(), self.runtime.npes());
        if ht && me + 1 != npes {
            return Err(self.invalid(format!(
                "only the last PE ({}) holds the final state of the sequence; pass ht = None \
                 (NULL in C) on PE {me}",
                npes - 1
            )));
        }
        Ok(())
    }

    /// Rejects the backward's boundary gradients off their PEs: the final state's gradient
    /// (`dht`: given) enters on the last PE only, the initial state's (`dh0`: asked for) leaves
    /// on PE 0 only.
    pub(crate) fn check_boundary_gradients(&self, dht: bool, dh0: bool) -> Result<()> {
        let (me, npes) = (self.runtime.pe(), self.runtime.npes());
        if dht && me + 1 != npes {
            return Err(self.invalid(format!(
                "only the last PE ({}) holds the final state's gradient; pass none on PE {me} \
                 (None in Rust, grad_ht = NULL in C)",
                npes - 1
            )));
        }
        if dh0 && me != 0 {
            return Err(self.invalid(format!(
                "only PE 0 computes the initial state's gradient; pass no buffer for it on PE \
                 {me} (dh0 = None in Rust, grad_h0 = NULL in C)"
            )));
        }
        Ok(())
    }

    /// Whether this family's kernels run in `mode`.
    pub(crate) fn supports(&self, mode: ExchangeMode) -> bool {
        mode != ExchangeMode::PipelinedChain || F::RELAYS_PREFIX
    }

    /// Switches every PE to `mode` (collective: checks that all PEs ask for the same mode, sets
    /// up NCCL on first use, and re-arms the credits when leaving [`ExchangeMode::NoComm`]).
    pub(crate) fn set_mode(&mut self, mode: ExchangeMode) -> Result<()> {
        if self.mode == Some(mode) {
            return Ok(());
        }
        // Calls still in flight on the caller's streams use the current mode's buffers and
        // advance the epoch read below: let them finish first.
        self.ctx.synchronize()?;
        let stream = self.runtime.stream().clone();
        let modes = self.runtime.all_gather_u64(mode.code())?;
        if let Some(p) = modes.iter().position(|&m| m != mode.code()) {
            return Err(self.invalid(format!(
                "PE {p} asked for another exchange mode than PE {} ({mode:?}); every PE must use \
                 the same mode",
                self.runtime.pe()
            )));
        }
        if !self.supports(mode) {
            return Err(self.invalid(format!(
                "the pipelined chain is not built for {} yet; use the overlapped mode (the \
                 all-gather) or a sequential one",
                F::NAME
            )));
        }
        if mode == ExchangeMode::SequentialNccl && self.nccl.is_none() {
            let comm = NcclComm::new(&self.runtime, &stream)?;
            // Where this NCCL has no windows (before 2.27), or the configuration asks for plain
            // memory, the mode gathers in the slots.
            if self.runtime.nccl_window() {
                self.nccl_window = comm.window(self.buffers.slots_bytes()).ok();
            }
            self.nccl = Some(comm);
        }
        if self.mode == Some(ExchangeMode::NoComm) && mode != ExchangeMode::NoComm {
            // NoComm calls sent no credits: grant them for every epoch so far, between barriers
            // so no PE puts before its readers have granted.
            let params = self.base_params(&stream);
            self.runtime.barrier_on_stream(&stream)?;
            // SAFETY: params point at buffers owned by self.
            unsafe { self.grant_credits.launch(&stream, SINGLE_THREAD, &params)? };
            self.runtime.barrier_on_stream(&stream)?;
        }
        stream.synchronize()?;
        self.calls = stream.clone_dtoh(&self.epoch)?[0];
        self.mode = Some(mode);
        Ok(())
    }

    /// The parameters every kernel of a call shares: the symmetric buffers, the epoch, the
    /// diagnostics, the layout, the PE, the mode and the chain; the family adds the rest.
    pub(crate) fn base_params(&self, stream: &CudaStream) -> F::Lasp2Params {
        let (b, h, dk, dv) = self.layout.dims();
        F::lasp2_params(ExchangeFields {
            slots: self.slots_address(),
            signals: self.buffers.signals.raw(),
            credit: self.buffers.credit.raw(),
            epoch: self.epoch.device_ptr(stream).0,
            diag: self.diag.device_ptr(stream).0,
            link: self
                .nic
                .as_ref()
                .map_or(0, |nic| nic.device_address(stream)),
            timeout_ns: self.runtime.wait_timeout().as_nanos() as u64,
            b,
            h,
            dk,
            dv,
            me: self.runtime.pe() as i32,
            npes: self.runtime.npes() as i32,
            exchange_mode: self.mode.map_or(0, ExchangeMode::kernel_mode),
            chain: self.direction as i32,
        })
    }

    /// Where this call's summaries go: the NCCL window in the sequential NCCL mode where there is
    /// one, else the symmetric slots.
    fn slots_address(&self) -> u64 {
        match (&self.nccl_window, self.mode) {
            (Some(window), Some(ExchangeMode::SequentialNccl)) => window.addr(),
            _ => self.buffers.slots.raw(),
        }
    }

    /// Whether the sequential NCCL mode gathers in a symmetric NCCL window, so that its timings
    /// can say which NCCL baseline they measured.
    pub(crate) fn nccl_window(&self) -> bool {
        self.nccl_window.is_some()
    }

    /// Whether each group's summary kernel runs on the exchange stream (overlapped, no-comm) rather
    /// than on the caller's stream before a host gather (the sequential modes).
    fn on_side_stream(&self) -> bool {
        matches!(
            self.mode(),
            ExchangeMode::Overlapped | ExchangeMode::PipelinedChain | ExchangeMode::NoComm
        )
    }

    /// Enqueues group `group`'s summary kernel (one CTA per Dv tile and head of the group's
    /// `heads`, from the params' first head), after what `stream` holds so far: on the exchange
    /// stream in the overlapped and no-comm modes where `beside` (the family's next kernels leave
    /// the summary's CTAs room on the SMs), else on `stream`. A summary whose CTAs cannot find
    /// room beside the next kernel's would start only as that kernel's CTAs finish, and every
    /// later PE would wait that long for it; in line, it costs its own short run.
    ///
    /// # Safety
    /// `params` must describe live buffers: the family's workspace with what its summary kernel
    /// reads (written on `stream` before this call), and the tensors the kernel reads.
    pub(crate) unsafe fn launch_summary(
        &mut self,
        stream: &Arc<CudaStream>,
        group: usize,
        heads: i32,
        params: &F::Lasp2Params,
        beside: bool,
    ) -> Result<()> {
        let shape = LaunchShape {
            grid: super::geometry::tile_grid(heads, self.layout.dv as i32),
            block: (F::SUMMARY_THREADS, 1, 1),
            shared_bytes: 0,
        };
        if !(self.on_side_stream() && beside) {
            // SAFETY: the caller's contract covers `params`; `stream` is the caller's.
            return unsafe { self.summary.launch(stream, shape, params) };
        }
        while self.tiles_ready.len() <= group {
            self.tiles_ready.push(self.ctx.new_event(None)?);
        }
        self.tiles_ready[group].record(stream)?;
        self.exchange_stream.wait(&self.tiles_ready[group])?;
        self.forked = true;
        // SAFETY: as above; the exchange stream waits for what `stream` held (tiles_ready).
        unsafe { self.summary.launch(&self.exchange_stream, shape, params) }
    }

    /// The sequential modes' host-driven all-gather of this call's summaries, on `stream` after
    /// the call's summary kernels; nothing in the other modes.
    pub(crate) fn gather_slots(&self, stream: &Arc<CudaStream>) -> Result<()> {
        let parity = ((self.calls + 1) & 1) as i32;
        self.buffers.gather_on_host(
            &self.runtime,
            self.nccl.as_ref(),
            self.mode(),
            stream,
            parity,
            self.slots_address(),
        )
    }

    /// Ends the call on `stream`: joins the exchange stream back (where it was used) and
    /// advances the epoch.
    pub(crate) fn end_call(
        &mut self,
        stream: &Arc<CudaStream>,
        params: &F::Lasp2Params,
    ) -> Result<()> {
        if std::mem::take(&mut self.forked) {
            self.exchange_done.record(&self.exchange_stream)?;
            stream.wait(&self.exchange_done)?;
        }
        // SAFETY: the kernel increments the epoch word owned by self.
        unsafe {
            self.advance_epoch.launch(stream, SINGLE_THREAD, params)?;
        }
        self.calls += 1;
        Ok(())
    }

    /// Waits for `stream`, then returns the error of the first expired wait, if any (naming the
    /// PE that never sent, the signal slot and the epoch).
    pub(crate) fn finish(&self, stream: &Arc<CudaStream>) -> Result<()> {
        stream.synchronize()?;
        stream.clone_dtoh(&self.diag)?[0].into_result()
    }

    /// Completed calls (the device epoch; synchronises `stream`).
    pub(crate) fn epoch(&self, stream: &Arc<CudaStream>) -> Result<u64> {
        Ok(stream.clone_dtoh(&self.epoch)?[0])
    }

    /// Records `calls` calls replayed from a captured CUDA graph, so host-side gathers of later
    /// calls use the right parity.
    pub(crate) fn note_replayed_calls(&mut self, calls: u64) {
        self.calls += calls;
    }

    /// Frees the symmetric buffers (collective).
    pub(crate) fn free(mut self) -> Result<()> {
        if let (Some(window), Some(comm)) = (self.nccl_window.take(), &self.nccl) {
            window.free(comm)?;
        }
        self.nccl = None;
        // Calls still in flight on the callers' streams use the buffers.
        self.ctx.synchronize()?;
        self.buffers.free(&self.runtime)
    }
}
