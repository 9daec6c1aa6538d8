//! The GPU checks as `cargo test` targets: the single-GPU forward and backward (scalar decay),
//! GLA's, Gated DeltaNet's and mLSTM's forward and backward against the CPU f64
//! reference, the device all-gather, LASP-2 forward and backward (GLA: forward), packed documents
//! through LASP-2 (and GLA's on one GPU) and the short convolution's halo exchange on every GPU of the node under `lasp-run`, with their fault
//! drills. One test executable, not one per file, keeps the bundle that a GPU node gets small
//! (scripts/bundle.sh).
//!
//! ```text
//! cargo build --release --workspace --bins       # lasp-run and the programs the tests run
//! cargo test --release -p lasp-shmem-examples --test gpu -- --test-threads=1
//! .bundle/tests/gpu --test-threads=1             # from scripts/bundle.sh's bundle
//! ```
//!
//! Where this machine has no GPU (no driver, no device, CUDA_VISIBLE_DEVICES empty), each test
//! prints `NOTICE: skipped ...` to standard error and passes; the drills that need two ranks do
//! the same on one GPU. Anything else that goes wrong fails. The single-GPU tests run their
//! checks in a child process of this executable each (NVSHMEM is initialised once per process
//! and must be finalized before it exits); the others run the example programs, found beside
//! this executable, and `lasp-run`, also found there or at `LASP_RUN`. GPU tests take turns on
//! the GPUs even when libtest runs tests in parallel. `source scripts/gpu-env.sh` first where
//! NVSHMEM comes from pip.

mod backward;
mod common;
mod emulated_links;
mod exchange;
mod forward;
mod gated_delta;
mod gla;
mod gla_packed;
mod lasp2;
mod mlstm;
mod mlstm_backward;
mod packed;
mod short_conv;
mod streams;
