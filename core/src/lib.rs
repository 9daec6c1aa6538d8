//! lasp-shmem: device-initiated GPU communication over NVSHMEM, and LASP-2 sequence parallelism
//! for linear attention built on it.
//!
//! Start with [`Runtime::init`]: it reads the launch environment (lasp-run, torchrun-style
//! variables, mpirun or nvshmrun), opens this rank's GPU, initialises NVSHMEM and registers the
//! embedded kernels. Operations such as [`exchange::transport::AllGather`] then run on caller streams with
//! no host collective; [`Runtime::shutdown`] is the collective end.

pub mod capi;
pub mod diagnostics;
pub mod error;
pub mod exchange;
pub mod family;
pub mod gpu;
pub mod kernel;
pub mod launch_env;
pub mod launcher;
pub mod nccl;
mod nvshmem;
pub mod ops;
pub mod reference;
pub mod rendezvous;
pub mod runtime;
pub mod settings;
pub mod symmetric;
pub mod tensor_map;

pub use error::{Error, Result};
pub use runtime::{Config, Runtime};
pub use symmetric::SymmetricBuffer;
