// Parameters of the short causal depthwise convolution on LASP-2 shards (short_conv/short_conv.cu):
// fla's ShortConvolution, y_t = act(bias + sum_i w[c][i] x_{t-K+1+i}), with the K - 1 tokens
// before a shard (its halo) put to it by the PE before it, and the halo's gradient put back. C, so
// that bindgen generates the host's structs from this file (kernels/build.rs).
#pragma once
#include <stdint.h>
#include "lasp/wait_diagnostics.h"

#define LASP_SHORT_CONV_MAX_K 4             // kernel sizes 1 .. 4 (fla's default is 4)
#define LASP_SHORT_CONV_CHANNELS_PER_THREAD 8  // the forward's: one 16-byte load of bf16 per token
#define LASP_SHORT_CONV_GRAD_CHANNELS_PER_THREAD 4  // the backward's (its running sums fill registers)
#define LASP_SHORT_CONV_THREADS 128         // the convolution kernels' CTA

enum lasp_short_conv_activation {
  LASP_SHORT_CONV_IDENTITY = 0,
  LASP_SHORT_CONV_SILU = 1,  // z sigma(z), after the bias
};

// One direction's halo exchange. The forward's flows from each PE to the next (a shard's last
// K - 1 tokens become its successor's halo), the backward's from each PE to the one before (the
// halo's gradient returns to the tokens it was copied from). Symmetric buffers, the same sizes on
// every PE:
//   slots    [2][B][K-1][C] fp32: parity e % 2 holds what `source` put for epoch e
//   staging  [B][K-1][C] fp32: what this PE puts to `dest` (assembled, then put with a signal)
//   signal   [2][B][channel tiles of the convolution kernel]: set to e by `source`'s CTA of that
//            sequence and tile when its rows of epoch e (parity e % 2) have landed
//   credit   [1]: set to e - 1 by `dest` when it has read every slot of epoch e - 1
// Epochs never wrap: a call with epoch e overwrites `dest`'s parity e % 2, last read at e - 2, only
// after `dest`'s credit for e - 2. Every wait is bounded and records PE, slot and epoch in `diag`.
typedef struct {
  float* slots;
  float* staging;
  uint64_t* signal;
  uint64_t* credit;
  uint64_t* epoch;         // device, 1 word: the last completed call (advanced by the last kernel)
  lasp_wait_diag* diag;    // device: the first expired wait
  uint64_t timeout_ns;
  int32_t me;
  int32_t source;          // the PE that puts into this PE's slots, or -1
  int32_t dest;            // the PE this PE puts to, or -1
  int32_t reserved;
} lasp_halo_exchange;

typedef struct {
  const uint16_t* x;        // [B, T, C] bf16: this PE's shard
  const float* weight;      // [C, K]; weight[c][K-1] multiplies the current token
  const float* bias;        // [C], or NULL
  const uint16_t* halo;     // backward: the forward's halo [B, K-1, C] bf16 (NULL: zeros)
  const uint16_t* dy;       // backward: [B, T, C] bf16
  uint16_t* out;            // forward: y; backward: dx; [B, T, C] bf16
  uint16_t* saved_halo;     // forward: the halo it used, [B, K-1, C] bf16 (NULL: not kept)
  float* partials;          // backward: [B][groups][C][K+1] each CTA's sums of d_weight (K) and
                            // d_bias (1), reduced in a fixed order by the reduce kernel
  float* d_weight;          // backward: [C, K]
  float* d_bias;            // backward: [C], or NULL
  const float* starts;      // packed documents: [K - 1 + T], 1 where token t of the shard (from
                            // -(K - 1), the halo's, at index t + K - 1) starts a document, else
                            // 0; no tap reads across a start. NULL: one sequence
  lasp_halo_exchange exchange;
  int32_t B;
  int32_t T;                // this PE's tokens, >= 1
  int32_t C;                // a multiple of LASP_SHORT_CONV_CHANNELS_PER_THREAD
  int32_t K;                // 1 .. LASP_SHORT_CONV_MAX_K
  int32_t groups;           // token groups per sequence (the convolution kernels' grid.y)
  int32_t activation;       // enum lasp_short_conv_activation
} lasp_short_conv_params;
