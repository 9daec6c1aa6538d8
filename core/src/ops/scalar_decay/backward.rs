//! Scalar-decay linear attention backward on one GPU: the gradients of
//! [`ScalarDecayForward`]'s `o` (and `ht`) with respect to
//! `q, k, v, g` (and `h0`).
//!
//! With `sigma = scale`, `G_t = a_0 + ... + a_t` and the reverse state
//! `dH_s = sigma sum_{t >= s} e^{G_t - G_s} q_t^T do_t + e^{G_{T-1} - G_s} dht`:
//! `dq_t = sigma S_t do_t^T`, `dk_s = v_s dH_s^T`, `dv_s = k_s dH_s`, `dh0 = e^{a_0} dH_0` and
//! `dg_t = e^{a_t} <S_{t-1}, dH_t>`, the pairs of tokens that straddle `t` (kernels/docs/maths.md,
//! "Scalar decay: backward"; the CPU reference `reference::scalar_decay::backward`).
//!
//! `dq` is the forward recurrence with `dO, V, K` in the roles of `Q, K, V` and `h0^T` as its start;
//! `dv` and `dk` are the same recurrence over the tokens from last to first (dH's suffix sums are
//! the reversed sequence's prefix sums) with `K, Q, dO` and `V, dO, Q`, started from `dht / sigma`
//! and its transpose. So the backward runs the forward's chunkwise kernels three times (the
//! reversed passes in their time-reversed build; the dq and dv passes also write their states at
//! every block boundary) and four kernels of its own for the start states and the gate gradient,
//! which meets the two directions' states at the block boundaries and sums each block's pairs
//! exactly (`kernels/cuda/scalar_decay/backward.cu`, formulas in
//! `kernels/cuda/include/lasp/scalar_decay/backward_params.h`, ported by [`geometry`]). The two
//! reversed passes share one states pass: in the same segments, the dk pass's segment states are
//! the transposes of the dv pass's.
//! Gradients are bf16 (`dq, dk, dv`) and fp32 (`dg, dh0`), as fla returns them.

use super::{
    check_args_of, ForwardArgs, ForwardShape, ScalarDecayForward, SegmentStarts, TensorChecks,
};
use crate::error::{Error, Result};
use crate::kernel::{width_index, Kernel, LaunchShape};
use crate::ops::{bf16, ranges_overlap, DeviceMut, DeviceRef, StreamOrder};
use crate::runtime::Runtime;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use lasp_shmem_kernels::instances;
use std::sync::Arc;

/// Launch and workspace formulas: the constants of `scalar_decay/backward_params.h` (generated from
/// it) and a port of its helpers (same integer types).
pub mod geometry {
    use crate::ops::scalar_decay::geometry as sd;
    use lasp_shmem_kernels::params as header;

    /// `LASP_SDB_STATE_TILE`: state_inputs transposes tiles of this many rows and columns.
    pub const STATE_TILE: i32 = header::LASP_SDB_STATE_TILE as i32;
    /// `LASP_SDB_STATE_THREADS`.
    pub const STATE_THREADS: u32 = header::LASP_SDB_STATE_THREADS;
    /// `LASP_SDB_TERM_THREADS`.
    pub const TERM_THREADS: u32 = header::LASP_SDB_TERM_THREADS;
    /// `LASP_SDB_GRAD_THREADS`: a thread per token of a block.
    pub const GRAD_THREADS: u32 = header::LASP_SDB_GRAD_THREADS;

    /// `lasp_sdb_state_inputs_grid`.
    pub const fn state_inputs_grid(b: i32, h: i32, dk: i32, dv: i32) -> (u32, u32, u32) {
        (
            ((dk / STATE_TILE) * (dv / STATE_TILE)) as u32,
            (b * h) as u32,
            1,
        )
    }

    /// `lasp_sdb_gate_terms_grid`: one CTA per (Dv tile, block, b*H+h).
    pub const fn gate_terms_grid(b: i32, t: i32, h: i32, dv: i32) -> (u32, u32, u32) {
        (
            sd::num_vtiles(dv) as u32,
            sd::num_blocks(t) as u32,
            (b * h) as u32,
        )
    }

