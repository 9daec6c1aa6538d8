//! Scalar-decay linear attention forward on one GPU (simple GLA, RetNet, Lightning attention).
//!
//! Per batch `b` and head `h`, with row vectors and `sigma = scale`:
//! `S_t = e^{a_t} S_{t-1} + k_t^T v_t`, `o_t = sigma q_t S_t`, `a_t = g[b, t, h] <= 0`.
//! Tensors are in fla's layout: `q, k [B, T, H, Dk]`, `v, o [B, T, H, Dv]` bf16, `g [B, T, H]`
//! fp32 (natural-log decays), optional `h0` / `ht` fp32 `[B, H, Dk, Dv]`.
//!
//! ```no_run
//! use lasp_shmem::ops::scalar_decay::{ForwardArgs, ForwardShape, ScalarDecayForward};
//! use lasp_shmem::ops::{bf16, DeviceMut, DeviceRef};
//! use lasp_shmem::{Config, Runtime};
//!
//! let rt = Runtime::init(Config::default())?;
//! let stream = rt.stream().clone();
//! let shape = ForwardShape { b: 1, t: 4096, h: 16, dk: 128, dv: 128 };
//! let q = stream.alloc_zeros::<bf16>(shape.qk_len())?;
//! let k = stream.alloc_zeros::<bf16>(shape.qk_len())?;
//! let v = stream.alloc_zeros::<bf16>(shape.v_len())?;
//! let g = stream.alloc_zeros::<f32>(shape.gate_len())?;
//! let mut o = stream.alloc_zeros::<bf16>(shape.v_len())?;
//! let mut forward = ScalarDecayForward::new(&rt)?;
//! forward.launch(
//!     &stream,
//!     ForwardArgs {
//!         shape,
//!         q: DeviceRef::new(&q),
//!         k: DeviceRef::new(&k),
//!         v: DeviceRef::new(&v),
//!         g: DeviceRef::new(&g),
//!         h0: None,
//!         o: DeviceMut::new(&mut o),
//!         ht: None,
//!         scale: None, // Dk^-1/2
//!     },
//! )?;
//! stream.synchronize()?;
//! # drop(forward);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! The kernels are `kernels/cuda/scalar_decay_fwd.cu`; [`geometry`] mirrors the launch, shared
//! memory and workspace formulas of `kernels/cuda/include/lasp/scalar_decay_params.h` and
//! [`ScalarDecayParams`] its parameter struct (unit tests compare both with the header's text).
//! Call sequence (one stream): with `S > 1` segments per sequence, the states kernel (local end
//! state of every segment but the last), the fold (prefix state entering every segment), then
//! always the output kernel: one warpgroup per CTA at two CTAs per SM when `S > 1`, two
//! warpgroups (a state role one chunk ahead of an output role) at one CTA per SM when `S = 1`.

use super::{bf16, ranges_overlap, DeviceMut, DeviceRef};
use crate::error::{Error, Result};
use crate::kernel::{Kernel, LaunchShape};
use crate::runtime::Runtime;
use crate::tensor_map::{self, TensorMap};
use cudarc::driver::{result as cu, sys, CudaContext, CudaSlice, CudaStream};
use std::sync::Arc;

/// Launch geometry, shared memory and workspace formulas, a line-by-line port of the helpers in
/// `scalar_decay_params.h` (same integer types and rounding). Keep both in sync.
pub mod geometry {
    /// Tokens per chunk (`LASP_SD_CHUNK`).
    pub const CHUNK: i32 = 64;
    /// Dv columns per CTA (`LASP_SD_TILE_V`).
    pub const TILE_V: i32 = 64;
    /// Threads per CTA of the states and output kernels (`LASP_SD_THREADS`).
    pub const THREADS: u32 = 128;
    /// cp.async pipeline depth the kernels are built with (`LASP_SD_STAGES`, default of the header;
    /// the build passes no override).
    pub const STAGES: u32 = 2;
    /// Threads per CTA of the fold kernel (`LASP_SD_FOLD_THREADS`).
    pub const FOLD_THREADS: u32 = 256;
    /// Threads per CTA of the two-role output kernel (`LASP_SD_ROLES_THREADS`).
    pub const ROLES_THREADS: u32 = 288;
    /// The two-role output kernel's pipeline depth (`LASP_SD_ROLES_STAGES`).
    pub const ROLES_STAGES: u32 = 4;
    /// The states kernels' pipeline depth (`LASP_SD_STATES_STAGES`).
    pub const STATES_STAGES: u32 = 4;

    /// `lasp_sd_num_chunks`.
    pub const fn num_chunks(t: i32) -> i32 {
        (t + CHUNK - 1) / CHUNK
    }

    /// `lasp_sd_num_vtiles`.
    pub const fn num_vtiles(dv: i32) -> i32 {
        dv / TILE_V
    }

    /// `lasp_sd_num_segments`: segments per (b, h) so that the output kernel's CTAs fill
    /// `target_ctas` once, never a second partial wave, never an empty segment.
    pub const fn num_segments(b: i32, h: i32, t: i32, dv: i32, target_ctas: i32) -> i32 {
        let base = b * h * num_vtiles(dv);
        let nc = num_chunks(t);
        let mut s = target_ctas / base;
        if s < 1 {
            s = 1;
        }
        if s > nc {
            s = nc;
        }
        let cps = (nc + s - 1) / s;
        (nc + cps - 1) / cps
    }

    /// The CTAs the automatic plan fills (host policy, not in the header). Two 2-stage output
    /// CTAs fit an SM, but a second one pays only where one per SM already splits sequences into
    /// segments (the states pass is paid anyway); where one per SM keeps every sequence whole, a
    /// second would add a states pass. Measured on H200: B=1, H=16,
    /// T=32K 0.376 -> 0.336 ms and T=128K 1.478 -> 1.355 ms with two per SM; B=4, T=8K 0.275 ms
    /// with one, 0.315 ms with two.
    pub const fn target_ctas(b: i32, h: i32, t: i32, dv: i32, sm_count: i32) -> i32 {
        if num_segments(b, h, t, dv, sm_count) == 1 {
            sm_count
        } else {
            2 * sm_count
        }
    }

    /// `LASP_SD_BLOCK_CHUNKS`: chunks per block of the backward's gate gradient.
    pub const BLOCK_CHUNKS: i32 = 4;

    /// `lasp_sd_num_blocks`.
    pub const fn num_blocks(t: i32) -> i32 {
        (num_chunks(t) + BLOCK_CHUNKS - 1) / BLOCK_CHUNKS
    }

    /// `lasp_sd_chunks_per_segment`.
    pub const fn chunks_per_segment(t: i32, s: i32) -> i32 {
        let nc = num_chunks(t);
        (nc + s - 1) / s
    }

    /// `lasp_sd_output_smem_bytes`: STAGES x (Q, K, V tile, gates) + 2 bf16 state tiles.
    pub const fn output_smem_bytes(dk: i32) -> u32 {
        let (c, dk, tv) = (CHUNK as u32, dk as u32, TILE_V as u32);
        let stage = 2 * c * dk * 2 + c * tv * 2 + c * 4;
        STAGES * stage + 2 * dk * tv * 2
    }

    /// `lasp_sd_roles_smem_bytes`: ROLES_STAGES x (Q, K, V tile, gates, an 8-byte mbarrier) + 2
    /// bf16 state tiles.
    pub const fn roles_smem_bytes(dk: i32) -> u32 {
        let (c, dk, tv) = (CHUNK as u32, dk as u32, TILE_V as u32);
        let stage = 2 * c * dk * 2 + c * tv * 2 + c * 4;
        ROLES_STAGES * (stage + 8) + 2 * dk * tv * 2
    }

    /// `lasp_sd_states_smem_bytes`: STATES_STAGES x (K, V tile, gates).
    pub const fn states_smem_bytes(dk: i32) -> u32 {
        let (c, dk, tv) = (CHUNK as u32, dk as u32, TILE_V as u32);
        let stage = c * dk * 2 + c * tv * 2 + c * 4;
        STATES_STAGES * stage
    }

    /// `lasp_sd_output_grid`: one CTA per (Dv tile, segment, b*H+h).
    pub const fn output_grid(b: i32, h: i32, dv: i32, s: i32) -> (u32, u32, u32) {
        (num_vtiles(dv) as u32, s as u32, (b * h) as u32)
    }

    /// `lasp_sd_states_grid`: segments 0..S-2 only; launch only when S > 1.
    pub const fn states_grid(b: i32, h: i32, dv: i32, s: i32) -> (u32, u32, u32) {
        (num_vtiles(dv) as u32, (s - 1) as u32, (b * h) as u32)
    }

    /// `lasp_sd_fold_grid`: one thread per state element per b*H+h; launch only when S > 1.
    pub const fn fold_grid(b: i32, h: i32, dk: i32, dv: i32) -> (u32, u32, u32) {
        (
            ((dk * dv + FOLD_THREADS as i32 - 1) / FOLD_THREADS as i32) as u32,
            (b * h) as u32,
            1,
        )
    }

    /// `lasp_sd_ws_state_bytes`: bytes of `ws_m` (and of `ws_p`).
    pub const fn ws_state_bytes(b: i32, h: i32, s: i32, dk: i32, dv: i32) -> u64 {
        b as u64 * h as u64 * (s - 1) as u64 * dk as u64 * dv as u64 * 4
    }

    /// `lasp_sd_ws_p_offset`.
    pub const fn ws_p_offset(b: i32, h: i32, s: i32, dk: i32, dv: i32) -> u64 {
        ws_state_bytes(b, h, s, dk, dv)
    }

