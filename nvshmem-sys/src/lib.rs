//! Raw bindings to the NVSHMEM 3.x host library, `libnvshmem_host.so.3`, loaded at run time.
//!
//! `bindings.rs` is bindgen output from the pinned headers (NVSHMEM 3.4.5), committed so that
//! building this crate needs neither libclang nor NVSHMEM. Regenerate it with
//! `source scripts/toolchain.sh && cargo run -p nvshmem-sys-bindgen && cargo fmt -p nvshmem-sys`.
//!
//! Only entry points the shared library exports are bound. The `static inline` initialisers of the
//! headers (`nvshmem_init`, `nvshmemx_init_attr`, `nvshmem_finalize`, ...) call into the device
//! archive and do not exist in the shared library: use `nvshmemx_hostlib_init_attr` and
//! `nvshmemx_hostlib_finalize`, and stamp the attribute's version fields with
//! [`init_attr_initializer`].
//!
//! The library is opened with `RTLD_GLOBAL` because its bootstrap and transport plugins are
//! opened later by name and resolve symbols against it.

#![allow(
    non_camel_case_types,
    non_upper_case_globals,
    non_snake_case,
    clippy::all
)]
// Generated code: its dynamic-loading wrappers call through function pointers inside unsafe fns
// whose contract is the C function's own.
#[rustfmt::skip]
#[allow(unsafe_op_in_unsafe_fn, clippy::undocumented_unsafe_blocks)]
mod bindings;
pub use bindings::*;

mod loader;
pub use loader::{load, load_resident, LoadError, LIBRARY_SONAME};

/// `NVSHMEMX_UNIQUEID_INITIALIZER`: a zeroed unique id with its version field stamped.
pub fn uniqueid_initializer() -> nvshmemx_uniqueid_t {
    nvshmemx_uniqueid_t {
        version: (1 << 16) + std::mem::size_of::<nvshmemx_uniqueid_t>() as i32,
        internal: [0; 124],
    }
}

/// `NVSHMEMX_INIT_ATTR_INITIALIZER`. `nvshmemx_hostlib_init_attr` does not stamp the version
/// fields itself (only the header-inline `nvshmemx_init_attr` does), so every attribute passed to
/// it must start from this value.
pub fn init_attr_initializer() -> nvshmemx_init_attr_t {
    nvshmemx_init_attr_t {
        version: (1 << 16) + std::mem::size_of::<nvshmemx_init_attr_t>() as i32,
        mpi_comm: std::ptr::null_mut(),
        args: nvshmemx_init_args_t {
            version: (1 << 16) + std::mem::size_of::<nvshmemx_init_args_t>() as i32,
            uid_args: nvshmemx_uniqueid_args_t {
                version: (1 << 16) + std::mem::size_of::<nvshmemx_uniqueid_args_t>() as i32,
                id: std::ptr::null_mut(),
                myrank: -1,
                nranks: -1,
            },
            content: [0; 96],
        },
    }
}

/// The NVSHMEM version these bindings were generated from, as (major, minor, patch).
pub const HEADER_VERSION: (u32, u32, u32) = (
    NVSHMEM_VENDOR_MAJOR_VERSION,
    NVSHMEM_VENDOR_MINOR_VERSION,
    NVSHMEM_VENDOR_PATCH_VERSION,
);
