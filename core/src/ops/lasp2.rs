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
//!
//! The heads are cut into groups ([`Lasp2Tuning::head_groups`]) and every kernel runs once per
//! group: states of every group, then outputs of every group. In the overlapped mode each group's
//! `fold_put` runs on a second, high-priority stream as soon as that group's states are done, so
//! group 0's exchange travels while group 1's states are computed and the last group's while
//! group 0's outputs are: the exchange leaves the critical path.

use super::scalar_decay::{
    self, check_args, geometry as sd, segment_kernels, ForwardArgs, ForwardShape,
};
use crate::diagnostics::WaitDiagnostics;
use crate::error::{Error, Result};
use crate::kernel::{Kernel, LaunchShape};
use crate::nccl::NcclComm;
use crate::runtime::Runtime;
use crate::symmetric::SymmetricBuffer;
use cudarc::driver::{result as cu, sys, CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr};
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
    /// `lasp2_timeline_words`.
    pub const fn timeline_words(b: i32, h: i32, dv: i32, s: i32) -> u64 {
        b as u64 * h as u64 * sd::num_vtiles(dv) as u64 * (2 + 3 * s as u64)
    }
    /// `lasp2_ws_p_offset` (16-byte aligned).
    pub const fn ws_p_offset(b: i32, h: i32, s: i32, dk: i32, dv: i32) -> u64 {
        (ws_m_bytes(b, h, s, dk, dv) + b as u64 * h as u64 * s as u64 * 4).div_ceil(16) * 16
    }
    /// `lasp2_workspace_bytes`.
    pub const fn workspace_bytes(b: i32, h: i32, s: i32, dk: i32, dv: i32) -> u64 {
        ws_p_offset(b, h, s, dk, dv) + ws_m_bytes(b, h, s, dk, dv)
    }
    /// `lasp2_states_grid` (all S segments) and `lasp2_output_grid`, for a group of `heads`.
    pub const fn segments_grid(heads: i32, dv: i32, s: i32) -> (u32, u32, u32) {
        (sd::num_vtiles(dv) as u32, s as u32, heads as u32)
    }
    /// `lasp2_fold_put_grid`, for a group of `heads`.
    pub const fn fold_put_grid(heads: i32, dv: i32) -> (u32, u32, u32) {
        (sd::num_vtiles(dv) as u32, heads as u32, 1)
    }
}

/// The C struct `lasp_lasp2_params` (192 bytes), passed by value to every LASP-2 kernel.
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
    ws_p: u64,
    slots: u64,
    signals: u64,
    credit: u64,
    epoch: u64,
    diag: u64,
    timeline: u64,
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
    bh_begin: i32,
}

/// `%globaltimer` stamps (ns, this GPU's clock) of one call, recorded on request
/// ([`Lasp2Forward::record_timeline`]). Tile `i = bh * (Dv/64) + vt`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lasp2Timeline {
    /// Per tile: the fold_put CTA is about to put (credits granted), and its puts are complete.
    pub puts: Vec<[u64; 2]>,
    /// Per (tile, segment), index `i * segments + s`: output CTA start, earlier PEs' tiles seen
    /// (signals), chunk loop start (prefix folded).
    pub outputs: Vec<[u64; 3]>,
    pub segments: usize,
}

impl Lasp2Timeline {
    fn from_words(words: &[u64], tiles: usize, segments: usize) -> Self {
        let (puts, outputs) = words.split_at(2 * tiles);
        Lasp2Timeline {
            puts: puts.chunks_exact(2).map(|c| [c[0], c[1]]).collect(),
            outputs: outputs
                .chunks_exact(3)
                .map(|c| [c[0], c[1], c[2]])
                .collect(),
            segments,
        }
    }

    /// Nanoseconds each output CTA spent waiting for the earlier PEs' tiles (0 where the data
    /// was there when the CTA started): the part of the exchange left on the critical path.
    pub fn output_waits_ns(&self) -> Vec<u64> {
        self.outputs
            .iter()
            .map(|o| o[1].saturating_sub(o[0]))
            .collect()
    }
}

