/* LASP-2 forward through the C ABI, on every GPU of a node:
 *
 *   target/release/lasp-run -n 4 target/release/lasp2_forward_c [--graph-calls N]
 *
 * (build: bash scripts/build-c-examples.sh). Each rank holds a ragged shard of two sequences,
 * calls the operation with its own cudaMalloc'd tensors on its own stream, and checks:
 * - the output and the final state against a float64 recurrence of the whole sequence, written
 *   here in C (S_t = e^{g_t} S_{t-1} + k_t^T v_t, o_t = scale q_t S_t), rel. error <= 5e-3;
 * - the sequential NCCL and NVSHMEM modes give bitwise the same outputs as the overlapped one;
 * - a captured CUDA graph of one call, replayed N times, gives them too;
 * - a host pointer, tokens that disagree with the element counts, a too-short tensor, a wrong
 *   dtype and a first call inside a graph capture are rejected before anything is enqueued;
 * - the single-GPU forward (a LASP_KIND_SINGLE_GPU lasp_op) of the whole sequence matches too.
 * Exits non-zero with the library's message on the first failure. */
#include "lasp_shmem.h"

#include <cuda_runtime_api.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define TOL 5e-3

static int rank = -1;

#define LASP(call)                                                                              \
  do {                                                                                          \
    lasp_status status_ = (call);                                                               \
    if (status_ != LASP_OK) {                                                                   \
      fprintf(stderr, "rank %d: %s returned %d: %s\n", rank, #call, (int)status_,               \
              lasp_last_error());                                                               \
      exit(1);                                                                                  \
    }                                                                                           \
  } while (0)

#define CUDA(call)                                                                              \
  do {                                                                                          \
    cudaError_t err_ = (call);                                                                  \
    if (err_ != cudaSuccess) {                                                                  \
      fprintf(stderr, "rank %d: %s failed: %s\n", rank, #call, cudaGetErrorString(err_));       \
      exit(1);                                                                                  \
    }                                                                                           \
  } while (0)

static void fail(const char *what) {
  fprintf(stderr, "rank %d: FAIL %s\n", rank, what);
  exit(1);
}

/* ---- inputs ---------------------------------------------------------------------------- */

static uint64_t rng_state;
static double uniform(void) { /* splitmix64 -> [0, 1) */
  uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return (double)((z ^ (z >> 31)) >> 11) * 0x1.0p-53;
}

static uint16_t bf16_bits(float x) { /* round to nearest even (inputs are finite) */
  uint32_t u;
  memcpy(&u, &x, 4);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
static float bf16_value(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float x;
  memcpy(&x, &u, 4);
  return x;
}

typedef struct {
  int b, t, h, dk, dv;
  uint16_t *q, *k, *v; /* bf16 bits, [B, T, H, D] */
  float *g, *h0;       /* [B, T, H], [B, H, Dk, Dv] */
  double *o, *ht;      /* the reference: [B, T, H, Dv], [B, H, Dk, Dv] */
} sequence;

static void fill_bf16(uint16_t *x, size_t n) {
  for (size_t i = 0; i < n; i++) x[i] = bf16_bits((float)(2.0 * uniform() - 1.0));
}

/* Random inputs of the whole sequence (the same on every rank) and its float64 recurrence. */
static sequence make_sequence(int b, int t, int h, int dk, int dv, uint64_t seed) {
  sequence s = {.b = b, .t = t, .h = h, .dk = dk, .dv = dv};
  size_t qk = (size_t)b * t * h * dk, vo = (size_t)b * t * h * dv, st = (size_t)b * h * dk * dv;
  s.q = malloc(qk * 2), s.k = malloc(qk * 2), s.v = malloc(vo * 2);
  s.g = malloc((size_t)b * t * h * 4), s.h0 = malloc(st * 4);
  s.o = malloc(vo * 8), s.ht = malloc(st * 8);
  rng_state = seed;
  fill_bf16(s.q, qk), fill_bf16(s.k, qk), fill_bf16(s.v, vo);
  for (size_t i = 0; i < (size_t)b * t * h; i++) /* decays from 0 (no decay) to e^-0.5 */
    s.g[i] = i % 17 == 0 ? 0.0f : (float)(-0.5 * uniform());
  for (size_t i = 0; i < st; i++) s.h0[i] = (float)(uniform() - 0.5);
  double scale = 1.0 / sqrt((double)dk);
  double *state = malloc((size_t)dk * dv * 8);
  for (int bi = 0; bi < b; bi++)
    for (int hi = 0; hi < h; hi++) {
      const float *h0 = s.h0 + ((size_t)bi * h + hi) * dk * dv;
      for (int i = 0; i < dk * dv; i++) state[i] = h0[i];
      for (int ti = 0; ti < t; ti++) {
        size_t row = ((size_t)bi * t + ti) * h + hi;
        double decay = exp((double)s.g[row]);
        const uint16_t *q = s.q + row * dk, *k = s.k + row * dk, *v = s.v + row * dv;
        for (int i = 0; i < dk; i++)
          for (int j = 0; j < dv; j++)
            state[i * dv + j] =
                decay * state[i * dv + j] + (double)bf16_value(k[i]) * bf16_value(v[j]);
        for (int j = 0; j < dv; j++) {
          double acc = 0;
          for (int i = 0; i < dk; i++) acc += (double)bf16_value(q[i]) * state[i * dv + j];
          s.o[row * dv + j] = scale * acc;
        }
      }
      memcpy(s.ht + ((size_t)bi * h + hi) * dk * dv, state, (size_t)dk * dv * 8);
    }
  free(state);
  return s;
}

/* Rows [start, start + len) of every sequence of x, [B, T, H, width] with elem-byte items. */
static void *slice_time(const void *x, const sequence *s, int start, int len, int width,
                        size_t elem) {
  size_t row = (size_t)s->h * width * elem;
  char *out = malloc((size_t)s->b * len * row);
  for (int bi = 0; bi < s->b; bi++)
    memcpy(out + (size_t)bi * len * row, (const char *)x + ((size_t)bi * s->t + start) * row,
           (size_t)len * row);
  return out;
}

static double rel_err_bf16(const uint16_t *got, const double *want, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; i++) {
    double d = bf16_value(got[i]) - want[i];
    num += d * d, den += want[i] * want[i];
  }
  return sqrt(num / den);
}

static double rel_err_f32(const float *got, const double *want, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; i++) {
    double d = got[i] - want[i];
    num += d * d, den += want[i] * want[i];
  }
  return sqrt(num / den);
}

