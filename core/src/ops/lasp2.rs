//! LASP-2 forward of scalar-decay linear attention across PEs (kernels/cuda/lasp2_fwd.cu;
//! protocol in kernels/cuda/LASP2_NOTES.md).
//!
//! PE `w` holds the `w`-th slice of every sequence. Per call and per (b, h): the states kernel
//! computes the local end state of every state segment; the last CTA to finish a tile folds them
//! into the shard's state `M_w` (from zero) and decay `Λ_w` and, in [`ExchangeMode::Overlapped`],
//! puts that tile into every later PE's slot with a signal, from the device; the output kernel
//! waits for the earlier PEs' tiles, folds the prefix `P_w = fold_{u<w}(e^{Λ_u} P + M_u)` and runs
//! the chunkwise forward of the shard from it. The sequential modes replace the device puts by a
//! host-driven all-gather between the same kernels; [`ExchangeMode::NoComm`] drops the exchange
//! (for timing). The fold and every other operation are the same in every mode, so outputs are
//! bit-identical.
//!
//! The states kernel cuts each output segment into [`Lasp2Tuning::state_splits`] state segments,
//! so it runs in several waves, tile by tile: the tiles of the first waves are folded and put
//! while the later waves compute, and only the last wave's puts are left when the output kernel
//! starts.

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
    /// The states kernel's CTAs put `(M_w, Λ_w)` into later PEs' slots with signals, tile by tile
    /// as tiles are done; the output kernel waits
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
    const fn align16(bytes: u64) -> u64 {
        bytes.div_ceil(16) * 16
    }
    /// `lasp2_ws_states_bytes`: fp32 `[B*H][segments][Dk][Dv]`.
    pub const fn ws_states_bytes(b: i32, h: i32, segments: i32, dk: i32, dv: i32) -> u64 {
        b as u64 * h as u64 * segments as u64 * dk as u64 * dv as u64 * 4
    }
    /// `lasp2_ws_tiles`.
    const fn tiles(b: i32, h: i32, dv: i32) -> u64 {
        b as u64 * h as u64 * sd::num_vtiles(dv) as u64
    }
    /// `lasp2_ws_p_offset`.
    pub const fn ws_p_offset(b: i32, h: i32, s_st: i32, dk: i32, dv: i32) -> u64 {
        ws_states_bytes(b, h, s_st, dk, dv)
    }
    /// `lasp2_ws_lambda_offset`.
    pub const fn ws_lambda_offset(b: i32, h: i32, s: i32, s_st: i32, dk: i32, dv: i32) -> u64 {
        ws_p_offset(b, h, s_st, dk, dv) + ws_states_bytes(b, h, s, dk, dv)
    }
    /// `lasp2_ws_lambda_p_offset`.
    pub const fn ws_lambda_p_offset(b: i32, h: i32, s: i32, s_st: i32, dk: i32, dv: i32) -> u64 {
        ws_lambda_offset(b, h, s, s_st, dk, dv) + align16(tiles(b, h, dv) * s_st as u64 * 4)
    }
    /// `lasp2_workspace_bytes`.
    pub const fn workspace_bytes(b: i32, h: i32, s: i32, s_st: i32, dk: i32, dv: i32) -> u64 {
        ws_lambda_p_offset(b, h, s, s_st, dk, dv) + align16(tiles(b, h, dv) * s as u64 * 4)
    }
    /// `lasp2_arrivals_count`: one counter per tile.
    pub const fn arrivals_count(b: i32, h: i32, dv: i32) -> u64 {
        tiles(b, h, dv)
    }
    /// `lasp2_timeline_words`.
    pub const fn timeline_words(b: i32, h: i32, dv: i32, s: i32) -> u64 {
        tiles(b, h, dv) * (2 + 3 * s as u64)
    }
    /// `lasp2_chunks_per_state_segment`: the largest divisor of `chunks_per_segment` that cuts
    /// it into at most `splits` parts.
    pub const fn chunks_per_state_segment(chunks_per_segment: i32, splits: i32) -> i32 {
        let mut k = if splits < 1 { 1 } else { splits };
        if k > chunks_per_segment {
            k = chunks_per_segment;
        }
        while chunks_per_segment % k != 0 {
            k -= 1;
        }
        chunks_per_segment / k
    }
    /// `lasp2_state_segments`.
    pub const fn state_segments(t: i32, chunks_per_state_segment: i32) -> i32 {
        (sd::num_chunks(t) + chunks_per_state_segment - 1) / chunks_per_state_segment
    }
    /// `lasp2_states_grid` (S_st state segments) and `lasp2_output_grid` (S output segments).
    pub const fn segments_grid(heads: i32, dv: i32, s: i32) -> (u32, u32, u32) {
        (sd::num_vtiles(dv) as u32, s as u32, heads as u32)
    }
}

