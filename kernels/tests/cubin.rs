//! The embedded cubins are what `cuModuleLoadData` and `nvshmemx_cumodule_init` need: executable
//! CUDA ELF images that carry NVSHMEM's device state and version symbols and every kernel the
//! crate declares. Checked on the CPU by reading the ELF symbol table.

use lasp_shmem_kernels::{cubin_for, CUBINS, KERNEL_NAMES};

const ET_EXEC: u16 = 2;
const EM_CUDA: u16 = 190;
const SHT_SYMTAB: u32 = 2;

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes(b[at..at + 2].try_into().unwrap())
}
fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}
fn u64_at(b: &[u8], at: usize) -> usize {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap()) as usize
}

/// Names in the ELF64 `.symtab`, read through its linked string table.
fn symbol_names(elf: &[u8]) -> Vec<String> {
    let (shoff, shentsize, shnum) = (
        u64_at(elf, 0x28),
        u16_at(elf, 0x3A) as usize,
        u16_at(elf, 0x3C) as usize,
    );
    let section = |i: usize| shoff + i * shentsize;
    let mut names = Vec::new();
    for i in 0..shnum {
        let sh = section(i);
        if u32_at(elf, sh + 4) != SHT_SYMTAB {
            continue;
        }
        let (offset, size, link, entsize) = (
            u64_at(elf, sh + 0x18),
            u64_at(elf, sh + 0x20),
            u32_at(elf, sh + 0x28) as usize,
            u64_at(elf, sh + 0x38),
        );
        let strtab = u64_at(elf, section(link) + 0x18);
        for sym in (offset..offset + size).step_by(entsize) {
            let name_at = strtab + u32_at(elf, sym) as usize;
            let len = elf[name_at..].iter().position(|&c| c == 0).unwrap();
            names.push(String::from_utf8_lossy(&elf[name_at..name_at + len]).into_owned());
        }
    }
    names
}

#[test]
fn every_cubin_is_an_executable_cuda_image_with_nvshmem_state_and_all_kernels() {
    assert!(!CUBINS.is_empty());
    for cubin in CUBINS {
        let elf = cubin.image;
        assert_eq!(&elf[..4], b"\x7fELF", "{}: not an ELF image", cubin.arch);
        assert_eq!(elf[4], 2, "{}: not ELF64", cubin.arch);
        assert_eq!(
            u16_at(elf, 0x10),
            ET_EXEC,
            "{}: relocatable, not device-linked",
            cubin.arch
        );
        assert_eq!(
            u16_at(elf, 0x12),
            EM_CUDA,
            "{}: not a CUDA image",
            cubin.arch
        );
        let names = symbol_names(elf);
        for required in ["nvshmemi_device_state_d", "nvshmemi_device_lib_version_d"] {
            assert!(
                names.iter().any(|n| n == required),
                "{}: no {required}",
                cubin.arch
            );
        }
        for kernel in KERNEL_NAMES {
            assert!(
                names.iter().any(|n| n == kernel),
                "{}: kernel {kernel} missing",
                cubin.arch
            );
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
