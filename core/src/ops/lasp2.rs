//! LASP-2 forward of scalar-decay linear attention across PEs (kernels/cuda/lasp2_fwd.cu;
//! protocol in kernels/cuda/LASP2_NOTES.md).
//!
//! PE `w` holds the `w`-th slice of every sequence. Per call and per (b, h): the states kernel
//! computes every segment's local end state; `fold_put` folds them into the shard's state `M_w`
//! (from zero) and decay `Λ_w` and, in [`ExchangeMode::Overlapped`], puts that tile into every
//! later PE's slot with a signal, from the device; the output kernel waits for the earlier PEs'
//! tiles, folds the prefix `P_w = fold_{u<w}(e^{Λ_u} P + M_u)` and runs the chunkwise forward of
//! the shard from it. The sequential modes replace the device puts by a host-driven all-gather
//! between the same kernels; [`ExchangeMode::NoComm`] drops the exchange (for timing). The fold
//! and every other operation are the same in every mode, so outputs are bit-identical.

use super::scalar_decay::{
    self, check_args, geometry as sd, segment_kernels, ForwardArgs, ForwardShape,
};
use crate::diagnostics::WaitDiagnostics;
use crate::error::{Error, Result};
use crate::kernel::{Kernel, LaunchShape};
use crate::nccl::NcclComm;
use crate::runtime::Runtime;
use crate::symmetric::SymmetricBuffer;
use cudarc::driver::{sys, CudaContext, CudaSlice, CudaStream, DevicePtr};
use std::sync::Arc;

/// How the memory states move between PEs. Every PE must use the same mode in a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ExchangeMode {
    /// Producer CTAs put `(M_w, Λ_w)` into later PEs' slots with signals; the output kernel waits
    /// on the signals (bounded) before its prologue. No host collective, no stream sync.
    Overlapped,
    /// The same kernels with NCCL's all-gather of the slots between them.
    SequentialNccl,
    /// The same kernels with NVSHMEM's on-stream all-gather (`fcollect`) between them.
    SequentialNvshmem,
    /// The same kernels with no exchange at all: the cost of the compute alone. Outputs of PEs
    /// other than 0 are then not the LASP-2 result.
    NoComm,
}

impl ExchangeMode {
    /// All modes, in benchmark order.
    pub const ALL: [ExchangeMode; 4] = [
        ExchangeMode::Overlapped,
        ExchangeMode::SequentialNccl,
        ExchangeMode::SequentialNvshmem,
        ExchangeMode::NoComm,
    ];

    /// `enum lasp2_exchange_mode`.
    fn kernel_mode(self) -> i32 {
        match self {
            ExchangeMode::NoComm => 0,
            ExchangeMode::Overlapped => 1,
            ExchangeMode::SequentialNccl | ExchangeMode::SequentialNvshmem => 2,
        }
    }

    fn code(self) -> u64 {
        self.kernel_mode() as u64 * 2 + matches!(self, ExchangeMode::SequentialNvshmem) as u64
    }
}

/// Mirrors of the header's layout and launch formulas (`lasp2_params.h`).
pub mod geometry {
    use super::sd;

    /// `LASP2_FOLD_THREADS`.
    pub const FOLD_THREADS: u32 = 256;
    /// `LASP2_SLOT_TRAILER_FLOATS`: Λ and padding after a tile's `Dk*64` floats.
    pub const SLOT_TRAILER_FLOATS: u64 = 4;

