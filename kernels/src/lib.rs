//! CUDA kernels of lasp-shmem, embedded as executable cubins.
//!
//! `build.rs` compiles every `cuda/*.cu` with `-rdc=true` and device-links the objects with
//! NVSHMEM's device archive (`libnvshmem_device.a`) into one cubin per target architecture. The
//! cubin therefore carries NVSHMEM's device state (`nvshmemi_device_state_d`) and must be
//! registered with `nvshmemx_cumodule_init` after `cuModuleLoadData`, before any launch.

/// An executable cubin for one GPU architecture.
#[derive(Debug, Clone, Copy)]
pub struct Cubin {
    /// The nvcc target, e.g. `sm_90a`.
    pub arch: &'static str,
    /// The ELF image to pass to `cuModuleLoadData`.
    pub image: &'static [u8],
}

include!(concat!(env!("OUT_DIR"), "/cubins.rs"));

/// The cubin for a device of compute capability `major.minor`, if one was built for it.
///
/// Architecture-specific targets (`sm_90a`) run only on exactly that major and minor version.
pub fn cubin_for(major: i32, minor: i32) -> Option<&'static Cubin> {
    let wanted = format!("sm_{major}{minor}");
    CUBINS
        .iter()
        .find(|cubin| cubin.arch.trim_end_matches(['a', 'f']) == wanted)
}

/// The names of the templated kernels, one constant per row of `kernels/instances.rs` (an array
/// indexed like [`instances::DK_WIDTHS`] for per-Dk rows).
pub mod instances {
    include!(concat!(env!("OUT_DIR"), "/instances.rs"));
}
