//! The embedded cubins are what `cuModuleLoadData` and `nvshmemx_cumodule_init` need: executable
//! CUDA ELF images that carry NVSHMEM's device state and version symbols and every kernel the
//! crate declares, none of which spills. Checked on the CPU by reading the ELF symbol table and
//! the `.nv.info` section.

use lasp_shmem_kernels::{cubin_for, Cubin, CUBINS, KERNEL_NAMES};
use std::collections::HashMap;

const ET_EXEC: u16 = 2;
const EM_CUDA: u16 = 190;
const SHT_SYMTAB: u32 = 2;
/// `.nv.info` record formats (CUDA ELF): no value, a 16-bit value, a sized payload.
const EIFMT_NVAL: u8 = 1;
const EIFMT_HVAL: u8 = 3;
const EIFMT_SVAL: u8 = 4;
/// `.nv.info` attribute: a function's own stack frame in bytes (payload: symbol index, bytes).
const EIATTR_FRAME_SIZE: u8 = 0x11;

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes(b[at..at + 2].try_into().unwrap())
}
fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}
fn u64_at(b: &[u8], at: usize) -> usize {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap()) as usize
}

/// The NUL-terminated string at `at`.
fn c_str(elf: &[u8], at: usize) -> String {
    let len = elf[at..].iter().position(|&c| c == 0).unwrap();
    String::from_utf8_lossy(&elf[at..at + len]).into_owned()
}

/// Byte offsets of the ELF64 section headers.
fn section_headers(elf: &[u8]) -> Vec<usize> {
    let (shoff, shentsize, shnum) = (
        u64_at(elf, 0x28),
        u16_at(elf, 0x3A) as usize,
        u16_at(elf, 0x3C) as usize,
    );
    (0..shnum).map(|i| shoff + i * shentsize).collect()
}

/// Names in the ELF64 `.symtab` (in symbol-index order), read through its linked string table.
fn symbol_names(elf: &[u8]) -> Vec<String> {
    let headers = section_headers(elf);
    let mut names = Vec::new();
    for &sh in &headers {
        if u32_at(elf, sh + 4) != SHT_SYMTAB {
            continue;
        }
        let (offset, size, link, entsize) = (
            u64_at(elf, sh + 0x18),
            u64_at(elf, sh + 0x20),
            u32_at(elf, sh + 0x28) as usize,
            u64_at(elf, sh + 0x38),
        );
        let strtab = u64_at(elf, headers[link] + 0x18);
        for sym in (offset..offset + size).step_by(entsize) {
            names.push(c_str(elf, strtab + u32_at(elf, sym) as usize));
        }
    }
    names
}

/// Stack-frame bytes per function, from the EIATTR_FRAME_SIZE records of `.nv.info`. Panics on a
/// record format it does not know rather than misread the rest.
fn frame_sizes(elf: &[u8]) -> HashMap<String, u32> {
    let headers = section_headers(elf);
    let names_at = u64_at(elf, headers[u16_at(elf, 0x3E) as usize] + 0x18);
    let symbols = symbol_names(elf);
    let mut frames = HashMap::new();
    for &sh in &headers {
        if c_str(elf, names_at + u32_at(elf, sh) as usize) != ".nv.info" {
            continue;
        }
        let (mut at, end) = (
            u64_at(elf, sh + 0x18),
            u64_at(elf, sh + 0x18) + u64_at(elf, sh + 0x20),
        );
        while at < end {
            let (format, attribute) = (elf[at], elf[at + 1]);
            at += match format {
                EIFMT_NVAL => 2,
                EIFMT_HVAL => 4,
                EIFMT_SVAL => {
                    let size = u16_at(elf, at + 2) as usize;
                    if attribute == EIATTR_FRAME_SIZE && size == 8 {
                        let symbol = &symbols[u32_at(elf, at + 4) as usize];
                        frames.insert(symbol.clone(), u32_at(elf, at + 8));
                    }
                    4 + size
                }
                other => panic!(".nv.info record format {other} at byte {at} is not known here"),
            };
        }
    }
    frames
}

