//! The C ABI (`core/include/lasp_shmem.h`): the runtime and one operation object, `lasp_op`, for
//! every family of linear attention, forward and backward, for a C, C++ or PyTorch caller that
//! brings its own launcher, streams and device pointers.
//!
//! A trainer started by torchrun already runs its own rendezvous on `MASTER_PORT`, so the
//! library does not bootstrap by itself there: rank 0 makes a unique id
//! ([`lasp_unique_id_create`]), the trainer hands it to every rank with its own collective
//! (`torch.distributed.broadcast`), and every rank initialises with it ([`lasp_runtime_init`]).
//! Programs started by lasp-run, mpirun or nvshmrun use [`lasp_runtime_init_from_env`].
//!
//! An operation is made from a versioned descriptor ([`OpDesc`]) and called with a call's
//! scalars ([`Call`]) and its tensors in named slots ([`Tensors`]). What the descriptor and the
//! call carry is checked once, for every family (`spec`, `tensors`); a family (`families`)
//! declares its slots and makes its operation, so a new family adds no entry point.
//!
//! Every entry point returns a status ([`status`]); the message of a failure is
//! [`status::lasp_last_error`]. Raw pointers are checked before use: handles and out-pointers
//! for NULL, structs for their size and reserved fields, device pointers against the driver's
//! record of their allocation ([`memory`]), streams against the runtime's context. A handle may
//! be used from any thread; calls on one handle are serialised by a lock.

pub mod memory;
pub mod status;

mod abi;
mod args;
mod documents;
mod families;
mod gated_delta;
mod gla;
mod handles;
mod mlstm;
mod op;
mod pairs;
mod runtime;
mod scalar_decay;
mod spec;
mod tensors;
#[cfg(test)]
mod tests;

pub use abi::*;
pub use handles::{OpHandle, RuntimeHandle};
pub use op::{
    lasp_op_backward, lasp_op_check_call, lasp_op_create, lasp_op_finish, lasp_op_forward,
    lasp_op_free, lasp_op_note_replayed_calls, lasp_op_set_mode, lasp_op_symmetric_bytes,
};
pub use runtime::{
    lasp_abi_version, lasp_runtime_attach, lasp_runtime_init, lasp_runtime_init_from_env,
    lasp_runtime_place, lasp_runtime_shutdown, lasp_unique_id_create,
};