static void *device_copy(const void *host, size_t bytes) {
  void *d;
  CUDA(cudaMalloc(&d, bytes));
  CUDA(cudaMemcpy(d, host, bytes, cudaMemcpyHostToDevice));
  return d;
}

/* ---- the checks ------------------------------------------------------------------------ */

static lasp_tensor device_tensor(const void *data, size_t numel, int32_t dtype) {
  lasp_tensor t = {(uint64_t)(uintptr_t)data, (int64_t)numel, dtype, 0};
  return t;
}

static void *slot_data(const lasp_tensors *tensors, int slot) {
  return (void *)(uintptr_t)tensors->slot[slot].data;
}

static lasp_tensors empty_tensors(void) {
  lasp_tensors tensors;
  memset(&tensors, 0, sizeof tensors);
  tensors.struct_size = sizeof tensors;
  return tensors;
}

static lasp_call call_of(int64_t tokens) {
  lasp_call call;
  memset(&call, 0, sizeof call);
  call.struct_size = sizeof call;
  call.tokens = tokens; /* scale 0: Dk^-1/2 */
  return call;
}

/* Scalar decay of one layout; forward only. */
static lasp_op_desc scalar_decay_desc(int32_t kind, int b, int h, int dk, int dv) {
  lasp_op_desc desc;
  memset(&desc, 0, sizeof desc);
  desc.struct_size = sizeof desc;
  desc.abi_version = LASP_SHMEM_ABI_VERSION;
  desc.family = LASP_FAMILY_SCALAR_DECAY;
  desc.kind = kind;
  if (kind == LASP_KIND_LASP2) desc.schedule = LASP_SCHEDULE_ALL_GATHER;
  desc.batch = b, desc.heads = h, desc.dk = dk, desc.dv = dv;
  return desc;
}

