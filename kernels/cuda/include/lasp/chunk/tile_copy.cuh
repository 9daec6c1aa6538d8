// Tile loads of the chunkwise kernels of every family: a chunk's [64 x D] bf16 rows of the fla
// layout into the swizzled shared-memory tiles that ldmatrix and wgmma read (lasp::swizzle), by
// cp.async with zero fill for the rows past the sequence.
#pragma once
#include <stdint.h>

#include "lasp/mma.cuh"

namespace lasp {
namespace chunk {

constexpr int kChunk = 64;  // tokens per chunk, in every family's chunkwise kernels

// Async copy (by a CTA of kThreads threads) of a [kChunk x 8*kRowChunks] bf16 tile whose row r starts at row0 + r*stride (elements)
// into swizzled shared memory at dst (lasp::swizzle with kChunk rows). Rows >= valid_rows are
// zero-filled (ragged last chunk).
// Thread tid always copies 16-byte chunk tid % kRowChunks of rows tid / kRowChunks + i*kRowStep:
// consecutive threads read consecutive 16 B of a row, and the shared offsets step by constants.
template <int kRowChunks, int kThreads>
__device__ __forceinline__ void copy_tile_async(uint32_t dst, const uint16_t* row0, int64_t stride, int valid_rows,
                                                int tid) {
  constexpr int kRowStep = kThreads / kRowChunks;
  constexpr int kPerThread = kChunk / kRowStep;
  static_assert(kRowStep % 8 == 0 && kPerThread * kRowStep == kChunk, "rows must keep their swizzle phase");
  const int r0 = tid / kRowChunks, c = tid % kRowChunks;
  const uint16_t* src = row0 + r0 * stride + c * 8;
  const int64_t src_step = kRowStep * stride;
  dst += swizzle(r0, c, kChunk);  // rows r0 + i*kRowStep share r0 % 8, hence the swizzle
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const bool ok = r0 + i * kRowStep < valid_rows;
    cp_async_16(dst + i * kRowStep * 128, ok ? src : row0, ok);
    src += src_step;
  }
}

// copy_tile_async for a chunk whose first rows may be virtual too: rows outside [first_valid,
// valid_rows) are zero-filled and not read, and `mapped` is the mapped address the zero-filling
// copies name (row0 itself may lie outside the tensor: a reversed loop's leading virtual tokens).
// Kept beside copy_tile_async rather than serving as it with first_valid = 0: ptxas keeps the
// r >= 0 test (it cannot prove tid >= 0), which adds 8-40 instructions to every in-order loop.
template <int kRowChunks, int kThreads>
__device__ __forceinline__ void copy_tile_range_async(uint32_t dst, const uint16_t* row0, int64_t stride,
                                                      int first_valid, int valid_rows, const uint16_t* mapped,
                                                      int tid) {
  constexpr int kRowStep = kThreads / kRowChunks;
  constexpr int kPerThread = kChunk / kRowStep;
  static_assert(kRowStep % 8 == 0 && kPerThread * kRowStep == kChunk, "rows must keep their swizzle phase");
  const int r0 = tid / kRowChunks, c = tid % kRowChunks;
  const uint16_t* src = row0 + r0 * stride + c * 8;
  const int64_t src_step = kRowStep * stride;
  dst += swizzle(r0, c, kChunk);
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int r = r0 + i * kRowStep;
    const bool ok = r >= first_valid && r < valid_rows;
    cp_async_16(dst + i * kRowStep * 128, ok ? src : mapped, ok);
    src += src_step;
  }
}

}  // namespace chunk
}  // namespace lasp