    /// `lasp2_slot_tile_floats`.
    pub const fn slot_tile_floats(dk: i32) -> u64 {
        dk as u64 * sd::TILE_V as u64 + SLOT_TRAILER_FLOATS
    }
    /// `lasp2_slot_pe_floats`: one PE's slot in one parity.
    pub const fn slot_pe_floats(b: i32, h: i32, dk: i32, dv: i32) -> u64 {
        b as u64 * h as u64 * sd::num_vtiles(dv) as u64 * slot_tile_floats(dk)
    }
    /// `lasp2_slots_bytes`.
    pub const fn slots_bytes(npes: i32, b: i32, h: i32, dk: i32, dv: i32) -> u64 {
        2 * npes as u64 * slot_pe_floats(b, h, dk, dv) * 4
    }
    /// `lasp2_signals_count`.
    pub const fn signals_count(npes: i32, b: i32, h: i32, dv: i32) -> u64 {
        2 * npes as u64 * b as u64 * h as u64 * sd::num_vtiles(dv) as u64
    }
    /// `lasp2_gather_bytes`.
    pub const fn gather_bytes(b: i32, h: i32, dk: i32, dv: i32) -> u64 {
        slot_pe_floats(b, h, dk, dv) * 4
    }
    /// `lasp2_gather_recv_offset`.
    pub const fn gather_recv_offset(
        parity: i32,
        npes: i32,
        b: i32,
        h: i32,
        dk: i32,
        dv: i32,
    ) -> u64 {
        parity as u64 * npes as u64 * gather_bytes(b, h, dk, dv)
    }
    /// `lasp2_gather_send_offset`.
    pub const fn gather_send_offset(
        parity: i32,
        me: i32,
        npes: i32,
        b: i32,
        h: i32,
        dk: i32,
        dv: i32,
    ) -> u64 {
        (parity as u64 * npes as u64 + me as u64) * gather_bytes(b, h, dk, dv)
    }
    /// `lasp2_ws_m_bytes` (= `lasp2_ws_lambda_offset`).
    pub const fn ws_m_bytes(b: i32, h: i32, s: i32, dk: i32, dv: i32) -> u64 {
        b as u64 * h as u64 * s as u64 * dk as u64 * dv as u64 * 4
    }
    /// `lasp2_workspace_bytes`.
    pub const fn workspace_bytes(b: i32, h: i32, s: i32, dk: i32, dv: i32) -> u64 {
        ws_m_bytes(b, h, s, dk, dv) + b as u64 * h as u64 * s as u64 * 4
    }
    /// `lasp2_states_grid` (all S segments) and `lasp2_output_grid`.
    pub const fn segments_grid(b: i32, h: i32, dv: i32, s: i32) -> (u32, u32, u32) {
        (sd::num_vtiles(dv) as u32, s as u32, (b * h) as u32)
    }
    /// `lasp2_fold_put_grid`.
    pub const fn fold_put_grid(b: i32, h: i32, dv: i32) -> (u32, u32, u32) {
        (sd::num_vtiles(dv) as u32, (b * h) as u32, 1)
    }
}

/// The C struct `lasp_lasp2_params` (168 bytes), passed by value to every LASP-2 kernel.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct Lasp2Params {
    q: u64,
    k: u64,
    v: u64,
    g: u64,
    o: u64,
    h0: u64,
    ht: u64,
    ws_m: u64,
    ws_lambda: u64,
    slots: u64,
    signals: u64,
    credit: u64,
    epoch: u64,
    diag: u64,
    timeout_ns: u64,
    b: i32,
    t: i32,
    h: i32,
    dk: i32,
    dv: i32,
    num_segments: i32,
    chunks_per_segment: i32,
    scale: f32,
    me: i32,
    npes: i32,
    exchange_mode: i32,
    write_final_state: i32,
}

/// What every PE must agree on: it fixes the symmetric layouts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Lasp2Layout {
    pub b: usize,
    pub h: usize,
    pub dk: usize,
    pub dv: usize,
}

impl Lasp2Layout {
    fn dims(&self) -> (i32, i32, i32, i32) {
        (self.b as i32, self.h as i32, self.dk as i32, self.dv as i32)
    }

    /// Symmetric bytes one instance allocates on each PE (size the runtime's heap with it).
    pub fn symmetric_bytes(&self, npes: usize) -> usize {
        let (b, h, dk, dv) = self.dims();
        let n = npes as i32;
        (geometry::slots_bytes(n, b, h, dk, dv)
            + geometry::gather_bytes(b, h, dk, dv)
            + 8 * (geometry::signals_count(n, b, h, dv) + npes as u64)) as usize
            + (64 << 10)
    }