    /// `lasp_sdb_gate_terms_smem_bytes`.
    pub const fn gate_terms_smem_bytes(dk: i32) -> u32 {
        let (c, dk, tv) = (sd::CHUNK as u32, dk as u32, sd::TILE_V as u32);
        let (qk, vtile, chunks) = (c * dk * 2, c * tv * 2, sd::BLOCK_CHUNKS as u32);
        chunks * (qk + vtile)
            + 2 * (qk + vtile)
            + 4 * dk * tv * 2
            + chunks * c * 4
            + 64
            + 4 * chunks * c * 4
            + chunks * c * 4
    }

    /// `lasp_sdb_gate_grad_grid`: one CTA per (block, b*H+h).
    pub const fn gate_grad_grid(b: i32, t: i32, h: i32) -> (u32, u32, u32) {
        (sd::num_blocks(t) as u32, (b * h) as u32, 1)
    }

    /// `lasp_sdb_state_bytes`: one fp32 `[B, H, Dk, Dv]` state.
    pub const fn state_bytes(b: i32, h: i32, dk: i32, dv: i32) -> u64 {
        b as u64 * h as u64 * dk as u64 * dv as u64 * 4
    }

    /// `lasp_sdb_block_states_bytes`: one state per head and block (as bf16 hi + lo).
    pub const fn block_states_bytes(b: i32, t: i32, h: i32, dk: i32, dv: i32) -> u64 {
        sd::num_blocks(t) as u64 * state_bytes(b, h, dk, dv)
    }

    /// `lasp_sdb_fwd_blocks_offset`: after four states.
    pub const fn fwd_blocks_offset(b: i32, h: i32, dk: i32, dv: i32) -> u64 {
        4 * state_bytes(b, h, dk, dv)
    }

    /// `lasp_sdb_rev_blocks_offset`.
    pub const fn rev_blocks_offset(b: i32, t: i32, h: i32, dk: i32, dv: i32) -> u64 {
        fwd_blocks_offset(b, h, dk, dv) + block_states_bytes(b, t, h, dk, dv)
    }

    /// `lasp_sdb_gate_rows_offset`.
    pub const fn gate_rows_offset(b: i32, t: i32, h: i32, dk: i32, dv: i32) -> u64 {
        rev_blocks_offset(b, t, h, dk, dv) + block_states_bytes(b, t, h, dk, dv)
    }

    /// `lasp_sdb_gate_z_offset`: after x_q, x_k, R and C of every token and Dv tile.
    pub const fn gate_z_offset(b: i32, t: i32, h: i32, dk: i32, dv: i32) -> u64 {
        let rows = sd::num_vtiles(dv) as u64 * 4 * b as u64 * h as u64 * t as u64 * 4;
        gate_rows_offset(b, t, h, dk, dv) + rows.div_ceil(16) * 16
    }

    /// `lasp_sdb_workspace_bytes`: after the blocks' parts of Z, per Dv tile.
    pub const fn workspace_bytes(b: i32, t: i32, h: i32, dk: i32, dv: i32) -> u64 {
        gate_z_offset(b, t, h, dk, dv)
            + sd::num_vtiles(dv) as u64 * b as u64 * h as u64 * sd::num_blocks(t) as u64 * 4
    }

    /// `lasp_sdb_dk_starts_offset`: the reversed passes' workspace holds the dv pass's starts
    /// at 0 (S - 1 states), then the dk pass's, then `rev_m` and the log-decays where the
    /// backward runs the reversed states pass itself.
    pub const fn dk_starts_offset(b: i32, h: i32, s: i32, dk: i32, dv: i32) -> u64 {
        (s as u64 - 1) * state_bytes(b, h, dk, dv)
    }

    /// `lasp_sdb_rev_m_offset`: also the bytes of the starts alone.
    pub const fn rev_m_offset(b: i32, h: i32, s: i32, dk: i32, dv: i32) -> u64 {
        2 * (s as u64 - 1) * state_bytes(b, h, dk, dv)
    }

