//! The C ABI (`core/include/lasp_shmem.h`): the runtime and the operations, forward and
//! backward, for a C, C++ or PyTorch caller that brings its own launcher, streams and device
//! pointers.
//!
//! A trainer started by torchrun already runs its own rendezvous on `MASTER_PORT`, so the
//! library does not bootstrap by itself there: rank 0 makes a unique id
//! ([`lasp_unique_id_create`]), the trainer hands it to every rank with its own collective
//! (`torch.distributed.broadcast`), and every rank initialises with it ([`lasp_runtime_init`]).
//! Programs started by lasp-run, mpirun or nvshmrun use [`lasp_runtime_init_from_env`].
//!
//! Every entry point returns a status ([`status`]); the message of a failure is
//! [`status::lasp_last_error`]. Raw pointers are checked before use: handles and out-pointers
//! for NULL, device pointers against the driver's record of their allocation ([`memory`]),
//! streams against the runtime's context. A handle may be used from any thread; calls on one
//! handle are serialised by a lock.

pub mod memory;
pub mod status;

mod abi;
mod args;
mod handles;
mod lasp2;
mod runtime;
mod scalar_decay;
#[cfg(test)]
mod tests;

pub use abi::{BackwardArgsC, ForwardArgsC, Place, RuntimeOptions, UniqueId, ABI_VERSION};
pub use handles::{
    Lasp2GradHandle, Lasp2Handle, OpHandle, RuntimeHandle, ScalarDecayGradHandle, ScalarDecayHandle,
};
pub use lasp2::{
    lasp_lasp2_backward, lasp_lasp2_create, lasp_lasp2_finish, lasp_lasp2_forward,
    lasp_lasp2_forward_saving, lasp_lasp2_free, lasp_lasp2_grad_create, lasp_lasp2_grad_finish,
    lasp_lasp2_grad_free, lasp_lasp2_grad_note_replayed_calls, lasp_lasp2_grad_set_mode,
    lasp_lasp2_note_replayed_calls, lasp_lasp2_set_mode, lasp_lasp2_symmetric_bytes,
};
pub use runtime::{
    lasp_abi_version, lasp_runtime_init, lasp_runtime_init_from_env, lasp_runtime_place,
    lasp_runtime_shutdown, lasp_unique_id_create,
};
pub use scalar_decay::{
    lasp_scalar_decay_backward, lasp_scalar_decay_create, lasp_scalar_decay_forward,
    lasp_scalar_decay_free, lasp_scalar_decay_grad_create, lasp_scalar_decay_grad_free,
};
