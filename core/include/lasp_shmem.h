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
 * Operations: one object, lasp_op, for every family of linear attention (scalar decay; GLA;
 * Gated DeltaNet; mLSTM), run on one GPU or across the ranks (LASP-2). A
 * versioned descriptor (lasp_op_desc) says which family, kind, exchange schedule and mode, and the
 * layout; lasp_op_create makes it (collective for LASP-2). Each call passes its scalars in a
 * lasp_call and its tensors in named slots (lasp_tensors, indexed by LASP_SLOT_*) on the caller's
 * stream: lasp_op_forward, and lasp_op_backward on an op created with LASP_OP_WITH_BACKWARD.
 * A new family or schedule adds descriptor values and slots, never functions.
 *
 * Training with LASP-2: fill LASP_SLOT_START_STATE (scalar decay, Gated DeltaNet; mLSTM with
 * LASP_SLOT_EXIT_STATE and LASP_SLOT_SAVED_ROWS) or LASP_SLOT_CHUNK_STATES (GLA) in the forward
 * call; it receives the state this rank's shard starts from (the state entering every chunk of
 * it). Keep it and pass it in the same slot to the backward, which
 * sends the state gradients down the ranks the way the forward sends the states up: every rank
 * calls it once per forward call, in the same order. Calls are not collective (the ranks meet
 * through device signals); lasp_op_create, lasp_op_set_mode and lasp_op_free are.
 *
 * Every struct begins with struct_size (= sizeof at the caller's compile time); the library
 * rejects a size it does not know, non-zero reserved fields, unknown families, kinds, schedules,
 * modes, flags and slots, a slot the call does not read, a missing tensor, a wrong dtype or
 * element count, each with a message that says what to do. Zero-initialise the structs
 * (lasp_op_desc desc = {0}; or memset) and fill what you use.
 *
 * Every function returns LASP_OK or an error status; lasp_last_error() then says what went
 * wrong and what to do. Arguments are checked before anything is enqueued: a bad shape, a host
 * pointer, a tensor of another GPU, one shorter than its shape, a stream of another context or
 * ranks that disagree on the layout or mode fail before any state moves. Every wait on another
 * GPU is bounded (options.wait_timeout_ms); an expired one makes lasp_op_finish return
 * LASP_ERROR_PEER_TIMEOUT naming the rank that never sent, the signal slot and the epoch.
 *
 * Threads: a handle may be used from any thread; calls on one handle are serialised.
 * Graphs: lasp_op_forward and lasp_op_backward may be captured into a CUDA graph after one
 * uncaptured call of the same shape (which sizes the workspace; a captured call that would have
 * to allocate it is refused with LASP_ERROR_INVALID_ARGUMENT); replays advance the epoch on the
 * device. The sequential modes pick their slot half on the host, by the parity of the call:
 * capture an even number of their calls per graph (or one graph per parity), and report replays
 * with lasp_op_note_replayed_calls.
 *
 * ABI 2 replaced ABI 1's per-operation functions (lasp_lasp2_*, lasp_lasp2_grad_*,
 * lasp_scalar_decay_*, lasp_scalar_decay_grad_*) and its lasp_forward_args /
 * lasp_backward_args by lasp_op; they were removed, not kept as wrappers, so that there is one
 * way to call each operation.
 */
#ifndef LASP_SHMEM_H
#define LASP_SHMEM_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define LASP_SHMEM_ABI_VERSION 3u

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

/* Families of linear attention (lasp_op_desc.family). */
#define LASP_FAMILY_SCALAR_DECAY 1 /* S_t = e^{g_t} S_{t-1} + k_t^T v_t: simple GLA, RetNet */
#define LASP_FAMILY_GLA 2          /* diag(e^{g_t}) per key: g [B, T, H, Dk]; Dk and Dv 64 or
                                      128 */
#define LASP_FAMILY_GATED_DELTA 3  /* the delta rule with g and beta [B, T, H]; Dk 64 or 128, Dv
                                      a multiple of 64 */
#define LASP_FAMILY_MLSTM 4        /* xLSTM's matrix LSTM, input and forget gate pre-activations
                                      [B, T, H]; Dk and Dv 64 or 128 */

/* Where an operation runs (lasp_op_desc.kind). */
#define LASP_KIND_SINGLE_GPU 1 /* whole sequences on this rank's GPU, no exchange */
#define LASP_KIND_LASP2 2      /* sequence parallel: this rank holds a shard of every sequence */