    /// `lasp_sdb_rev_lambda_offset`.
    pub const fn rev_lambda_offset(b: i32, h: i32, s: i32, dk: i32, dv: i32) -> u64 {
        3 * (s as u64 - 1) * state_bytes(b, h, dk, dv)
    }

    /// `lasp_sdb_reversed_bytes` (0 when S == 1).
    pub const fn reversed_bytes(b: i32, h: i32, s: i32, dk: i32, dv: i32) -> u64 {
        rev_lambda_offset(b, h, s, dk, dv)
            + (b as u64 * h as u64 * (s as u64 - 1) * 4).div_ceil(16) * 16
    }
}

/// The C struct `lasp_sd_bwd_params`, generated from its header. Pointer fields hold device
/// addresses; NULL where a tensor is absent.
pub type BackwardParams = lasp_shmem_kernels::params::lasp_sd_bwd_params;

/// The tensors of one backward call: the forward's inputs, the output gradients, and the
/// gradients to write. All must live in the runtime's GPU context.
#[derive(Debug)]
pub struct BackwardArgs<'a> {
    /// The dimensions every tensor must agree with (Dk and Dv each 64 or 128).
    pub shape: ForwardShape,
    /// The forward's q, k `[B, T, H, Dk]` and v `[B, T, H, Dv]`, bf16, 16-byte aligned.
    pub q: DeviceRef<'a, bf16>,
    pub k: DeviceRef<'a, bf16>,
    pub v: DeviceRef<'a, bf16>,
    /// The forward's log-decays `[B, T, H]`, fp32, finite and `<= 0`.
    pub g: DeviceRef<'a, f32>,
    /// The forward's initial state `[B, H, Dk, Dv]` fp32, or `None` for zero.
    pub h0: Option<DeviceRef<'a, f32>>,
    /// The gradient of o `[B, T, H, Dv]`, bf16, 16-byte aligned.
    pub d_o: DeviceRef<'a, bf16>,
    /// The gradient of the final state `[B, H, Dk, Dv]` fp32, or `None` for zero.
    pub d_ht: Option<DeviceRef<'a, f32>>,
    /// Gradients of q, k `[B, T, H, Dk]` and v `[B, T, H, Dv]`, bf16; every element is written.
    pub dq: DeviceMut<'a, bf16>,
    pub dk: DeviceMut<'a, bf16>,
    pub dv: DeviceMut<'a, bf16>,
    /// Gradient of g `[B, T, H]`, fp32; every element is written.
    pub dg: DeviceMut<'a, f32>,
    /// Gradient of h0 `[B, H, Dk, Dv]` fp32, or `None` to skip it.
    pub dh0: Option<DeviceMut<'a, f32>>,
    /// The forward's `sigma`; `None` for `Dk^-1/2`.
    pub scale: Option<f32>,
}

impl<'a> BackwardArgs<'a> {
    /// The streams of the buffers the views come from ([`crate::ops`], "Ordering").
    pub(crate) fn homes(&self) -> [Option<&'a Arc<CudaStream>>; 12] {
        [
            self.q.home(),
            self.k.home(),
            self.v.home(),
            self.g.home(),
            self.h0.and_then(|h0| h0.home()),
            self.d_o.home(),
            self.d_ht.and_then(|d| d.home()),
            self.dq.home(),
            self.dk.home(),
            self.dv.home(),
            self.dg.home(),
            self.dh0.as_ref().and_then(DeviceMut::home),
        ]
    }
}

fn invalid(msg: String) -> Error {
    Error::InvalidArgument(msg)
}

