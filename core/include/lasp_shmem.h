/* lasp-shmem C ABI: device-initiated LASP-2 sequence parallelism for linear attention.
 *
 * Link with -llasp_shmem (liblasp_shmem.so, built by `cargo build --release -p lasp-shmem`).
 * The library loads the CUDA driver and NVSHMEM's host library at run time; the caller needs
 * neither at link time.
 *
 * Bootstrap from a trainer that runs its own launcher (torchrun):
 *   rank 0:      lasp_unique_id_create(&opts, &place, &id);
 *   every rank:  broadcast id's 128 bytes from rank 0 (torch.distributed.broadcast, MPI_Bcast);
 *                lasp_runtime_init(&opts, &place, &id, &rt);
 * Programs started by lasp-run, mpirun or nvshmrun call lasp_runtime_init_from_env instead.
 *
 * Environment: NVSHMEM reads its NVSHMEM_* settings from the process environment, once, at init,
 * and the library never writes the environment (setenv races with getenv in every other thread,
 * and a trainer runs threads long before it calls in). Put them in the environment before the
 * process starts (the job script, the launcher's -x / --export):
 *   NVSHMEM_DISABLE_NVLS=1          keeps NVLink multicast off (recommended on shared nodes);
 *   NVSHMEM_REMOTE_TRANSPORT=none   when every rank runs on one node;
 *   NVSHMEM_SYMMETRIC_SIZE=bytes    at least options.symmetric_heap_bytes + 256 MiB; required
 *                                   when that exceeds NVSHMEM's 1 GiB default (init fails with
 *                                   LASP_ERROR_INVALID_ARGUMENT otherwise);
 *   NVSHMEM_BOOTSTRAP=MPI           under mpirun (init fails with LASP_ERROR_LAUNCH otherwise).
 * lasp-run sets the first two (and a per-job LASP_RENDEZVOUS_NONCE) for the ranks it starts.
 * A malformed LASP_WAIT_TIMEOUT_MS (a positive number of milliseconds) or NVSHMEM_SYMMETRIC_SIZE
 * is an error at init, never silently replaced by a default.
 *
 * Then, per layout: lasp_lasp2_create (collective), lasp_lasp2_forward on the caller's stream
 * with its own device pointers (not collective: the ranks meet through device signals), and at
 * the end lasp_lasp2_free and lasp_runtime_shutdown (both collective).
 *
 * Training: lasp_lasp2_forward_saving also writes the state this rank's shard starts from;
 * keep it, and pass it as args.h0 of lasp_lasp2_backward on a lasp_lasp2_grad of the same
 * layout (lasp_lasp2_grad_create, collective). The backward sends the state gradients down the
 * ranks the way the forward sends the states up: every rank calls it once per forward call,
 * in the same order. The single-GPU pair is lasp_scalar_decay_forward / _backward.
 *
 * Every function returns LASP_OK or an error status; lasp_last_error() then says what went
 * wrong and what to do. Arguments are checked before anything is enqueued: a bad shape, a host
 * pointer, a tensor of another GPU, one shorter than its shape, a stream of another context or
 * ranks that disagree on the layout or mode fail before any state moves. Every wait on another
 * GPU is bounded (options.wait_timeout_ms); an expired one makes lasp_lasp2_finish return
 * LASP_ERROR_PEER_TIMEOUT naming the rank that never sent, the signal slot and the epoch.
 *
 * Threads: a handle may be used from any thread; calls on one handle are serialised.
 * Graphs: lasp_lasp2_forward and lasp_lasp2_backward may be captured into a CUDA graph after
 * one uncaptured call of the same shape (which sizes the workspace; a captured call that would
 * have to allocate it is refused with LASP_ERROR_INVALID_ARGUMENT); replays advance the epoch on
 * the device. The
 * sequential modes pick their slot half on the host, by the parity of the call: capture an even
 * number of their calls per graph (or one graph per parity), and report replays with
 * lasp_lasp2_note_replayed_calls (lasp_lasp2_grad_note_replayed_calls).
 */