    /// `lasp_sd_ws_lambda_offset`.
    pub const fn ws_lambda_offset(b: i32, h: i32, s: i32, dk: i32, dv: i32) -> u64 {
        2 * ws_state_bytes(b, h, s, dk, dv)
    }

    /// `lasp_scalar_decay_workspace_bytes`: `B*H*(S-1)*(2*Dk*Dv + 1)*4`, zero when S == 1.
    pub const fn workspace_bytes(b: i32, h: i32, s: i32, dk: i32, dv: i32) -> u64 {
        2 * ws_state_bytes(b, h, s, dk, dv) + b as u64 * h as u64 * (s - 1) as u64 * 4
    }
}

/// The C struct `lasp_scalar_decay_params` (120 bytes), passed by value to the states, fold and
/// one-warpgroup output kernels; the two-role output kernel takes it inside [`RolesParams`].
/// Device pointers are raw addresses; NULL (0) where a tensor is absent.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ScalarDecayParams {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub g: u64,
    pub o: u64,
    pub h0: u64,
    pub ht: u64,
    pub ws_m: u64,
    pub ws_p: u64,
    pub ws_lambda: u64,
    pub block_states: u64,
    pub b: i32,
    pub t: i32,
    pub h: i32,
    pub dk: i32,
    pub dv: i32,
    pub num_segments: i32,
    pub chunks_per_segment: i32,
    pub scale: f32,
}

/// The C struct `lasp_sd_roles_params` (512 bytes): the forward's parameters and the tensor maps
/// the two-role output kernel copies q, k and v through.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct RolesParams {
    pub params: ScalarDecayParams,
    pub q: TensorMap,
    pub k: TensorMap,
    pub v: TensorMap,
}

impl RolesParams {
    /// `params` with the tensor maps of its q, k and v (`shape`'s dimensions).
    fn new(params: ScalarDecayParams, shape: &ForwardShape) -> Result<Self> {
        let (b, t, h) = (shape.b, shape.t, shape.h);
        Ok(RolesParams {
            params,
            q: tensor_map::bf16_token_tiles(
                "scalar-decay forward, q",
                params.q,
                [shape.dk, h, t, b],
            )?,
            k: tensor_map::bf16_token_tiles(
                "scalar-decay forward, k",
                params.k,
                [shape.dk, h, t, b],
            )?,
            v: tensor_map::bf16_token_tiles(
                "scalar-decay forward, v",
                params.v,
                [shape.dv, h, t, b],
            )?,
        })
    }
}

/// The largest T accepted: token indices plus a chunk stay within `i32` in the kernels.
pub const MAX_T: usize = (i32::MAX - geometry::CHUNK) as usize;
/// The largest B*H accepted (the kernels' grid z).
pub const MAX_BH: usize = 65_535;
/// The most segments per sequence a plan may use (the kernels' grid y).
const MAX_SEGMENTS: i32 = 65_535;

/// Problem dimensions of one call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ForwardShape {
    /// Batch B.
    pub b: usize,
    /// Tokens per sequence T.
    pub t: usize,
    /// Heads H.
    pub h: usize,
    /// Key/query width Dk: 64 or 128.
    pub dk: usize,
    /// Value width Dv: a positive multiple of 64.
    pub dv: usize,
}

impl From<crate::reference::Shape> for ForwardShape {
    fn from(s: crate::reference::Shape) -> Self {
        ForwardShape {
            b: s.b,
            t: s.t,
            h: s.h,
            dk: s.dk,
            dv: s.dv,
        }
    }
}

impl ForwardShape {
    /// Elements of q and k, `B*T*H*Dk`.
    pub fn qk_len(&self) -> usize {
        self.b * self.t * self.h * self.dk
    }

    /// Elements of v and o, `B*T*H*Dv`.
    pub fn v_len(&self) -> usize {
        self.b * self.t * self.h * self.dv
    }

    /// Elements of g, `B*T*H`.
    pub fn gate_len(&self) -> usize {
        self.b * self.t * self.h
    }

    /// Elements of h0 and ht, `B*H*Dk*Dv`.
    pub fn state_len(&self) -> usize {
        self.b * self.h * self.dk * self.dv
    }

    /// The default scale `Dk^-1/2` (fla's).
    pub fn default_scale(&self) -> f32 {
        (1.0 / (self.dk as f64).sqrt()) as f32
    }

    /// Checks that the kernels support the shape; the error says what to change.
    pub fn validate(&self) -> Result<()> {
        let ForwardShape { b, t, h, dk, dv } = *self;
        if b == 0 || t == 0 || h == 0 {
            return Err(invalid(format!(
                "scalar-decay forward: B, T and H must be at least 1 (got B={b}, T={t}, H={h}); \
                 skip the call when there is nothing to compute"
            )));
        }
        if dk != 64 && dk != 128 {
            let advice = if dk < 128 {
                format!(
                    "pad q and k with zero columns up to {}, which leaves o unchanged (ht gains \
                     zero rows), and pass scale = {dk}^-1/2 explicitly",
                    if dk < 64 { 64 } else { 128 }
                )
            } else {
                "split q and k into blocks of 128 columns, run one call per block with the same \
                 v, g and scale, and add the outputs (in fp32)"
                    .to_string()
            };
            return Err(invalid(format!(
                "scalar-decay forward: Dk = {dk} is not supported (the kernels are built for Dk 64 \
                 and 128); {advice}"
            )));
        }
        if dv == 0 || dv % 64 != 0 {
            return Err(invalid(format!(
                "scalar-decay forward: Dv = {dv} is not a positive multiple of 64; pad v with zero \
                 columns to the next multiple of 64 and drop the extra columns of o (and ht)"
            )));
        }
        let bh = b.saturating_mul(h);
        if bh > MAX_BH {
            return Err(invalid(format!(
                "scalar-decay forward: B*H = {b}*{h} exceeds {MAX_BH} (the kernels' grid limit); \
                 split the batch into calls of at most {} sequences",
                (MAX_BH / h).max(1)
            )));
        }
        if t > MAX_T {
            return Err(invalid(format!(
                "scalar-decay forward: T = {t} exceeds {MAX_T}; split the sequence and carry the \
                 state between the calls with ht -> h0"
            )));
        }
        // Every index the kernels form in i64 and the host in usize, and the CTA count formula's
        // B*H*Dv/64 in i32, must not overflow.
        let elems = [dk, dv]
            .iter()
            .map(|&d| bh.checked_mul(t).and_then(|x| x.checked_mul(d)))
            .collect::<Option<Vec<usize>>>()
            .filter(|v| v.iter().all(|&x| x <= i64::MAX as usize / 4));
        let ctas_ok = bh
            .checked_mul(dv / 64)
            .is_some_and(|x| x <= i32::MAX as usize);
        if elems.is_none() || !ctas_ok {
            return Err(invalid(format!(
                "scalar-decay forward: shape B={b}, T={t}, H={h}, Dk={dk}, Dv={dv} is too large \
                 to index; split it into several calls"
            )));
        }
        Ok(())
    }
}

fn invalid(msg: String) -> Error {
    Error::InvalidArgument(msg)
}

/// How one call runs: segments per sequence, the three launches and the workspace they need.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ForwardPlan {
    /// The shape the plan is for.
    pub shape: ForwardShape,
    /// Chunks of 64 tokens per sequence.
    pub num_chunks: u32,
    /// Segments per (b, h), S >= 1; none is empty.
    pub num_segments: u32,
    /// Chunks per segment (the last segment may hold fewer).
    pub chunks_per_segment: u32,
    /// Workspace bytes (0 when S == 1).
    pub workspace_bytes: u64,
    /// The states kernel's launch (only when S > 1).
    pub states: Option<LaunchShape>,
    /// The fold kernel's launch (only when S > 1).
    pub fold: Option<LaunchShape>,
    /// The output kernel's launch.
    pub output: LaunchShape,
    /// Whether the output kernel runs as two warpgroups and a loading warp
    /// (`lasp_scalar_decay_output_roles_dk*`): plans with one segment, where one CTA per SM keeps
    /// every sequence whole and a second warpgroup is the only other work its SM gets.
    pub output_roles: bool,
}

impl ForwardPlan {
    /// The plan for `shape` when the output kernel should fill `target_ctas` CTAs (SMs x CTAs
    /// per SM), or with `force_segments` segments per sequence (clamped to one chunk each at
    /// least, and rounded, as the header's formula does, so that no segment is empty: e.g. 5
    /// requested over 16 chunks gives 4 segments of 4).
    pub fn new(
        shape: &ForwardShape,
        target_ctas: u32,
        force_segments: Option<u32>,
    ) -> Result<Self> {
        shape.validate()?;
        let (b, t, h, dk, dv) = (
            shape.b as i32,
            shape.t as i32,
            shape.h as i32,
            shape.dk as i32,
            shape.dv as i32,
        );
        let nc = geometry::num_chunks(t);
        let s = match force_segments {
            None => geometry::num_segments(b, h, t, dv, target_ctas.min(i32::MAX as u32) as i32),
            Some(0) => {
                return Err(invalid(
                    "scalar-decay forward: a forced segment count must be at least 1 (use None \
                     for the automatic plan)"
                        .into(),
                ))
            }
            Some(want) => {
                let s = (want.min(nc as u32)) as i32;
                let cps = (nc + s - 1) / s;
                (nc + cps - 1) / cps
            }
        };
        if s > MAX_SEGMENTS {
            return Err(invalid(format!(
                "scalar-decay forward: {s} segments per sequence exceed {MAX_SEGMENTS} (the \
                 kernels' grid y limit); force fewer segments or lower the target CTA count"
            )));
        }
        let cps = geometry::chunks_per_segment(t, s);
        let many = s > 1;
        // One segment: every sequence is whole at one CTA per SM, where the two-role kernel wins.
        let (output_threads, output_smem) = if many {
            (geometry::THREADS, geometry::output_smem_bytes(dk))
        } else {
            (geometry::ROLES_THREADS, geometry::roles_smem_bytes(dk))
        };
        Ok(ForwardPlan {
            shape: *shape,
            num_chunks: nc as u32,
            num_segments: s as u32,
            chunks_per_segment: cps as u32,
            workspace_bytes: geometry::workspace_bytes(b, h, s, dk, dv),
            states: many.then_some(LaunchShape {
                grid: geometry::states_grid(b, h, dv, s),
                block: (geometry::THREADS, 1, 1),
                shared_bytes: geometry::states_smem_bytes(dk),
            }),
            fold: many.then_some(LaunchShape {
                grid: geometry::fold_grid(b, h, dk, dv),
                block: (geometry::FOLD_THREADS, 1, 1),
                shared_bytes: 0,
            }),
            output: LaunchShape {
                grid: geometry::output_grid(b, h, dv, s),
                block: (output_threads, 1, 1),
                shared_bytes: output_smem,
            },
            output_roles: !many,
        })
    }

