//! The C parameter structs of the forward's kernels, mirrored field for field:
//! `lasp_scalar_decay_params` and `lasp_sd_roles_params` of `scalar_decay/forward_params.h` (the layout
//! tests in `tests.rs` compare them with the header's text).

use super::ForwardShape;
use crate::error::Result;
use crate::tensor_map::{self, TensorMap};

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
    pub(super) fn new(params: ScalarDecayParams, shape: &ForwardShape) -> Result<Self> {
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