#ifndef LASP_SHMEM_H
#define LASP_SHMEM_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define LASP_SHMEM_ABI_VERSION 1u

/* Status codes. */
typedef int32_t lasp_status;
#define LASP_OK 0
#define LASP_ERROR_INVALID_ARGUMENT 1 /* rejected before anything was enqueued */
#define LASP_ERROR_LAUNCH 2           /* launch environment, ranks, rendezvous */
#define LASP_ERROR_CUDA 3             /* no driver, no GPU, another failed driver call */
#define LASP_ERROR_NVSHMEM 4          /* NVSHMEM not found, wrong version, a failed call */
#define LASP_ERROR_PEER_TIMEOUT 5     /* a wait on another GPU expired */
#define LASP_ERROR_STATE 6            /* calls out of order */
#define LASP_ERROR_INTERNAL 7         /* a bug in lasp-shmem: please report the message */
/* Codes are only ever appended; a caller should treat an unknown code as an error. */
#define LASP_ERROR_NCCL 8             /* an NCCL call failed (sequential NCCL mode) */
#define LASP_ERROR_KERNEL_FAULT 9     /* a kernel faulted: the CUDA context is unusable, exit
                                         the process; a bug to report */
#define LASP_ERROR_KERNEL_LAUNCH 10   /* the driver refused a launch; nothing was enqueued; a
                                         bug to report */
#define LASP_ERROR_BUILD 11           /* built without a kernel this call or GPU needs: rebuild */

/* Exchange modes of the LASP-2 forward and backward. Outputs are bitwise the same in all but
 * NO_COMM. */
#define LASP_MODE_OVERLAPPED 0         /* device puts with signals, hidden behind compute */
#define LASP_MODE_SEQUENTIAL_NCCL 1    /* the same kernels around NCCL's all-gather */
#define LASP_MODE_SEQUENTIAL_NVSHMEM 2 /* the same kernels around NVSHMEM's fcollect */
#define LASP_MODE_NO_COMM 3            /* no exchange: the compute's cost alone (timing only) */

/* A CUstream or cudaStream_t (both are this type). NULL is the legacy default stream. */
typedef struct CUstream_st *lasp_stream;

typedef struct lasp_runtime lasp_runtime;
typedef struct lasp_lasp2 lasp_lasp2;             /* LASP-2 forward */
typedef struct lasp_lasp2_grad lasp_lasp2_grad;   /* LASP-2 backward */
typedef struct lasp_scalar_decay lasp_scalar_decay;           /* one GPU, forward */
typedef struct lasp_scalar_decay_grad lasp_scalar_decay_grad; /* one GPU, backward */

typedef struct lasp_runtime_options {
  uint32_t abi_version;          /* LASP_SHMEM_ABI_VERSION */
  uint32_t reserved;             /* 0 */
  uint64_t symmetric_heap_bytes; /* 0: 256 MiB; sum lasp_lasp2_symmetric_bytes of the ops;
                                    NVSHMEM_SYMMETRIC_SIZE must hold it (see Environment) */
  uint64_t wait_timeout_ms;      /* 0: LASP_WAIT_TIMEOUT_MS, else 10 s */
  const char *nvshmem_library;   /* NULL: NVSHMEM_HOME, else the usual places */
} lasp_runtime_options;

/* This process's place in the job, as torchrun's RANK, WORLD_SIZE, LOCAL_RANK and
 * LOCAL_WORLD_SIZE give it. The local rank selects the GPU. */
typedef struct lasp_place {
  int32_t rank;
  int32_t world_size;
  int32_t local_rank;
  int32_t local_world_size;
} lasp_place;

typedef struct lasp_unique_id {
  uint8_t bytes[128];
} lasp_unique_id;