/// Checks the shape, every tensor's length and alignment, and that no gradient overlaps an input
/// or another gradient; returns the scale.
pub(crate) fn check_backward_args(args: &BackwardArgs<'_>) -> Result<f32> {
    let s = args.shape;
    s.validate()?;
    if s.dv != 64 && s.dv != 128 {
        return Err(invalid(format!(
            "scalar-decay backward: Dv = {} is not supported (the dq and dk passes run the \
             forward kernels with Dv as their key width, built for 64 and 128); split v into \
             blocks of 64 or 128 columns and run one forward and backward per block",
            s.dv
        )));
    }
    // Lengths, alignment and the scale, as the forward checks them (o stands for dv here).
    // SAFETY: a second view of dv's memory, only read for its address and length by the check;
    // nothing is launched with it.
    let dv_for_check = unsafe { DeviceMut::from_raw(args.dv.addr(), args.dv.len()) };
    let scale = check_args_of(
        "scalar-decay backward",
        &ForwardArgs {
            shape: s,
            q: args.q,
            k: args.k,
            v: args.v,
            g: args.g,
            h0: args.h0,
            o: dv_for_check,
            ht: None,
            scale: args.scale,
        },
    )?;
    let checks = TensorChecks::new("scalar-decay backward", &s);
    checks.length("d_o", "[B, T, H, Dv]", args.d_o.len(), s.v_len())?;
    checks.length("dq", "[B, T, H, Dk]", args.dq.len(), s.qk_len())?;
    checks.length("dk", "[B, T, H, Dk]", args.dk.len(), s.qk_len())?;
    checks.length("dv", "[B, T, H, Dv]", args.dv.len(), s.v_len())?;
    checks.length("dg", "[B, T, H]", args.dg.len(), s.gate_len())?;
    if let Some(d_ht) = &args.d_ht {
        checks.length("d_ht", "[B, H, Dk, Dv]", d_ht.len(), s.state_len())?;
    }
    if let Some(dh0) = &args.dh0 {
        checks.length("dh0", "[B, H, Dk, Dv]", dh0.len(), s.state_len())?;
    }
    checks.aligned("d_o", args.d_o.addr(), 16)?;
    checks.aligned("dq", args.dq.addr(), 16)?;
    checks.aligned("dk", args.dk.addr(), 16)?;
    checks.aligned("dv", args.dv.addr(), 16)?;
    checks.aligned("dg", args.dg.addr(), 4)?;
    if let Some(d_ht) = &args.d_ht {
        checks.aligned("d_ht", d_ht.addr(), 8)?;
    }
    if let Some(dh0) = &args.dh0 {
        checks.aligned("dh0", dh0.addr(), 8)?;
    }
    let mut inputs = vec![
        ("q", args.q.byte_range()),
        ("k", args.k.byte_range()),
        ("v", args.v.byte_range()),
        ("g", args.g.byte_range()),
        ("d_o", args.d_o.byte_range()),
    ];
    inputs.extend(args.h0.map(|x| ("h0", x.byte_range())));
    inputs.extend(args.d_ht.map(|x| ("d_ht", x.byte_range())));
    let mut outputs = vec![
        ("dq", args.dq.byte_range()),
        ("dk", args.dk.byte_range()),
        ("dv", args.dv.byte_range()),
        ("dg", args.dg.byte_range()),
    ];
    outputs.extend(args.dh0.as_ref().map(|x| ("dh0", x.byte_range())));
    for (i, (out_name, out)) in outputs.iter().enumerate() {
        let others = inputs.iter().chain(&outputs[i + 1..]);
        if let Some((name, _)) = others.into_iter().find(|(_, r)| ranges_overlap(*out, *r)) {
            return Err(invalid(format!(
                "scalar-decay backward: {out_name} overlaps {name} (the passes read the inputs \
                 and write every gradient while other gradients are being computed); give \
                 {out_name} its own buffer"
            )));
        }
    }
    Ok(scale)
}

/// The reversed states pass's output, from a caller that ran it itself: the LASP-2 backward,
/// whose pass over the shard (for the state gradient it exchanges) walks the same tokens in the
/// same segments with `Q, dO` in the roles the dv pass gives them.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ReversedStates {
    /// Segments per sequence, S (the dv and dk passes run in as many).
    pub(crate) segments: u32,
    /// Device address of `R_s`, fp32 `[B*H][slots][Dk][Dv]` (segments s < S - 1 are read).
    pub(crate) m: u64,
    /// Device address of their log-decays `Λ_s`, fp32 `[B*H][slots]`.
    pub(crate) lambda: u64,
    /// Segment states per head in `m` and `lambda`: S - 1, or S where the last is there too.
    pub(crate) slots: u32,
}

