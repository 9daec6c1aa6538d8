//! The structs NVSHMEM reads by pointer must match the C layout of the pinned headers exactly
//! (`static_assert`s in nvshmem_types.h and nvshmem_uniqueid.h).

use nvshmem_sys::*;
use std::mem::{offset_of, size_of};

#[test]
fn uniqueid_is_128_bytes_with_its_version_stamped() {
    assert_eq!(size_of::<nvshmemx_uniqueid_t>(), 128);
    assert_eq!(uniqueid_initializer().version, (1 << 16) + 128);
}

#[test]
fn init_attr_is_144_bytes_with_every_version_field_stamped() {
    assert_eq!(size_of::<nvshmemx_init_attr_t>(), 144);
    assert_eq!(size_of::<nvshmemx_init_args_t>(), 128);
    assert_eq!(size_of::<nvshmemx_uniqueid_args_t>(), 24);
    assert_eq!(offset_of!(nvshmemx_init_attr_t, mpi_comm), 8);
    assert_eq!(offset_of!(nvshmemx_init_attr_t, args), 16);
    assert_eq!(offset_of!(nvshmemx_init_args_t, uid_args), 8);
    let attr = init_attr_initializer();
    assert_eq!(attr.version, (1 << 16) + 144);
    assert_eq!(attr.args.version, (1 << 16) + 128);
    assert_eq!(attr.args.uid_args.version, (1 << 16) + 24);
    assert_eq!(attr.args.uid_args.myrank, -1);
}

#[test]
fn bindings_come_from_the_pinned_nvshmem() {
    assert_eq!(HEADER_VERSION, (3, 4, 5));
    assert_eq!(flags_NVSHMEMX_INIT_WITH_UNIQUEID, 1 << 3);
    assert_eq!(nvshmemx_init_status_t_NVSHMEM_STATUS_IS_INITIALIZED, 2);
}
