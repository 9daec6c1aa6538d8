//! The header's ABI version and the structs a caller fills, laid out as `lasp_shmem.h` declares
//! them (its `_Static_assert`s fix their sizes; the tests compare them).

use crate::rendezvous::ID_BYTES;
use std::ffi::{c_char, c_void};

/// `LASP_SHMEM_ABI_VERSION`: bumped whenever a struct or a signature of the header changes.
pub const ABI_VERSION: u32 = 1;

/// `lasp_runtime_options`.
#[repr(C)]
#[derive(Debug)]
pub struct RuntimeOptions {
    /// `LASP_SHMEM_ABI_VERSION` of the header the caller was compiled with.
    pub abi_version: u32,
    pub reserved: u32,
    /// Symmetric memory the program will allocate (0: 256 MiB); see
    /// [`lasp_lasp2_symmetric_bytes`].
    ///
    /// [`lasp_lasp2_symmetric_bytes`]: super::lasp_lasp2_symmetric_bytes
    pub symmetric_heap_bytes: u64,
    /// Bound on every wait on another GPU (0: `LASP_WAIT_TIMEOUT_MS`, else 10 s).
    pub wait_timeout_ms: u64,
    /// An explicit `libnvshmem_host.so.3` (NULL: `NVSHMEM_HOME`, else the usual places).
    pub nvshmem_library: *const c_char,
}

/// `lasp_place`: this process's place in the job, as torchrun's variables give it.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Place {
    pub rank: i32,
    pub world_size: i32,
    /// Selects the GPU (the ordinal among the visible GPUs).
    pub local_rank: i32,
    pub local_world_size: i32,
}

/// `lasp_unique_id`: NVSHMEM's bootstrap id, plain bytes to broadcast.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct UniqueId {
    pub bytes: [u8; ID_BYTES],
}

/// `lasp_forward_args`: one call's tensors in fla's layout, contiguous.
#[repr(C)]
#[derive(Debug)]
pub struct ForwardArgsC {
    pub batch: i64,
    /// This rank's tokens per sequence (LASP-2: its shard; ranks may differ).
    pub tokens: i64,
    pub heads: i64,
    pub dk: i64,
    pub dv: i64,
    /// `[B, T, H, Dk]` bf16.
    pub q: *const c_void,
    /// `[B, T, H, Dk]` bf16.
    pub k: *const c_void,
    /// `[B, T, H, Dv]` bf16.
    pub v: *const c_void,
    /// `[B, T, H]` fp32 log-decays, finite and `<= 0`.
    pub g: *const f32,
    /// `[B, H, Dk, Dv]` fp32 initial state, or NULL for zero.
    pub h0: *const f32,
    /// `[B, T, H, Dv]` bf16 output.
    pub o: *mut c_void,
    /// `[B, H, Dk, Dv]` fp32 final state, or NULL (LASP-2: the last rank only).
    pub ht: *mut f32,
    /// `sigma` in `o_t = sigma q_t S_t`; 0 for `Dk^-1/2`.
    pub scale: f32,
    pub reserved: u32,
}

/// `lasp_backward_args`: one backward call's tensors in fla's layout, contiguous. The inputs
/// are the forward's and the gradients of its outputs; the `grad_*` outputs are written whole.
#[repr(C)]
#[derive(Debug)]
pub struct BackwardArgsC {
    pub batch: i64,
    pub tokens: i64,
    pub heads: i64,
    /// 64 or 128.
    pub dk: i64,
    /// 64 or 128.
    pub dv: i64,
    /// The forward's q, k `[B, T, H, Dk]` and v `[B, T, H, Dv]`, bf16.
    pub q: *const c_void,
    pub k: *const c_void,
    pub v: *const c_void,
    /// The forward's `[B, T, H]` fp32 log-decays.
    pub g: *const f32,
    /// `[B, H, Dk, Dv]` fp32, or NULL for zero: the forward's initial state (LASP-2: the
    /// `start_state` that `lasp_lasp2_forward_saving` wrote on this rank).
    pub h0: *const f32,
    /// `[B, T, H, Dv]` bf16: the gradient of o.
    pub grad_o: *const c_void,
    /// `[B, H, Dk, Dv]` fp32 gradient of the final state, or NULL (LASP-2: last rank only).
    pub grad_ht: *const f32,
    /// `[B, T, H, Dk]`, `[B, T, H, Dk]`, `[B, T, H, Dv]` bf16 and `[B, T, H]` fp32.
    pub grad_q: *mut c_void,
    pub grad_k: *mut c_void,
    pub grad_v: *mut c_void,
    pub grad_g: *mut f32,
    /// `[B, H, Dk, Dv]` fp32 gradient of the initial state, or NULL (LASP-2: rank 0 only).
    pub grad_h0: *mut f32,
    /// The forward's `sigma`; 0 for `Dk^-1/2`.
    pub scale: f32,
    pub reserved: u32,
}