/* One forward of the current mode with O (and HT) poisoned first; returns o's bits (and ht's). */
static void call(lasp_op *op, cudaStream_t stream, const lasp_call *scalars,
                 const lasp_tensors *tensors, size_t o_bytes, size_t ht_bytes, void *o_host,
                 void *ht_host) {
  void *o = slot_data(tensors, LASP_SLOT_O), *ht = slot_data(tensors, LASP_SLOT_HT);
  CUDA(cudaMemsetAsync(o, 0xff, o_bytes, stream)); /* bf16 NaN everywhere */
  if (ht) CUDA(cudaMemsetAsync(ht, 0xff, ht_bytes, stream));
  LASP(lasp_op_forward(op, stream, scalars, tensors));
  LASP(lasp_op_finish(op, stream));
  CUDA(cudaMemcpy(o_host, o, o_bytes, cudaMemcpyDeviceToHost));
  if (ht) CUDA(cudaMemcpy(ht_host, ht, ht_bytes, cudaMemcpyDeviceToHost));
}

static void check_layout(const lasp_runtime *rt, const lasp_place *place, int dk, int dv,
                         int graph_calls) {
  const int b = 2, h = 3, npes = place->world_size, me = place->rank;
  const int per_rank = 3 * 64 + 11, short_by = npes > 1 ? 37 : 0;
  int start = me * per_rank, len = me + 1 == npes ? per_rank - short_by : per_rank;
  int total = npes * per_rank - short_by;
  int last = me + 1 == npes;
  sequence s = make_sequence(b, total, h, dk, dv, 7 + dk);

  void *q = slice_time(s.q, &s, start, len, dk, 2), *k = slice_time(s.k, &s, start, len, dk, 2);
  void *v = slice_time(s.v, &s, start, len, dv, 2), *g = slice_time(s.g, &s, start, len, 1, 4);
  double *want_o = slice_time(s.o, &s, start, len, dv, 8);
  size_t qk_elems = (size_t)b * len * h * dk, o_elems = (size_t)b * len * h * dv;
  size_t g_elems = (size_t)b * len * h, st_elems = (size_t)b * h * dk * dv;
  size_t o_bytes = o_elems * 2, ht_bytes = st_elems * 4;
  lasp_call shard = call_of(len);
  lasp_tensors tensors = empty_tensors();
  tensors.slot[LASP_SLOT_Q] = device_tensor(device_copy(q, qk_elems * 2), qk_elems,
                                            LASP_DTYPE_BF16);
  tensors.slot[LASP_SLOT_K] = device_tensor(device_copy(k, qk_elems * 2), qk_elems,
                                            LASP_DTYPE_BF16);
  tensors.slot[LASP_SLOT_V] = device_tensor(device_copy(v, o_bytes), o_elems, LASP_DTYPE_BF16);
  tensors.slot[LASP_SLOT_G] = device_tensor(device_copy(g, g_elems * 4), g_elems, LASP_DTYPE_F32);
  tensors.slot[LASP_SLOT_H0] = device_tensor(device_copy(s.h0, ht_bytes), st_elems,
                                             LASP_DTYPE_F32);
  void *d_o, *d_ht = NULL;
  CUDA(cudaMalloc(&d_o, o_bytes));
  tensors.slot[LASP_SLOT_O] = device_tensor(d_o, o_elems, LASP_DTYPE_BF16);
  if (last) {
    CUDA(cudaMalloc(&d_ht, ht_bytes));
    tensors.slot[LASP_SLOT_HT] = device_tensor(d_ht, st_elems, LASP_DTYPE_F32);
  }
  cudaStream_t stream;
  CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  lasp_op_desc desc = scalar_decay_desc(LASP_KIND_LASP2, b, h, dk, dv);
  lasp_op *op;
  LASP(lasp_op_create(rt, &desc, &op));
  /* A first call inside a capture cannot allocate its workspace: refused, saying what to do. */
  cudaGraph_t empty;
  CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  lasp_status refused = lasp_op_forward(op, stream, &shard, &tensors);
  CUDA(cudaStreamEndCapture(stream, &empty));
  CUDA(cudaGraphDestroy(empty));
  if (refused != LASP_ERROR_INVALID_ARGUMENT || !strstr(lasp_last_error(), "before the capture"))
    fail("a first call inside a graph capture was not refused");
  uint16_t *o = malloc(o_bytes), *o2 = malloc(o_bytes);
  float *ht = malloc(ht_bytes), *ht2 = malloc(ht_bytes);
  call(op, stream, &shard, &tensors, o_bytes, ht_bytes, o, ht);
  double err = rel_err_bf16(o, want_o, o_elems);
  printf("rank %d: Dk=Dv=%d, shard of %d of %d tokens: o rel err %.2e", me, dk, len, total, err);
  if (last) printf(", final state rel err %.2e", rel_err_f32(ht, s.ht, st_elems));
  printf(" (tolerance %.0e)\n", TOL);
  if (!(err <= TOL) || (last && !(rel_err_f32(ht, s.ht, st_elems) <= TOL)))
    fail("the overlapped output does not match the float64 recurrence");

  const int modes[2] = {LASP_MODE_SEQUENTIAL_NCCL, LASP_MODE_SEQUENTIAL_NVSHMEM};
  for (int m = 0; m < 2; m++) {
    LASP(lasp_op_set_mode(op, modes[m]));
    call(op, stream, &shard, &tensors, o_bytes, ht_bytes, o2, ht2);
    if (memcmp(o, o2, o_bytes) != 0 || (last && memcmp(ht, ht2, ht_bytes) != 0))
      fail(m == 0 ? "sequential NCCL gave other bits" : "sequential NVSHMEM gave other bits");
  }
  printf("rank %d: Dk=Dv=%d: sequential NCCL and NVSHMEM give bitwise the overlapped outputs\n",
         me, dk);

  /* A captured graph of one overlapped call (the calls above sized the workspace). */
  LASP(lasp_op_set_mode(op, LASP_MODE_OVERLAPPED));
  CUDA(cudaMemsetAsync(d_o, 0xff, o_bytes, stream));
  CUDA(cudaStreamSynchronize(stream));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  lasp_status captured = lasp_op_forward(op, stream, &shard, &tensors);
  CUDA(cudaStreamEndCapture(stream, &graph));
  LASP(captured);
  CUDA(cudaGraphInstantiate(&exec, graph, 0));
  for (int i = 0; i < graph_calls; i++) CUDA(cudaGraphLaunch(exec, stream));
  LASP(lasp_op_note_replayed_calls(op, (uint64_t)graph_calls, 0));
  LASP(lasp_op_finish(op, stream));
  CUDA(cudaMemcpy(o2, d_o, o_bytes, cudaMemcpyDeviceToHost));
  if (memcmp(o, o2, o_bytes) != 0) fail("the graph-replayed calls gave other bits");
  printf("rank %d: Dk=Dv=%d: %d graph-replayed calls, outputs bitwise identical\n", me, dk,
         graph_calls);
  CUDA(cudaGraphExecDestroy(exec));
  CUDA(cudaGraphDestroy(graph));

  /* Bad tensors are caught before anything is enqueued (no rank waits for these calls). */
  lasp_tensors bad = tensors;
  bad.slot[LASP_SLOT_Q].data = (uint64_t)(uintptr_t)q; /* host memory */
  if (lasp_op_forward(op, stream, &shard, &bad) != LASP_ERROR_INVALID_ARGUMENT ||
      !strstr(lasp_last_error(), "LASP_SLOT_Q at 0x"))
    fail("a host pointer for q was not rejected");
  lasp_call longer = call_of(64 * len); /* far longer than every tensor */
  if (lasp_op_forward(op, stream, &longer, &tensors) != LASP_ERROR_INVALID_ARGUMENT ||
      !strstr(lasp_last_error(), "elements but [B, T, H, Dk]"))
    fail("tokens that disagree with the element counts were not rejected");
  /* Element counts that agree with those tokens, but allocations too short for them. */
  bad = tensors;
  const int per_token[] = {LASP_SLOT_Q, LASP_SLOT_K, LASP_SLOT_V, LASP_SLOT_G, LASP_SLOT_O};
  for (int i = 0; i < 5; i++) bad.slot[per_token[i]].numel *= 64;
  if (lasp_op_forward(op, stream, &longer, &bad) != LASP_ERROR_INVALID_ARGUMENT ||
      !strstr(lasp_last_error(), "smaller than the shape"))
    fail("a tensor shorter than its shape was not rejected");
  bad = tensors;
  bad.slot[LASP_SLOT_G].dtype = LASP_DTYPE_BF16;
  if (lasp_op_forward(op, stream, &shard, &bad) != LASP_ERROR_INVALID_ARGUMENT ||
      !strstr(lasp_last_error(), "LASP_SLOT_G is LASP_DTYPE_BF16 but must be LASP_DTYPE_F32"))
    fail("a gate tensor of the wrong dtype was not rejected");
  printf("rank %d: a first call in a capture, a host pointer, wrong tokens, a too-short tensor "
         "and a wrong dtype are rejected: \"%.100s...\"\n",
         me, lasp_last_error());
  LASP(lasp_op_free(op));

  /* The single-GPU forward of the whole sequence on this GPU. */
  if (me == 0) {
    lasp_op_desc single_desc = scalar_decay_desc(LASP_KIND_SINGLE_GPU, b, h, dk, dv);
    lasp_op *single;
    LASP(lasp_op_create(rt, &single_desc, &single));
    size_t all_qk = (size_t)b * total * h * dk, all_o = (size_t)b * total * h * dv;
    size_t all_g = (size_t)b * total * h;
    lasp_call whole_call = call_of(total);
    lasp_tensors whole = empty_tensors();
    whole.slot[LASP_SLOT_Q] = device_tensor(device_copy(s.q, all_qk * 2), all_qk, LASP_DTYPE_BF16);
    whole.slot[LASP_SLOT_K] = device_tensor(device_copy(s.k, all_qk * 2), all_qk, LASP_DTYPE_BF16);
    whole.slot[LASP_SLOT_V] = device_tensor(device_copy(s.v, all_o * 2), all_o, LASP_DTYPE_BF16);
    whole.slot[LASP_SLOT_G] = device_tensor(device_copy(s.g, all_g * 4), all_g, LASP_DTYPE_F32);
    whole.slot[LASP_SLOT_H0] = tensors.slot[LASP_SLOT_H0];
    void *whole_o;
    CUDA(cudaMalloc(&whole_o, all_o * 2));
    whole.slot[LASP_SLOT_O] = device_tensor(whole_o, all_o, LASP_DTYPE_BF16);
    CUDA(cudaMemsetAsync(whole_o, 0xff, all_o * 2, stream));
    LASP(lasp_op_forward(single, stream, &whole_call, &whole));
    LASP(lasp_op_finish(single, stream));
    uint16_t *got = malloc(all_o * 2);
    CUDA(cudaMemcpy(got, whole_o, all_o * 2, cudaMemcpyDeviceToHost));
    double e = rel_err_bf16(got, s.o, all_o);
    printf("rank 0: Dk=Dv=%d: single-GPU forward of all %d tokens: o rel err %.2e\n", dk, total,
           e);
    if (!(e <= TOL)) fail("the single-GPU forward does not match the float64 recurrence");
    LASP(lasp_op_free(single));
    free(got);
    const int whole_slots[] = {LASP_SLOT_Q, LASP_SLOT_K, LASP_SLOT_V, LASP_SLOT_G, LASP_SLOT_O};
    for (int i = 0; i < 5; i++) CUDA(cudaFree(slot_data(&whole, whole_slots[i])));
  }

  CUDA(cudaStreamDestroy(stream));
  /* Every filled slot; cudaFree(NULL) of an empty one is a no-op. */
  for (int i = 0; i < LASP_SLOT_COUNT; i++) CUDA(cudaFree(slot_data(&tensors, i)));
  free(q), free(k), free(v), free(g), free(want_o), free(o), free(o2), free(ht), free(ht2);
  free(s.q), free(s.k), free(s.v), free(s.g), free(s.h0), free(s.o), free(s.ht);
}

int main(int argc, char **argv) {
  int graph_calls = 100;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--graph-calls") == 0 && i + 1 < argc) {
      graph_calls = atoi(argv[++i]);
    } else {
      fprintf(stderr, "usage: %s [--graph-calls N]\n", argv[0]);
      return 2;
    }
  }
  lasp_runtime_options options = {.struct_size = sizeof options,
                                  .abi_version = LASP_SHMEM_ABI_VERSION,
                                  .symmetric_heap_bytes = 64u << 20};
  lasp_runtime *rt;
  LASP(lasp_runtime_init_from_env(&options, &rt));
  lasp_place place;
  LASP(lasp_runtime_place(rt, &place));
  rank = place.rank;
  CUDA(cudaSetDevice(place.local_rank)); /* the runtime's GPU, for cudaMalloc and the streams */
  check_layout(rt, &place, 64, 64, graph_calls);
  check_layout(rt, &place, 128, 128, graph_calls);
  LASP(lasp_runtime_shutdown(rt));
  printf("rank %d: lasp2_forward_c: every check passed\n", rank);
  return 0;
}