/// How a call is cut into launches. Per head the arithmetic depends only on the segment count S
/// (chunk boundaries and fold order), never on the groups, so any tuning gives the same bits as
/// long as S is unchanged; every mode of a PE uses the same plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lasp2Tuning {
    /// Head groups G (at most B*H). With 2 or more, group g's exchange overlaps group g + 1's
    /// states pass and the last group's exchange overlaps group 0's output pass; 1 puts the whole
    /// exchange between the states and the output passes.
    pub head_groups: usize,
    /// CTAs per SM that one group's states or output launch aims for (segments are cut to reach
    /// it). 2 hides latency inside the kernels; 1 leaves more room beside them for the
    /// `fold_put` CTAs of the exchange stream but places the compute CTAs unevenly when those
    /// take SMs first (measured slower at every shape, benches/results/raw/run12).
    pub ctas_per_sm: u32,
}

impl Lasp2Tuning {
    /// Share of a call's bytes above which the exchange is worth splitting the heads for: the
    /// busiest PE's egress, `(npes - 1)` fp32 states per head, over the q, k, v, o bytes per head.
    /// Two groups hide the exchange (output CTAs wait <= 4 us) but cost compute: twice the
    /// launches, S doubled. Measured on 4x H200 (benches/results/raw/run12, B1, same job): at
    /// W = 4, B = 4, T_local = 8K (share 2.3 %) one group took 0.397 ms and two 0.424; at
    /// T_local = 32K (0.6 %) 0.368 against 0.444; at 128K (0.15 %) 1.312 against 1.389. One
    /// group's exposed exchange grows with npes - 1 while the grouping cost stays a fixed
    /// fraction, so the break-even lies above 2.3 %; 3 % is an estimate (W = 8, where B = 4,
    /// T_local = 8K has 5.5 %, was not available to measure).
    const GROUPING_THRESHOLD: f64 = 0.03;

    /// The plan a call gets unless one was set ([`Lasp2Forward::set_tuning`]).
    pub fn automatic(npes: usize, layout: Lasp2Layout, t_local: usize) -> Self {
        let exchange = npes.saturating_sub(1) as f64 * (layout.dk * layout.dv * 4) as f64;
        let tokens = t_local.max(1) as f64 * (2 * (layout.dk + layout.dv) * 2) as f64;
        Lasp2Tuning {
            head_groups: if exchange > Self::GROUPING_THRESHOLD * tokens {
                2
            } else {
                1
            },
            ctas_per_sm: 2,
        }
    }
}

/// The launches of one call: S segments per head (the same for every group) and the head groups
/// as `(first b*H+h, heads)`, contiguous and ascending.
#[derive(Clone, Debug, PartialEq, Eq)]
struct CallPlan {
    segments: i32,
    chunks_per_segment: i32,
    groups: Vec<(i32, i32)>,
}

impl CallPlan {
    fn new(bh: i32, t: i32, dv: i32, sm_count: u32, tuning: Lasp2Tuning) -> Self {
        let g = (tuning.head_groups.max(1) as i32).min(bh);
        let groups: Vec<(i32, i32)> = (0..g)
            .map(|i| {
                let begin = (i as i64 * bh as i64 / g as i64) as i32;
                let end = ((i + 1) as i64 * bh as i64 / g as i64) as i32;
                (begin, end - begin)
            })
            .collect();
        let widest = groups.iter().map(|&(_, n)| n).max().expect("g >= 1");
        let target = (sm_count.max(1) * tuning.ctas_per_sm.max(1)) as i32;
        let segments = sd::num_segments(1, widest, t, dv, target);
        CallPlan {
            segments,
            chunks_per_segment: sd::chunks_per_segment(t, segments),
            groups,
        }
    }
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