/* How LASP-2 moves the states between ranks (lasp_op_desc.schedule; 0 on one GPU). */
#define LASP_SCHEDULE_AUTO 0            /* the library's choice: LASP_SCHEDULE_ALL_GATHER today */
#define LASP_SCHEDULE_ALL_GATHER 1      /* every rank sends its state tile to every later rank */
#define LASP_SCHEDULE_PIPELINED_CHAIN 2 /* not a creation option: the chain is LASP_MODE_PIPELINED_CHAIN */

/* Exchange modes of LASP-2 (lasp_op_desc.mode, lasp_op_set_mode; 0 on one GPU). Outputs are
 * bitwise the same in all but NO_COMM. */
#define LASP_MODE_OVERLAPPED 0         /* device puts with signals, hidden behind compute */
#define LASP_MODE_SEQUENTIAL_NCCL 1    /* the same kernels around NCCL's all-gather, on a
                                          symmetric NCCL window where NCCL registers one */
#define LASP_MODE_SEQUENTIAL_NVSHMEM 2 /* the same kernels around NVSHMEM's fcollect */
#define LASP_MODE_NO_COMM 3            /* no exchange: the compute's cost alone (timing only) */
#define LASP_MODE_PIPELINED_CHAIN 4    /* device puts along the pipelined chain: each rank folds its
                                          state into its predecessor's and forwards it to the next
                                          (scalar decay, GLA, mLSTM; Gated DeltaNet refuses it) */

/* lasp_op_desc.flags. */
#define LASP_OP_WITH_BACKWARD 1u /* also create the backward (at lasp_op_create, collectively,
                                    so that no call allocates symmetric memory; LASP-2 then
                                    needs twice lasp_op_symmetric_bytes of a forward alone) */

/* Element types (lasp_tensor.dtype; 0 in an empty slot). */
#define LASP_DTYPE_BF16 1
#define LASP_DTYPE_F16 2
#define LASP_DTYPE_F32 3
#define LASP_DTYPE_I32 4
#define LASP_DTYPE_I64 5

