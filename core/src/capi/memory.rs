//! Checks of the raw device pointers a C caller passes, before anything is enqueued.
//!
//! A Rust caller's views come from buffers the borrow checker tracks; a C caller's are bare
//! addresses. A host pointer, a tensor of another GPU or one shorter than the shape says would
//! otherwise fault inside a kernel (which ends the whole CUDA context) or read a neighbour's
//! memory: the driver's pointer attributes catch those here, with the tensor's name.

use crate::error::{Error, Result};
use cudarc::driver::sys::{self, CUmemorytype, CUpointer_attribute};
use std::ffi::c_void;

/// What the driver knows about one address.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PointerFacts {
    /// `CU_MEMORYTYPE_*` as a number; 0 for an address the driver does not know.
    pub memory_type: u32,
    pub device_ordinal: i32,
    /// The allocation holding the address: its first byte and its length.
    pub range_start: u64,
    pub range_bytes: u64,
}

/// Asks the driver about `addr` (any address: an unknown one gives memory type 0).
pub fn pointer_facts(addr: u64) -> Result<PointerFacts> {
    let mut facts = PointerFacts::default();
    let mut range_bytes: usize = 0;
    let mut attributes = [
        CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
        CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
        CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
        CUpointer_attribute::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
    ];
    let mut data: [*mut c_void; 4] = [
        (&mut facts.memory_type as *mut u32).cast(),
        (&mut facts.device_ordinal as *mut i32).cast(),
        (&mut facts.range_start as *mut u64).cast(),
        (&mut range_bytes as *mut usize).cast(),
    ];
    // SAFETY: each data pointer points at a live variable of the attribute's type (unsigned int,
    // int, CUdeviceptr, size_t); unknown addresses leave them at their defaults and succeed.
    let rc = unsafe {
        sys::cuPointerGetAttributes(
            attributes.len() as u32,
            attributes.as_mut_ptr(),
            data.as_mut_ptr(),
            addr,
        )
    };
    if rc != sys::CUresult::CUDA_SUCCESS {
        return Err(Error::from_driver(
            "cuPointerGetAttributes",
            &cudarc::driver::DriverError(rc),
        ));
    }
    facts.range_bytes = range_bytes as u64;
    Ok(facts)
}

/// Checks that `bytes` bytes from `addr` are GPU memory of device `ordinal`, inside one
/// allocation; `name` and `what` (the tensor and its layout) go into the message.
pub fn check_device_range(
    name: &str,
    what: &str,
    addr: u64,
    bytes: u64,
    ordinal: usize,
) -> Result<()> {
    if addr == 0 {
        return Err(Error::InvalidArgument(format!(
            "{name} is NULL; pass the device pointer of a CUDA tensor {what}"
        )));
    }
    verdict(name, what, addr, bytes, ordinal, pointer_facts(addr)?)
}

/// The decision of [`check_device_range`] on the driver's facts (pure, for tests).
fn verdict(
    name: &str,
    what: &str,
    addr: u64,
    bytes: u64,
    ordinal: usize,
    facts: PointerFacts,
) -> Result<()> {
    let device = CUmemorytype::CU_MEMORYTYPE_DEVICE as u32;
    let unified = CUmemorytype::CU_MEMORYTYPE_UNIFIED as u32;
    if facts.memory_type != device && facts.memory_type != unified {
        let kind = if facts.memory_type == CUmemorytype::CU_MEMORYTYPE_HOST as u32 {
            "page-locked host memory"
        } else {
            "not memory the CUDA driver knows (a host pointer?)"
        };
        return Err(Error::InvalidArgument(format!(
            "{name} at {addr:#x} is {kind}; pass the device pointer of a CUDA tensor {what} on \
             GPU {ordinal}"
        )));
    }
    if facts.device_ordinal != ordinal as i32 {
        return Err(Error::InvalidArgument(format!(
            "{name} at {addr:#x} lives on GPU {} but this rank's runtime runs on GPU {ordinal}; \
             move the tensor to GPU {ordinal} (the local rank selects the GPU)",
            facts.device_ordinal
        )));
    }
    let end = facts.range_start.saturating_add(facts.range_bytes);
    let need_end = addr.saturating_add(bytes);
    if need_end > end {
        return Err(Error::InvalidArgument(format!(
            "{name} needs {bytes} bytes from {addr:#x} ({what}) but its allocation ends {} \
             bytes after {addr:#x}; the tensor is smaller than the shape says: check B, T, H, Dk \
             and Dv against its size",
            end.saturating_sub(addr)
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(memory_type: CUmemorytype, ordinal: i32, start: u64, bytes: u64) -> PointerFacts {
        PointerFacts {
            memory_type: memory_type as u32,
            device_ordinal: ordinal,
            range_start: start,
            range_bytes: bytes,
        }
    }

    #[test]
    fn device_ranges_inside_one_allocation_pass() {
        let f = facts(CUmemorytype::CU_MEMORYTYPE_DEVICE, 2, 0x1000, 0x1000);
        assert!(verdict("q", "[B, T, H, Dk] bf16", 0x1000, 0x1000, 2, f).is_ok());
        assert!(verdict("q", "[B, T, H, Dk] bf16", 0x1800, 0x800, 2, f).is_ok());
        let managed = facts(CUmemorytype::CU_MEMORYTYPE_UNIFIED, 0, 0, 64);
        assert!(verdict("g", "[B, T, H] fp32", 0, 64, 0, managed).is_ok());
    }

    #[test]
    fn host_memory_other_gpus_and_short_tensors_are_named() {
        let msg = |f: PointerFacts, addr: u64, bytes: u64| {
            verdict("k", "[B, T, H, Dk] bf16", addr, bytes, 1, f)
                .unwrap_err()
                .to_string()
        };
        let unknown = PointerFacts::default();
        assert!(msg(unknown, 0x10, 4).contains("k at 0x10 is not memory the CUDA driver knows"));
        let pinned = facts(CUmemorytype::CU_MEMORYTYPE_HOST, 1, 0x10, 64);
        assert!(msg(pinned, 0x10, 4).contains("page-locked host memory"));
        let elsewhere = facts(CUmemorytype::CU_MEMORYTYPE_DEVICE, 3, 0x10, 64);
        assert!(msg(elsewhere, 0x10, 4)
            .contains("lives on GPU 3 but this rank's runtime runs on GPU 1"));
        let short = facts(CUmemorytype::CU_MEMORYTYPE_DEVICE, 1, 0x1000, 0x100);
        let text = msg(short, 0x1080, 0x100);
        assert!(
            text.contains("k needs 256 bytes from 0x1080") && text.contains("ends 128 bytes after"),
            "{text}"
        );
    }

    #[test]
    fn null_is_rejected_without_asking_the_driver() {
        let msg = check_device_range("v", "[B, T, H, Dv] bf16", 0, 8, 0)
            .unwrap_err()
            .to_string();
        assert_eq!(
            msg,
            "v is NULL; pass the device pointer of a CUDA tensor [B, T, H, Dv] bf16"
        );
    }
}