/// The scalar-decay backward: the forward's kernels (in both time directions), the five kernels
/// of its own, and workspaces for the passes' start and end states, the per-token gate terms and
/// their block sums, and the reversed passes' segment states and starts.
///
/// Launches of one instance on different streams must be ordered by the caller (the workspaces
/// are shared). The workspace grows on demand (a context synchronisation then) and is freed when
/// the instance is dropped (after a context synchronisation).
pub struct ScalarDecayBackward {
    ctx: Arc<CudaContext>,
    forward: ScalarDecayForward,
    state_inputs: Kernel,
    reversed_starts: Kernel,
    /// Dk-indexed (`[64, 128]`).
    gate_terms: [Kernel; 2],
    gate_grad: Kernel,
    workspace: Option<CudaSlice<u8>>,
    /// The reversed passes' (geometry::reversed_bytes, the starts alone where the caller gives
    /// the reversed states; none while they run one segment).
    reversed: Option<CudaSlice<u8>>,
}

impl ScalarDecayBackward {
    /// Looks up the kernels in the runtime's module.
    pub fn new(runtime: &Runtime) -> Result<Self> {
        let module = runtime.module();
        let gate_terms = module.kernels_per_width(instances::SD_BWD_GATE_TERMS)?;
        for (kernel, dk) in gate_terms.iter().zip([64, 128]) {
            kernel.set_max_dynamic_shared_bytes(geometry::gate_terms_smem_bytes(dk))?;
        }
        Ok(ScalarDecayBackward {
            ctx: runtime.context().clone(),
            forward: ScalarDecayForward::new(runtime)?,
            state_inputs: module.kernel("lasp_sd_bwd_state_inputs")?,
            reversed_starts: module.kernel("lasp_sd_bwd_reversed_starts")?,
            gate_terms,
            gate_grad: module.kernel("lasp_sd_bwd_gate_grad")?,
            workspace: None,
            reversed: None,
        })
    }

    /// The forward whose kernels the passes run (its plan policy and overrides apply to them).
    pub fn forward_mut(&mut self) -> &mut ScalarDecayForward {
        &mut self.forward
    }

    /// Enqueues the backward on `stream` (a stream of the runtime's context). Everything is
    /// validated before the first launch; in debug builds each pass also checks the gates,
    /// which synchronises `stream`.
    pub fn launch(&mut self, stream: &Arc<CudaStream>, args: BackwardArgs<'_>) -> Result<()> {
        StreamOrder::around(stream, args.homes(), "scalar-decay backward", || {
            // SAFETY: no caller-computed states: every buffer the launches address is a view the
            // arguments check, or a workspace of self's.
            unsafe { self.launch_with(stream, args, None, || Ok(())) }
        })
    }