    /// Checks that the kernels support the layout (as [`ForwardShape::validate`] for any T).
    pub fn validate(&self) -> Result<()> {
        ForwardShape {
            b: self.b,
            t: 1,
            h: self.h,
            dk: self.dk,
            dv: self.dv,
        }
        .validate()
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
    segment_prefix: Kernel,
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
    /// The user's plan, or `None` for [`Lasp2Tuning::automatic`] per call.
    tuning: Option<Lasp2Tuning>,
    /// The second stream of the overlapped and no-communication modes: it runs each group's
    /// fold_put (and so the puts) beside the main stream's next kernels. Highest priority, so
    /// its CTAs are placed first when an SM frees up.
    exchange_stream: Arc<CudaStream>,
    /// `states_done[g]`: group g's states kernel finished (main -> exchange stream).
    states_done: Vec<CudaEvent>,
    /// Every fold_put of the call finished (exchange stream -> main, before the epoch advances).
    exchange_done: CudaEvent,
    /// Stamps of the last call when recording ([`Lasp2Forward::record_timeline`]), with the
    /// segment count it was recorded at.
    timeline: Option<(CudaSlice<u64>, usize)>,
    record_timeline: bool,
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
        layout.validate()?;
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
        let (_, highest_priority) = cu::stream::get_priority_range()?;
        let exchange_stream = ctx.new_stream_with_priority(highest_priority)?;
        let exchange_done = ctx.new_event(None)?;
        let mut op = Lasp2Forward {
            runtime: runtime.clone(),
            layout,
            states,
            output,
            fold_put: module.kernel("lasp_lasp2_fold_put")?,
            segment_prefix: module.kernel("lasp_lasp2_segment_prefix")?,
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
            tuning: None,
            exchange_stream,
            states_done: Vec::new(),
            exchange_done,
            timeline: None,
            record_timeline: false,
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

    /// Fixes the launch plan's knobs, or with `None` returns to [`Lasp2Tuning::automatic`] (not
    /// collective: the plan changes neither the symmetric layout nor the protocol). A plan with
    /// another segment count S changes the rounding of the outputs (bits are equal across
    /// modes and head groupings at one S).
    pub fn set_tuning(&mut self, tuning: Option<Lasp2Tuning>) -> Result<()> {
        if let Some(t) = tuning {
            if t.head_groups == 0 || t.ctas_per_sm == 0 {
                return Err(invalid(format!(
                    "{t:?}: head_groups and ctas_per_sm must be at least 1"
                )));
            }
        }
        self.tuning = tuning;
        Ok(())
    }

    /// Records `%globaltimer` stamps of every following call (puts, data seen, loop start per
    /// CTA), read back with [`Lasp2Forward::timeline`]. Costs a few stores per CTA.
    pub fn record_timeline(&mut self, on: bool) {
        self.record_timeline = on;
    }

    /// The stamps of the last call made while recording (synchronises `stream`), or `None`.
    pub fn timeline(&self, stream: &Arc<CudaStream>) -> Result<Option<Lasp2Timeline>> {
        let Some((buffer, segments)) = &self.timeline else {
            return Ok(None);
        };
        let l = self.layout;
        let tiles = l.b * l.h * (l.dv / sd::TILE_V as usize);
        let words = stream.clone_dtoh(buffer)?;
        let used = geometry::timeline_words(l.b as i32, l.h as i32, l.dv as i32, *segments as i32);
        Ok(Some(Lasp2Timeline::from_words(
            &words[..used as usize],
            tiles,
            *segments,
        )))
    }

    /// The plan knobs a call with `t_local` tokens on this PE uses.
    pub fn tuning_for(&self, t_local: usize) -> Lasp2Tuning {
        self.tuning
            .unwrap_or_else(|| Lasp2Tuning::automatic(self.runtime.npes(), self.layout, t_local))
    }

    fn plan(&self, t: i32) -> CallPlan {
        let l = self.layout;
        CallPlan::new(
            (l.b * l.h) as i32,
            t,
            l.dv as i32,
            self.sm_count,
            self.tuning_for(t as usize),
        )
    }

    /// Switches every PE to `mode` (collective: checks that all PEs ask for the same mode, sets
    /// up NCCL on first use, and re-arms the credits when leaving [`ExchangeMode::NoComm`]).
    pub fn set_mode(&mut self, mode: ExchangeMode) -> Result<()> {
        if self.mode == Some(mode) {
            return Ok(());
        }
        // Calls still in flight on the caller's streams use the current mode's buffers and
        // advance the epoch read below: let them finish first.
        self.ctx.synchronize()?;
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
        let plan = self.plan(t);
        let segments = plan.segments;
        let ws_bytes = geometry::workspace_bytes(b, h, segments, dk, dv);
        super::ensure_workspace(
            &self.ctx,
            stream,
            &mut self.workspace,
            ws_bytes,
            "LASP-2 forward",
        )?;
        while self.states_done.len() < plan.groups.len() {
            self.states_done.push(self.ctx.new_event(None)?);
        }
        let ws = self
            .workspace
            .as_ref()
            .expect("ensured above")
            .device_ptr(stream)
            .0;
        let timeline = self.prepare_timeline(stream, segments)?;
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
            ws_p: ws + geometry::ws_p_offset(b, h, segments, dk, dv),
            t,
            num_segments: segments,
            chunks_per_segment: plan.chunks_per_segment,
            scale,
            exchange_mode: mode.kernel_mode(),
            write_final_state: (last && args.ht.is_some()) as i32,
            timeline,
            ..self.base_params(stream)
        };
        let i = usize::from(l.dk == 128);
        let group_params = |bh_begin| Lasp2Params { bh_begin, ..params };
        let segments_launch = |heads, smem| LaunchShape {
            grid: geometry::segments_grid(heads, dv, segments),
            block: (sd::THREADS, 1, 1),
            shared_bytes: smem,
        };
        let fold_put = |heads| LaunchShape {
            grid: geometry::fold_put_grid(heads, dv),
            block: (geometry::FOLD_THREADS, 1, 1),
            shared_bytes: 0,
        };
        // The sequential modes gather every group's slot tiles at once, so their fold_puts stay on
        // the caller's stream; the others hand each group's fold_put to the exchange stream.
        let side = matches!(mode, ExchangeMode::Overlapped | ExchangeMode::NoComm);
        self.ctx.bind_to_thread()?;
        for (g, &(bh_begin, heads)) in plan.groups.iter().enumerate() {
            let p = group_params(bh_begin);
            // SAFETY: Lasp2Params has the C layout of lasp_lasp2_params (tests); the shape,
            // lengths, alignment and overlaps were checked above; views borrow their buffers for
            // the call; symmetric buffers, epoch, diag and workspace are owned by self. A group's
            // fold_put reads only its own heads' workspace, written by its states kernel, which
            // the event orders before it; the next call's states kernels wait for exchange_done.
            unsafe {
                self.states[i].launch(
                    stream,
                    segments_launch(heads, sd::states_smem_bytes(dk)),
                    &p,
                )?;
                if side {
                    self.states_done[g].record(stream)?;
                    self.exchange_stream.wait(&self.states_done[g])?;
                    self.fold_put
                        .launch(&self.exchange_stream, fold_put(heads), &p)?;
                } else {
                    self.fold_put.launch(stream, fold_put(heads), &p)?;
                }
                // The group's shard-local segment prefixes, for its output kernel (reads the
                // workspace as fold_put does; writes only ws_p).
                if segments > 1 {
                    self.segment_prefix.launch(stream, fold_put(heads), &p)?;
                }
            }
        }
        self.gather_slots(stream, mode)?;
        for &(bh_begin, heads) in &plan.groups {
            // SAFETY: as above; outputs of different groups write disjoint heads.
            unsafe {
                self.output[i].launch(
                    stream,
                    segments_launch(heads, sd::output_smem_bytes(dk)),
                    &group_params(bh_begin),
                )?;
            }
        }
        if side {
            self.exchange_done.record(&self.exchange_stream)?;
            stream.wait(&self.exchange_done)?;
        }
        // SAFETY: as above.
        unsafe {
            self.advance_epoch
                .launch(stream, single_thread(), &params)?;
        }
        self.calls += 1;
        Ok(())
    }

    /// The timeline buffer of this call, zeroed on `stream` (0 = not recording).
    fn prepare_timeline(&mut self, stream: &Arc<CudaStream>, segments: i32) -> Result<u64> {
        if !self.record_timeline {
            return Ok(0);
        }
        let (b, h, _, dv) = self.layout.dims();
        let words = geometry::timeline_words(b, h, dv, segments) as usize;
        if self.timeline.as_ref().is_none_or(|(t, _)| t.len() < words) {
            // An earlier call may still write the old buffer.
            self.ctx.synchronize()?;
            self.timeline = Some((stream.alloc_zeros(words)?, 0));
        }
        let (buffer, recorded_segments) = self.timeline.as_mut().expect("allocated above");
        *recorded_segments = segments as usize;
        stream.memset_zeros(buffer)?;
        Ok(buffer.device_ptr(stream).0)
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
        assert_eq!(size_of::<Lasp2Params>(), 192);
        assert!(HEADER.contains("sizeof(lasp_lasp2_params) == 192"));
        assert_eq!(offset_of!(Lasp2Params, timeout_ns), 128);
        assert_eq!(offset_of!(Lasp2Params, b), 136);
        assert_eq!(offset_of!(Lasp2Params, scale), 164);
        assert_eq!(offset_of!(Lasp2Params, write_final_state), 180);
        assert_eq!(offset_of!(Lasp2Params, bh_begin), 184);
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
            "ws_p;",
            "slots;",
            "signals;",
            "credit;",
            "epoch;",
            "diag;",
            "timeline;",
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
            "bh_begin;",
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
        // ws_m 4,194,304 B + 64 Λ floats = 4,194,560 (16-aligned), then ws_p of ws_m's size.
        assert_eq!(geometry::ws_p_offset(4, 16, 1, 128, 128), 4_194_560);
        assert_eq!(geometry::workspace_bytes(4, 16, 1, 128, 128), 8_388_864);
        // 3 heads x 1 segment x 64 x 64 floats + 3 Λ floats = 49,164 B, rounded up to 49,168.
        assert_eq!(geometry::ws_p_offset(1, 3, 1, 64, 64), 49_168);
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

    #[test]
    fn automatic_plans_group_heads_only_where_the_exchange_is_a_sizeable_share() {
        let l = Lasp2Layout {
            b: 4,
            h: 16,
            dk: 128,
            dv: 128,
        };
        let groups = |npes, t| Lasp2Tuning::automatic(npes, l, t).head_groups;
        assert_eq!(
            (groups(8, 8192), groups(4, 8192), groups(1, 8192)),
            (2, 1, 1)
        );
        assert_eq!(
            (groups(8, 32768), groups(32, 32768), groups(4, 131072)),
            (1, 2, 1)
        );
        assert_eq!(Lasp2Tuning::automatic(4, l, 1).ctas_per_sm, 2);
    }

    #[test]
    fn timeline_words_split_into_puts_and_output_ctas() {
        // B=1, H=2, Dv=128 (2 tiles per head), S=3: 4 tiles x 2 put stamps, 12 CTAs x 3 stamps.
        assert_eq!(geometry::timeline_words(1, 2, 128, 3), 8 + 36);
        let words: Vec<u64> = (0..44).collect();
        let t = Lasp2Timeline::from_words(&words, 4, 3);
        assert_eq!(t.puts.len(), 4);
        assert_eq!(t.puts[3], [6, 7]);
        assert_eq!(t.outputs.len(), 12);
        // CTA (tile 1, segment 2) is output index 1 * 3 + 2 = 5: words 8 + 15 ..
        assert_eq!(t.outputs[5], [23, 24, 25]);
        assert_eq!(t.output_waits_ns(), vec![1; 12]);
    }

    #[test]
    fn plans_cut_heads_into_contiguous_groups_with_one_segment_count() {
        let sms = 132;
        let two = Lasp2Tuning {
            head_groups: 2,
            ctas_per_sm: 1,
        };
        // B=4, H=16, D=128, T=8K: 64 heads -> 2 groups of 32 (64 tiles each); S = 2 for 128
        // CTAs per group launch (one per SM).
        let p = CallPlan::new(64, 8192, 128, sms, two);
        assert_eq!(p.groups, vec![(0, 32), (32, 32)]);
        assert_eq!((p.segments, p.chunks_per_segment), (2, 64));
        // B=1, H=16, T=32K: 8 heads per group, S = 8.
        let p = CallPlan::new(16, 32768, 128, sms, two);
        assert_eq!(p.groups, vec![(0, 8), (8, 8)]);
        assert_eq!(p.segments, 8);
        // Odd head counts: groups differ by at most one head and S fits the wider one.
        let p = CallPlan::new(
            5,
            4096,
            64,
            sms,
            Lasp2Tuning {
                head_groups: 3,
                ..two
            },
        );
        assert_eq!(p.groups, vec![(0, 1), (1, 2), (3, 2)]);
        assert_eq!(p.segments, sd::num_segments(1, 2, 4096, 64, 132));
        // More groups than heads: one head per group.
        let p = CallPlan::new(1, 100, 64, sms, two);
        assert_eq!(p.groups, vec![(0, 1)]);
        // One group is the ungrouped plan of the single-GPU policy at one CTA per SM.
        let one = Lasp2Tuning {
            head_groups: 1,
            ctas_per_sm: 1,
        };
        let p = CallPlan::new(64, 8192, 128, sms, one);
        assert_eq!((p.groups.clone(), p.segments), (vec![(0, 64)], 1));
        // Two CTAs per SM double the segments where the sequence allows it.
        let p = CallPlan::new(
            64,
            8192,
            128,
            sms,
            Lasp2Tuning {
                ctas_per_sm: 2,
                ..two
            },
        );
        assert_eq!(p.segments, 4);
    }
}