    /// Which output kernel the plan launches, for reports: "two-role" or "one-warpgroup".
    pub fn output_kind(&self) -> &'static str {
        if self.output_roles {
            "two-role"
        } else {
            "one-warpgroup"
        }
    }

    /// The same plan with the one-warpgroup output kernel (for GPUs whose blocks cannot have the
    /// two-role kernel's shared memory).
    pub fn with_one_warpgroup_output(self) -> Self {
        ForwardPlan {
            output: LaunchShape {
                block: (geometry::THREADS, 1, 1),
                shared_bytes: geometry::output_smem_bytes(self.shape.dk as i32),
                ..self.output
            },
            output_roles: false,
            ..self
        }
    }

    /// Byte offsets of `ws_p` and `ws_lambda` in the workspace (`ws_m` is at 0).
    pub fn workspace_offsets(&self) -> (u64, u64) {
        let s = &self.shape;
        let (b, h, n, dk, dv) = (
            s.b as i32,
            s.h as i32,
            self.num_segments as i32,
            s.dk as i32,
            s.dv as i32,
        );
        (
            geometry::ws_p_offset(b, h, n, dk, dv),
            geometry::ws_lambda_offset(b, h, n, dk, dv),
        )
    }
}

/// The tensors of one call. Views come from cudarc buffers ([`DeviceRef::new`],
/// [`DeviceMut::new`]) or raw pointers; all must live in the runtime's GPU context.
#[derive(Debug)]
pub struct ForwardArgs<'a> {
    /// The dimensions every tensor must agree with.
    pub shape: ForwardShape,
    /// Queries `[B, T, H, Dk]`, bf16, contiguous, 16-byte aligned.
    pub q: DeviceRef<'a, bf16>,
    /// Keys `[B, T, H, Dk]`, bf16, contiguous, 16-byte aligned.
    pub k: DeviceRef<'a, bf16>,
    /// Values `[B, T, H, Dv]`, bf16, contiguous, 16-byte aligned.
    pub v: DeviceRef<'a, bf16>,
    /// Log-decays `[B, T, H]`, fp32, finite and `<= 0` (the caller's contract: checked in debug
    /// builds, and on request by [`ScalarDecayForward::validate_gates`]).
    pub g: DeviceRef<'a, f32>,
    /// Initial state `[B, H, Dk, Dv]` fp32, 8-byte aligned; `None` for zero.
    pub h0: Option<DeviceRef<'a, f32>>,
    /// Output `[B, T, H, Dv]`, bf16, 16-byte aligned; every element is written.
    pub o: DeviceMut<'a, bf16>,
    /// Final state `[B, H, Dk, Dv]` fp32, 8-byte aligned; `None` to skip it. Must not overlap h0.
    pub ht: Option<DeviceMut<'a, f32>>,
    /// `sigma` in `o_t = sigma q_t S_t`; `None` for `Dk^-1/2`.
    pub scale: Option<f32>,
}

/// Checks lengths, alignment, scale and overlaps against the (validated) shape; returns the
/// scale to use.
pub(crate) fn check_args(args: &ForwardArgs<'_>) -> Result<f32> {
    check_args_of("scalar-decay forward", args)
}

/// The length and alignment checks of one call's tensors; `op` names the operation in errors.
pub(crate) struct TensorChecks<'a> {
    op: &'a str,
    dims: String,
}

impl<'a> TensorChecks<'a> {
    pub(crate) fn new(op: &'a str, s: &ForwardShape) -> Self {
        let dims = format!("B={}, T={}, H={}, Dk={}, Dv={}", s.b, s.t, s.h, s.dk, s.dv);
        TensorChecks { op, dims }
    }

    /// `got` elements where `layout` needs `want`.
    pub(crate) fn length(&self, name: &str, layout: &str, got: usize, want: usize) -> Result<()> {
        if got == want {
            return Ok(());
        }
        Err(invalid(format!(
            "{}: {name} has {got} elements but {layout} with {} needs {want}; pass the shape the \
             tensors were made with (fla layout, contiguous)",
            self.op, self.dims
        )))
    }

    /// `addr` must be a multiple of `to` bytes.
    pub(crate) fn aligned(&self, name: &str, addr: u64, to: u64) -> Result<()> {
        if addr % to == 0 {
            return Ok(());
        }
        Err(invalid(format!(
            "{}: {name} starts at device address {addr:#x}, which is not {to}-byte aligned; pass \
             a tensor whose data starts on a {to}-byte boundary (e.g. a .contiguous() copy instead \
             of a view at an odd offset)",
            self.op
        )))
    }
}

/// [`check_args`] with `op` naming the operation in errors (the backward checks its inputs so).
pub(crate) fn check_args_of(op: &str, args: &ForwardArgs<'_>) -> Result<f32> {
    let s = &args.shape;
    let checks = TensorChecks::new(op, s);
    let length =
        |name: &str, layout: &str, got: usize, want: usize| checks.length(name, layout, got, want);
    let aligned = |name: &str, addr: u64, to: u64| checks.aligned(name, addr, to);
    length("q", "[B, T, H, Dk]", args.q.len(), s.qk_len())?;
    length("k", "[B, T, H, Dk]", args.k.len(), s.qk_len())?;
    length("v", "[B, T, H, Dv]", args.v.len(), s.v_len())?;
    length("g", "[B, T, H]", args.g.len(), s.gate_len())?;
    length("o", "[B, T, H, Dv]", args.o.len(), s.v_len())?;
    if let Some(h0) = &args.h0 {
        length("h0", "[B, H, Dk, Dv]", h0.len(), s.state_len())?;
    }
    if let Some(ht) = &args.ht {
        length("ht", "[B, H, Dk, Dv]", ht.len(), s.state_len())?;
    }
    aligned("q", args.q.addr(), 16)?;
    aligned("k", args.k.addr(), 16)?;
    aligned("v", args.v.addr(), 16)?;
    aligned("o", args.o.addr(), 16)?;
    aligned("g", args.g.addr(), 4)?;
    if let Some(h0) = &args.h0 {
        aligned("h0", h0.addr(), 8)?;
    }
    if let Some(ht) = &args.ht {
        aligned("ht", ht.addr(), 8)?;
    }
    let scale = args.scale.unwrap_or_else(|| s.default_scale());
    if !(scale.is_finite() && scale > 0.0) {
        return Err(invalid(format!(
            "{op}: scale = {scale} must be finite and > 0; pass None for the default \
             Dk^-1/2"
        )));
    }
    let mut inputs = vec![
        ("q", args.q.byte_range()),
        ("k", args.k.byte_range()),
        ("v", args.v.byte_range()),
        ("g", args.g.byte_range()),
    ];
    if let Some(h0) = &args.h0 {
        inputs.push(("h0", h0.byte_range()));
    }
    let mut outputs = vec![("o", args.o.byte_range())];
    if let Some(ht) = &args.ht {
        outputs.push(("ht", ht.byte_range()));
    }
    for (out_name, out) in &outputs {
        for (in_name, input) in &inputs {
            if ranges_overlap(*out, *input) {
                return Err(invalid(format!(
                    "{op}: output {out_name} overlaps input {in_name} (the kernels \
                     read {in_name} while other CTAs write {out_name}); give {out_name} its own \
                     buffer{}",
                    if *out_name == "ht" && *in_name == "h0" {
                        " (copy ht into h0 after the call if you want it in place)"
                    } else {
                        ""
                    }
                )));
            }
        }
    }
    if outputs.len() == 2 && ranges_overlap(outputs[0].1, outputs[1].1) {
        return Err(invalid(format!(
            "{op}: o and ht overlap; give each its own buffer"
        )));
    }
    Ok(scale)
}

/// The first gate that breaks the contract (finite and `<= 0`), as an error naming `[b, t, h]`.
pub fn check_gate_values(g: &[f32], shape: &ForwardShape) -> Result<()> {
    let Some(pos) = g.iter().position(|x| !(x.is_finite() && *x <= 0.0)) else {
        return Ok(());
    };
    let x = g[pos];
    let (h, bt) = (pos % shape.h.max(1), pos / shape.h.max(1));
    let (t, b) = (bt % shape.t.max(1), bt / shape.t.max(1));
    let what = if x.is_finite() {
        "positive: gates are natural-log decays a_t <= 0; pass log(decay), e.g. logsigmoid(x) \
         or -softplus(x), not the decay factor itself"
            .to_string()
    } else {
        format!(
            "not finite ({x}): find where the gate computation produced it (log(0) = -inf from a \
             zero decay: clamp the decay away from 0, e.g. logsigmoid instead of log(sigmoid))"
        )
    };
    Err(invalid(format!(
        "scalar-decay forward: gate g[b={b}, t={t}, h={h}] (flat index {pos}) = {x} is {what}"
    )))
}

