//! Tensor maps: the descriptors the Tensor Memory Accelerator (sm_90) copies tiles through. A map
//! is encoded on the host for one tensor (address, dimensions, strides, box, swizzle) and passed to
//! a kernel inside its by-value parameters (`lasp_tensor_map` in the kernels' headers).

use crate::error::{describe_driver_error, Error, Result};
use cudarc::driver::sys;

/// An encoded `CUtensorMap` as the kernels' parameters hold it: `lasp_tensor_map`, 128 opaque
/// bytes, 128-byte aligned (CUDA 13).
pub type TensorMap = lasp_shmem_kernels::params::lasp_tensor_map;

/// The map of a dense bf16 tensor `[B][T][H][D]` (`dims_inner_first` = `[D, H, T, B]`, the last
/// index contiguous) at device address `addr`, read in boxes of 64 columns x 1 head x 64 tokens x
/// 1 sequence with the 128-byte swizzle of the kernels' shared-memory tiles. Boxes reaching past
/// the tensor's edge (a ragged last chunk) are filled with zeros there.
pub fn bf16_token_tiles(what: &str, addr: u64, dims_inner_first: [usize; 4]) -> Result<TensorMap> {
    const BF16_BYTES: u64 = 2;
    let dims = dims_inner_first.map(|d| d as u64);
    // Byte strides of dimensions 1..3 (dimension 0 is contiguous).
    let strides = [
        dims[0] * BF16_BYTES,
        dims[0] * dims[1] * BF16_BYTES,
        dims[0] * dims[1] * dims[2] * BF16_BYTES,
    ];
    let box_dims: [u32; 4] = [64, 1, 64, 1];
    let element_strides: [u32; 4] = [1; 4];
    let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::uninit();
    // SAFETY: every pointer refers to a live local array of the length the call reads (rank 4:
    // 4 dimensions, 3 strides, 4 box sizes, 4 element strides) and `map` has room for one
    // CUtensorMap. The call only encodes: it does not touch device memory.
    let rc = unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            4,
            addr as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            box_dims.as_ptr(),
            element_strides.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    rc.result().map_err(|e| {
        Error::InvalidArgument(format!(
            "{what}: the Tensor Memory Accelerator cannot address this tensor ({}): it needs a \
             16-byte-aligned base address and at most 2^32 elements per dimension; pass a \
             contiguous bf16 tensor allocated by CUDA",
            describe_driver_error(&e)
        ))
    })?;
    // SAFETY: cuTensorMapEncodeTiled returned success, so it wrote the whole map.
    let map = unsafe { map.assume_init() };
    Ok(TensorMap { opaque: map.opaque })
}
