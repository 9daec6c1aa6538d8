//! kernels (in progress)
