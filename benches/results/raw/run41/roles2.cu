// Standalone timing: one-warpgroup output kernel (2 CTAs/SM) vs the two-role kernel at
// LASP_SD_ROLES_MIN_BLOCKS CTAs/SM with setmaxnreg (needs a non-relocatable build).
#include <cuda_runtime.h>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include "sd_fwd_mod.cu"

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %s:%d\n", cudaGetErrorString(e), __FILE__, __LINE__); exit(1); } } while (0)

__global__ void fill_bf16(uint16_t* x, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    uint32_t h = (uint32_t)i * 0x9E3779B1u ^ seed * 0x85EBCA77u; h ^= h >> 15; h *= 0x2C1B3C6Du; h ^= h >> 12;
    float f = ((h & 0xFFFF) / 65536.0f - 0.5f) * 2.0f;
    uint32_t b = __float_as_uint(f); x[i] = (uint16_t)((b + 0x8000u) >> 16);
  }
}
__global__ void fill_gate(float* g, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    uint32_t h = (uint32_t)i * 0x27D4EB2Fu ^ seed; h ^= h >> 13; h *= 0x5bd1e995u; h ^= h >> 15;
    g[i] = -((h & 0xFFFF) / 65536.0f) / 16.0f;
  }
}
__global__ void count_diff(const uint16_t* a, const uint16_t* b, size_t n, unsigned long long* c) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    if (a[i] != b[i]) atomicAdd(c, 1ull);
}

static dim3 d3(lasp_sd_dim3 d) { return dim3(d.x, d.y, d.z); }

int main() {
  const int H = 16, D = 128;
  int shapes[3][2] = {{1, 32768}, {1, 131072}, {4, 8192}};
  auto out_k = lasp_scalar_decay_output_dk128;
  auto roles_k = lasp_scalar_decay_output_roles_dk128;
  CK(cudaFuncSetAttribute(out_k, cudaFuncAttributeMaxDynamicSharedMemorySize, lasp_sd_output_smem_bytes(D)));
  CK(cudaFuncSetAttribute(roles_k, cudaFuncAttributeMaxDynamicSharedMemorySize, lasp_sd_roles_smem_bytes(D)));
  CK(cudaFuncSetAttribute(lasp_scalar_decay_states_dk128, cudaFuncAttributeMaxDynamicSharedMemorySize, lasp_sd_states_smem_bytes(D)));
  int occ_out = 0, occ_roles = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ_out, out_k, LASP_SD_THREADS, lasp_sd_output_smem_bytes(D)));
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ_roles, roles_k, LASP_SD_ROLES_THREADS, lasp_sd_roles_smem_bytes(D)));
  printf("roles stages %d, min blocks %d, smem %u; CTAs per SM: one-warpgroup %d, two-role %d\n", LASP_SD_ROLES_STAGES,
         LASP_SD_ROLES_MIN_BLOCKS, lasp_sd_roles_smem_bytes(D), occ_out, occ_roles);
  for (auto& sh : shapes) {
    const int B = sh[0], T = sh[1];
    for (int target : {264, 132}) {
      const int S = lasp_sd_num_segments(B, H, T, D, target), cps = lasp_sd_chunks_per_segment(T, S);
      const size_t nqk = (size_t)B * T * H * D, ng = (size_t)B * T * H;
      uint16_t *q, *k, *v, *o, *o2; float *g, *ws = nullptr; unsigned long long* diff;
      CK(cudaMalloc(&q, nqk * 2)); CK(cudaMalloc(&k, nqk * 2)); CK(cudaMalloc(&v, nqk * 2));
      CK(cudaMalloc(&o, nqk * 2)); CK(cudaMalloc(&o2, nqk * 2)); CK(cudaMalloc(&g, ng * 4)); CK(cudaMalloc(&diff, 8));
      fill_bf16<<<528, 256>>>(q, nqk, 1); fill_bf16<<<528, 256>>>(k, nqk, 2); fill_bf16<<<528, 256>>>(v, nqk, 3);
      fill_gate<<<528, 256>>>(g, ng, 4);
      CK(cudaMemset(o, 0xFF, nqk * 2)); CK(cudaMemset(o2, 0xEE, nqk * 2)); CK(cudaMemset(diff, 0, 8));
      lasp_scalar_decay_params p = {};
      p.q = q; p.k = k; p.v = v; p.g = g; p.o = o; p.B = B; p.T = T; p.H = H; p.Dk = D; p.Dv = D;
      p.num_segments = S; p.chunks_per_segment = cps; p.scale = 1.0f / sqrtf((float)D);
      if (S > 1) {
        const uint64_t bytes = lasp_sd_ws_lambda_offset(B, H, S, D, D) + (uint64_t)B * H * (S - 1) * 4;
        CK(cudaMalloc(&ws, bytes));
        p.ws_m = ws; p.ws_p = (float*)((char*)ws + lasp_sd_ws_p_offset(B, H, S, D, D));
        p.ws_lambda = (float*)((char*)ws + lasp_sd_ws_lambda_offset(B, H, S, D, D));
        lasp_scalar_decay_states_dk128<<<d3(lasp_sd_states_grid(B, H, D, S)), LASP_SD_THREADS, lasp_sd_states_smem_bytes(D)>>>(p);
        lasp_scalar_decay_fold<<<d3(lasp_sd_fold_grid(B, H, D, D)), LASP_SD_FOLD_THREADS>>>(p);
      }
      const dim3 grid = d3(lasp_sd_output_grid(B, H, D, S));
      lasp_scalar_decay_params p2 = p; p2.o = o2;
      out_k<<<grid, LASP_SD_THREADS, lasp_sd_output_smem_bytes(D)>>>(p);
      roles_k<<<grid, LASP_SD_ROLES_THREADS, lasp_sd_roles_smem_bytes(D)>>>(p2);
      count_diff<<<528, 256>>>(o, o2, nqk, diff);
      CK(cudaDeviceSynchronize());
      unsigned long long nd = 0; CK(cudaMemcpy(&nd, diff, 8, cudaMemcpyDeviceToHost));
      cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
      std::vector<float> t_out, t_roles;
      for (int it = 0; it < 70; ++it) {
        for (int which = 0; which < 2; ++which) {
          CK(cudaEventRecord(e0));
          if (which == 0) out_k<<<grid, LASP_SD_THREADS, lasp_sd_output_smem_bytes(D)>>>(p);
          else roles_k<<<grid, LASP_SD_ROLES_THREADS, lasp_sd_roles_smem_bytes(D)>>>(p2);
          CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1));
          float ms; CK(cudaEventElapsedTime(&ms, e0, e1));
          if (it >= 20) (which == 0 ? t_out : t_roles).push_back(ms);
        }
      }
      std::sort(t_out.begin(), t_out.end()); std::sort(t_roles.begin(), t_roles.end());
      printf("B=%d T=%d S=%d (target %d): output kernel alone, median ms: one-warpgroup %.4f, two-role %.4f; "
             "outputs differing: %llu of %zu\n", B, T, S, target, t_out[t_out.size() / 2], t_roles[t_roles.size() / 2], nd, nqk);
      CK(cudaFree(q)); CK(cudaFree(k)); CK(cudaFree(v)); CK(cudaFree(o)); CK(cudaFree(o2)); CK(cudaFree(g));
      CK(cudaFree(diff)); if (ws) CK(cudaFree(ws));
    }
  }
  return 0;
}