/* Tensor slots (lasp_tensors.slot[LASP_SLOT_*]), fla's layout, contiguous, on the runtime's GPU.
 * A call reads the slots its family and direction use (below for every family) and
 * rejects any other slot that is not empty. Slots are only ever appended, up to
 * LASP_SLOT_CAPACITY.
 * Scalar decay, forward:  Q, K [B, T, H, Dk] bf16; V [B, T, H, Dv] bf16; G [B, T, H] fp32
 *                         log-decays, finite and <= 0; H0 [B, H, Dk, Dv] fp32 or empty for zero;
 *                         O [B, T, H, Dv] bf16 out; HT [B, H, Dk, Dv] fp32 out, or empty (LASP-2:
 *                         last rank only); START_STATE (LASP-2) [B, H, Dk, Dv] fp32 out, or empty.
 * Scalar decay, backward: the forward's Q, K, V, G; one GPU: its H0 (or empty), LASP-2: the
 *                         START_STATE the forward wrote on this rank; DO [B, T, H, Dv] bf16; DHT
 *                         [B, H, Dk, Dv] fp32 or empty for zero (LASP-2: last rank only); DQ, DK,
 *                         DV, DG out, as Q, K, V, G; DH0 out, as H0, or empty (LASP-2: rank 0).
 * GLA, forward: Q, K, V as scalar decay's; G [B, T, H, Dk] fp32 (a log-decay per key dimension);
 *               H0, O, HT as scalar decay's; no START_STATE. With LASP_OP_WITH_BACKWARD: also
 *               CHUNK_STATES [B*H, ceil(T/64), Dk, Dv] bf16 out (the state entering every chunk
 *               of 64 tokens of this rank's shard, kept for the backward; LASP-2: they hold the
 *               earlier ranks' prefix), or empty where no backward follows.
 * GLA, backward: the forward's Q, K, V, G, H0 (or empty; LASP-2: the sequence's, on every rank)
 *               and the CHUNK_STATES it wrote on this rank; DO, DHT, DQ, DK, DV, DH0 as scalar
 *               decay's; DG out, as G. LASP-2: DHT on the last rank only and DH0 on rank 0 only;
 *               lasp_op_backward refuses either on another rank with
 *               LASP_ERROR_INVALID_ARGUMENT naming the rank.
 * Gated DeltaNet, forward:  scalar decay's slots and BETA [B, T, H] fp32 (write strengths,
 *               finite); keys as the model gives them (l2-normalised where it normalises them).
 * Gated DeltaNet, backward: scalar decay's slots (H0 on one GPU, the START_STATE the forward
 *               wrote with LASP-2), the forward's BETA, and DBETA out, as BETA.
 * mLSTM (mlstm_kernels' mLSTMexp and its gradient), a state is (C [B, H, Dk, Dv], n [B, H, Dk],
 *               m [B, H]) in one fp32 tensor of B*H*(Dk*Dv + Dk + 1) elements, C then n then m.
 * mLSTM, forward: Q, K, V as scalar decay's; I_GATE and G [B, T, H] fp32, the input and forget
 *               gate pre-activations, finite; H0 a state or empty for (0, 0, 0); O out; HT a state
 *               out, or empty (LASP-2: last rank only); SAVED_ROWS [2, B, T, H] fp32 out (every
 *               token's stabiliser, then its denominator), or empty where no backward follows;
 *               LASP-2 with a backward: START_STATE and EXIT_STATE, states out (entering and
 *               leaving this rank's shard), both or neither.
 * mLSTM, backward: the forward's Q, K, V, I_GATE, G and SAVED_ROWS; one GPU: its H0 (or empty)
 *               and, with DHT, its HT; LASP-2: the START_STATE and EXIT_STATE it wrote on this
 *               rank; DO as scalar decay's; DHT [B, H, Dk, Dv] fp32, the gradient of the final
 *               state's C, or empty (LASP-2: last rank only); DQ, DK, DV out; DI_GATE and DG out,
 *               as I_GATE and G; DH0 [B, H, Dk, Dv] fp32 out, the initial state's C, or empty
 *               (LASP-2: rank 0 only).
 * Packed documents (scalar decay, Gated DeltaNet, GLA, mLSTM; both directions, one GPU and
 *               LASP-2): CU_SEQLENS, fla's cu_seqlens of the whole packed sequence [0, l_1,
 *               l_1 + l_2, ..., total], int32 or int64, entries past the last repeating the
 *               total (a buffer of fixed capacity: a captured graph replays with other documents
 *               written into it), with call.shard_start; every batch row packed alike. The state
 *               forgets at every document start, across ranks too; DG is 0 there. No H0, HT, DHT
 *               or DH0: every document starts from zero.
 *               Every family's forward also takes DOCUMENT_HT [B, N, H, Dk, Dv] fp32 out
 *               (N = CU_SEQLENS's entries - 1; mLSTM's: C [B, N, H, Dk, Dv], n [B, N, H, Dk] and
 *               m [B, N, H] back to back), or empty: each document's state after its last token
 *               where that token is in this call's tokens, zeros for the other documents (the
 *               sum over the ranks holds every document's); LASP-2 needs START_STATE with it
 *               (not GLA's or mLSTM's). No gradient flows from it (the backward takes none). */
#define LASP_SLOT_Q 0
#define LASP_SLOT_K 1
#define LASP_SLOT_V 2
#define LASP_SLOT_G 3
#define LASP_SLOT_BETA 4 /* Gated DeltaNet */
#define LASP_SLOT_H0 5
#define LASP_SLOT_O 6
#define LASP_SLOT_HT 7
#define LASP_SLOT_START_STATE 8
#define LASP_SLOT_DO 9
#define LASP_SLOT_DHT 10
#define LASP_SLOT_DQ 11
#define LASP_SLOT_DK 12
#define LASP_SLOT_DV 13
#define LASP_SLOT_DG 14
#define LASP_SLOT_DBETA 15      /* Gated DeltaNet */
#define LASP_SLOT_DH0 16
#define LASP_SLOT_CU_SEQLENS 17 /* scalar decay, Gated DeltaNet, GLA: packed documents */
#define LASP_SLOT_CHUNK_STATES 18
#define LASP_SLOT_I_GATE 19     /* mLSTM */
#define LASP_SLOT_DI_GATE 20    /* mLSTM */
#define LASP_SLOT_SAVED_ROWS 21 /* mLSTM */
#define LASP_SLOT_EXIT_STATE 22 /* mLSTM */
#define LASP_SLOT_DOCUMENT_HT 23 /* packed documents' final states */
#define LASP_SLOT_COUNT 24      /* slots this header defines */
#define LASP_SLOT_CAPACITY 32   /* room in lasp_tensors: new slots need no new struct size */

/* A CUstream or cudaStream_t (both are this type). NULL is the legacy default stream. */
typedef struct CUstream_st *lasp_stream;