    /// [`ScalarDecayBackward::launch`] with `before_reversed_passes` enqueued after the dq pass
    /// and before anything reads `args.d_ht`: LASP-2 computes the shard's `d_ht` there, while
    /// the dq pass (which needs only `h0`) has kept the GPU busy. With `states`, the reversed
    /// passes start from the caller's reversed states pass instead of running one.
    ///
    /// # Safety
    /// Where `states` is given, its `m` and `lambda` must address live device buffers of the
    /// sizes it states (B, H, Dk, Dv of `args.shape`), written before this call on `stream` and
    /// not written again until the backward's kernels complete.
    pub(crate) unsafe fn launch_with(
        &mut self,
        stream: &Arc<CudaStream>,
        args: BackwardArgs<'_>,
        states: Option<ReversedStates>,
        before_reversed_passes: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        let scale = check_backward_args(&args)?;
        crate::ops::require_runtime_stream(stream, &self.ctx, "scalar-decay backward")?;
        let s = args.shape;
        let (b, t, h, dk, dv) = (s.b as i32, s.t as i32, s.h as i32, s.dk as i32, s.dv as i32);
        let rev_segments = match &states {
            Some(st) => st.segments,
            None => self.forward.reversed_segments(&s)?,
        };
        let rs = rev_segments as i32;
        let ws = crate::ops::ensure_workspace(
            &self.ctx,
            stream,
            &mut self.workspace,
            geometry::workspace_bytes(b, t, h, dk, dv),
            "scalar-decay backward",
        )?;
        // The starts, and the reversed states unless the caller gives its own.
        let reversed_bytes = match &states {
            Some(_) => geometry::rev_m_offset(b, h, rs, dk, dv),
            None => geometry::reversed_bytes(b, h, rs, dk, dv),
        };
        let reversed = crate::ops::ensure_workspace(
            &self.ctx,
            stream,
            &mut self.reversed,
            reversed_bytes,
            "scalar-decay backward",
        )?;
        let rev = if rs > 1 { reversed } else { 0 };
        let own_states = (
            rev + geometry::rev_m_offset(b, h, rs, dk, dv),
            rev + geometry::rev_lambda_offset(b, h, rs, dk, dv),
        );
        let (rev_m, rev_lambda, rev_slots) = match &states {
            Some(st) => (st.m, st.lambda, st.slots as i32),
            None => (own_states.0, own_states.1, rs - 1),
        };
        let state = geometry::state_bytes(b, h, dk, dv);
        let state_len = s.state_len();
        let part = |i: u64| ws + i * state;
        let params = BackwardParams {
            q: args.q.addr() as _,
            k: args.k.addr() as _,
            v: args.v.addr() as _,
            d_o: args.d_o.addr() as _,
            g: args.g.addr() as _,
            h0: args.h0.map_or(0, |x| x.addr()) as _,
            dht: args.d_ht.map_or(0, |x| x.addr()) as _,
            h0_t: part(0) as _,
            dht_scaled: part(1) as _,
            dht_t_scaled: part(2) as _,
            rev_m: rev_m as _,
            rev_lambda: rev_lambda as _,
            dv_starts: rev as _,
            dk_starts: (rev + geometry::dk_starts_offset(b, h, rs, dk, dv)) as _,
            dh0_scaled: part(3) as _,
            fwd_blocks: (ws + geometry::fwd_blocks_offset(b, h, dk, dv)) as _,
            rev_blocks: (ws + geometry::rev_blocks_offset(b, t, h, dk, dv)) as _,
            gate_rows: (ws + geometry::gate_rows_offset(b, t, h, dk, dv)) as _,
            gate_z: (ws + geometry::gate_z_offset(b, t, h, dk, dv)) as _,
            dg: args.dg.addr() as _,
            dh0: args.dh0.as_ref().map_or(0, |x| x.addr()) as _,
            B: b,
            T: t,
            H: h,
            Dk: dk,
            Dv: dv,
            scale,
            rev_segments: rs,
            rev_slots,
        };
        // Views of one workspace state each.
        // SAFETY: every address is a `state_len`-float part of the workspace (geometry), owned by
        // self and freed only after a context synchronisation; each part is written by one
        // kernel and read by later ones on this stream.
        let ws_ref = |addr: u64| unsafe { DeviceRef::<f32>::from_raw(addr, state_len) };
        // SAFETY: as for ws_ref.
        let ws_mut = |addr: u64| unsafe { DeviceMut::<f32>::from_raw(addr, state_len) };
        let transposed = ForwardShape {
            dk: s.dv,
            dv: s.dk,
            ..s
        };
        let has_h0 = args.h0.is_some();
        let has_dht = args.d_ht.is_some();
        let has_dh0 = args.dh0.is_some();
        let state_shape = LaunchShape {
            grid: geometry::state_inputs_grid(b, h, dk, dv),
            block: (geometry::STATE_THREADS, 1, 1),
            shared_bytes: 0,
        };

        self.ctx.bind_to_thread()?;
        if has_h0 {
            // SAFETY: BackwardParams is lasp_sd_bwd_params, generated from the header; the kernel
            // reads h0 (checked length) and writes h0^T, a workspace state owned by self.
            unsafe { self.state_inputs.launch(stream, state_shape, &params)? };
        }
        // dq: dO, V, K in the roles of Q, K, V from h0^T; it writes S^T at the block boundaries
        // (for dg).
        // SAFETY: fwd_blocks is the workspace part of geometry::block_states_bytes for this
        // shape (the dq pass's state, [Dv][Dk], has the same size), owned by self.
        unsafe {
            self.forward.launch_writing_block_states(
                stream,
                ForwardArgs {
                    shape: transposed,
                    q: args.d_o,
                    k: args.v,
                    v: args.k,
                    g: args.g,
                    h0: has_h0.then(|| ws_ref(params.h0_t as u64)),
                    o: args.dq,
                    ht: None,
                    scale: Some(scale),
                },
                params.fwd_blocks as u64,
            )?
        };
        before_reversed_passes()?;
        self.ctx.bind_to_thread()?;
        // dv, reversed: K, Q, dO from dht / sigma; its final state is dH_0 / sigma (for dh0).
        let dv_pass = ForwardArgs {
            shape: s,
            q: args.k,
            k: args.q,
            v: args.d_o,
            g: args.g,
            h0: has_dht.then(|| ws_ref(params.dht_scaled as u64)),
            o: args.dv,
            ht: has_dh0.then(|| ws_mut(params.dh0_scaled as u64)),
            scale: Some(scale),
        };
        // dk, reversed: V, dO, Q from dht^T / sigma.
        let dk_pass = ForwardArgs {
            shape: transposed,
            q: args.v,
            k: args.d_o,
            v: args.q,
            g: args.g,
            h0: has_dht.then(|| ws_ref(params.dht_t_scaled as u64)),
            o: args.dk,
            ht: None,
            scale: Some(scale),
        };
        // One reversed states pass (over Q and dO, in the dv pass's roles) serves both passes.
        if states.is_none() {
            // SAFETY: own_states are the reversed workspace's rev_m and rev_lambda, owned by
            // self and sized for rev_segments (geometry::reversed_bytes).
            unsafe {
                self.forward
                    .launch_reversed_states(stream, &dv_pass, rev_segments, own_states)?
            };
        }
        if has_dht || rev_segments > 1 {
            self.ctx.bind_to_thread()?;
            // SAFETY: as above; the kernel reads d_ht (checked length) and the reversed states
            // (the caller's, sized for `rev_segments` by its contract, or the workspace's) and
            // writes the starts, workspace parts owned by self.
            unsafe { self.reversed_starts.launch(stream, state_shape, &params)? };
        }
        // The dv pass also writes dH / sigma at the block boundaries (for dg).
        for (pass, prefixes, blocks) in [
            (
                dv_pass,
                params.dv_starts as u64,
                Some(params.rev_blocks as u64),
            ),
            (dk_pass, params.dk_starts as u64, None),
        ] {
            let starts = SegmentStarts {
                segments: rev_segments,
                prefixes,
            };
            // SAFETY: the starts are parts of the reversed workspace owned by self, sized for
            // rev_segments and written by reversed_starts just before on this stream; rev_blocks
            // is the workspace part of geometry::block_states_bytes, owned by self.
            unsafe {
                self.forward
                    .launch_reversed_output(stream, pass, starts, blocks)?
            };
        }
        self.ctx.bind_to_thread()?;
        // SAFETY: as above; gate_terms reads q, k, v, d_o, g, h0 / d_ht (checked lengths) and the
        // block states the dq and dv passes wrote before it on this stream, and writes the
        // workspace's gate rows and columns; gate_grad reads them (and the block states, g, the dv
        // pass's dH_0) and writes dg and dh0, whose lengths were checked.
        unsafe {
            self.gate_terms[width_index(s.dk)].launch(
                stream,
                LaunchShape {
                    grid: geometry::gate_terms_grid(b, t, h, dv),
                    block: (geometry::TERM_THREADS, 1, 1),
                    shared_bytes: geometry::gate_terms_smem_bytes(dk),
                },
                &params,
            )?;
            self.gate_grad.launch(
                stream,
                LaunchShape {
                    grid: geometry::gate_grad_grid(b, t, h),
                    block: (geometry::GRAD_THREADS, 1, 1),
                    shared_bytes: 0,
                },
                &params,
            )?;
        }
        Ok(())
    }
}

