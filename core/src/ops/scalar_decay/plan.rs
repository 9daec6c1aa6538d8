//! [`ForwardPlan`]: how one call runs (segments per sequence, the launches of the states, fold
//! and output kernels, the workspace they need), chosen from the shape and a CTA target.

use super::{geometry, invalid, ForwardShape};
use crate::error::Result;
use crate::kernel::LaunchShape;

/// The most segments per sequence a plan may use (the kernels' grid y).
const MAX_SEGMENTS: i32 = 65_535;

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
