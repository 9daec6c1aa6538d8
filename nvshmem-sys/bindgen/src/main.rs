//! Regenerates `nvshmem-sys/src/bindings.rs` from the pinned NVSHMEM host headers.
//!
//! ```text
//! source scripts/toolchain.sh && cargo run -p nvshmem-sys-bindgen
//! ```
//!
//! Needs libclang with its resource headers (Debian: `apt-get install libclang-dev`; the pinned
//! toolchain's wheel has none). The output is committed, so building nvshmem-sys needs no libclang.
//! Only host entry points that `libnvshmem_host.so.3` really exports are bound: the
//! `static inline` initialisers (`nvshmem_init`, `nvshmemx_init_attr`, `nvshmem_finalize`, ...)
//! call into the device archive and cannot be resolved from the shared library.

use std::path::PathBuf;

/// Host functions the runtime uses. Each is exported by `libnvshmem_host.so.3` (3.x).
const FUNCTIONS: &[&str] = &[
    "nvshmemx_hostlib_init_attr",
    "nvshmemx_hostlib_finalize",
    "nvshmemx_set_attr_uniqueid_args",
    "nvshmemx_get_uniqueid",
    "nvshmemx_init_status",
    "nvshmemx_vendor_get_version_info",
    "nvshmem_my_pe",
    "nvshmem_n_pes",
    "nvshmem_team_my_pe",
    "nvshmem_team_n_pes",
    "nvshmem_malloc",
    "nvshmem_align",
    "nvshmem_free",
    "nvshmem_ptr",
    "nvshmemx_cumodule_init",
    "nvshmemx_cumodule_finalize",
    "nvshmem_barrier_all",
    "nvshmemx_barrier_all_on_stream",
    "nvshmemx_quiet_on_stream",
    "nvshmemx_getmem_on_stream",
    "nvshmemx_fcollectmem_on_stream",
];

fn main() {
    let nvshmem_home = PathBuf::from(
        std::env::var("NVSHMEM_HOME")
            .expect("NVSHMEM_HOME is not set: run `source scripts/toolchain.sh` first"),
    );
    let nvcc = PathBuf::from(std::env::var("NVCC").expect("NVCC is not set"));
    let cuda_include = nvcc
        .parent()
        .and_then(|bin| bin.parent())
        .expect("NVCC has no parent folder")
        .join("include");
    let out = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../src/bindings.rs");

    let mut builder = bindgen::Builder::default()
        .header(
            nvshmem_home
                .join("include/nvshmem_host.h")
                .display()
                .to_string(),
        )
        .clang_args(["-x", "c++", "-std=c++17", "-DNVSHMEM_HOSTLIB_ONLY"])
        .clang_arg(format!("-I{}", nvshmem_home.join("include").display()))
        .clang_arg(format!("-I{}", cuda_include.display()))
        .dynamic_library_name("NvshmemHost")
        .dynamic_link_require_all(true)
        .allowlist_type("nvshmemx_init_attr_t|nvshmemx_uniqueid_t|nvshmem_team_t")
        .allowlist_var("NVSHMEM_VENDOR_.*_VERSION")
        .allowlist_type("nvshmemx_status|flags|nvshmemx_init_status_t|nvshmem_team_id_t")
        // CUDA handles cross the boundary as opaque pointers: the caller's cudarc types cast to them.
        .blocklist_type("cudaStream_t|CUstream_st|CUstream|CUmodule|CUmod_st")
        .raw_line("pub type cudaStream_t = *mut ::core::ffi::c_void;")
        .raw_line("pub type CUmodule = *mut ::core::ffi::c_void;")
        .default_enum_style(bindgen::EnumVariation::Consts)
        .layout_tests(false)
        .derive_default(false)
        .generate_comments(false);
    for function in FUNCTIONS {
        builder = builder.allowlist_function(function);
    }
    let bindings = builder
        .generate()
        .expect("bindgen could not parse the NVSHMEM headers");
    bindings
        .write_to_file(&out)
        .expect("could not write bindings.rs");
    eprintln!("wrote {}; run `cargo fmt -p nvshmem-sys`", out.display());
}
