//! Checks of what a caller passes, before anything uses it: pointers to its structs and their
//! sizes and reserved fields, out-pointers, counts and its stream.

use super::abi::{SizedStruct, ABI_VERSION};
use crate::error::{Error, Result};
use crate::runtime::Runtime;
use cudarc::driver::{sys, CudaStream};
use std::sync::Arc;

pub(super) fn invalid(msg: String) -> Error {
    Error::InvalidArgument(msg)
}

/// This library, as messages name it.
pub(super) fn this_library() -> String {
    format!(
        "lasp-shmem {} (ABI {ABI_VERSION})",
        env!("CARGO_PKG_VERSION")
    )
}

/// `*ptr` for a pointer the caller passed, or an error naming the argument.
///
/// # Safety
/// A non-NULL `ptr` must point at a live, properly aligned `T` for `'a`.
pub(super) unsafe fn arg<'a, T>(ptr: *const T, name: &str) -> Result<&'a T> {
    // SAFETY: the caller's contract.
    unsafe { ptr.as_ref() }.ok_or_else(|| invalid(format!("{name} is NULL")))
}

/// `*ptr` for a struct of the header that begins with `struct_size`, once that size is this
/// build's. The size is read first, alone, so that a struct of another size is never read whole.
///
/// # Safety
/// A non-NULL `ptr` must point at a live, aligned struct of at least 4 bytes whose first field
/// is its `struct_size`, and, where that says `size_of::<T>()`, at a `T` for `'a`.
pub(super) unsafe fn sized_arg<'a, T: SizedStruct>(ptr: *const T, name: &str) -> Result<&'a T> {
    if ptr.is_null() {
        return Err(invalid(format!("{name} is NULL")));
    }
    // SAFETY: the caller's contract: the struct begins with its u32 size (SizedStruct).
    let size = unsafe { ptr.cast::<u32>().read() };
    check_struct_size::<T>(name, size)?;
    // SAFETY: the caller's contract, now that the caller's struct has this build's size.
    Ok(unsafe { &*ptr })
}

/// The one `struct_size` this build knows for `T`. (When a struct grows, the older sizes are
/// accepted here and the missing tail read as zero.)
pub(super) fn check_struct_size<T: SizedStruct>(name: &str, size: u32) -> Result<()> {
    let known = std::mem::size_of::<T>();
    if size as usize == known {
        return Ok(());
    }
    let c_name = T::C_NAME;
    let what = if size == 0 {
        format!("{name}.struct_size is 0; set it to sizeof({c_name})")
    } else {
        format!(
            "{name}.struct_size is {size} but {} knows {c_name} of {known} bytes; set it to \
             sizeof({c_name}) and compile against the lasp_shmem.h of the library you load",
            this_library()
        )
    };
    Err(invalid(what))
}

/// Fails on the first non-zero entry of reserved fields, which a later ABI may give a meaning.
pub(super) fn check_reserved<T: Into<u64> + Copy>(name: &str, fields: &[T]) -> Result<()> {
    match fields.iter().position(|&v| v.into() != 0) {
        None => Ok(()),
        Some(i) => {
            let index = if fields.len() > 1 {
                format!("[{i}]")
            } else {
                String::new()
            };
            Err(invalid(format!(
                "{name}{index} is {:#x}; reserved fields must be 0: zero-initialise the struct \
                 (= {{0}} or memset) before filling it",
                fields[i].into()
            )))
        }
    }
}

/// Writes `value` to an out-pointer the caller passed.
///
/// # Safety
/// A non-NULL `ptr` must point at writable memory for a `T`.
pub(super) unsafe fn put<T>(ptr: *mut T, name: &str, value: T) -> Result<()> {
    if ptr.is_null() {
        return Err(invalid(format!(
            "{name} is NULL; pass where to store the result"
        )));
    }
    // SAFETY: the caller's contract; `write` does not drop the uninitialised old value.
    unsafe { ptr.write(value) };
    Ok(())
}

/// A count the caller passed as a signed C integer, as a `usize`; `name` goes into the error.
pub(super) fn count<T: TryInto<usize> + Copy + std::fmt::Display>(
    name: &str,
    v: T,
) -> Result<usize> {
    v.try_into()
        .map_err(|_| invalid(format!("{name} = {v} is negative")))
}

/// The caller's stream, checked to belong to the runtime's context.
pub(super) fn borrowed_stream(runtime: &Runtime, stream: sys::CUstream) -> Result<Arc<CudaStream>> {
    let ctx = runtime.context();
    ctx.bind_to_thread()?;
    let mut owner: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: writes one CUcontext; an invalid stream handle is reported, not dereferenced
    // (the driver validates handles it was given).
    let rc = unsafe { sys::cuStreamGetCtx(stream, &mut owner) };
    if rc != sys::CUresult::CUDA_SUCCESS {
        return Err(invalid(format!(
            "stream {stream:p} is not a CUDA stream the driver knows ({rc:?}); pass a stream of \
             GPU {} (torch.cuda.current_stream().cuda_stream)",
            ctx.ordinal()
        )));
    }
    if owner != ctx.cu_ctx() {
        return Err(invalid(format!(
            "stream {stream:p} belongs to another CUDA context than the runtime's (the primary \
             context of GPU {}); create the stream on that GPU",
            ctx.ordinal()
        )));
    }
    // SAFETY: the stream belongs to this context (checked above); the caller keeps it alive
    // during the call and orders its own work on it, which is the ABI's contract.
    Ok(unsafe { ctx.wrap_borrowed_stream(stream) })
}