typedef struct lasp_runtime lasp_runtime;
typedef struct lasp_op lasp_op;

typedef struct lasp_runtime_options {
  uint32_t struct_size;          /* sizeof(lasp_runtime_options) */
  uint32_t abi_version;          /* LASP_SHMEM_ABI_VERSION */
  uint64_t symmetric_heap_bytes; /* 0: 256 MiB; sum lasp_op_symmetric_bytes of the ops;
                                    NVSHMEM_SYMMETRIC_SIZE must hold it (see Environment) */
  uint64_t wait_timeout_ms;      /* 0: LASP_WAIT_TIMEOUT_MS, else 10 s */
  const char *nvshmem_library;   /* NULL: NVSHMEM_HOME, else the usual places */
} lasp_runtime_options;

/* This process's place in the job, as torchrun's RANK, WORLD_SIZE, LOCAL_RANK and
 * LOCAL_WORLD_SIZE give it. The local rank selects the GPU. (Four numbers that will not grow:
 * no struct_size.) */
typedef struct lasp_place {
  int32_t rank;
  int32_t world_size;
  int32_t local_rank;
  int32_t local_world_size;
} lasp_place;

typedef struct lasp_unique_id {
  uint8_t bytes[128];
} lasp_unique_id;

/* What an operation is: fixed at creation (LASP-2: every rank passes the same). */
typedef struct lasp_op_desc {
  uint32_t struct_size; /* sizeof(lasp_op_desc) */
  uint32_t abi_version; /* LASP_SHMEM_ABI_VERSION */
  int32_t family;       /* LASP_FAMILY_* */
  int32_t kind;         /* LASP_KIND_* */
  int32_t schedule;     /* LASP_SCHEDULE_* (LASP-2; 0 on one GPU) */
  int32_t mode;         /* LASP_MODE_* (LASP-2; 0 on one GPU) */
  int64_t batch;        /* B */
  int64_t heads;        /* H */
  int64_t dk;           /* 64 or 128 */
  int64_t dv;           /* a multiple of 64; 64 or 128 with LASP_OP_WITH_BACKWARD */
  int64_t tokens;       /* T of every call (LASP-2: this rank's shard), or 0: given per call */
  uint64_t flags;       /* LASP_OP_* */
  uint64_t reserved[8]; /* 0 */
} lasp_op_desc;

/* One call's scalars. */
typedef struct lasp_call {
  uint32_t struct_size; /* sizeof(lasp_call) */
  float scale;          /* sigma in o_t = sigma q_t S_t; 0 for Dk^-1/2; the backward: the
                           forward's */
  int64_t tokens;       /* T: tokens per sequence (LASP-2: this rank's shard; ranks may
                           differ); 0: desc.tokens */
  int64_t shard_start;  /* with LASP_SLOT_CU_SEQLENS: the packed sequence's index of this call's
                           first token (LASP-2: the sum of the earlier ranks' tokens; one GPU: 0);
                           0 without */
  uint64_t reserved[5]; /* 0 */
} lasp_call;

/* One tensor: a device address, its element count and type. All zero: an empty slot. */
typedef struct lasp_tensor {
  uint64_t data;    /* device address (torch: tensor.data_ptr()) */
  int64_t numel;    /* elements */
  int32_t dtype;    /* LASP_DTYPE_* */
  int32_t reserved; /* 0 */
} lasp_tensor;

/* One call's tensors by slot. Optional outputs (HT, START_STATE, CHUNK_STATES, DH0) are asked
 * for by filling their slot, optional inputs (H0, DHT) are zero when empty: the slot is the one
 * place that says so, with no flag to keep in step with it. */
typedef struct lasp_tensors {
  uint32_t struct_size; /* sizeof(lasp_tensors) */
  uint32_t reserved;    /* 0 */
  lasp_tensor slot[LASP_SLOT_CAPACITY];
} lasp_tensors;

