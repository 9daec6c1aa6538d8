//! [`MlstmPlan`]: how one mLSTM forward call runs (segments per sequence, the launches, the
//! workspace), from the shape and the GPU's multiprocessor count.

use crate::error::{Error, Result};
use crate::kernel::LaunchShape;
use crate::ops::scalar_decay::ForwardShape;
use crate::ops::{split_into_segments, Scope};
use lasp_shmem_kernels::params as header;

/// Tokens per chunk of the on-chip loop.
pub(crate) const CHUNK: usize = header::LASP_MLSTM_CHUNK as usize;
const FOLD_THREADS: u32 = header::LASP_MLSTM_FOLD_THREADS;
/// The most segments per sequence (the kernels' grid y).
const MAX_SEGMENTS: usize = 65_535;

/// How one call runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MlstmPlan {
    /// The shape the plan is for.
    pub shape: ForwardShape,
    /// What the states pass summarises (a shard's workspace also holds the state entering it,
    /// which the LASP-2 fold writes).
    pub scope: Scope,
    /// Segments per (b, h), S >= 1; none is empty. A segment is TFLA's large chunk: its state
    /// stays on chip while 64-token chunks stream through.
    pub num_segments: u32,
    /// Chunks of 64 tokens per segment (the last segment may hold fewer).
    pub chunks_per_segment: u32,
    /// Segments the states pass summarises: S - 1 on one GPU, S in a shard.
    pub num_summaries: u32,
    /// Pieces R the states pass cuts each summarised segment into (one CTA each), so that it
    /// fills the GPU where S is small.
    pub states_splits: u32,
    /// Workspace bytes (0 on one GPU when S == 1).
    pub workspace_bytes: u64,
    /// The states kernel's launch (where any segment is summarised).
    pub states: Option<LaunchShape>,
    /// The fold kernel's launch (one GPU: where S > 1; a shard: always, the LASP-2 fold).
    pub fold: Option<LaunchShape>,
    /// The output kernel's launch.
    pub output: LaunchShape,
}

/// Threads of the states and output kernels (`lasp_mlstm_threads`): a warpgroup per 64 columns
/// of Dv.
fn threads(dv: usize) -> u32 {
    128 * (dv as u32 / header::LASP_MLSTM_TILE_V)
}

/// One pipeline stage (`lasp_mlstm_stage_bytes`): Q (with O), K, V, both gates of a chunk.
fn stage_bytes(dk: usize, dv: usize, with_q: bool) -> u32 {
    let (c, dk, dv) = (CHUNK as u32, dk as u32, dv as u32);
    (if with_q { 2 } else { 1 }) * c * dk * 2 + c * dv * 2 + 2 * c * 4
}

/// The normaliser's partial vectors (`lasp_mlstm_normaliser_bytes`): two where the CTA has two
/// threads per key dimension.
fn normaliser_bytes(dk: usize, dv: usize) -> u32 {
    let parts = if threads(dv) >= 2 * dk as u32 { 2 } else { 1 };
    parts * dk as u32 * 4
}

/// Shared-memory bytes of the output kernel (`lasp_mlstm_output_smem_bytes`).
pub(crate) fn output_smem_bytes(dk: usize, dv: usize) -> u32 {
    let (dk32, dv32) = (dk as u32, dv as u32);
    let tiles = header::LASP_MLSTM_STAGES * stage_bytes(dk, dv, true)
        + 4 * dk32 * dv32 * 2
        + 2 * normaliser_bytes(dk, dv);
    let words = header::LASP_MLSTM_STAGES * 8;
    if tiles + words <= header::LASP_MLSTM_BLOCK_SMEM {
        tiles + words
    } else {
        tiles
    }
}

/// Shared-memory bytes of the states kernel (`lasp_mlstm_states_smem_bytes`).
pub(crate) fn states_smem_bytes(dk: usize, dv: usize) -> u32 {
    header::LASP_MLSTM_STAGES * stage_bytes(dk, dv, false)
        + normaliser_bytes(dk, dv)
        + header::LASP_MLSTM_STAGES * 8
}

/// Output CTAs one SM holds at once (228 KiB of shared memory, 1 KiB reserved per CTA, at most
/// 16 warps of these kernels' 255 registers per thread).
fn ctas_per_sm(dk: usize, dv: usize) -> usize {
    let by_memory = (233_472 / (output_smem_bytes(dk, dv) + 1024)) as usize;
    let by_registers = (65_536 / (255 * threads(dv))) as usize;
    by_memory.min(by_registers).max(1)
}

/// Byte offsets of the workspace's arrays (`ws_c` is at 0); the `start_*` arrays (the state
/// entering a shard) are empty on one GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkspaceOffsets {
    pub pc: u64,
    pub start_c: u64,
    pub n: u64,
    pub pn: u64,
    pub start_n: u64,
    pub m: u64,
    pub f: u64,
    pub pm: u64,
    pub start_m: u64,
    /// The workspace's size.
    pub end: u64,
}