/// The C struct `lasp_lasp2_params` (208 bytes), passed by value to every LASP-2 kernel.
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
    ws_lambda_p: u64,
    arrivals: u64,
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
    state_segments: i32,
    chunks_per_state_segment: i32,
    scale: f32,
    me: i32,
    npes: i32,
    exchange_mode: i32,
    write_final_state: i32,
}

/// `%globaltimer` stamps (ns, this GPU's clock) of one call, recorded on request
/// ([`Lasp2Forward::record_timeline`]). Tile `i = bh * (Dv/64) + vt`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lasp2Timeline {
    /// Per tile: its last states CTA is about to put (credits granted), and its puts are complete.
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

/// How a call is cut into CTAs. The arithmetic depends on the plan (chunk boundaries of the
/// segments and the fold order), so another plan gives results that differ by rounding; every
/// mode of a PE uses the same plan, so modes stay bitwise equal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lasp2Tuning {
    /// CTAs per SM the output kernel aims for (its segments S are cut to reach it): 2 hides
    /// latency inside the chunk loop.
    pub ctas_per_sm: u32,
    /// State segments per output segment, at most (the states kernel runs `S * splits` CTAs per
    /// tile, in waves when that exceeds one wave): with more than one, the tiles of the first
    /// waves are put while the later waves compute, so only the last wave's share of the exchange
    /// is left when the output kernel starts; each split adds a tile to fold and a wave to fill.
    pub state_splits: u32,
}

impl Lasp2Tuning {
    /// Share of a call's bytes above which the exchange is worth splitting the states pass for:
    /// the busiest PE's egress, `(npes - 1)` fp32 states per head, over the q, k, v, o bytes per
    /// head (2.3 % at W = 4, B = 4, T_local = 8K, H = 16, D = 128; 0.6 % at T_local = 32K).
    const SPLIT_THRESHOLD: f64 = 0.01;
    /// State segments per output segment above the threshold: four waves of the states kernel
    /// leave a quarter of the exchange after it.
    const SPLITS: u32 = 4;

    /// The plan a call gets unless one was set ([`Lasp2Forward::set_tuning`]).
    pub fn automatic(npes: usize, layout: Lasp2Layout, t_local: usize) -> Self {
        let exchange = npes.saturating_sub(1) as f64 * (layout.dk * layout.dv * 4) as f64;
        let tokens = t_local.max(1) as f64 * (2 * (layout.dk + layout.dv) * 2) as f64;
        Lasp2Tuning {
            ctas_per_sm: 2,
            state_splits: if exchange > Self::SPLIT_THRESHOLD * tokens {
                Self::SPLITS
            } else {
                1
            },
        }
    }
}

/// The launches of one call: S output segments per head and S_st state segments, which nest in
/// them (`chunks_per_segment` is a multiple of `chunks_per_state_segment`).
#[derive(Clone, Debug, PartialEq, Eq)]
struct CallPlan {
    segments: i32,
    chunks_per_segment: i32,
    state_segments: i32,
    chunks_per_state_segment: i32,
}