#if defined(__cplusplus)
#define LASP_STATIC_ASSERT static_assert
#elif defined(__STDC_VERSION__) && __STDC_VERSION__ >= 201112L
#define LASP_STATIC_ASSERT _Static_assert
#endif
#ifdef LASP_STATIC_ASSERT
LASP_STATIC_ASSERT(sizeof(lasp_runtime_options) == 32, "lasp_runtime_options layout");
LASP_STATIC_ASSERT(sizeof(lasp_place) == 16, "lasp_place layout");
LASP_STATIC_ASSERT(sizeof(lasp_unique_id) == 128, "lasp_unique_id layout");
LASP_STATIC_ASSERT(sizeof(lasp_op_desc) == 136, "lasp_op_desc layout");
LASP_STATIC_ASSERT(sizeof(lasp_call) == 64, "lasp_call layout");
LASP_STATIC_ASSERT(sizeof(lasp_tensor) == 24, "lasp_tensor layout");
LASP_STATIC_ASSERT(sizeof(lasp_tensors) == 776, "lasp_tensors layout");
#undef LASP_STATIC_ASSERT
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
/* Guest mode: joins the NVSHMEM another library of this process has initialised (PyTorch's
 * SymmetricMemory NVSHMEM backend) on CUDA device `device`, instead of initialising it. The PEs
 * and the symmetric heap are that library's; the same NVSHMEM release as the kernels' is required
 * (the message names both otherwise); lasp_runtime_shutdown never finalizes it. Collective over
 * NVSHMEM's PEs. */
lasp_status lasp_runtime_attach(const lasp_runtime_options *options, int32_t device,
                                lasp_runtime **runtime);
lasp_status lasp_runtime_place(const lasp_runtime *runtime, lasp_place *place);
/* Collective; fails (and the handle stays valid) while an operation is alive. */
lasp_status lasp_runtime_shutdown(lasp_runtime *runtime);

/* Operations. */

/* Symmetric memory per rank that lasp_op_create(desc) allocates on npes ranks (0 on one GPU),
 * to size options.symmetric_heap_bytes before init. Checks desc as lasp_op_create does. */
lasp_status lasp_op_symmetric_bytes(const lasp_op_desc *desc, int32_t npes, uint64_t *bytes);
/* Collective for LASP-2: every rank passes the same descriptor, or every rank gets an error
 * naming the ranks that differ. The descriptor is checked before the runtime is used. */
lasp_status lasp_op_create(const lasp_runtime *runtime, const lasp_op_desc *desc, lasp_op **op);
/* Enqueue one call on stream; every argument is checked before anything is enqueued. The
 * tensors must stay valid, and unwritten by anything else, until the call completes. */
lasp_status lasp_op_forward(lasp_op *op, lasp_stream stream, const lasp_call *call,
                            const lasp_tensors *tensors);
lasp_status lasp_op_backward(lasp_op *op, lasp_stream stream, const lasp_call *call,
                             const lasp_tensors *tensors);
/* Checks a call against a descriptor as lasp_op_forward (direction 0) or lasp_op_backward (1)
 * does, up to the device pointers and the stream, with no runtime or GPU: for the tests of a
 * binding. */
#define LASP_DIRECTION_FORWARD 0
#define LASP_DIRECTION_BACKWARD 1
lasp_status lasp_op_check_call(const lasp_op_desc *desc, int32_t direction, const lasp_call *call,
                               const lasp_tensors *tensors);
/* LASP-2: switches every rank's forward and backward to another LASP_MODE_* (collective). */
lasp_status lasp_op_set_mode(lasp_op *op, int32_t mode);
/* LASP-2, the planner: times the exchange modes (and the launch plans that give the same bits) on
 * this call of `direction` (LASP_DIRECTION_*), in turns, the slowest rank's median; switches every
 * rank's op of that direction to the fastest and writes its LASP_MODE_* to *mode, the same on
 * every rank. Collective: every rank passes its own tensors of the same layout, checked as
 * lasp_op_forward / lasp_op_backward check them. It makes about 30 calls per candidate, which
 * write the outputs as a call does, and synchronises the stream; run it once per layout and shard
 * length, outside any CUDA graph capture. lasp_op_set_mode overrides its choice. */
lasp_status lasp_op_plan(lasp_op *op, lasp_stream stream, int32_t direction, const lasp_call *call,
                         const lasp_tensors *tensors, int32_t *mode);
/* Synchronises stream; LASP_ERROR_PEER_TIMEOUT if a wait of an earlier call expired. */
lasp_status lasp_op_finish(lasp_op *op, lasp_stream stream);
/* Calls replayed from captured CUDA graphs since the last report: a graph of one training step
 * replayed n times is (op, n, n). */
lasp_status lasp_op_note_replayed_calls(lasp_op *op, uint64_t forward_calls,
                                        uint64_t backward_calls);
/* Collective for LASP-2 (its symmetric buffers are freed on every rank). */
lasp_status lasp_op_free(lasp_op *op);

#ifdef __cplusplus
}
#endif

#endif /* LASP_SHMEM_H */