    /// A 64-bit digest of the layout, the PE count and the kernels' interface version.
    fn fingerprint(&self, npes: usize) -> u64 {
        // FNV-1a over the fields: stable across builds and platforms (unlike std's hasher).
        let mut h = 0xcbf2_9ce4_8422_2325u64;
        for v in [
            self.b,
            self.h,
            self.dk,
            self.dv,
            npes,
            std::mem::size_of::<Lasp2Params>(),
        ] {
            for byte in (v as u64).to_le_bytes() {
                h = (h ^ byte as u64).wrapping_mul(0x0000_0100_0000_01b3);
            }
        }
        h
    }
}

/// The LASP-2 forward on one PE: owns the symmetric slots and signals, the epoch counter and the
/// workspace. Creating it and switching modes are collective; each call is not (in the
/// overlapped mode, it synchronises with the other PEs only through device signals).
pub struct Lasp2Forward {
    runtime: Runtime,
    ctx: Arc<CudaContext>,
    layout: Lasp2Layout,
    states: [Kernel; 2],
    output: [Kernel; 2],
    fold_put: Kernel,
    advance_epoch: Kernel,
    grant_credits: Kernel,
    slots: SymmetricBuffer<f32>,
    signals: SymmetricBuffer<u64>,
    credit: SymmetricBuffer<u64>,
    staging: SymmetricBuffer<u8>,
    epoch: CudaSlice<u64>,
    diag: CudaSlice<WaitDiagnostics>,
    workspace: Option<CudaSlice<u8>>,
    nccl: Option<NcclComm>,
    /// Host mirror of the device epoch (completed calls), for the parity of host-side gathers.
    calls: u64,
    mode: Option<ExchangeMode>,
    sm_count: u32,
}

fn invalid(msg: String) -> Error {
    Error::InvalidArgument(format!("LASP-2 forward: {msg}"))
}

impl Lasp2Forward {
    /// Allocates the symmetric buffers, checks that every PE has the same layout and sets the
    /// exchange mode (collective). Calls are then not collective: only [`Lasp2Forward::set_mode`]
    /// and [`Lasp2Forward::free`] are, so a PE that stops calling cannot block the others in a
    /// host collective; their calls end in a bounded wait that names it.
    pub fn new(runtime: &Runtime, layout: Lasp2Layout, mode: ExchangeMode) -> Result<Self> {
        ForwardShape {
            b: layout.b,
            t: 1,
            h: layout.h,
            dk: layout.dk,
            dv: layout.dv,
        }
        .validate()?;
        let npes = runtime.npes();
        let fingerprints = runtime.all_gather_u64(layout.fingerprint(npes))?;
        let mine = fingerprints[runtime.pe()];
        let differ: Vec<usize> = (0..npes).filter(|&p| fingerprints[p] != mine).collect();
        if !differ.is_empty() {
            return Err(invalid(format!(
                "PEs {differ:?} set up a different layout than PE {} ({layout:?}, {npes} PEs); \
                 every PE must pass the same B, H, Dk and Dv",
                runtime.pe()
            )));
        }
        let ctx = runtime.context().clone();
        let (states, output) = segment_kernels(
            runtime,
            ["lasp_lasp2_states_dk64", "lasp_lasp2_states_dk128"],
            ["lasp_lasp2_output_dk64", "lasp_lasp2_output_dk128"],
        )?;
        let module = runtime.module();
        let (b, h, dk, dv) = layout.dims();
        let n = npes as i32;
        let stream = runtime.stream();
        let sm_count = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?
            .max(1) as u32;
        let mut op = Lasp2Forward {
            runtime: runtime.clone(),
            layout,
            states,
            output,
            fold_put: module.kernel("lasp_lasp2_fold_put")?,
            advance_epoch: module.kernel("lasp_lasp2_advance_epoch")?,
            grant_credits: module.kernel("lasp_lasp2_grant_credits")?,
            slots: runtime.alloc_zeroed((geometry::slots_bytes(n, b, h, dk, dv) / 4) as usize)?,
            signals: runtime.alloc_zeroed(geometry::signals_count(n, b, h, dv) as usize)?,
            credit: runtime.alloc_zeroed(npes)?,
            staging: runtime.alloc(geometry::gather_bytes(b, h, dk, dv) as usize)?,
            epoch: stream.alloc_zeros(1)?,
            diag: stream.alloc_zeros(1)?,
            workspace: None,
            nccl: None,
            calls: 0,
            mode: None,
            sm_count,
            ctx,
        };
        stream.synchronize()?;
        op.set_mode(mode)?;
        Ok(op)
    }

