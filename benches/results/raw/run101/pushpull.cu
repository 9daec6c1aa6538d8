// Push vs pull over NVLink between all GPUs of one process (peer access), all-gather pattern:
// every GPU moves B bytes to (push) or from (pull) each of the other N-1 GPUs at once.
// A device-side start barrier (a system-scope counter on GPU 0, over NVLink) aligns the GPUs;
// each GPU times its own kernel with globaltimer from the barrier's release to its last CTA.
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); exit(1); } } while (0)

struct Args {
  const uint4* src[8];  // every GPU's source (B bytes)
  uint4* dst[8];        // every GPU's destination (N * B bytes)
  int n, me; size_t units;  // 16-byte units per source
  unsigned* arrive; unsigned target;  // host-mapped barrier
  unsigned long long* times;  // [0]: release seen by block 0, [1 + cta]: end per CTA
  int pull, unroll;
};

__device__ unsigned long long gtimer() { unsigned long long t; asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t)); return t; }

template <int U>
__device__ void copy(uint4* d, const uint4* s, size_t units) {
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  for (; i + (U - 1) * stride < units; i += U * stride) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = s[i + u * stride];
#pragma unroll
    for (int u = 0; u < U; ++u) d[i + u * stride] = v[u];
  }
  for (; i < units; i += stride) d[i] = s[i];
}

__global__ void __launch_bounds__(512) move(Args a) {
  if (threadIdx.x == 0) {
    atomicAdd_system(a.arrive, 1u);
    while (atomicAdd_system(a.arrive, 0u) < a.target) {}
    if (blockIdx.x == 0) a.times[0] = gtimer();
  }
  __syncthreads();
  for (int k = 1; k < a.n; ++k) {
    const int peer = (a.me + k) % a.n;
    // Phase k: GPU i sends to (push) or reads from (pull) GPU i + k, a permutation: one stream per link.
    if (a.pull) {
      const uint4* s = a.src[peer]; uint4* d = a.dst[a.me] + peer * a.units;
      if (a.unroll == 4) copy<4>(d, s, a.units); else copy<1>(d, s, a.units);
    } else {
      const uint4* s = a.src[a.me]; uint4* d = a.dst[peer] + a.me * a.units;
      if (a.unroll == 4) copy<4>(d, s, a.units); else copy<1>(d, s, a.units);
    }
  }
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) a.times[1 + blockIdx.x] = gtimer();
}

int main(int argc, char** argv) {
  int n; CK(cudaGetDeviceCount(&n)); n = std::min(n, 8);
  const int ctas = argc > 1 ? atoi(argv[1]) : 64;
  for (int i = 0; i < n; ++i) { CK(cudaSetDevice(i)); for (int j = 0; j < n; ++j) if (i != j) CK(cudaDeviceEnablePeerAccess(j, 0)); }
  setvbuf(stdout, nullptr, _IOLBF, 0);
  // The start barrier's counter lives on GPU 0 and is reached over NVLink (atomics to host memory
  // over PCIe are not supported on this kind of host).
  unsigned* arrive; CK(cudaSetDevice(0)); CK(cudaMalloc(&arrive, 64));
  std::vector<size_t> sizes = {1u << 20, 4u << 20, 8u << 20, 32u << 20};
  const size_t maxb = 32u << 20;
  std::vector<uint4*> src(n), dst(n); std::vector<unsigned long long*> times(n); std::vector<cudaStream_t> st(n);
  for (int i = 0; i < n; ++i) {
    CK(cudaSetDevice(i)); CK(cudaMalloc(&src[i], maxb)); CK(cudaMalloc(&dst[i], maxb * n));
    CK(cudaMemset(src[i], i + 1, maxb)); CK(cudaMalloc(&times[i], 8 * (ctas + 1))); CK(cudaStreamCreateWithFlags(&st[i], cudaStreamNonBlocking));
  }
  printf("%d GPUs, %d CTAs x 512 threads per GPU; us per round: max over GPUs of (last CTA end - barrier release), median of 30\n", n, ctas);
  for (size_t b : sizes) for (int pull = 0; pull < 2; ++pull) for (int unroll : {1, 4}) {
    std::vector<double> samples;
    for (int it = 0; it < 35; ++it) {
      CK(cudaSetDevice(0)); CK(cudaMemset(arrive, 0, 64)); CK(cudaDeviceSynchronize());
      for (int i = 0; i < n; ++i) {
        Args a{}; for (int j = 0; j < n; ++j) { a.src[j] = src[j]; a.dst[j] = dst[j]; }
        a.n = n; a.me = i; a.units = b / 16; a.arrive = arrive; a.target = n * ctas; a.times = times[i]; a.pull = pull; a.unroll = unroll;
        CK(cudaSetDevice(i)); move<<<ctas, 512, 0, st[i]>>>(a); CK(cudaGetLastError());
      }
      double worst = 0;
      for (int i = 0; i < n; ++i) {
        CK(cudaSetDevice(i)); CK(cudaStreamSynchronize(st[i]));
        std::vector<unsigned long long> t(ctas + 1); CK(cudaMemcpy(t.data(), times[i], 8 * (ctas + 1), cudaMemcpyDeviceToHost));
        unsigned long long end = *std::max_element(t.begin() + 1, t.end());
        worst = std::max(worst, (end - t[0]) / 1e3);
      }
      if (it >= 5) samples.push_back(worst);
    }
    std::sort(samples.begin(), samples.end());
    const double us = samples[samples.size() / 2];
    printf("%-4s unroll %d  %6zu KiB per GPU: %8.2f us  egress %6.1f GB/s (min %.2f max %.2f)\n", pull ? "pull" : "push", unroll, b >> 10, us,
           (n - 1) * b / us / 1e3, samples.front(), samples.back());
  }
  // Data check of the last round (pull, unroll 4, 32 MiB): every peer block holds its source's byte.
  int bad = 0;
  for (int i = 0; i < n; ++i) for (int j = 0; j < n; ++j) if (i != j) {
    unsigned char c; CK(cudaSetDevice(i)); CK(cudaMemcpy(&c, (char*)dst[i] + j * (32u << 20) + 12345, 1, cudaMemcpyDeviceToHost)); bad += c != j + 1;
  }
  printf("data check: %s\n", bad ? "FAILED" : "ok");
  return bad != 0;
}