/// A timed variant of the output kernel, for [`ScalarDecayForward::launch_output_probe`].
///
/// A measurement tool (`forward_bench --probes`; `kernels/docs/scalar-decay.md`, "Probes"),
/// not an API for users: only [`OutputProbe::Output`] computes the forward's output, and only
/// after a full [`ScalarDecayForward::launch`] of the same inputs has left the segment prefixes in
/// the workspace. Every variant runs with the output kernel's grid, block, shared memory and
/// params; the probe kernels are `lasp::sd::Probe` in `scalar_decay.cuh`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OutputProbe {
    /// The production output kernel alone: the forward without its states pass and fold.
    Output,
    /// The output kernel's loads (every chunk's q, k, v, g through the same cp.async pipeline)
    /// and O stores, without its math.
    Memory,
    /// The output kernel's math with no HBM traffic for inputs: each pipeline stage is loaded
    /// once and reused for every chunk; O stores go to the segment's first chunk (L2).
    Compute,
    /// [`OutputProbe::Compute`] without the gate exponentials, causal mask and scalings.
    NoExp,
}

impl OutputProbe {
    /// Every variant, the production kernel first.
    pub const ALL: [OutputProbe; 4] = [
        OutputProbe::Output,
        OutputProbe::Memory,
        OutputProbe::Compute,
        OutputProbe::NoExp,
    ];

    /// A short name for reports (`output`, `probe_memory`, `probe_compute`, `probe_no_exp`).
    pub fn label(self) -> &'static str {
        match self {
            OutputProbe::Output => "output",
            OutputProbe::Memory => "probe_memory",
            OutputProbe::Compute => "probe_compute",
            OutputProbe::NoExp => "probe_no_exp",
        }
    }

    /// The probe kernels, indexed by Dk `[64, 128]` (`None` for the production kernel).
    fn probe_kernel_names(self) -> Option<[&'static str; 2]> {
        match self {
            OutputProbe::Output => None,
            OutputProbe::Memory => Some([
                "lasp_scalar_decay_output_dk64_probe_memory",
                "lasp_scalar_decay_output_dk128_probe_memory",
            ]),
            OutputProbe::Compute => Some([
                "lasp_scalar_decay_output_dk64_probe_compute",
                "lasp_scalar_decay_output_dk128_probe_compute",
            ]),
            OutputProbe::NoExp => Some([
                "lasp_scalar_decay_output_dk64_probe_no_exp",
                "lasp_scalar_decay_output_dk128_probe_no_exp",
            ]),
        }
    }
}

/// The scalar-decay forward: its kernels, its launch plan policy and its workspace.
///
/// One instance may be launched many times on one stream. Its workspace is shared by the
/// launches: launches of one instance on different streams must be ordered by the caller (or
/// use one instance per stream). The workspace grows on demand (a context synchronisation then)
/// and is freed when the instance is dropped (after a context synchronisation).
pub struct ScalarDecayForward {
    runtime: Runtime,
    ctx: Arc<CudaContext>,
    /// Indexed by Dk: [64, 128].
    states: [Kernel; 2],
    output: [Kernel; 2],
    /// The time-reversed states and output kernels of the backward's dk and dv passes (Dk-indexed).
    states_reversed: [Kernel; 2],
    output_reversed: [Kernel; 2],
    /// The output kernels that also write the states at the block boundaries, for the backward's
    /// dq pass (in order; two-role where `output_roles` is there) and dv pass (reversed).
    output_block_states: [Kernel; 2],
    output_roles_block_states: Option<[Kernel; 2]>,
    output_reversed_block_states: [Kernel; 2],
    /// The two-role output kernels, for plans with one segment (None where this GPU has no Tensor
    /// Memory Accelerator or cannot give a block their shared memory: such plans use `output`).
    output_roles: Option<[Kernel; 2]>,
    fold: Kernel,
    /// The probe kernels (Memory, Compute, NoExp; each indexed by Dk), looked up on the first
    /// [`ScalarDecayForward::launch_output_probe`].
    probes: Option<[[Kernel; 2]; 3]>,
    sm_count: u32,
    /// Override of the plan's CTA target (None: geometry::target_ctas).
    target_ctas: Option<u32>,
    force_segments: Option<u32>,
    /// False: plans with one segment use the one-warpgroup output kernel too (tests, tuning).
    two_role_output: bool,
    workspace: Option<CudaSlice<u8>>,
}

/// Where a reversed pass's segments start when the caller computed the starts
/// ([`ScalarDecayForward::launch_reversed_output`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct SegmentStarts {
    /// Segments per sequence, S.
    pub(crate) segments: u32,
    /// Device address of the starts of segments 1 .. S-1, fp32 `[B*H][S-1][Dk][Dv]` (Dk, Dv of
    /// the pass's shape); unused (0 is fine) when S = 1.
    pub(crate) prefixes: u64,
}

fn dk_index(dk: usize) -> usize {
    usize::from(dk == 128)
}

/// An output-kernel launch with the parameters of its kind.
enum OutputLaunch {
    TwoRole(Kernel, LaunchShape, Box<RolesParams>),
    OneWarpgroup(Kernel, LaunchShape, ScalarDecayParams),
}

impl OutputLaunch {
    /// # Safety
    /// As for [`Kernel::launch`]: the parameters describe tensors that stay valid, and are used
    /// by nothing else in a conflicting way, until the kernel completes.
    unsafe fn enqueue(&self, stream: &CudaStream) -> Result<()> {
        // SAFETY: each kernel gets the parameter struct of its C signature; the caller's contract
        // covers the tensors.
        unsafe {
            match self {
                OutputLaunch::TwoRole(kernel, shape, params) => {
                    kernel.launch(stream, *shape, params.as_ref())
                }
                OutputLaunch::OneWarpgroup(kernel, shape, params) => {
                    kernel.launch(stream, *shape, params)
                }
            }
        }
    }
}

