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
    encode(
        what,
        Element::BF16,
        addr,
        &dims_inner_first,
        &[64, 1, 64, 1],
        sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
    )
}

/// The map of a dense fp32 tensor `[B][T][N]` of per-token values (`dims_inner_first` = `[N, T,
/// B]`) at device address `addr`, read in boxes of `box_columns` x 64 tokens x 1 sequence,
/// unswizzled; tokens past the edge read zeros. A box row takes a multiple of 16 bytes, and so
/// must N's stride and the base.
pub fn f32_token_boxes(
    what: &str,
    addr: u64,
    dims_inner_first: [usize; 3],
    box_columns: u32,
) -> Result<TensorMap> {
    encode(
        what,
        Element::F32,
        addr,
        &dims_inner_first,
        &[box_columns, 64, 1],
        sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_NONE,
    )
}

/// An element type of a map: the driver's code, its bytes and its name in messages.
struct Element {
    dtype: sys::CUtensorMapDataType,
    bytes: u64,
    name: &'static str,
}

impl Element {
    const BF16: Element = Element {
        dtype: sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        bytes: 2,
        name: "bf16",
    };
    const F32: Element = Element {
        dtype: sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
        bytes: 4,
        name: "fp32",
    };
}

/// Encodes the tiled map of a dense tensor of `dims` (innermost first, the innermost contiguous)
/// of `element`s at `addr`, read in boxes of `box_dims` with `swizzle`; boxes past the edge read
/// zeros.
fn encode(
    what: &str,
    element: Element,
    addr: u64,
    dims: &[usize],
    box_dims: &[u32],
    swizzle: sys::CUtensorMapSwizzle,
) -> Result<TensorMap> {
    let rank = dims.len();
    assert!(rank == box_dims.len() && (1..=5).contains(&rank));
    let dims: Vec<u64> = dims.iter().map(|&d| d as u64).collect();
    // Byte strides of dimensions 1.. (dimension 0 is contiguous).
    let strides: Vec<u64> = (1..rank)
        .map(|i| dims[..i].iter().product::<u64>() * element.bytes)
        .collect();
    let element_strides = vec![1u32; rank];
    let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::uninit();
    // SAFETY: every pointer refers to a live vector or slice of the length the call reads (rank
    // dimensions, box sizes and element strides, rank - 1 strides) and `map` has room for one
    // CUtensorMap. The call only encodes: it does not touch device memory.
    let rc = unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            element.dtype,
            rank as u32,
            addr as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            box_dims.as_ptr(),
            element_strides.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            swizzle,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    rc.result().map_err(|e| {
        Error::InvalidArgument(format!(
            "{what}: the Tensor Memory Accelerator cannot address this tensor ({}): it needs a \
             16-byte-aligned base address, rows of a multiple of 16 bytes and at most 2^32 \
             elements per dimension; pass a contiguous {} tensor allocated by CUDA",
            describe_driver_error(&e),
            element.name
        ))
    })?;
    // SAFETY: cuTensorMapEncodeTiled returned success, so it wrote the whole map.
    let map = unsafe { map.assume_init() };
    Ok(TensorMap { opaque: map.opaque })
}
