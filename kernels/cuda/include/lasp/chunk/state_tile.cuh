// The fp32 state tile a warpgroup holds in registers (the accumulator layout of m64n64 wgmma over
// Dk/64 row tiles), its loads and stores, and the clamped exponential every family's gates use.
#pragma once
#include <math.h>
#include <stdint.h>

#include "lasp/mma.cuh"

namespace lasp {
namespace chunk {

// e^x for x that is <= 0 in exact arithmetic; the clamp absorbs rounding of differences of cumsums.
// x = -inf (a masked entry) gives exactly 0.
__device__ __forceinline__ float exp_nonpos(float x) { return ex2_approx(fminf(x, 0.f) * 1.4426950408889634f); }

// The state elements a lane holds: s[mt][nt][2*hh + e] = S[d][c] with d = 64*mt + d_warp + 8*hh + g,
// d_warp = 16*warp, c = 8*nt + 2*t + e (column within the 64-column tile): the accumulator layout
// of two m64n64 wgmma (or 2x4 m16 mma.sync) tiles stacked along Dk.
struct StateLane {
  int d_warp, g, t;
};

template <int DK>
using StateRegs = float[DK / 64][8][4];

// f(x0, x1, d, c) for every element pair (columns c, c + 1 of row d) the lane holds.
template <int DK, class F>
__device__ __forceinline__ void for_each_state_pair(StateRegs<DK>& s, const StateLane& ln, F&& f) {
#pragma unroll
  for (int mt = 0; mt < DK / 64; ++mt)
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh)
        f(s[mt][nt][2 * hh], s[mt][nt][2 * hh + 1], 64 * mt + ln.d_warp + 8 * hh + ln.g, 8 * nt + 2 * ln.t);
}

// s = 0.
template <int DK>
__device__ __forceinline__ void state_zero(StateRegs<DK>& s, const StateLane& ln) {
  for_each_state_pair<DK>(s, ln, [](float& x0, float& x1, int, int) { x0 = 0.f, x1 = 0.f; });
}

// s = tile, element (d, c) at base[d * ld + c] (fp32, 8-byte aligned rows).
template <int DK>
__device__ __forceinline__ void state_load(StateRegs<DK>& s, const StateLane& ln, const float* base, int64_t ld) {
  for_each_state_pair<DK>(s, ln, [&](float& x0, float& x1, int d, int c) {
    const float2 x = *reinterpret_cast<const float2*>(base + d * ld + c);
    x0 = x.x, x1 = x.y;
  });
}

// tile = s.
template <int DK>
__device__ __forceinline__ void state_store(StateRegs<DK>& s, const StateLane& ln, float* base, int64_t ld) {
  for_each_state_pair<DK>(s, ln, [&](float& x0, float& x1, int d, int c) {
    *reinterpret_cast<float2*>(base + d * ld + c) = make_float2(x0, x1);
  });
}

// tile = s rounded to bf16, element (d, c) at base[d * ld + c] (4-byte aligned pairs).
template <int DK>
__device__ __forceinline__ void state_store_bf16(StateRegs<DK>& s, const StateLane& ln, uint16_t* base, int64_t ld) {
  for_each_state_pair<DK>(s, ln, [&](float& x0, float& x1, int d, int c) {
    *reinterpret_cast<uint32_t*>(base + d * ld + c) = pack_bf16x2(x0, x1);
  });
}

}  // namespace chunk
}  // namespace lasp