/* One call's tensors, fla's layout, contiguous, on the runtime's GPU. */
typedef struct lasp_forward_args {
  int64_t batch;   /* B */
  int64_t tokens;  /* T: this rank's tokens per sequence (LASP-2: its shard) */
  int64_t heads;   /* H */
  int64_t dk;      /* 64 or 128 */
  int64_t dv;      /* a multiple of 64 */
  const void *q;   /* [B, T, H, Dk] bf16, 16-byte aligned */
  const void *k;   /* [B, T, H, Dk] bf16, 16-byte aligned */
  const void *v;   /* [B, T, H, Dv] bf16, 16-byte aligned */
  const float *g;  /* [B, T, H] fp32 log-decays, finite and <= 0 */
  const float *h0; /* [B, H, Dk, Dv] fp32 initial state, or NULL for zero */
  void *o;         /* [B, T, H, Dv] bf16 output, 16-byte aligned */
  float *ht;       /* [B, H, Dk, Dv] fp32 final state, or NULL (LASP-2: last rank only) */
  float scale;     /* sigma in o_t = sigma q_t S_t; 0 for Dk^-1/2 */
  uint32_t reserved; /* 0 */
} lasp_forward_args;

/* One backward call's tensors, fla's layout, contiguous, on the runtime's GPU. The inputs are
 * the forward's and the gradients of its outputs; every grad_* output is written whole. */
typedef struct lasp_backward_args {
  int64_t batch;          /* B */
  int64_t tokens;         /* T: as in the forward call */
  int64_t heads;          /* H */
  int64_t dk;             /* 64 or 128 */
  int64_t dv;             /* 64 or 128 */
  const void *q;          /* the forward's q [B, T, H, Dk] bf16 */
  const void *k;          /* the forward's k [B, T, H, Dk] bf16 */
  const void *v;          /* the forward's v [B, T, H, Dv] bf16 */
  const float *g;         /* the forward's g [B, T, H] fp32 */
  const float *h0;        /* [B, H, Dk, Dv] fp32 or NULL for zero: the forward's h0; LASP-2: the
                             start_state of lasp_lasp2_forward_saving on this rank */
  const void *grad_o;     /* [B, T, H, Dv] bf16 */
  const float *grad_ht;   /* [B, H, Dk, Dv] fp32 or NULL for zero (LASP-2: last rank only) */
  void *grad_q;           /* [B, T, H, Dk] bf16 */
  void *grad_k;           /* [B, T, H, Dk] bf16 */
  void *grad_v;           /* [B, T, H, Dv] bf16 */
  float *grad_g;          /* [B, T, H] fp32 */
  float *grad_h0;         /* [B, H, Dk, Dv] fp32 or NULL (LASP-2: rank 0 only) */
  float scale;            /* the forward's scale; 0 for Dk^-1/2 */
  uint32_t reserved;      /* 0 */
} lasp_backward_args;

#if defined(__STDC_VERSION__) && __STDC_VERSION__ >= 201112L
_Static_assert(sizeof(lasp_runtime_options) == 32, "lasp_runtime_options layout");
_Static_assert(sizeof(lasp_place) == 16, "lasp_place layout");
_Static_assert(sizeof(lasp_unique_id) == 128, "lasp_unique_id layout");
_Static_assert(sizeof(lasp_forward_args) == 104, "lasp_forward_args layout");
_Static_assert(sizeof(lasp_backward_args) == 144, "lasp_backward_args layout");
#elif defined(__cplusplus)
static_assert(sizeof(lasp_runtime_options) == 32, "lasp_runtime_options layout");
static_assert(sizeof(lasp_place) == 16, "lasp_place layout");
static_assert(sizeof(lasp_unique_id) == 128, "lasp_unique_id layout");
static_assert(sizeof(lasp_forward_args) == 104, "lasp_forward_args layout");
static_assert(sizeof(lasp_backward_args) == 144, "lasp_backward_args layout");
#endif

/* LASP_SHMEM_ABI_VERSION of the library. */
uint32_t lasp_abi_version(void);

/* The message of this thread's last call that failed ("" if none); valid until its next
 * failing call. */
const char *lasp_last_error(void);

