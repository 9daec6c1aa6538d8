//! The C parameter structs of the forward's kernels, `lasp_scalar_decay_params` and
//! `lasp_sd_roles_params` of `scalar_decay/forward_params.h`, as bindgen generates them
//! (`lasp_shmem_kernels::params`).

use super::ForwardShape;
use crate::error::Result;
use crate::tensor_map;
use lasp_shmem_kernels::params as header;

/// The C struct `lasp_scalar_decay_params`, passed by value to the states, fold and
/// one-warpgroup output kernels; the two-role output kernel takes it inside [`RolesParams`].
/// Pointer fields hold device addresses; NULL where a tensor is absent.
pub type ScalarDecayParams = header::lasp_scalar_decay_params;

/// The C struct `lasp_sd_roles_params`: the forward's parameters and the tensor maps the
/// two-role output kernel copies q, k and v in and o out through.
pub type RolesParams = header::lasp_sd_roles_params;

/// `params` with the tensor maps of its q, k, v and o (`shape`'s dimensions).
pub(super) fn roles_params(params: ScalarDecayParams, shape: &ForwardShape) -> Result<RolesParams> {
    let (b, t, h) = (shape.b, shape.t, shape.h);
    Ok(RolesParams {
        p: params,
        q: tensor_map::bf16_token_tiles(
            "scalar-decay forward, q",
            params.q as u64,
            [shape.dk, h, t, b],
        )?,
        k: tensor_map::bf16_token_tiles(
            "scalar-decay forward, k",
            params.k as u64,
            [shape.dk, h, t, b],
        )?,
        v: tensor_map::bf16_token_tiles(
            "scalar-decay forward, v",
            params.v as u64,
            [shape.dv, h, t, b],
        )?,
        o: tensor_map::bf16_token_tiles(
            "scalar-decay forward, o",
            params.o as u64,
            [shape.dv, h, t, b],
        )?,
        // The padding bindgen spells out between `p` and the 128-byte-aligned maps.
        ..Default::default()
    })
}