    /// The layout every PE agreed on.
    pub fn layout(&self) -> Lasp2Layout {
        self.layout
    }

    /// Switches every PE to `mode` (collective: checks that all PEs ask for the same mode, sets
    /// up NCCL on first use, and re-arms the credits when leaving [`ExchangeMode::NoComm`]).
    pub fn set_mode(&mut self, mode: ExchangeMode) -> Result<()> {
        if self.mode == Some(mode) {
            return Ok(());
        }
        let stream = self.runtime.stream().clone();
        let modes = self.runtime.all_gather_u64(mode.code())?;
        if let Some(p) = modes.iter().position(|&m| m != mode.code()) {
            return Err(invalid(format!(
                "PE {p} asked for another exchange mode than PE {} ({mode:?}); every PE must use the same mode",
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

    fn base_params(&self, stream: &CudaStream) -> Lasp2Params {
        let (b, h, dk, dv) = self.layout.dims();
        Lasp2Params {
            slots: self.slots.raw(),
            signals: self.signals.raw(),
            credit: self.credit.raw(),
            epoch: self.epoch.device_ptr(stream).0,
            diag: self.diag.device_ptr(stream).0,
            timeout_ns: self.runtime.wait_timeout().as_nanos() as u64,
            b,
            h,
            dk,
            dv,
            me: self.runtime.pe() as i32,
            npes: self.runtime.npes() as i32,
            ..Default::default()
        }
    }

    fn ensure_workspace(&mut self, stream: &Arc<CudaStream>, bytes: u64) -> Result<()> {
        if self
            .workspace
            .as_ref()
            .is_some_and(|w| w.len() as u64 >= bytes)
        {
            return Ok(());
        }
        // Earlier calls may still use the old workspace.
        self.ctx.synchronize()?;
        self.workspace = Some(stream.alloc_zeros::<u8>(bytes.max(16) as usize)?);
        stream.synchronize()?;
        Ok(())
    }

    /// Enqueues one LASP-2 forward of this PE's shard on `stream` in the current mode.
    /// `args.shape.t` is this
    /// PE's shard length (it may differ between PEs); `h0` is the global initial state (the same
    /// on every PE); `ht`, the final state of the whole sequence, is written by the last PE only
    /// and must be `None` elsewhere. Everything is validated before the first launch.
    pub fn forward(&mut self, stream: &Arc<CudaStream>, args: ForwardArgs<'_>) -> Result<()> {
        let mode = self.mode.expect("set by new");
        let s = args.shape;
        s.validate()?;
        let l = self.layout;
        if (s.b, s.h, s.dk, s.dv) != (l.b, l.h, l.dk, l.dv) {
            return Err(invalid(format!(
                "the call's B={}, H={}, Dk={}, Dv={} differ from the layout {l:?} every PE agreed on; create another Lasp2Forward for another layout",
                s.b, s.h, s.dk, s.dv
            )));
        }
        let scale = check_args(&args)?;
        let (me, npes) = (self.runtime.pe(), self.runtime.npes());
        let last = me + 1 == npes;
        if args.ht.is_some() && !last {
            return Err(invalid(format!(
                "only the last PE ({}) holds the final state of the sequence; pass ht = None on PE {me}",
                npes - 1
            )));
        }
        if !Arc::ptr_eq(stream.context(), &self.ctx) {
            return Err(invalid(
                "the stream belongs to another CUDA context; use a stream of the runtime's GPU"
                    .into(),
            ));
        }
        let (b, h, dk, dv) = l.dims();
        let t = s.t as i32;
        let segments = sd::num_segments(
            b,
            h,
            t,
            dv,
            sd::target_ctas(b, h, t, dv, self.sm_count as i32),
        );
        let cps = sd::chunks_per_segment(t, segments);
        let ws_bytes = geometry::workspace_bytes(b, h, segments, dk, dv);
        self.ensure_workspace(stream, ws_bytes)?;
        let ws = self
            .workspace
            .as_ref()
            .expect("ensured above")
            .device_ptr(stream)
            .0;
        let params = Lasp2Params {
            q: args.q.addr(),
            k: args.k.addr(),
            v: args.v.addr(),
            g: args.g.addr(),
            o: args.o.addr(),
            h0: args.h0.map_or(0, |x| x.addr()),
            ht: args.ht.as_ref().map_or(0, |x| x.addr()),
            ws_m: ws,
            ws_lambda: ws + geometry::ws_m_bytes(b, h, segments, dk, dv),
            t,
            num_segments: segments,
            chunks_per_segment: cps,
            scale,
            exchange_mode: mode.kernel_mode(),
            write_final_state: (last && args.ht.is_some()) as i32,
            ..self.base_params(stream)
        };
        let i = usize::from(l.dk == 128);
        let segments_launch = |smem| LaunchShape {
            grid: geometry::segments_grid(b, h, dv, segments),
            block: (sd::THREADS, 1, 1),
            shared_bytes: smem,
        };
        let fold_put = LaunchShape {
            grid: geometry::fold_put_grid(b, h, dv),
            block: (geometry::FOLD_THREADS, 1, 1),
            shared_bytes: 0,
        };
        self.ctx.bind_to_thread()?;
        // SAFETY: Lasp2Params has the C layout of lasp_lasp2_params (tests); the shape, lengths,
        // alignment and overlaps were checked above; views borrow their buffers for the call;
        // symmetric buffers, epoch, diag and workspace are owned by self.
        unsafe {
            self.states[i].launch(stream, segments_launch(sd::states_smem_bytes(dk)), &params)?;
            self.fold_put.launch(stream, fold_put, &params)?;
        }
        self.gather_slots(stream, mode)?;
        // SAFETY: as above.
        unsafe {
            self.output[i].launch(stream, segments_launch(sd::output_smem_bytes(dk)), &params)?;
            self.advance_epoch
                .launch(stream, single_thread(), &params)?;
        }
        self.calls += 1;
        Ok(())
    }

    /// The sequential modes' host-driven all-gather of this call's slot half.
    fn gather_slots(&self, stream: &Arc<CudaStream>, mode: ExchangeMode) -> Result<()> {
        let (b, h, dk, dv) = self.layout.dims();
        let (me, npes) = (self.runtime.pe() as i32, self.runtime.npes() as i32);
        let parity = ((self.calls + 1) & 1) as i32;
        let bytes = geometry::gather_bytes(b, h, dk, dv);
        let base = self.slots.raw();
        let send = base + geometry::gather_send_offset(parity, me, npes, b, h, dk, dv);
        let recv = base + geometry::gather_recv_offset(parity, npes, b, h, dk, dv);
        match mode {
            ExchangeMode::Overlapped | ExchangeMode::NoComm => Ok(()),
            ExchangeMode::SequentialNccl => {
                let comm = self.nccl.as_ref().expect("created by set_mode");
                // SAFETY: the parity half of `slots`, [npes][bytes], owned by self.
                unsafe { comm.all_gather_in_place(recv, bytes as usize) }
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
                self.runtime
                    .fcollect_on_stream(stream, recv, self.staging.raw(), bytes as usize)
            }
        }
    }

    /// Waits for `stream`, then returns the error of the first expired wait, if any (naming the
    /// PE that never sent, the signal slot and the epoch).
    pub fn finish(&self, stream: &Arc<CudaStream>) -> Result<()> {
        stream.synchronize()?;
        stream.clone_dtoh(&self.diag)?[0].into_result()
    }

    /// Completed calls (the device epoch; synchronises `stream`).
    pub fn epoch(&self, stream: &Arc<CudaStream>) -> Result<u64> {
        Ok(stream.clone_dtoh(&self.epoch)?[0])
    }

    /// Records `calls` calls replayed from a captured CUDA graph, so host-side gathers of later
    /// calls use the right parity.
    pub fn note_replayed_calls(&mut self, calls: u64) {
        self.calls += calls;
    }

    /// Frees the symmetric buffers (collective).
    pub fn free(mut self) -> Result<()> {
        self.nccl = None;
        let rt = self.runtime.clone();
        rt.free(self.staging)?;
        rt.free(self.credit)?;
        rt.free(self.signals)?;
        rt.free(self.slots)
    }
}

fn single_thread() -> LaunchShape {
    LaunchShape {
        grid: (1, 1, 1),
        block: (1, 1, 1),
        shared_bytes: 0,
    }
}

/// The scalar-decay shape of one PE's shard (re-exported for callers of [`Lasp2Forward::forward`]).
pub type ShardShape = scalar_decay::ForwardShape;

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    const HEADER: &str = include_str!("../../../kernels/cuda/include/lasp/lasp2_params.h");

    #[test]
    fn params_mirror_the_header() {
        assert_eq!(size_of::<Lasp2Params>(), 168);
        assert!(HEADER.contains("sizeof(lasp_lasp2_params) == 168"));
        assert_eq!(offset_of!(Lasp2Params, timeout_ns), 112);
        assert_eq!(offset_of!(Lasp2Params, b), 120);
        assert_eq!(offset_of!(Lasp2Params, scale), 148);
        assert_eq!(offset_of!(Lasp2Params, write_final_state), 164);
        // Field order as in the header.
        let order = [
            "q;",
            "k;",
            "v;",
            "g;",
            "o;",
            "h0;",
            "ht;",
            "ws_m;",
            "ws_lambda;",
            "slots;",
            "signals;",
            "credit;",
            "epoch;",
            "diag;",
            "timeout_ns;",
            "B;",
            "T;",
            "H;",
            "Dk;",
            "Dv;",
            "num_segments;",
            "chunks_per_segment;",
            "scale;",
            "me;",
            "npes;",
            "exchange_mode;",
            "write_final_state;",
        ];
        let body = &HEADER[HEADER
            .find("typedef struct {\n  const uint16_t* q;")
            .unwrap()..];
        let mut at = 0;
        for field in order {
            let found = body[at..]
                .find(field)
                .unwrap_or_else(|| panic!("{field} out of order"));
            at += found + field.len();
        }
    }

    #[test]
    fn layouts_match_the_worked_example_of_the_notes() {
        // B=4, H=16, Dk=Dv=128, 4 PEs: 4,196,352 B per PE and parity; 1,024 signal words.
        assert_eq!(geometry::gather_bytes(4, 16, 128, 128), 4_196_352);
        assert_eq!(geometry::slots_bytes(4, 4, 16, 128, 128), 33_570_816);
        assert_eq!(geometry::signals_count(4, 4, 16, 128), 1024);
        assert_eq!(geometry::workspace_bytes(4, 16, 1, 128, 128), 4_194_560);
        assert_eq!(
            geometry::gather_send_offset(1, 2, 4, 4, 16, 128, 128),
            6 * 4_196_352
        );
        assert_eq!(geometry::slot_tile_floats(64) * 4, 16_400);
    }

    #[test]
    fn modes_and_fingerprints_distinguish_what_must_agree() {
        let codes: std::collections::HashSet<u64> =
            ExchangeMode::ALL.iter().map(|m| m.code()).collect();
        assert_eq!(codes.len(), 4);
        let a = Lasp2Layout {
            b: 4,
            h: 16,
            dk: 128,
            dv: 128,
        };
        assert_ne!(a.fingerprint(4), a.fingerprint(2));
        assert_ne!(a.fingerprint(4), Lasp2Layout { h: 8, ..a }.fingerprint(4));
        assert_eq!(a.fingerprint(4), a.fingerprint(4));
    }
}
