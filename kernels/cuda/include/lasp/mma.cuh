// Warp-level tensor-core, async-copy and barrier primitives (sm_80+ PTX, used on sm_90a): ldmatrix,
// mma.sync m16n8k16 bf16 -> fp32 and m16n8k8 tf32 -> fp32, cp.async with zero fill, bf16x2 packing,
// the swizzled tile layout, named barriers.
//
// Fragment layouts of mma.m16n8k16 (lane = 4*g + t, g = lane / 4, t = lane % 4):
//   A 16x16 (row-major): a0 = A[g][2t..2t+1], a1 = A[g+8][2t..], a2 = A[g][2t+8..], a3 = A[g+8][2t+8..]
//   B 16x8  (k x n):     b0 = B[2t..2t+1][g], b1 = B[2t+8..2t+9][g]
//   C 16x8  (fp32):      c0,c1 = C[g][2t..2t+1], c2,c3 = C[g+8][2t..2t+1]
// Each 32-bit register holds two bf16, the lower column (or k) index in the low half.
// Fragment layouts of mma.m16n8k8 with .tf32 (one element per register):
//   A 16x8 (row-major):  a0 = A[g][t], a1 = A[g+8][t], a2 = A[g][t+4], a3 = A[g+8][t+4]
//   B 8x8  (k x n):      b0 = B[t][g], b1 = B[t+4][g]
//   C 16x8 (fp32):       as m16n8k16's
#pragma once
#include <stdint.h>

namespace lasp {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// The 128-byte-swizzled tile layout of every bf16 tile in shared memory, which is also the layout
// wgmma reads with SWIZZLE_128B (K-major or MN-major) when a block starts 1024-byte aligned. Rows
// are 64 elements (128 B); a tile wider than that is stored as column blocks of `rows` x 128 B one
// after the other. Byte offset of 16-byte chunk `chunk` of row `row`: within a block, chunk c of row
// r sits at c ^ (r % 8), so the 8 rows one 8x8 ldmatrix reads (and the rows one fragment store
// writes) fall in 8 different bank groups: conflict-free.
__device__ __forceinline__ uint32_t swizzle(int row, int chunk, int rows) {
  return static_cast<uint32_t>((chunk >> 3) * rows * 128 + row * 128 + (((chunk ^ row) & 7) << 4));
}

// Four 8x8 b16 matrices; lane l gives the row address of matrix l / 8.
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// Same, each matrix transposed (lane gets column g's elements 2t, 2t+1).
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// d += A * B, bf16 inputs, fp32 accumulate.
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// d += A * B, tf32 inputs (fp32 patterns rounded by tf32_rn), fp32 accumulate.
__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// fp32 to tf32 (10 mantissa bits, nearest even), as a 32-bit pattern whose low 13 bits are zero:
// also the fp32 of that value. The .rn form (sm_90) is one instruction (F2FP.TF32); .rna, the form
// sm_80 has, is emulated in three.
__device__ __forceinline__ uint32_t tf32_rn(float x) {
  uint32_t r;
  asm("cvt.rn.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return r;
}

// Round two fp32 to bf16 (nearest even) and pack: lo in bits 0..15, hi in bits 16..31.
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// Multiply the two bf16 halves of x by fp32 factors (in fp32), round back to bf16.
__device__ __forceinline__ uint32_t scale_bf16x2(uint32_t x, float lo, float hi) {
  return pack_bf16x2(__uint_as_float(x << 16) * lo, __uint_as_float(x & 0xffff0000u) * hi);
}

// 2^x (MUFU.EX2, relative error ~2^-22; subnormal results flush to 0, 2^-inf = 0).
__device__ __forceinline__ float ex2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// 16-byte store to global memory (16-byte aligned): one instruction, where nvcc splits a uint4
// assignment whose fields are chosen apart into four.
__device__ __forceinline__ void st_global_16(void* dst, uint4 v) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(__cvta_generic_to_global(dst)), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w)
               : "memory");
}

// 16-byte global -> shared copy; when !valid, writes 16 zero bytes and reads nothing (src must
// still be a mapped address: pass any valid pointer).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
               : "memory");
}

// 8-byte variant (same zero-fill rule).
__device__ __forceinline__ void cp_async_8(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 8 : 0)
               : "memory");
}

// 4-byte variant (same zero-fill rule).
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 4 : 0)
               : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Wait until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Named barrier `id` (1..15; 0 is __syncthreads) whose phases complete when `count` threads (a
// multiple of 32) have arrived. sync: count this warp in and wait for the phase to complete;
// arrive: count this warp in and go on (the producer side of a producer / consumer handshake).
// The non-.aligned forms (barrier.sync / barrier.arrive, not bar.sync / bar.arrive, which are
// barrier.*.aligned): the warps of different roles meet at the same barrier from different
// instructions, which .aligned forbids (every thread of the CTA must then execute the same
// barrier instruction; compute-sanitizer's synccheck reports the divergence).
__device__ __forceinline__ void named_barrier_sync(int id, int count) {
  asm volatile("barrier.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int count) {
  asm volatile("barrier.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

}  // namespace lasp