/* Runtime. options may be NULL (every default). */
lasp_status lasp_unique_id_create(const lasp_runtime_options *options, const lasp_place *place,
                                  lasp_unique_id *id); /* rank 0 only, before any init */
lasp_status lasp_runtime_init(const lasp_runtime_options *options, const lasp_place *place,
                              const lasp_unique_id *id, lasp_runtime **runtime); /* collective */
lasp_status lasp_runtime_init_from_env(const lasp_runtime_options *options,
                                       lasp_runtime **runtime); /* collective */
lasp_status lasp_runtime_place(const lasp_runtime *runtime, lasp_place *place);
/* Collective; fails (and the handle stays valid) while an operation handle is alive. */
lasp_status lasp_runtime_shutdown(lasp_runtime *runtime);

/* LASP-2 forward across the ranks. */
lasp_status lasp_lasp2_symmetric_bytes(int64_t batch, int64_t heads, int64_t dk, int64_t dv,
                                       int32_t world_size, uint64_t *bytes);
lasp_status lasp_lasp2_create(const lasp_runtime *runtime, int64_t batch, int64_t heads,
                              int64_t dk, int64_t dv, int32_t mode,
                              lasp_lasp2 **op); /* collective */
lasp_status lasp_lasp2_set_mode(lasp_lasp2 *op, int32_t mode); /* collective */
lasp_status lasp_lasp2_forward(lasp_lasp2 *op, lasp_stream stream, const lasp_forward_args *args);
/* The same, also writing start_state [B, H, Dk, Dv] fp32 for the backward. */
lasp_status lasp_lasp2_forward_saving(lasp_lasp2 *op, lasp_stream stream,
                                      const lasp_forward_args *args, float *start_state);
/* Synchronises stream; LASP_ERROR_PEER_TIMEOUT if a wait of an earlier call expired. */
lasp_status lasp_lasp2_finish(lasp_lasp2 *op, lasp_stream stream);
lasp_status lasp_lasp2_note_replayed_calls(lasp_lasp2 *op, uint64_t calls);
lasp_status lasp_lasp2_free(lasp_lasp2 *op); /* collective */

/* LASP-2 backward across the ranks (Dv 64 or 128); the same rules as the forward. */
lasp_status lasp_lasp2_grad_create(const lasp_runtime *runtime, int64_t batch, int64_t heads,
                                   int64_t dk, int64_t dv, int32_t mode,
                                   lasp_lasp2_grad **op); /* collective */
lasp_status lasp_lasp2_grad_set_mode(lasp_lasp2_grad *op, int32_t mode); /* collective */
lasp_status lasp_lasp2_backward(lasp_lasp2_grad *op, lasp_stream stream,
                                const lasp_backward_args *args);
lasp_status lasp_lasp2_grad_finish(lasp_lasp2_grad *op, lasp_stream stream);
lasp_status lasp_lasp2_grad_note_replayed_calls(lasp_lasp2_grad *op, uint64_t calls);
lasp_status lasp_lasp2_grad_free(lasp_lasp2_grad *op); /* collective */

/* The same forward and its backward on one GPU (whole sequences, no exchange). */
lasp_status lasp_scalar_decay_create(const lasp_runtime *runtime, lasp_scalar_decay **op);
lasp_status lasp_scalar_decay_forward(lasp_scalar_decay *op, lasp_stream stream,
                                      const lasp_forward_args *args);
lasp_status lasp_scalar_decay_free(lasp_scalar_decay *op);
lasp_status lasp_scalar_decay_grad_create(const lasp_runtime *runtime, lasp_scalar_decay_grad **op);
lasp_status lasp_scalar_decay_backward(lasp_scalar_decay_grad *op, lasp_stream stream,
                                       const lasp_backward_args *args); /* Dv 64 or 128 */
lasp_status lasp_scalar_decay_grad_free(lasp_scalar_decay_grad *op);

#ifdef __cplusplus
}
#endif

#endif /* LASP_SHMEM_H */
