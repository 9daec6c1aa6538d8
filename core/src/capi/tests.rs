//! Unit tests of the C ABI's host side: the structs, codes, modes and exported functions against
//! the header's text, and the checks of options and call arguments.

// Lint debt: this module is being rewritten; remove with the rewrite.
#![allow(clippy::undocumented_unsafe_blocks, unsafe_op_in_unsafe_fn)]

use super::args::{backward_views, device_views};
use super::lasp2::exchange_mode;
use super::runtime::config_of;
use super::status::*;
use super::*;
use crate::ops::scalar_decay::lasp2::ExchangeMode;
use std::collections::BTreeSet;
use std::mem::{offset_of, size_of};
use std::path::PathBuf;
use std::time::Duration;

const HEADER: &str = include_str!("../../include/lasp_shmem.h");

/// `#define NAME VALUE` lines of the header (VALUE without a `u` suffix).
fn header_define(name: &str) -> u32 {
    HEADER
        .lines()
        .filter_map(|l| l.strip_prefix("#define "))
        .find_map(|l| {
            let mut words = l.split_whitespace();
            (words.next() == Some(name)).then(|| words.next().expect("a value"))
        })
        .unwrap_or_else(|| panic!("{name} is not defined in lasp_shmem.h"))
        .trim_end_matches('u')
        .parse()
        .expect("a number")
}

#[test]
fn structs_have_the_layout_the_header_asserts() {
    assert_eq!(size_of::<RuntimeOptions>(), 32);
    assert_eq!(offset_of!(RuntimeOptions, symmetric_heap_bytes), 8);
    assert_eq!(offset_of!(RuntimeOptions, nvshmem_library), 24);
    assert_eq!(size_of::<Place>(), 16);
    assert_eq!(size_of::<UniqueId>(), 128);
    assert_eq!(size_of::<ForwardArgsC>(), 104);
    assert_eq!(offset_of!(ForwardArgsC, q), 40);
    assert_eq!(offset_of!(ForwardArgsC, ht), 88);
    assert_eq!(offset_of!(ForwardArgsC, scale), 96);
    assert_eq!(size_of::<BackwardArgsC>(), 144);
    assert_eq!(offset_of!(BackwardArgsC, q), 40);
    assert_eq!(offset_of!(BackwardArgsC, grad_o), 80);
    assert_eq!(offset_of!(BackwardArgsC, grad_q), 96);
    assert_eq!(offset_of!(BackwardArgsC, grad_h0), 128);
    assert_eq!(offset_of!(BackwardArgsC, scale), 136);
    for (name, size) in [
        ("lasp_runtime_options", 32),
        ("lasp_place", 16),
        ("lasp_unique_id", 128),
        ("lasp_forward_args", 104),
        ("lasp_backward_args", 144),
    ] {
        let assertion = format!("_Static_assert(sizeof({name}) == {size},");
        assert!(HEADER.contains(&assertion), "the header lacks {assertion}");
    }
}

#[test]
fn the_header_defines_the_codes_and_modes_of_the_library() {
    assert_eq!(header_define("LASP_SHMEM_ABI_VERSION"), ABI_VERSION);
    for (name, code) in [
        ("LASP_OK", LASP_OK),
        ("LASP_ERROR_INVALID_ARGUMENT", LASP_ERROR_INVALID_ARGUMENT),
        ("LASP_ERROR_LAUNCH", LASP_ERROR_LAUNCH),
        ("LASP_ERROR_CUDA", LASP_ERROR_CUDA),
        ("LASP_ERROR_NVSHMEM", LASP_ERROR_NVSHMEM),
        ("LASP_ERROR_PEER_TIMEOUT", LASP_ERROR_PEER_TIMEOUT),
        ("LASP_ERROR_STATE", LASP_ERROR_STATE),
        ("LASP_ERROR_INTERNAL", LASP_ERROR_INTERNAL),
    ] {
        assert_eq!(header_define(name) as Status, code, "{name}");
    }
    for (name, mode) in [
        ("LASP_MODE_OVERLAPPED", ExchangeMode::Overlapped),
        ("LASP_MODE_SEQUENTIAL_NCCL", ExchangeMode::SequentialNccl),
        (
            "LASP_MODE_SEQUENTIAL_NVSHMEM",
            ExchangeMode::SequentialNvshmem,
        ),
        ("LASP_MODE_NO_COMM", ExchangeMode::NoComm),
    ] {
        assert_eq!(
            exchange_mode(header_define(name) as i32).unwrap(),
            mode,
            "{name}"
        );
    }
    assert!(exchange_mode(4).is_err() && exchange_mode(-1).is_err());
}

