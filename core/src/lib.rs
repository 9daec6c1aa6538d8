//! lasp-shmem: device-initiated GPU communication over NVSHMEM, and LASP-2 sequence parallelism
//! for linear attention built on it.

pub mod reference;
