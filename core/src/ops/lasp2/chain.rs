//! The exchange of one LASP-2 operation along its chain (kernels/cuda/lasp2_chain.cu): the
//! symmetric slots, signals and credits, the epoch counter, the mode, the second stream that runs
//! the `fold_put` kernels beside the compute, and the sequential modes' host-driven all-gathers.
//! The forward and the backward each own one; they differ only in the chain's direction.

use super::{fold_launch, geometry, single_thread, Chain, ExchangeMode, Lasp2Layout, Lasp2Params};
use crate::diagnostics::WaitDiagnostics;
use crate::error::{Error, Result};
use crate::kernel::Kernel;
use crate::nccl::NcclComm;
use crate::ops::scalar_decay::ForwardShape;
use crate::runtime::Runtime;
use crate::symmetric::SymmetricBuffer;
use cudarc::driver::{result as cu, CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr};
use std::sync::Arc;

/// One operation's exchange. Creating it and switching modes are collective; calls are not (in
/// the overlapped mode the PEs synchronise only through device signals).
pub(crate) struct StateChain {
    runtime: Runtime,
    ctx: Arc<CudaContext>,
    layout: Lasp2Layout,
    chain: Chain,
    /// The operation's name, for messages ("LASP-2 forward").
    op: &'static str,
    fold_put: Kernel,
    advance_epoch: Kernel,
    grant_credits: Kernel,
    slots: SymmetricBuffer<f32>,
    signals: SymmetricBuffer<u64>,
    credit: SymmetricBuffer<u64>,
    staging: SymmetricBuffer<u8>,
    epoch: CudaSlice<u64>,
    diag: CudaSlice<WaitDiagnostics>,
    nccl: Option<NcclComm>,
    /// Host mirror of the device epoch (completed calls), for the parity of host-side gathers.
    calls: u64,
    mode: Option<ExchangeMode>,
    /// The second stream of the overlapped and no-communication modes: it runs each group's
    /// fold_put (and so the puts) beside the main stream's next kernels. Highest priority, so
    /// its CTAs are placed first when an SM frees up.
    exchange_stream: Arc<CudaStream>,
    /// `tiles_ready[g]`: group g's states kernel finished (main -> exchange stream).
    tiles_ready: Vec<CudaEvent>,
    /// Every fold_put of the call finished (exchange stream -> main, before the epoch advances).
    exchange_done: CudaEvent,
}