impl MlstmPlan {
    /// The plan for `shape` in `scope` on a GPU of `sm_count` multiprocessors (the output
    /// kernel's CTAs fill them once), or with `force_segments` segments per sequence (clamped to
    /// one chunk each at least and rounded so that none is empty) and `force_splits` states
    /// pieces per segment (clamped to its chunks; pieces past the segment's end are empty).
    pub fn new(
        shape: &ForwardShape,
        scope: Scope,
        sm_count: u32,
        force_segments: Option<u32>,
        force_splits: Option<u32>,
    ) -> Result<Self> {
        validate(shape)?;
        let (b, t, h, dk, dv) = (shape.b, shape.t, shape.h, shape.dk, shape.dv);
        let (segments, per_segment) = split_into_segments(
            t.div_ceil(CHUNK),
            force_segments,
            sm_count as usize * ctas_per_sm(dk, dv) / (b * h),
            MAX_SEGMENTS,
            "mLSTM forward",
        )?;
        let bh = (b * h) as u32;
        let summaries = match scope {
            Scope::SingleGpu => segments - 1,
            Scope::Shard => segments,
        };
        let summarised = summaries > 0;
        // The states pass's CTAs (one per SM: their registers) fill the GPU once.
        let splits = match (summarised, force_splits) {
            (false, _) => 1,
            (true, Some(r)) => (r as usize).clamp(1, per_segment),
            (true, None) => (sm_count as usize / (summaries * b * h)).clamp(1, per_segment),
        };
        let mut plan = MlstmPlan {
            shape: *shape,
            scope,
            num_segments: segments as u32,
            chunks_per_segment: per_segment as u32,
            num_summaries: summaries as u32,
            states_splits: splits as u32,
            workspace_bytes: 0,
            states: summarised.then_some(LaunchShape {
                grid: (1, (summaries * splits) as u32, bh),
                block: (threads(dv), 1, 1),
                shared_bytes: states_smem_bytes(dk, dv),
            }),
            fold: (segments > 1 || scope == Scope::Shard).then_some(LaunchShape {
                grid: (((dk * dv + dk) as u32).div_ceil(FOLD_THREADS), bh, 1),
                block: (FOLD_THREADS, 1, 1),
                shared_bytes: 0,
            }),
            output: LaunchShape {
                grid: (1, segments as u32, bh),
                block: (threads(dv), 1, 1),
                shared_bytes: output_smem_bytes(dk, dv),
            },
        };
        plan.workspace_bytes = plan.workspace_offsets().end;
        Ok(plan)
    }

    /// Where each workspace array starts: `ws_c`, `ws_n`, `ws_m`, `ws_f` over every (b*H+h,
    /// piece), `ws_pc`, `ws_pn`, `ws_pm` over every (b*H+h, boundary), `start_*` over every
    /// b*H+h in a shard; tiles, then vectors, then scalars.
    pub fn workspace_offsets(&self) -> WorkspaceOffsets {
        let s = &self.shape;
        let bh = (s.b * s.h) as u64;
        let slots = bh * (self.num_segments - 1) as u64;
        let pieces = bh * (self.num_summaries * self.states_splits) as u64;
        let starts = if self.scope == Scope::Shard { bh } else { 0 };
        let (tile, vector) = ((s.dk * s.dv * 4) as u64, (s.dk * 4) as u64);
        let pc = pieces * tile;
        let start_c = pc + slots * tile;
        let n = start_c + starts * tile;
        let pn = n + pieces * vector;
        let start_n = pn + slots * vector;
        let m = start_n + starts * vector;
        let f = m + pieces * 4;
        let pm = f + pieces * 4;
        let start_m = pm + slots * 4;
        WorkspaceOffsets {
            pc,
            start_c,
            n,
            pn,
            start_n,
            m,
            f,
            pm,
            start_m,
            end: start_m + starts * 4,
        }
    }
}

/// Checks that the mLSTM forward kernels support `shape`; the error says what to change.
pub(crate) fn validate(shape: &ForwardShape) -> Result<()> {
    validate_for("mLSTM forward", shape)
}

/// [`validate`] for operation `op` (the backward checks its own shape before its passes' plans,
/// which exchange Dk and Dv).
pub(crate) fn validate_for(op: &str, shape: &ForwardShape) -> Result<()> {
    shape.validate_as(op)?;
    if shape.dv != 64 && shape.dv != 128 {
        return Err(Error::InvalidArgument(format!(
            "{op}: Dv = {} is not supported (the kernels are built for Dv 64 and 128); split v \
             into blocks of 128 columns and run one call per block with the same q, k and gates \
             (the normaliser does not depend on v; the backward's dq, dk and gate gradients are \
             then the sums over the blocks)",
            shape.dv
        )));
    }
    Ok(())
}
