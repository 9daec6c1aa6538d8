//! [`GlaPlan`]: how one GLA forward call runs (segments per sequence, the launches, the
//! workspace), from the shape and the GPU's multiprocessor count.

use crate::error::{Error, Result};
use crate::kernel::LaunchShape;
use crate::ops::scalar_decay::ForwardShape;
use crate::ops::split_into_segments;
use lasp_shmem_kernels::params as header;

/// Tokens per chunk.
pub(crate) const CHUNK: usize = header::LASP_GLA_CHUNK as usize;
const STATES_THREADS: u32 = header::LASP_GLA_STATES_THREADS;
const FOLD_THREADS: u32 = header::LASP_GLA_FOLD_THREADS;
/// The most segments per sequence (the kernels' grid y).
const MAX_SEGMENTS: usize = 65_535;

/// How one call runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GlaPlan {
    /// The shape the plan is for.
    pub shape: ForwardShape,
    /// Segments per (b, h), S >= 1; none is empty.
    pub num_segments: u32,
    /// Chunks of 64 tokens per segment (the last segment may hold fewer).
    pub chunks_per_segment: u32,
    /// Pieces R the states pass cuts each of segments 0..S-2 into (one CTA each), so that it
    /// fills the GPU with two CTAs per SM where S is small.
    pub states_splits: u32,
    /// Workspace bytes (0 when S == 1).
    pub workspace_bytes: u64,
    /// The states kernel's launch (only when S > 1).
    pub states: Option<LaunchShape>,
    /// The fold kernel's launch (only when S > 1).
    pub fold: Option<LaunchShape>,
    /// The output kernel's launch.
    pub output: LaunchShape,
}

/// Shared-memory bytes of the output kernel (`lasp_gla_output_smem_bytes`).
pub(crate) fn output_smem_bytes(dk: usize, dv: usize) -> u32 {
    let (c, dk, dv) = (CHUNK as u32, dk as u32, dv as u32);
    let stage = 2 * c * dk * 2 + c * dv * 2 + c * dk * 4;
    header::LASP_GLA_STAGES * stage
        + c * dk * 2
        + dk * dv * 2
        + 3 * dk * 4
        + 8 * output_threads(dv as usize)
}

/// Threads of the output kernel (`lasp_gla_output_threads`): a warpgroup per 64 columns of Dv.
pub(crate) fn output_threads(dv: usize) -> u32 {
    128 * (dv as u32 / 64)
}

/// Shared-memory bytes of the states kernel (`lasp_gla_states_smem_bytes`).
pub(crate) fn states_smem_bytes(dk: usize) -> u32 {
    let (c, dk) = (CHUNK as u32, dk as u32);
    header::LASP_GLA_STATES_STAGES * (c * dk * 2 + c * 64 * 2 + c * dk * 4) + 8 * STATES_THREADS
}

impl GlaPlan {
    /// The plan for `shape` on a GPU of `sm_count` multiprocessors (one output CTA each), or
    /// with `force_segments` segments per sequence (clamped to one chunk each at least and
    /// rounded so that none is empty) and `force_splits` states pieces per segment (clamped to
    /// its chunks; pieces past the segment's end are empty).
    pub fn new(
        shape: &ForwardShape,
        sm_count: u32,
        force_segments: Option<u32>,
        force_splits: Option<u32>,
    ) -> Result<Self> {
        validate(shape)?;
        let (b, t, h, dk, dv) = (shape.b, shape.t, shape.h, shape.dk, shape.dv);
        let chunks = t.div_ceil(CHUNK);
        // One output CTA per (segment, b*H+h) and SM: as many segments as fill the SMs once.
        let (segments, per_segment) = split_into_segments(
            chunks,
            force_segments,
            sm_count as usize / (b * h),
            MAX_SEGMENTS,
            "GLA forward",
        )?;
        let bh = (b * h) as u32;
        let many = segments > 1;
        let vtiles = dv / 64;
        let boundaries = segments - 1;
        let splits = match (many, force_splits) {
            (false, _) => 1,
            (true, Some(r)) => (r as usize).clamp(1, per_segment),
            (true, None) => {
                (2 * sm_count as usize / (vtiles * boundaries * b * h)).clamp(1, per_segment)
            }
        };
        let pieces = boundaries * splits;
        let tile = (dk * dv * 4) as u64;
        let per_bh = (pieces as u64 + boundaries as u64) * tile + (pieces * dk * 4) as u64;
        Ok(GlaPlan {
            shape: *shape,
            num_segments: segments as u32,
            chunks_per_segment: per_segment as u32,
            states_splits: splits as u32,
            workspace_bytes: (b * h) as u64 * per_bh,
            states: many.then_some(LaunchShape {
                grid: (vtiles as u32, pieces as u32, bh),
                block: (STATES_THREADS, 1, 1),
                shared_bytes: states_smem_bytes(dk),
            }),
            fold: many.then_some(LaunchShape {
                grid: (((dk * dv) as u32).div_ceil(FOLD_THREADS), bh, 1),
                block: (FOLD_THREADS, 1, 1),
                shared_bytes: 0,
            }),
            output: LaunchShape {
                grid: (1, segments as u32, bh),
                block: (output_threads(dv), 1, 1),
                shared_bytes: output_smem_bytes(dk, dv),
            },
        })
    }

    /// Byte offsets of `ws_p` and `ws_lambda` in the workspace (`ws_m` is at 0).
    pub fn workspace_offsets(&self) -> (u64, u64) {
        let s = &self.shape;
        let boundaries = (self.num_segments - 1) as u64;
        let tiles = (s.b * s.h) as u64 * boundaries;
        let tile = (s.dk * s.dv * 4) as u64;
        let p = tiles * self.states_splits as u64 * tile;
        (p, p + tiles * tile)
    }
}

/// How errors name the layout of the states entering every chunk.
pub(crate) const CHUNK_STATES_LAYOUT: &str = "[B*H, ceil(T / 64), Dk, Dv]";

/// Elements of the states entering every chunk ([`super::GlaArgs::chunk_states`]):
/// `B*H * ceil(T / 64) * Dk * Dv`.
pub fn chunk_states_len(shape: &ForwardShape) -> usize {
    shape.b * shape.h * shape.t.div_ceil(CHUNK) * shape.dk * shape.dv
}

/// Checks that the GLA forward kernels support `shape`; the error says what to change.
pub(crate) fn validate(shape: &ForwardShape) -> Result<()> {
    validate_as(
        shape,
        "GLA forward",
        "split v into blocks of 128 columns and run one call per block with the same q, k, g",
    )
}

/// Checks that GLA's kernels support `shape`, `op` naming the operation and `split_v` saying how
/// to run a wider v.
pub(crate) fn validate_as(shape: &ForwardShape, op: &str, split_v: &str) -> Result<()> {
    shape.validate_as(op)?;
    if shape.dv != 64 && shape.dv != 128 {
        return Err(Error::InvalidArgument(format!(
            "{op}: Dv = {} is not supported (the kernels are built for Dv 64 and 128); {split_v}",
            shape.dv
        )));
    }
    Ok(())
}