impl StateChain {
    /// Allocates the symmetric buffers, checks that every PE set up the same layout and chain,
    /// and sets the mode (collective).
    pub(crate) fn new(
        runtime: &Runtime,
        layout: Lasp2Layout,
        mode: ExchangeMode,
        chain: Chain,
        op: &'static str,
    ) -> Result<Self> {
        layout.validate()?;
        let npes = runtime.npes();
        let fingerprints = runtime.all_gather_u64(layout.fingerprint(npes, chain))?;
        let mine = fingerprints[runtime.pe()];
        let differ: Vec<usize> = (0..npes).filter(|&p| fingerprints[p] != mine).collect();
        if !differ.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "{op}: PEs {differ:?} set up a different layout than PE {} ({layout:?}, {npes} \
                 PEs, {chain:?} chain); every PE must pass the same B, H, Dk and Dv, and create \
                 the same LASP-2 operations in the same order",
                runtime.pe()
            )));
        }
        let ctx = runtime.context().clone();
        let module = runtime.module();
        let (b, h, dk, dv) = layout.dims();
        let n = npes as i32;
        let stream = runtime.stream();
        let (_, highest_priority) = cu::stream::get_priority_range()?;
        let mut exchange = StateChain {
            runtime: runtime.clone(),
            layout,
            chain,
            op,
            fold_put: module.kernel("lasp_lasp2_fold_put")?,
            advance_epoch: module.kernel("lasp_lasp2_advance_epoch")?,
            grant_credits: module.kernel("lasp_lasp2_grant_credits")?,
            slots: runtime.alloc_zeroed((geometry::slots_bytes(n, b, h, dk, dv) / 4) as usize)?,
            signals: runtime.alloc_zeroed(geometry::signals_count(n, b, h, dv) as usize)?,
            credit: runtime.alloc_zeroed(npes)?,
            staging: runtime.alloc(geometry::gather_bytes(b, h, dk, dv) as usize)?,
            epoch: stream.alloc_zeros(1)?,
            diag: stream.alloc_zeros(1)?,
            nccl: None,
            calls: 0,
            mode: None,
            exchange_stream: ctx.new_stream_with_priority(highest_priority)?,
            tiles_ready: Vec::new(),
            exchange_done: ctx.new_event(None)?,
            ctx,
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

    /// The checks every call of the operation starts with: a supported shape whose B, H, Dk and
    /// Dv are the layout every PE agreed on, and a stream of the runtime's GPU.
    pub(crate) fn check_call(&self, stream: &CudaStream, shape: &ForwardShape) -> Result<()> {
        shape.validate()?;
        let (s, l) = (shape, self.layout);
        if (s.b, s.h, s.dk, s.dv) != (l.b, l.h, l.dk, l.dv) {
            return Err(self.invalid(format!(
                "the call's B={}, H={}, Dk={}, Dv={} differ from the layout {l:?} every PE agreed \
                 on; create another instance for another layout",
                s.b, s.h, s.dk, s.dv
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
        if mode == ExchangeMode::SequentialNccl && self.nccl.is_none() {
            self.nccl = Some(NcclComm::new(&self.runtime, &stream)?);
        }
        if self.mode == Some(ExchangeMode::NoComm) && mode != ExchangeMode::NoComm {
            // NoComm calls sent no credits: grant them for every epoch so far, between barriers
            // so no PE puts before its readers have granted.
            let params = self.base_params(&stream);
            self.runtime.barrier_on_stream(&stream)?;
            // SAFETY: params point at buffers owned by self.
            unsafe {
                self.grant_credits
                    .launch(&stream, single_thread(), &params)?
            };
            self.runtime.barrier_on_stream(&stream)?;
        }
        stream.synchronize()?;
        self.calls = stream.clone_dtoh(&self.epoch)?[0];
        self.mode = Some(mode);
        Ok(())
    }

    /// The parameters every kernel of a call shares: the symmetric buffers, the epoch, the
    /// diagnostics, the layout, the PE, the mode and the chain.
    pub(crate) fn base_params(&self, stream: &CudaStream) -> Lasp2Params {
        let (b, h, dk, dv) = self.layout.dims();
        Lasp2Params {
            slots: self.slots.raw() as _,
            signals: self.signals.raw() as _,
            credit: self.credit.raw() as _,
            epoch: self.epoch.device_ptr(stream).0 as _,
            diag: self.diag.device_ptr(stream).0 as _,
            timeout_ns: self.runtime.wait_timeout().as_nanos() as u64,
            B: b,
            H: h,
            Dk: dk,
            Dv: dv,
            me: self.runtime.pe() as i32,
            npes: self.runtime.npes() as i32,
            exchange_mode: self.mode.map_or(0, ExchangeMode::kernel_mode),
            chain: self.chain as i32,
            ..Default::default()
        }
    }

    /// Whether each group's fold_put runs on the exchange stream (overlapped, no-comm) rather
    /// than on the caller's stream before a host gather (the sequential modes).
    fn on_side_stream(&self) -> bool {
        matches!(self.mode(), ExchangeMode::Overlapped | ExchangeMode::NoComm)
    }

    /// Enqueues group `group`'s fold_put (`heads` heads from `params.bh_begin`), after what
    /// `stream` holds so far: on the exchange stream in the overlapped and no-comm modes, else
    /// on `stream`.
    ///
    /// # Safety
    /// `params` must describe live buffers: the workspace with the group's segment states (written
    /// on `stream` before this call), `g`, and `h0` where the chain reads it.
    pub(crate) unsafe fn launch_fold_put(
        &mut self,
        stream: &Arc<CudaStream>,
        group: usize,
        heads: i32,
        params: &Lasp2Params,
    ) -> Result<()> {
        let shape = fold_launch(heads, params.Dv);
        if !self.on_side_stream() {
            return self.fold_put.launch(stream, shape, params);
        }
        while self.tiles_ready.len() <= group {
            self.tiles_ready.push(self.ctx.new_event(None)?);
        }
        self.tiles_ready[group].record(stream)?;
        self.exchange_stream.wait(&self.tiles_ready[group])?;
        self.fold_put.launch(&self.exchange_stream, shape, params)
    }

    /// The sequential modes' host-driven all-gather of this call's slot half, on `stream` after
    /// the call's fold_puts; nothing in the other modes.
    pub(crate) fn gather_slots(&self, stream: &Arc<CudaStream>) -> Result<()> {
        let (b, h, dk, dv) = self.layout.dims();
        let (me, npes) = (self.runtime.pe() as i32, self.runtime.npes() as i32);
        let parity = ((self.calls + 1) & 1) as i32;
        let bytes = geometry::gather_bytes(b, h, dk, dv);
        let base = self.slots.raw();
        let send = base + geometry::gather_send_offset(parity, me, npes, b, h, dk, dv);
        let recv = base + geometry::gather_recv_offset(parity, npes, b, h, dk, dv);
        match self.mode() {
            ExchangeMode::Overlapped | ExchangeMode::NoComm => Ok(()),
            ExchangeMode::SequentialNccl => {
                let comm = self.nccl.as_ref().expect("created by set_mode");
                // SAFETY: the parity half of `slots`, [npes][bytes], owned by self; on the
                // caller's stream, after this call's fold_puts.
                unsafe { comm.all_gather_in_place(stream, recv, bytes as usize) }
            }
            ExchangeMode::SequentialNvshmem => {
                // fcollect's source may not overlap its destination: stage this PE's block.
                // SAFETY: both ranges are `bytes` long inside symmetric buffers owned by self.
                unsafe {
                    cudarc::driver::result::memcpy_dtod_async(
                        self.staging.raw(),
                        send,
                        bytes as usize,
                        stream.cu_stream(),
                    )
                }?;
                // SAFETY: `staging` and the parity half of `slots` are distinct symmetric
                // buffers owned by self, of `bytes` and npes x `bytes` from `recv`; every PE
                // makes this call in the same mode and order; on the caller's stream.
                unsafe {
                    self.runtime.fcollect_on_stream(
                        stream,
                        recv,
                        self.staging.raw(),
                        bytes as usize,
                    )
                }
            }
        }
    }

    /// Ends the call on `stream`: joins the exchange stream back (where it was used) and
    /// advances the epoch.
    pub(crate) fn end_call(
        &mut self,
        stream: &Arc<CudaStream>,
        params: &Lasp2Params,
    ) -> Result<()> {
        if self.on_side_stream() {
            self.exchange_done.record(&self.exchange_stream)?;
            stream.wait(&self.exchange_done)?;
        }
        // SAFETY: the kernel increments the epoch word owned by self.
        unsafe {
            self.advance_epoch.launch(stream, single_thread(), params)?;
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
        self.nccl = None;
        let rt = self.runtime.clone();
        rt.free(self.staging)?;
        rt.free(self.credit)?;
        rt.free(self.signals)?;
        rt.free(self.slots)
    }
}
