//! Launch geometry, shared memory and workspace formulas: the constants of
//! `scalar_decay/forward_params.h` (generated from it) and a line-by-line port of its helpers (same
//! integer types and rounding; keep both in sync, the unit tests pin their values).

use lasp_shmem_kernels::params as header;

/// Tokens per chunk (`LASP_SD_CHUNK`).
pub const CHUNK: i32 = header::LASP_SD_CHUNK as i32;
/// Dv columns per CTA (`LASP_SD_TILE_V`).
pub const TILE_V: i32 = header::LASP_SD_TILE_V as i32;
/// Threads per CTA of the states and output kernels (`LASP_SD_THREADS`).
pub const THREADS: u32 = header::LASP_SD_THREADS;
/// cp.async pipeline depth the kernels are built with (`LASP_SD_STAGES`: the header's default,
/// as nvcc and bindgen both read it without an override).
pub const STAGES: u32 = header::LASP_SD_STAGES;
/// Threads per CTA of the fold kernel (`LASP_SD_FOLD_THREADS`).
pub const FOLD_THREADS: u32 = header::LASP_SD_FOLD_THREADS;
/// Threads per CTA of the two-role output kernel (`LASP_SD_ROLES_THREADS`).
pub const ROLES_THREADS: u32 = header::LASP_SD_ROLES_THREADS;
/// The two-role output kernel's pipeline depth (`LASP_SD_ROLES_STAGES`).
pub const ROLES_STAGES: u32 = header::LASP_SD_ROLES_STAGES;
/// The states kernels' pipeline depth (`LASP_SD_STATES_STAGES`).
pub const STATES_STAGES: u32 = header::LASP_SD_STATES_STAGES;

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
pub const BLOCK_CHUNKS: i32 = header::LASP_SD_BLOCK_CHUNKS as i32;

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

/// `lasp_sd_update_smem_bytes`: the output loop without O, STAGES x (K, V tile, gates) + 2 bf16
/// state tiles.
pub const fn update_smem_bytes(dk: i32) -> u32 {
    let (c, dk, tv) = (CHUNK as u32, dk as u32, TILE_V as u32);
    let stage = c * dk * 2 + c * tv * 2 + c * 4;
    STAGES * stage + 2 * dk * tv * 2
}

/// `lasp_sd_roles_smem_bytes`: ROLES_STAGES x (Q, K, V tile, gates, an 8-byte mbarrier) + 2
/// bf16 state tiles, then from the next 1 KiB boundary O's staging tile.
pub const fn roles_smem_bytes(dk: i32) -> u32 {
    let (c, dk, tv) = (CHUNK as u32, dk as u32, TILE_V as u32);
    let stage = 2 * c * dk * 2 + c * tv * 2 + c * 4;
    (ROLES_STAGES * (stage + 8) + 2 * dk * tv * 2).next_multiple_of(1024) + c * tv * 2
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
