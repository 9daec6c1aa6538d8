//! nvshmem-sys (in progress)