impl Drop for ScalarDecayBackward {
    fn drop(&mut self) {
        if self.workspace.is_some() {
            // Launches in flight may still use the workspace.
            let _ = self.ctx.synchronize();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geometry_values() {
        // A thread per token of a block of 4 chunks.
        assert_eq!(geometry::GRAD_THREADS, 256);
        assert_eq!(geometry::state_inputs_grid(4, 16, 128, 64), (8, 64, 1));
        // A CTA per (Dv tile, block of 4 chunks, head), for both gate kernels.
        assert_eq!(geometry::gate_terms_grid(1, 9, 3, 128), (2, 1, 3));
        assert_eq!(geometry::gate_terms_grid(4, 8192, 16, 64), (1, 32, 64));
        assert_eq!(geometry::gate_grad_grid(2, 1, 3), (1, 6, 1));
        assert_eq!(geometry::gate_grad_grid(2, 256, 3), (1, 6, 1));
        assert_eq!(geometry::gate_grad_grid(1, 257, 16), (2, 16, 1));
        assert_eq!(geometry::gate_grad_grid(1, 131072, 16), (512, 16, 1));
        // At Dk 128: K and V tiles of 4 chunks (16 + 8 KiB each), two Q and dO buffers, four state
        // tiles (16 KiB), the gates (1 KiB), the decays (64 B), four warps' column sums (4 KiB),
        // the column decays (1 KiB).
        assert_eq!(
            geometry::gate_terms_smem_bytes(128),
            4 * 24576 + 2 * 24576 + 4 * 16384 + 1024 + 64 + 4096 + 1024
        );
        assert_eq!(geometry::state_bytes(1, 2, 64, 128), 65536);
        // One block: a boundary state each way; x_q, x_k, R and C of every token; one Z part.
        let s = 16384u64;
        assert_eq!(geometry::fwd_blocks_offset(1, 1, 64, 64), 4 * s);
        assert_eq!(geometry::rev_blocks_offset(1, 3, 1, 64, 64), 5 * s);
        assert_eq!(geometry::gate_z_offset(1, 3, 1, 64, 64), 6 * s + 48);
        assert_eq!(geometry::workspace_bytes(1, 3, 1, 64, 64), 6 * s + 48 + 4);
        // T = 300: two blocks, two boundary states each way; Dv 128: two tiles.
        let s = 64u64 * 128 * 4;
        assert_eq!(geometry::rev_blocks_offset(1, 300, 1, 64, 128), 6 * s);
        assert_eq!(geometry::gate_rows_offset(1, 300, 1, 64, 128), 8 * s);
        assert_eq!(
            geometry::workspace_bytes(1, 300, 1, 64, 128),
            8 * s + 2 * 4 * 300 * 4 + 2 * 2 * 4
        );
        // The reversed passes' workspace at B=1, H=3, S=4, Dk=64, Dv=128: three segment starts per
        // head each way, three segment states, 9 log-decays (36 bytes, rounded up to 48).
        let state = 3 * 64 * 128 * 4;
        assert_eq!(geometry::dk_starts_offset(1, 3, 4, 64, 128), 3 * state);
        assert_eq!(geometry::rev_m_offset(1, 3, 4, 64, 128), 6 * state);
        assert_eq!(geometry::rev_lambda_offset(1, 3, 4, 64, 128), 9 * state);
        assert_eq!(geometry::reversed_bytes(1, 3, 4, 64, 128), 9 * state + 48);
        assert_eq!(geometry::reversed_bytes(2, 16, 1, 128, 128), 0);
    }
}