impl CallPlan {
    fn new(bh: i32, t: i32, dv: i32, sm_count: u32, tuning: Lasp2Tuning) -> Self {
        let target = (sm_count.max(1) * tuning.ctas_per_sm.max(1)) as i32;
        let segments = sd::num_segments(1, bh, t, dv, target);
        let chunks_per_segment = sd::chunks_per_segment(t, segments);
        let chunks_per_state_segment = geometry::chunks_per_state_segment(
            chunks_per_segment,
            tuning.state_splits.max(1) as i32,
        );
        CallPlan {
            segments,
            chunks_per_segment,
            state_segments: geometry::state_segments(t, chunks_per_state_segment),
            chunks_per_state_segment,
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
    advance_epoch: Kernel,
    grant_credits: Kernel,
    slots: SymmetricBuffer<f32>,
    signals: SymmetricBuffer<u64>,
    credit: SymmetricBuffer<u64>,
    staging: SymmetricBuffer<u8>,
    epoch: CudaSlice<u64>,
    diag: CudaSlice<WaitDiagnostics>,
    /// Per tile, the states CTAs done in the running call (zero between calls).
    arrivals: CudaSlice<u32>,
    workspace: Option<CudaSlice<u8>>,
    nccl: Option<NcclComm>,
    /// Host mirror of the device epoch (completed calls), for the parity of host-side gathers.
    calls: u64,
    mode: Option<ExchangeMode>,
    sm_count: u32,
    /// The user's plan, or `None` for [`Lasp2Tuning::automatic`] per call.
    tuning: Option<Lasp2Tuning>,
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
            advance_epoch: module.kernel("lasp_lasp2_advance_epoch")?,
            grant_credits: module.kernel("lasp_lasp2_grant_credits")?,
            slots: runtime.alloc_zeroed((geometry::slots_bytes(n, b, h, dk, dv) / 4) as usize)?,
            signals: runtime.alloc_zeroed(geometry::signals_count(n, b, h, dv) as usize)?,
            credit: runtime.alloc_zeroed(npes)?,
            staging: runtime.alloc(geometry::gather_bytes(b, h, dk, dv) as usize)?,
            epoch: stream.alloc_zeros(1)?,
            diag: stream.alloc_zeros(1)?,
            arrivals: stream.alloc_zeros(geometry::arrivals_count(b, h, dv) as usize)?,
            workspace: None,
            nccl: None,
            calls: 0,
            mode: None,
            sm_count,
            tuning: None,
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
    /// collective: the plan changes neither the symmetric layout nor the protocol). Another
    /// plan changes the rounding of the outputs (bits are equal across modes at one plan).
    pub fn set_tuning(&mut self, tuning: Option<Lasp2Tuning>) -> Result<()> {
        if let Some(t) = tuning {
            if t.ctas_per_sm == 0 || t.state_splits == 0 {
                return Err(invalid(format!(
                    "{t:?}: ctas_per_sm and state_splits must be at least 1"
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
        let plan = self.plan(t);
        let (segments, state_segments) = (plan.segments, plan.state_segments);
        let ws_bytes = geometry::workspace_bytes(b, h, segments, state_segments, dk, dv);
        self.ensure_workspace(stream, ws_bytes)?;
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
            ws_lambda: ws + geometry::ws_lambda_offset(b, h, segments, state_segments, dk, dv),
            ws_p: ws + geometry::ws_p_offset(b, h, state_segments, dk, dv),
            ws_lambda_p: ws + geometry::ws_lambda_p_offset(b, h, segments, state_segments, dk, dv),
            arrivals: self.arrivals.device_ptr(stream).0,
            t,
            num_segments: segments,
            chunks_per_segment: plan.chunks_per_segment,
            state_segments,
            chunks_per_state_segment: plan.chunks_per_state_segment,
            scale,
            exchange_mode: mode.kernel_mode(),
            write_final_state: (last && args.ht.is_some()) as i32,
            timeline,
            ..self.base_params(stream)
        };
        let i = usize::from(l.dk == 128);
        let launch = |segments, smem| LaunchShape {
            grid: geometry::segments_grid(b * h, dv, segments),
            block: (sd::THREADS, 1, 1),
            shared_bytes: smem,
        };
        self.ctx.bind_to_thread()?;
        // SAFETY: Lasp2Params has the C layout of lasp_lasp2_params (tests); the shape, lengths,
        // alignment and overlaps were checked above; views borrow their buffers for the call;
        // symmetric buffers, epoch, diag, arrival counters (zero between calls) and workspace
        // (sized for this plan) are owned by self. One stream orders the kernels.
        unsafe {
            self.states[i].launch(
                stream,
                launch(state_segments, sd::states_smem_bytes(dk)),
                &params,
            )?;
        }
        self.gather_slots(stream, mode)?;
        // SAFETY: as above.
        unsafe {
            self.output[i].launch(stream, launch(segments, sd::output_smem_bytes(dk)), &params)?;
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
        assert_eq!(size_of::<Lasp2Params>(), 208);
        assert!(HEADER.contains("sizeof(lasp_lasp2_params) == 208"));
        assert_eq!(offset_of!(Lasp2Params, timeout_ns), 144);
        assert_eq!(offset_of!(Lasp2Params, b), 152);
        assert_eq!(offset_of!(Lasp2Params, chunks_per_state_segment), 184);
        assert_eq!(offset_of!(Lasp2Params, scale), 188);
        assert_eq!(offset_of!(Lasp2Params, write_final_state), 204);
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
            "ws_lambda_p;",
            "arrivals;",
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
            "state_segments;",
            "chunks_per_state_segment;",
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
        // S = 2 output segments, S_st = 8 state segments (the automatic plan at T_local = 8K):
        // ws_m 8 x 4 MiB, ws_p 2 x 4 MiB, then 128 tiles x 8 and x 2 Λ floats.
        assert_eq!(geometry::ws_p_offset(4, 16, 8, 128, 128), 33_554_432);
        assert_eq!(
            geometry::ws_lambda_offset(4, 16, 2, 8, 128, 128),
            41_943_040
        );
        assert_eq!(
            geometry::ws_lambda_p_offset(4, 16, 2, 8, 128, 128),
            41_947_136
        );
        assert_eq!(geometry::workspace_bytes(4, 16, 2, 8, 128, 128), 41_948_160);
        assert_eq!(geometry::arrivals_count(4, 16, 128), 128);
        // 3 heads x 64 x 64 floats per state; 3 Λ floats each rounded up to 16 bytes.
        assert_eq!(geometry::ws_lambda_offset(1, 3, 1, 1, 64, 64), 2 * 49_152);
        assert_eq!(
            geometry::workspace_bytes(1, 3, 1, 1, 64, 64),
            2 * 49_152 + 32
        );
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
    fn automatic_plans_split_the_states_pass_only_where_the_exchange_is_a_sizeable_share() {
        let l = Lasp2Layout {
            b: 4,
            h: 16,
            dk: 128,
            dv: 128,
        };
        let splits = |npes, t| Lasp2Tuning::automatic(npes, l, t).state_splits;
        assert_eq!(
            (splits(8, 8192), splits(4, 8192), splits(1, 8192)),
            (4, 4, 1)
        );
        assert_eq!(
            (splits(4, 32768), splits(32, 32768), splits(4, 131072)),
            (1, 4, 1)
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
    fn plans_nest_the_state_segments_in_the_output_segments() {
        let sms = 132;
        let plan = |bh, t, splits| {
            CallPlan::new(
                bh,
                t,
                128,
                sms,
                Lasp2Tuning {
                    ctas_per_sm: 2,
                    state_splits: splits,
                },
            )
        };
        // B=4, H=16, T=8K: 128 tiles, S = 2 for two CTAs per SM; 4 splits -> 16-chunk state
        // segments, S_st = 8: 1,024 states CTAs, four waves.
        let p = plan(64, 8192, 4);
        assert_eq!((p.segments, p.chunks_per_segment), (2, 64));
        assert_eq!((p.state_segments, p.chunks_per_state_segment), (8, 16));
        // B=1, H=16, T=32K: S = 8 of 64 chunks; one split leaves the states pass as it was.
        let p = plan(16, 32768, 1);
        assert_eq!((p.segments, p.state_segments), (8, 8));
        // Segments of 7 chunks split at most 4 ways: 7 is prime, so not at all; 6 chunks: 3 ways.
        assert_eq!(geometry::chunks_per_state_segment(7, 4), 7);
        assert_eq!(geometry::chunks_per_state_segment(6, 4), 2);
        assert_eq!(geometry::chunks_per_state_segment(1, 8), 1);
        // Every plan: state segments nest in the output segments, none is empty, and they cover
        // the shard exactly.
        for t in [1, 63, 64, 65, 1000, 8191, 8192, 40_000, 131_072] {
            for bh in [1, 3, 64, 256] {
                for splits in 1..=8 {
                    let p = plan(bh, t, splits);
                    let chunks = sd::num_chunks(t);
                    let split = p.chunks_per_segment / p.chunks_per_state_segment;
                    assert_eq!(p.chunks_per_segment % p.chunks_per_state_segment, 0);
                    assert!(split >= 1 && split <= splits as i32, "{t} {bh} {splits}");
                    assert!((p.state_segments - 1) * p.chunks_per_state_segment < chunks);
                    assert!(p.state_segments * p.chunks_per_state_segment >= chunks);
                    assert!((p.segments - 1) * p.chunks_per_segment < chunks);
                }
            }
        }
    }
}