/// Checks that `elf` is an executable (not relocatable) 64-bit CUDA image.
fn assert_executable_cuda_image(elf: &[u8], what: &str) {
    assert_eq!(&elf[..4], b"\x7fELF", "{what}: not an ELF image");
    assert_eq!(elf[4], 2, "{what}: not ELF64");
    assert_eq!(
        u16_at(elf, 0x10),
        ET_EXEC,
        "{what}: relocatable, not linked"
    );
    assert_eq!(u16_at(elf, 0x12), EM_CUDA, "{what}: not a CUDA image");
}

/// Every image of `cubin`: the device-linked one, then the standalone ones.
fn images(cubin: &'static Cubin) -> impl Iterator<Item = &'static [u8]> {
    std::iter::once(cubin.image).chain(cubin.standalone.iter().copied())
}

#[test]
fn every_cubin_is_an_executable_cuda_image_with_nvshmem_state_and_all_kernels() {
    assert!(!CUBINS.is_empty());
    for cubin in CUBINS {
        assert_executable_cuda_image(cubin.image, cubin.arch);
        let names = symbol_names(cubin.image);
        for required in ["nvshmemi_device_state_d", "nvshmemi_device_lib_version_d"] {
            assert!(
                names.iter().any(|n| n == required),
                "{}: no {required}",
                cubin.arch
            );
        }
        // The standalone images carry no NVSHMEM state: the runtime registers only the main one.
        for (i, image) in cubin.standalone.iter().enumerate() {
            let what = format!("{} standalone image {i}", cubin.arch);
            assert_executable_cuda_image(image, &what);
            assert!(
                !symbol_names(image)
                    .iter()
                    .any(|n| n.starts_with("nvshmemi_")),
                "{what}: has NVSHMEM symbols"
            );
        }
        // Every kernel in exactly one image.
        let per_image: Vec<Vec<String>> = images(cubin).map(symbol_names).collect();
        for kernel in KERNEL_NAMES {
            let holders = per_image
                .iter()
                .filter(|names| names.iter().any(|n| n == kernel))
                .count();
            assert_eq!(
                holders, 1,
                "{}: kernel {kernel} in {holders} images",
                cubin.arch
            );
        }
    }
}

/// A stack frame in a kernel means register spills or a local array. The chunk loops keep their
/// state in registers, and the two-role output kernel uses exactly its cap of 168 registers (288
/// threads), so a source or compiler change that spills fails here instead of showing up only as
/// a slower kernel on a GPU.
#[test]
fn no_kernel_has_a_stack_frame() {
    for cubin in CUBINS {
        let frames: HashMap<String, u32> = images(cubin).flat_map(frame_sizes).collect();
        for kernel in KERNEL_NAMES {
            match frames.get(*kernel) {
                Some(0) => {}
                Some(bytes) => panic!(
                    "{}: {kernel} has a {bytes}-byte stack frame (register spills or a local \
                     array; see `cuobjdump -res-usage`)",
                    cubin.arch
                ),
                None => panic!("{}: no frame-size record for {kernel}", cubin.arch),
            }
        }
    }
}

#[test]
fn the_crate_declares_the_exchange_kernels() {
    for kernel in [
        "lasp_allgather",
        "lasp_allgather_check",
        "lasp_allgather_dynamic",
        "lasp_allgather_fill",
        "lasp_allgather_floor",
        "lasp_allgather_peer_major",
        "lasp_pingpong",
    ] {
        assert!(
            KERNEL_NAMES.contains(&kernel),
            "{kernel} not declared: {KERNEL_NAMES:?}"
        );
    }
}

#[test]
fn the_crate_declares_the_output_kernel_probes() {
    for dk in [64, 128] {
        for probe in ["memory", "compute", "no_exp"] {
            let kernel = format!("lasp_scalar_decay_output_dk{dk}_probe_{probe}");
            assert!(
                KERNEL_NAMES.contains(&kernel.as_str()),
                "{kernel} not declared: {KERNEL_NAMES:?}"
            );
        }
    }
}

#[test]
fn hopper_gets_the_sm90a_cubin_and_unknown_devices_none() {
    assert_eq!(cubin_for(9, 0).map(|c| c.arch), Some("sm_90a"));
    assert!(cubin_for(7, 5).is_none());
}