/// The Dk-indexed (`[64, 128]`) states and output kernels of a chunkwise family (the single-GPU
/// forward, LASP-2), with their dynamic shared-memory limits raised to what the plans launch with;
/// an error if this GPU cannot give a block that much shared memory.
pub(crate) fn segment_kernels(
    runtime: &Runtime,
    states: [&'static str; 2],
    output: [&'static str; 2],
) -> Result<([Kernel; 2], [Kernel; 2])> {
    let ctx = runtime.context();
    ctx.bind_to_thread()?;
    let optin = ctx
        .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?
        as u32;
    let need = geometry::output_smem_bytes(128);
    if optin < need {
        return Err(Error::Launch(format!(
            "the chunkwise kernels need {need} bytes of shared memory per block but this GPU ({}) \
             allows {optin}; run on an H100/H200 (sm_90)",
            ctx.name().unwrap_or_default()
        )));
    }
    let module = runtime.module();
    let states = [module.kernel(states[0])?, module.kernel(states[1])?];
    let output = [module.kernel(output[0])?, module.kernel(output[1])?];
    for (i, dk) in [64, 128].into_iter().enumerate() {
        states[i].set_max_dynamic_shared_bytes(geometry::states_smem_bytes(dk))?;
        output[i].set_max_dynamic_shared_bytes(geometry::output_smem_bytes(dk))?;
    }
    Ok((states, output))
}

impl ScalarDecayForward {
    /// Looks up the kernels in the runtime's module and raises their shared-memory limits.
    pub fn new(runtime: &Runtime) -> Result<Self> {
        let ctx = runtime.context().clone();
        let (states, output) = segment_kernels(
            runtime,
            [
                "lasp_scalar_decay_states_dk64",
                "lasp_scalar_decay_states_dk128",
            ],
            [
                "lasp_scalar_decay_output_dk64",
                "lasp_scalar_decay_output_dk128",
            ],
        )?;
        let (states_reversed, output_reversed) = segment_kernels(
            runtime,
            [
                "lasp_scalar_decay_states_reversed_dk64",
                "lasp_scalar_decay_states_reversed_dk128",
            ],
            [
                "lasp_scalar_decay_output_reversed_dk64",
                "lasp_scalar_decay_output_reversed_dk128",
            ],
        )?;
        let (_, output_block_states) = segment_kernels(
            runtime,
            [
                "lasp_scalar_decay_states_dk64",
                "lasp_scalar_decay_states_dk128",
            ],
            [
                "lasp_scalar_decay_output_block_states_dk64",
                "lasp_scalar_decay_output_block_states_dk128",
            ],
        )?;
        let (_, output_reversed_block_states) = segment_kernels(
            runtime,
            [
                "lasp_scalar_decay_states_reversed_dk64",
                "lasp_scalar_decay_states_reversed_dk128",
            ],
            [
                "lasp_scalar_decay_output_reversed_block_states_dk64",
                "lasp_scalar_decay_output_reversed_block_states_dk128",
            ],
        )?;
        let module = runtime.module();
        let optin = ctx.attribute(
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
        )? as u32;
        let (major, _) = ctx.compute_capability()?;
        let roles = |names: [&'static str; 2]| -> Result<[Kernel; 2]> {
            let kernels = [module.kernel(names[0])?, module.kernel(names[1])?];
            for (i, dk) in [64, 128].into_iter().enumerate() {
                kernels[i].set_max_dynamic_shared_bytes(geometry::roles_smem_bytes(dk))?;
            }
            Ok(kernels)
        };
        let (output_roles, output_roles_block_states) =
            if major >= 9 && optin >= geometry::roles_smem_bytes(128) {
                (
                    Some(roles([
                        "lasp_scalar_decay_output_roles_dk64",
                        "lasp_scalar_decay_output_roles_dk128",
                    ])?),
                    Some(roles([
                        "lasp_scalar_decay_output_roles_block_states_dk64",
                        "lasp_scalar_decay_output_roles_block_states_dk128",
                    ])?),
                )
            } else {
                (None, None)
            };
        let fold = module.kernel("lasp_scalar_decay_fold")?;
        let sm_count = super::sm_count(&ctx)?;
        Ok(ScalarDecayForward {
            runtime: runtime.clone(),
            ctx,
            states,
            output,
            states_reversed,
            output_reversed,
            output_block_states,
            output_roles_block_states,
            output_reversed_block_states,
            output_roles,
            fold,
            probes: None,
            sm_count,
            target_ctas: None,
            force_segments: None,
            two_role_output: true,
            workspace: None,
        })
    }

    /// The GPU's multiprocessor count.
    pub fn sm_count(&self) -> u32 {
        self.sm_count
    }

    /// The CTA count the plan of `shape` fills: the override, else [`geometry::target_ctas`].
    pub fn target_ctas(&self, shape: &ForwardShape) -> u32 {
        self.target_ctas.unwrap_or_else(|| {
            geometry::target_ctas(
                shape.b as i32,
                shape.h as i32,
                shape.t.min(i32::MAX as usize) as i32,
                shape.dv as i32,
                self.sm_count as i32,
            )
            .max(1) as u32
        })
    }

    /// Overrides the CTA count the automatic plan fills (tuning). At least 1.
    pub fn set_target_ctas(&mut self, ctas: u32) -> Result<()> {
        if ctas == 0 {
            return Err(invalid(
                "scalar-decay forward: target CTAs must be at least 1 (default: the SM count)"
                    .into(),
            ));
        }
        self.target_ctas = Some(ctas);
        Ok(())
    }

    /// Forces the number of segments per sequence (tests and tuning; see [`ForwardPlan::new`]
    /// for the rounding), or restores the automatic plan with `None`.
    pub fn set_num_segments(&mut self, segments: Option<u32>) -> Result<()> {
        if segments == Some(0) {
            return Err(invalid(
                "scalar-decay forward: a forced segment count must be at least 1 (use None for \
                 the automatic plan)"
                    .into(),
            ));
        }
        self.force_segments = segments;
        Ok(())
    }

    /// Whether plans with one segment run the two-role output kernel (the default) or the
    /// one-warpgroup one (tests compare the two; both give the same bits).
    pub fn set_two_role_output(&mut self, enabled: bool) {
        self.two_role_output = enabled;
    }

    /// The plan a launch of `shape` would use (validates the shape).
    pub fn plan(&self, shape: &ForwardShape) -> Result<ForwardPlan> {
        let plan = ForwardPlan::new(shape, self.target_ctas(shape), self.force_segments)?;
        Ok(if self.output_roles.is_some() && self.two_role_output {
            plan
        } else {
            plan.with_one_warpgroup_output()
        })
    }

    /// Copies `g` to the host (synchronising `stream`) and checks that every gate is finite and
    /// `<= 0`; the error names the first offending `[b, t, h]`.
    pub fn validate_gates(
        &self,
        stream: &Arc<CudaStream>,
        g: DeviceRef<'_, f32>,
        shape: &ForwardShape,
    ) -> Result<()> {
        if g.len() != shape.gate_len() {
            return Err(invalid(format!(
                "scalar-decay forward: g has {} elements but [B, T, H] = [{}, {}, {}] needs {}",
                g.len(),
                shape.b,
                shape.t,
                shape.h,
                shape.gate_len()
            )));
        }
        let mut host = vec![0f32; g.len()];
        self.ctx.bind_to_thread()?;
        // SAFETY: g is a live device allocation of at least g.len() f32 (DeviceRef's contract);
        // the copy completes before `host` is read (stream synchronised below).
        unsafe { cu::memcpy_dtoh_async(&mut host, g.addr(), stream.cu_stream()) }?;
        stream.synchronize()?;
        check_gate_values(&host, shape)
    }

    /// Validates a call (shape, tensors, stream, in debug builds the gates), makes the workspace
    /// large enough for `plan`, and returns it with the kernels' params.
    fn prepare_plan(
        &mut self,
        stream: &Arc<CudaStream>,
        args: &ForwardArgs<'_>,
        plan: ForwardPlan,
    ) -> Result<(ForwardPlan, ScalarDecayParams)> {
        let scale = check_args(args)?;
        if !Arc::ptr_eq(stream.context(), &self.ctx) {
            return Err(invalid(
                "scalar-decay forward: the stream belongs to another CUDA context; launch on a \
                 stream of the runtime's GPU (runtime.stream() or runtime.context().new_stream())"
                    .into(),
            ));
        }
        if cfg!(debug_assertions) {
            self.validate_gates(stream, args.g, &args.shape)?;
        }
        super::ensure_workspace(
            &self.ctx,
            stream,
            &mut self.workspace,
            plan.workspace_bytes,
            "scalar-decay forward",
        )?;
        let (ws_m, ws_p, ws_lambda) = match (&self.workspace, plan.num_segments > 1) {
            (Some(ws), true) => {
                let (base, _no_events) = cudarc::driver::DevicePtr::device_ptr(ws, stream);
                let (p, lambda) = plan.workspace_offsets();
                (base, base + p, base + lambda)
            }
            _ => (0, 0, 0),
        };
        let s = &args.shape;
        let params = ScalarDecayParams {
            q: args.q.addr(),
            k: args.k.addr(),
            v: args.v.addr(),
            g: args.g.addr(),
            o: args.o.addr(),
            h0: args.h0.map_or(0, |x| x.addr()),
            ht: args.ht.as_ref().map_or(0, |x| x.addr()),
            ws_m,
            ws_p,
            ws_lambda,
            block_states: 0,
            b: s.b as i32,
            t: s.t as i32,
            h: s.h as i32,
            dk: s.dk as i32,
            dv: s.dv as i32,
            num_segments: plan.num_segments as i32,
            chunks_per_segment: plan.chunks_per_segment as i32,
            scale,
        };
        self.ctx.bind_to_thread()?;
        Ok((plan, params))
    }

    /// Enqueues the forward on `stream` (a stream of the runtime's context) and returns the plan
    /// it used. Everything is validated before the first launch; in debug builds the gates are
    /// checked too, which synchronises `stream`.
    pub fn launch(
        &mut self,
        stream: &Arc<CudaStream>,
        args: ForwardArgs<'_>,
    ) -> Result<ForwardPlan> {
        let plan = self.plan(&args.shape)?;
        let (plan, params) = self.prepare_plan(stream, &args, plan)?;
        let output = self.output_launch(&plan, &params)?;
        // SAFETY: ScalarDecayParams has the C layout of lasp_scalar_decay_params (tests below);
        // RolesParams that of lasp_sd_roles_params, with maps of the same tensors; the shape is
        // supported, every tensor has the length, alignment and non-overlap the kernels need
        // (checked in prepare_plan), the views borrow their buffers for the call and their
        // contracts keep the memory valid until the kernels complete; the workspace is owned by
        // self and freed only after a context synchronisation.
        unsafe {
            if let (Some(states_shape), Some(fold)) = (plan.states, plan.fold) {
                self.states[dk_index(args.shape.dk)].launch(stream, states_shape, &params)?;
                self.fold.launch(stream, fold, &params)?;
            }
            output.enqueue(stream)?;
        }
        Ok(plan)
    }

    /// [`ScalarDecayForward::launch`] with the output kernel that also writes the state entering
    /// every block (`geometry::num_blocks`) to `block_states`, `4 Dk Dv` bytes per head and block
    /// (bf16 hi + lo tiles, `lasp::sd::state_store_tiles`; the backward's dq pass, for the gate
    /// gradient).
    ///
    /// # Safety
    /// `block_states` must address a live device buffer of that size, used by nothing else until
    /// the kernels complete.
    pub(crate) unsafe fn launch_writing_block_states(
        &mut self,
        stream: &Arc<CudaStream>,
        args: ForwardArgs<'_>,
        block_states: u64,
    ) -> Result<ForwardPlan> {
        let plan = self.plan(&args.shape)?;
        let (plan, params) = self.prepare_plan(stream, &args, plan)?;
        let params = ScalarDecayParams {
            block_states,
            ..params
        };
        let i = dk_index(args.shape.dk);
        let output = match self.output_roles_block_states {
            Some(roles) if plan.output_roles => OutputLaunch::TwoRole(
                roles[i],
                plan.output,
                Box::new(RolesParams::new(params, &plan.shape)?),
            ),
            _ => OutputLaunch::OneWarpgroup(self.output_block_states[i], plan.output, params),
        };
        // SAFETY: as in `launch`; the output kernel also writes the block states, which this
        // function's contract sizes.
        unsafe {
            if let (Some(states_shape), Some(fold)) = (plan.states, plan.fold) {
                self.states[i].launch(stream, states_shape, &params)?;
                self.fold.launch(stream, fold, &params)?;
            }
            output.enqueue(stream)?;
        }
        Ok(plan)
    }

    /// The segments both reversed passes of the backward run in: they run the one-warpgroup
    /// kernel, whose plans fill two CTAs per SM, and share one states pass (the overrides of
    /// [`ScalarDecayForward::set_target_ctas`] and [`ScalarDecayForward::set_num_segments`]
    /// apply).
    pub(crate) fn reversed_segments(&self, shape: &ForwardShape) -> Result<u32> {
        let target = self.target_ctas.unwrap_or(2 * self.sm_count);
        Ok(ForwardPlan::new(shape, target, self.force_segments)?.num_segments)
    }

    /// The one-warpgroup plan of `shape` in exactly `segments` segments, without a workspace of
    /// this forward's (the caller's buffers hold the segment states and starts).
    fn reversed_plan(shape: &ForwardShape, segments: u32) -> Result<ForwardPlan> {
        let plan = ForwardPlan::new(shape, 1, Some(segments))?.with_one_warpgroup_output();
        if plan.num_segments != segments {
            return Err(invalid(format!(
                "scalar-decay reversed pass: {segments} segments do not cut T = {} into \
                 non-empty segments of whole chunks ({} would); use that count",
                shape.t, plan.num_segments
            )));
        }
        Ok(ForwardPlan {
            workspace_bytes: 0,
            ..plan
        })
    }

    /// The states kernel of a reversed pass alone: the end states from zero of segments
    /// 0 .. S-2 (tokens from last to first) into `m` (fp32 `[B*H][S-1][Dk][Dv]`) and their
    /// log-decays into `lambda` (`[B*H][S-1]`). Nothing to do when S = 1.
    ///
    /// # Safety
    /// `m` and `lambda` must address live device buffers of those sizes (B, H, Dk, Dv of
    /// `args.shape`), used by nothing else until the kernel completes.
    pub(crate) unsafe fn launch_reversed_states(
        &mut self,
        stream: &Arc<CudaStream>,
        args: &ForwardArgs<'_>,
        segments: u32,
        (m, lambda): (u64, u64),
    ) -> Result<()> {
        let plan = Self::reversed_plan(&args.shape, segments)?;
        let (plan, params) = self.prepare_plan(stream, args, plan)?;
        let Some(states) = plan.states else {
            return Ok(());
        };
        let params = ScalarDecayParams {
            ws_m: m,
            ws_p: 0,
            ws_lambda: lambda,
            ..params
        };
        // SAFETY: as in `launch`; the states kernel reads k, v and g (checked in prepare_plan)
        // and writes only ws_m and ws_lambda, which this function's contract sizes for the plan.
        unsafe { self.states_reversed[dk_index(args.shape.dk)].launch(stream, states, &params) }
    }

    /// The output kernel of a reversed pass alone, cut into `starts.segments` segments that
    /// start from `args.h0` (segment 0) and from `starts.prefixes` (segment s > 0: slot s - 1 of
    /// a `[B*H][S-1][Dk][Dv]` fp32 buffer, the layout the fold kernel writes). With
    /// `block_states`, it also writes its state at the end of every block there (`4 Dk Dv` bytes
    /// per head and block, bf16 hi + lo tiles; the backward's dv pass, for the gate gradient).
    ///
    /// # Safety
    /// Where S > 1, `starts.prefixes` must address a live device buffer of that size, written
    /// before this launch on `stream` and not written again until the kernel completes; where
    /// given, `block_states` must address a live device buffer of its size, used by nothing else
    /// until the kernel completes.
    pub(crate) unsafe fn launch_reversed_output(
        &mut self,
        stream: &Arc<CudaStream>,
        args: ForwardArgs<'_>,
        starts: SegmentStarts,
        block_states: Option<u64>,
    ) -> Result<()> {
        let plan = Self::reversed_plan(&args.shape, starts.segments)?;
        let (plan, params) = self.prepare_plan(stream, &args, plan)?;
        let params = ScalarDecayParams {
            ws_m: 0,
            ws_p: starts.prefixes,
            ws_lambda: 0,
            block_states: block_states.unwrap_or(0),
            ..params
        };
        let i = dk_index(args.shape.dk);
        let kernel = match block_states {
            Some(_) => self.output_reversed_block_states[i],
            None => self.output_reversed[i],
        };
        let launch = OutputLaunch::OneWarpgroup(kernel, plan.output, params);
        // SAFETY: as in `launch`; the output kernel reads of the workspace only the segment
        // starts, which `starts.prefixes` holds for every segment s > 0 (this function's
        // contract).
        unsafe { launch.enqueue(stream) }
    }

    /// The output kernel `plan` runs, with its parameters: the two-role kernel (with the tensor
    /// maps of `params`' q, k, v) where the plan has it, else the one-warpgroup kernel.
    fn output_launch(
        &self,
        plan: &ForwardPlan,
        params: &ScalarDecayParams,
    ) -> Result<OutputLaunch> {
        let i = dk_index(plan.shape.dk);
        Ok(match self.output_roles {
            Some(roles) if plan.output_roles => OutputLaunch::TwoRole(
                roles[i],
                plan.output,
                Box::new(RolesParams::new(*params, &plan.shape)?),
            ),
            _ => OutputLaunch::OneWarpgroup(self.output[i], plan.output, *params),
        })
    }

    /// Measurement tool, not an API for users (see [`OutputProbe`]): enqueues only the output
    /// kernel, or one of its probes, exactly as [`ScalarDecayForward::launch`] would launch the
    /// output kernel for `args` (same plan, params and workspace), and returns that plan. No
    /// states pass and no fold run: the segments start from whatever prefixes the workspace
    /// holds (the last forward's, or zeros). `args.o` (and `args.ht`, if given) receive the
    /// variant's values, which are not the forward's output except for [`OutputProbe::Output`]
    /// after a forward of the same inputs.
    pub fn launch_output_probe(
        &mut self,
        stream: &Arc<CudaStream>,
        args: ForwardArgs<'_>,
        probe: OutputProbe,
    ) -> Result<ForwardPlan> {
        let plan = self.plan(&args.shape)?;
        let (plan, params) = self.prepare_plan(stream, &args, plan)?;
        let i = dk_index(args.shape.dk);
        // The probes are variants of the one-warpgroup output kernel and launch like it, also
        // where the plan runs the two-role kernel.
        let one_warpgroup = plan.with_one_warpgroup_output().output;
        let launch = match probe {
            OutputProbe::Output => self.output_launch(&plan, &params)?,
            OutputProbe::Memory => {
                OutputLaunch::OneWarpgroup(self.probe_kernels()?[0][i], one_warpgroup, params)
            }
            OutputProbe::Compute => {
                OutputLaunch::OneWarpgroup(self.probe_kernels()?[1][i], one_warpgroup, params)
            }
            OutputProbe::NoExp => {
                OutputLaunch::OneWarpgroup(self.probe_kernels()?[2][i], one_warpgroup, params)
            }
        };
        // SAFETY: as in `launch`: the probe kernels take the output kernel's params and read and
        // write only what it does (q, k, v, g, workspace prefixes; o, ht), or less.
        unsafe { launch.enqueue(stream)? };
        Ok(plan)
    }

    /// The probe kernels (Memory, Compute, NoExp), looked up and given the output kernel's
    /// shared-memory limit on first use.
    fn probe_kernels(&mut self) -> Result<[[Kernel; 2]; 3]> {
        if let Some(probes) = self.probes {
            return Ok(probes);
        }
        let module = self.runtime.module();
        let load = |probe: OutputProbe| -> Result<[Kernel; 2]> {
            let names = probe
                .probe_kernel_names()
                .expect("a probe, not the production kernel");
            let kernels = [module.kernel(names[0])?, module.kernel(names[1])?];
            for (kernel, dk) in kernels.iter().zip([64, 128]) {
                kernel.set_max_dynamic_shared_bytes(geometry::output_smem_bytes(dk))?;
            }
            Ok(kernels)
        };
        let probes = [
            load(OutputProbe::Memory)?,
            load(OutputProbe::Compute)?,
            load(OutputProbe::NoExp)?,
        ];
        self.probes = Some(probes);
        Ok(probes)
    }
}

impl Drop for ScalarDecayForward {
    fn drop(&mut self) {
        if self.workspace.is_some() {
            // Launches in flight may still use the workspace.
            let _ = self.ctx.synchronize();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::geometry as g;
    use super::*;
    use std::mem::{offset_of, size_of};

    const HEADER: &str = include_str!("../../../kernels/cuda/include/lasp/scalar_decay_params.h");

    /// `#define NAME value` of the header (first token of the value).
    fn define(name: &str) -> i64 {
        HEADER
            .lines()
            .find_map(|l| {
                let rest = l.trim().strip_prefix("#define ")?.strip_prefix(name)?;
                rest.starts_with(' ')
                    .then(|| rest.split_whitespace().next().unwrap().parse().unwrap())
            })
            .unwrap_or_else(|| panic!("#define {name} not in the header"))
    }

    /// (C type, field name) of lasp_scalar_decay_params, in order.
    fn header_fields() -> Vec<(String, String)> {
        let start = HEADER.find("typedef struct {").unwrap();
        let end = HEADER[start..].find("} lasp_scalar_decay_params;").unwrap() + start;
        HEADER[start + "typedef struct {".len()..end]
            .lines()
            .filter_map(|l| {
                let decl = l.split("//").next().unwrap().trim();
                let decl = decl.strip_suffix(';')?;
                let name = decl.rsplit([' ', '*']).next().unwrap();
                let ty = decl[..decl.len() - name.len()].trim();
                Some((ty.to_string(), name.to_string()))
            })
            .collect()
    }

    #[test]
    fn params_match_the_header_layout() {
        assert_eq!(size_of::<ScalarDecayParams>(), 120);
        assert_eq!(std::mem::align_of::<ScalarDecayParams>(), 8);
        // Offsets from the header's declarations (natural alignment, as the C compiler lays
        // them out), compared with the Rust struct's.
        let rust = [
            ("q", offset_of!(ScalarDecayParams, q)),
            ("k", offset_of!(ScalarDecayParams, k)),
            ("v", offset_of!(ScalarDecayParams, v)),
            ("g", offset_of!(ScalarDecayParams, g)),
            ("o", offset_of!(ScalarDecayParams, o)),
            ("h0", offset_of!(ScalarDecayParams, h0)),
            ("ht", offset_of!(ScalarDecayParams, ht)),
            ("ws_m", offset_of!(ScalarDecayParams, ws_m)),
            ("ws_p", offset_of!(ScalarDecayParams, ws_p)),
            ("ws_lambda", offset_of!(ScalarDecayParams, ws_lambda)),
            ("block_states", offset_of!(ScalarDecayParams, block_states)),
            ("B", offset_of!(ScalarDecayParams, b)),
            ("T", offset_of!(ScalarDecayParams, t)),
            ("H", offset_of!(ScalarDecayParams, h)),
            ("Dk", offset_of!(ScalarDecayParams, dk)),
            ("Dv", offset_of!(ScalarDecayParams, dv)),
            ("num_segments", offset_of!(ScalarDecayParams, num_segments)),
            (
                "chunks_per_segment",
                offset_of!(ScalarDecayParams, chunks_per_segment),
            ),
            ("scale", offset_of!(ScalarDecayParams, scale)),
        ];
        let fields = header_fields();
        assert_eq!(fields.len(), rust.len(), "header fields: {fields:?}");
        let mut offset = 0usize;
        for ((ty, name), (rust_name, rust_offset)) in fields.iter().zip(rust) {
            let size = if ty.ends_with('*') {
                8
            } else {
                match ty.as_str() {
                    "int32_t" | "float" => 4,
                    other => panic!("unexpected C type {other} of {name}"),
                }
            };
            offset = offset.div_ceil(size) * size;
            assert_eq!(name, rust_name, "field order differs from the header");
            assert_eq!(offset, rust_offset, "offset of {name}");
            offset += size;
        }
        assert_eq!(offset.div_ceil(8) * 8, 120);
        // The exact offsets gcc gives for the header (offsetof), for the record.
        assert_eq!(offset_of!(ScalarDecayParams, b), 88);
        assert_eq!(offset_of!(ScalarDecayParams, scale), 116);
    }

    #[test]
    fn roles_params_match_the_header_layout() {
        // lasp_sd_roles_params: the 112-byte params, then three 128-byte-aligned 128-byte maps.
        assert_eq!(size_of::<RolesParams>(), 512);
        assert_eq!(std::mem::align_of::<RolesParams>(), 128);
        assert_eq!(offset_of!(RolesParams, params), 0);
        assert_eq!(offset_of!(RolesParams, q), 128);
        assert_eq!(offset_of!(RolesParams, k), 256);
        assert_eq!(offset_of!(RolesParams, v), 384);
        let body = HEADER
            .split("typedef struct {\n  lasp_scalar_decay_params p;")
            .nth(1)
            .expect("lasp_sd_roles_params in the header");
        let body = &body[..body.find("} lasp_sd_roles_params;").unwrap()];
        assert_eq!(body.trim(), "lasp_tensor_map q, k, v;");
        assert!(HEADER.contains("LASP_ALIGN_128 uint64_t opaque[16];"));
    }

    #[test]
    fn every_probe_kernel_is_in_the_cubin_at_its_dk_index() {
        assert_eq!(OutputProbe::Output.probe_kernel_names(), None);
        for probe in OutputProbe::ALL {
            let Some(names) = probe.probe_kernel_names() else {
                continue;
            };
            for (name, dk) in names.into_iter().zip([64, 128]) {
                assert!(
                    name.starts_with(&format!("lasp_scalar_decay_output_dk{dk}_probe_")),
                    "{name} is not the Dk {dk} kernel of {}",
                    probe.label()
                );
                assert!(
                    lasp_shmem_kernels::KERNEL_NAMES.contains(&name),
                    "{name} is not declared by the kernels"
                );
            }
        }
    }

    #[test]
    fn constants_match_the_header() {
        assert_eq!(define("LASP_SD_CHUNK"), g::CHUNK as i64);
        assert_eq!(define("LASP_SD_TILE_V"), g::TILE_V as i64);
        assert_eq!(define("LASP_SD_THREADS"), g::THREADS as i64);
        assert_eq!(define("LASP_SD_STAGES"), g::STAGES as i64);
        assert_eq!(define("LASP_SD_FOLD_THREADS"), g::FOLD_THREADS as i64);
        assert_eq!(define("LASP_SD_ROLES_THREADS"), g::ROLES_THREADS as i64);
        assert_eq!(define("LASP_SD_ROLES_STAGES"), g::ROLES_STAGES as i64);
        assert_eq!(define("LASP_SD_STATES_STAGES"), g::STATES_STAGES as i64);
        // The build must not override the pipeline depth, or the shared-memory sizes differ.
        let build = include_str!("../../../kernels/build.rs");
        assert!(
            !build.contains("LASP_SD_STAGES"),
            "kernels/build.rs sets LASP_SD_STAGES: mirror it in geometry::STAGES"
        );
    }

    #[test]
    fn two_ctas_per_sm_only_where_one_per_tile_leaves_sms_idle() {
        // B=4, H=16, Dv=128: one CTA per SM keeps sequences whole; a second would add a states pass.
        assert_eq!(g::target_ctas(4, 16, 8192, 128, 132), 132);
        assert_eq!(g::num_segments(4, 16, 8192, 128, 132), 1);
        // B=1: one per SM already splits into 4 segments, so two per SM and 8 segments.
        assert_eq!(g::target_ctas(1, 16, 32768, 128, 132), 264);
        assert_eq!(g::num_segments(1, 16, 32768, 128, 264), 8);
        // A sequence of one chunk cannot be split: one per SM.
        assert_eq!(g::target_ctas(1, 1, 64, 64, 132), 132);
    }

    #[test]
    fn shared_memory_and_workspace_formulas() {
        // 2 stages x (Q, K, V tile, gates) + 2 bf16 state tiles; two Dk=128 output CTAs fit the
        // 228 KiB of an H100/H200 SM (with 1 KiB reserved per CTA).
        assert_eq!(g::output_smem_bytes(128), 115_200);
        assert_eq!(g::output_smem_bytes(64), 66_048);
        // 4 stages x (K, V tile, gates): two Dk=128 states CTAs per SM.
        assert_eq!(g::states_smem_bytes(128), 99_328);
        assert_eq!(g::states_smem_bytes(64), 66_560);
        assert!(2 * (g::states_smem_bytes(128) + 1024) <= 228 * 1024);
        assert!(2 * (g::output_smem_bytes(128) + 1024) <= 228 * 1024);
        // 4 stages x (Q, K, V tile, gates) + 2 bf16 state tiles: one two-role CTA per SM.
        assert_eq!(g::roles_smem_bytes(128), 197_664);
        assert_eq!(g::roles_smem_bytes(64), 115_744);
        assert!(g::roles_smem_bytes(128) + 1024 <= 228 * 1024);
        // B*H*(S-1)*(2*Dk*Dv + 1)*4, with the values gcc computed from the header.
        assert_eq!(g::workspace_bytes(1, 1, 1, 128, 128), 0);
        assert_eq!(g::workspace_bytes(1, 1, 2, 128, 128), 131_076);
        assert_eq!(g::workspace_bytes(1, 1, 16, 128, 128), 1_966_140);
        assert_eq!(g::workspace_bytes(1, 16, 4, 128, 128), 6_291_648);
        assert_eq!(g::workspace_bytes(1, 1, 64, 128, 128), 8_257_788);
        for (b, h, s, dk, dv) in [(2, 3, 5, 64, 192), (1, 16, 4, 128, 128)] {
            let state = g::ws_state_bytes(b, h, s, dk, dv);
            assert_eq!(state, (b * h * (s - 1) * dk * dv * 4) as u64);
            assert_eq!(g::ws_p_offset(b, h, s, dk, dv), state);
            assert_eq!(g::ws_lambda_offset(b, h, s, dk, dv), 2 * state);
            assert_eq!(
                g::workspace_bytes(b, h, s, dk, dv),
                (b * h * (s - 1) * (2 * dk * dv + 1) * 4) as u64
            );
        }
    }

    #[test]
    fn segment_formula_matches_the_header_values() {
        // (B, H, T, Dv, target) -> (S, chunks per segment), as gcc computed them from the header.
        let cases = [
            ((1, 1, 1, 128, 132), (1, 1)),
            ((1, 1, 64, 128, 132), (1, 1)),
            ((1, 1, 65, 128, 132), (2, 1)),
            ((1, 256, 65, 128, 132), (1, 2)),
            ((1, 1, 1000, 128, 132), (16, 1)),
            ((1, 16, 1000, 128, 132), (4, 4)),
            ((1, 1, 8191, 128, 132), (64, 2)),
            ((1, 16, 8192, 128, 132), (4, 32)),
            ((1, 16, 32768, 128, 132), (4, 128)),
            ((1, 16, 131072, 128, 132), (4, 512)),
            ((4, 16, 8192, 128, 132), (1, 128)),
            ((1, 1, 131072, 128, 132), (64, 32)),
        ];
        for ((b, h, t, dv, target), want) in cases {
            let s = g::num_segments(b, h, t, dv, target);
            assert_eq!((s, g::chunks_per_segment(t, s)), want, "B={b} H={h} T={t}");
        }
        assert_eq!(g::output_grid(1, 16, 128, 4), (2, 4, 16));
        assert_eq!(g::states_grid(1, 16, 128, 4), (2, 3, 16));
        assert_eq!(g::fold_grid(1, 16, 128, 128), (64, 16, 1));
        assert_eq!(g::fold_grid(2, 3, 64, 192), (48, 6, 1));
    }

    #[test]
    fn no_segment_is_ever_empty() {
        for nc in 1..300 {
            let t = nc * 64 - 5;
            for target in [1, 7, 64, 132, 264, 1000] {
                for bh in [1, 3, 16] {
                    let s = g::num_segments(1, bh, t, 64, target);
                    let cps = g::chunks_per_segment(t, s);
                    assert!(
                        s >= 1 && (s - 1) * cps < nc && s * cps >= nc,
                        "nc={nc} s={s}"
                    );
                }
            }
            for want in 1..=(nc as u32 + 3) {
                let shape = ForwardShape {
                    b: 1,
                    t: t as usize,
                    h: 1,
                    dk: 64,
                    dv: 64,
                };
                let p = ForwardPlan::new(&shape, 132, Some(want)).unwrap();
                let (s, cps) = (p.num_segments as i32, p.chunks_per_segment as i32);
                assert!(s <= want as i32 && (s - 1) * cps < nc && s * cps >= nc);
                assert_eq!(cps, g::chunks_per_segment(t, s));
            }
        }
    }

    #[test]
    fn plan_launches_and_forced_segments() {
        let shape = ForwardShape {
            b: 1,
            t: 1000,
            h: 1,
            dk: 128,
            dv: 128,
        };
        let auto = ForwardPlan::new(&shape, 132, None).unwrap();
        assert_eq!(
            (auto.num_chunks, auto.num_segments, auto.chunks_per_segment),
            (16, 16, 1)
        );
        assert_eq!(auto.states.unwrap().grid, (2, 15, 1));
        assert_eq!(auto.states.unwrap().shared_bytes, 99_328);
        assert_eq!(auto.fold.unwrap().grid, (64, 1, 1));
        assert_eq!(auto.output.grid, (2, 16, 1));
        assert_eq!(auto.output.shared_bytes, 115_200);
        assert_eq!((auto.output.block, auto.output_roles), ((128, 1, 1), false));
        assert_eq!(auto.workspace_bytes, 1_966_140);
        assert_eq!(auto.workspace_offsets(), (15 * 65536, 30 * 65536));
        let five = ForwardPlan::new(&shape, 132, Some(5)).unwrap();
        assert_eq!((five.num_segments, five.chunks_per_segment), (4, 4));
        let one = ForwardPlan::new(&shape, 132, Some(1)).unwrap();
        assert_eq!((one.num_segments, one.workspace_bytes), (1, 0));
        assert!(one.states.is_none() && one.fold.is_none());
        assert_eq!(one.output.grid, (2, 1, 1));
        // One segment: the two-role output kernel.
        assert_eq!((one.output.block, one.output_roles), ((288, 1, 1), true));
        assert_eq!(one.output.shared_bytes, 197_664);
        let many = ForwardPlan::new(&shape, 132, Some(1000)).unwrap();
        assert_eq!(many.num_segments, 16);
        let long = ForwardShape {
            t: 70_000 * 64,
            ..shape
        };
        let msg = err_text(ForwardPlan::new(&long, 132, Some(70_000)));
        assert!(msg.contains("70000 segments"), "{msg}");
        // 70000 chunks over 65535 requested segments: 2 chunks each, so 35000 segments.
        let p = ForwardPlan::new(&long, 132, Some(65_535)).unwrap();
        assert_eq!((p.num_segments, p.chunks_per_segment), (35_000, 2));
        assert!(ForwardPlan::new(&shape, 132, Some(0)).is_err());
    }

    fn err_text<T: std::fmt::Debug>(r: Result<T>) -> String {
        match r {
            Err(Error::InvalidArgument(m)) => m,
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
    }

    #[test]
    fn unsupported_shapes_are_rejected_with_advice() {
        let ok = ForwardShape {
            b: 2,
            t: 100,
            h: 4,
            dk: 64,
            dv: 192,
        };
        ok.validate().unwrap();
        let msg = err_text(ForwardShape { dk: 96, ..ok }.validate());
        assert!(msg.contains("Dk = 96") && msg.contains("pad"), "{msg}");
        let msg = err_text(ForwardShape { dv: 100, ..ok }.validate());
        assert!(
            msg.contains("Dv = 100") && msg.contains("multiple of 64"),
            "{msg}"
        );
        let msg = err_text(ForwardShape { t: 0, ..ok }.validate());
        assert!(msg.contains("T=0"), "{msg}");
        let msg = err_text(
            ForwardShape {
                b: 1024,
                h: 128,
                ..ok
            }
            .validate(),
        );
        assert!(
            msg.contains("65535") && msg.contains("511 sequences"),
            "{msg}"
        );
        let msg = err_text(ForwardShape { t: MAX_T + 1, ..ok }.validate());
        assert!(msg.contains("ht -> h0"), "{msg}");
    }

    /// Args over fake, well-separated, aligned addresses (only checked, never launched).
    fn fake_args(shape: ForwardShape, h0: bool, ht: bool) -> ForwardArgs<'static> {
        let region = |i: u64| i << 36;
        // SAFETY: never dereferenced.
        unsafe {
            ForwardArgs {
                shape,
                q: DeviceRef::from_raw(region(1), shape.qk_len()),
                k: DeviceRef::from_raw(region(2), shape.qk_len()),
                v: DeviceRef::from_raw(region(3), shape.v_len()),
                g: DeviceRef::from_raw(region(4), shape.gate_len()),
                h0: h0.then(|| DeviceRef::from_raw(region(5), shape.state_len())),
                o: DeviceMut::from_raw(region(6), shape.v_len()),
                ht: ht.then(|| DeviceMut::from_raw(region(7), shape.state_len())),
                scale: None,
            }
        }
    }

    #[test]
    fn argument_checks() {
        let shape = ForwardShape {
            b: 2,
            t: 100,
            h: 3,
            dk: 128,
            dv: 64,
        };
        let scale = check_args(&fake_args(shape, true, true)).unwrap();
        assert_eq!(scale, (1.0f64 / 128f64.sqrt()) as f32);
        check_args(&fake_args(shape, false, false)).unwrap();

        let mut a = fake_args(shape, true, true);
        a.q = unsafe { DeviceRef::from_raw(a.q.addr(), a.q.len() - 1) };
        let msg = err_text(check_args(&a));
        assert!(
            msg.contains("q has 76799 elements") && msg.contains("76800"),
            "{msg}"
        );

        let mut a = fake_args(shape, true, true);
        a.ht = Some(unsafe { DeviceMut::from_raw(1 << 40, 5) });
        assert!(err_text(check_args(&a)).contains("ht has 5 elements"));

        let mut a = fake_args(shape, true, true);
        a.v = unsafe { DeviceRef::from_raw(a.v.addr() + 2, a.v.len()) };
        let msg = err_text(check_args(&a));
        assert!(
            msg.contains("v starts at") && msg.contains("16-byte"),
            "{msg}"
        );

        let mut a = fake_args(shape, true, true);
        a.h0 = Some(unsafe { DeviceRef::from_raw((5 << 36) + 4, shape.state_len()) });
        assert!(err_text(check_args(&a)).contains("8-byte"));

        let mut a = fake_args(shape, true, true);
        a.scale = Some(0.0);
        assert!(err_text(check_args(&a)).contains("scale = 0"));
        a.scale = Some(f32::NAN);
        assert!(err_text(check_args(&a)).contains("finite"));

        // ht overlapping h0 (in place) is refused with advice.
        let mut a = fake_args(shape, true, true);
        let h0 = a.h0.unwrap();
        a.ht = Some(unsafe { DeviceMut::from_raw(h0.addr(), h0.len()) });
        let msg = err_text(check_args(&a));
        assert!(
            msg.contains("ht overlaps input h0") && msg.contains("copy ht"),
            "{msg}"
        );

        // o overlapping q.
        let mut a = fake_args(shape, true, true);
        a.o = unsafe { DeviceMut::from_raw(a.q.addr() + 64, shape.v_len()) };
        assert!(err_text(check_args(&a)).contains("o overlaps input q"));

        // o overlapping ht.
        let mut a = fake_args(shape, true, true);
        a.ht = Some(unsafe { DeviceMut::from_raw(a.o.addr() + 1024, shape.state_len()) });
        assert!(err_text(check_args(&a)).contains("o and ht overlap"));
    }

    #[test]
    fn gate_contract_names_the_first_bad_gate() {
        let shape = ForwardShape {
            b: 2,
            t: 5,
            h: 3,
            dk: 64,
            dv: 64,
        };
        let mut g = vec![-0.5f32; shape.gate_len()];
        g[0] = 0.0;
        check_gate_values(&g, &shape).unwrap();
        // flat = (b*T + t)*H + h = (1*5 + 2)*3 + 1 = 22
        g[22] = 0.25;
        let msg = err_text(check_gate_values(&g, &shape));
        assert!(
            msg.contains("g[b=1, t=2, h=1]") && msg.contains("positive"),
            "{msg}"
        );
        g[22] = -0.5;
        g[29] = f32::NEG_INFINITY;
        let msg = err_text(check_gate_values(&g, &shape));
        assert!(
            msg.contains("g[b=1, t=4, h=2]") && msg.contains("not finite"),
            "{msg}"
        );
    }
}