#[test]
fn the_header_declares_exactly_the_exported_functions() {
    let sources = [
        include_str!("mod.rs"),
        include_str!("abi.rs"),
        include_str!("args.rs"),
        include_str!("handles.rs"),
        include_str!("runtime.rs"),
        include_str!("lasp2.rs"),
        include_str!("scalar_decay.rs"),
        include_str!("status.rs"),
    ];
    let exported: BTreeSet<&str> = sources
        .iter()
        .flat_map(|s| s.split("extern \"C\" fn ").skip(1))
        .map(|rest| rest.split('(').next().expect("a name"))
        .collect();
    // The identifier before each '(' of the header, where it names a lasp_ function.
    let declared: BTreeSet<&str> = HEADER
        .split('(')
        .filter_map(|before| {
            before
                .rsplit(|c: char| !(c.is_alphanumeric() || c == '_'))
                .next()
        })
        .filter(|w| w.starts_with("lasp_"))
        .collect();
    assert_eq!(exported, declared);
    assert_eq!(exported.len(), 27);
}

#[test]
fn options_are_read_and_checked() {
    assert_eq!(
        unsafe { config_of(std::ptr::null()) }
            .unwrap()
            .symmetric_heap_bytes,
        256 << 20
    );
    let library = c"/opt/nvshmem/lib/libnvshmem_host.so.3";
    let options = RuntimeOptions {
        abi_version: ABI_VERSION,
        reserved: 0,
        symmetric_heap_bytes: 1 << 30,
        wait_timeout_ms: 2500,
        nvshmem_library: library.as_ptr(),
    };
    // SAFETY: a valid struct with a NUL-terminated path.
    let config = unsafe { config_of(&options) }.unwrap();
    assert_eq!(config.symmetric_heap_bytes, 1 << 30);
    assert_eq!(config.wait_timeout, Duration::from_millis(2500));
    assert_eq!(
        config.nvshmem_library.unwrap(),
        PathBuf::from("/opt/nvshmem/lib/libnvshmem_host.so.3")
    );
    let stale = RuntimeOptions {
        abi_version: 0,
        ..options
    };
    // SAFETY: as above.
    let msg = unsafe { config_of(&stale) }.unwrap_err().to_string();
    assert!(
        msg.contains("abi_version is 0 but this library implements ABI 1"),
        "{msg}"
    );
}

#[test]
fn forward_arguments_are_checked_before_the_driver_is_asked() {
    let args = |dk: i64, tokens: i64| ForwardArgsC {
        batch: 1,
        tokens,
        heads: 2,
        dk,
        dv: 64,
        q: std::ptr::null(),
        k: std::ptr::null(),
        v: std::ptr::null(),
        g: std::ptr::null(),
        h0: std::ptr::null(),
        o: std::ptr::null_mut(),
        ht: std::ptr::null_mut(),
        scale: 0.0,
        reserved: 0,
    };
    // SAFETY: only the shape and NULL pointers are looked at: no device memory is touched.
    let msg = |a: ForwardArgsC| unsafe { device_views(&a, 0) }.unwrap_err().to_string();
    assert!(msg(args(128, -1)).contains("args.tokens = -1 is negative"));
    assert!(msg(args(32, 8)).contains("Dk = 32 is not supported"));
    assert!(msg(args(64, 0)).contains("B, T and H must be at least 1"));
    assert!(msg(args(64, 8)).starts_with("q is NULL; pass the device pointer"));
}

#[test]
fn backward_arguments_are_checked_before_the_driver_is_asked() {
    let args = |dv: i64, heads: i64| BackwardArgsC {
        batch: 2,
        tokens: 100,
        heads,
        dk: 128,
        dv,
        q: std::ptr::null(),
        k: std::ptr::null(),
        v: std::ptr::null(),
        g: std::ptr::null(),
        h0: std::ptr::null(),
        grad_o: std::ptr::null(),
        grad_ht: std::ptr::null(),
        grad_q: std::ptr::null_mut(),
        grad_k: std::ptr::null_mut(),
        grad_v: std::ptr::null_mut(),
        grad_g: std::ptr::null_mut(),
        grad_h0: std::ptr::null_mut(),
        scale: 0.0,
        reserved: 0,
    };
    // SAFETY: only the shape and NULL pointers are looked at: no device memory is touched.
    let msg = |a: BackwardArgsC| unsafe { backward_views(&a, 0) }.unwrap_err().to_string();
    assert!(msg(args(64, -3)).contains("args.heads = -3 is negative"));
    assert!(msg(args(64, 0)).contains("B, T and H must be at least 1"));
    assert!(msg(args(64, 4)).starts_with("q is NULL; pass the device pointer"));
}
