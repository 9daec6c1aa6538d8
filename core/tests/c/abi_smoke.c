/* The C ABI from plain C, on a machine with or without a GPU: the header compiles as strict
 * C11, the library links and loads, and every check that needs no GPU answers with its status
 * and message: struct sizes, reserved fields, families, kinds, schedules, modes, slots, dtypes
 * and element counts. Run by core/tests/c_abi.rs; prints "abi_smoke: N checks passed". */
#include "lasp_shmem.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int checks = 0;

static void expect(const char *what, lasp_status got, lasp_status want, const char *fragment) {
  const char *msg = lasp_last_error();
  if (got != want || (fragment != NULL && strstr(msg, fragment) == NULL)) {
    fprintf(stderr, "FAIL %s: status %d (want %d), message \"%s\" (want \"%s\" in it)\n", what,
            (int)got, (int)want, msg, fragment ? fragment : "");
    exit(1);
  }
  checks++;
}

static void expect_true(const char *what, int ok) {
  if (!ok) {
    fprintf(stderr, "FAIL %s\n", what);
    exit(1);
  }
  checks++;
}

/* Scalar decay across the ranks, forward only: B=4, H=16, Dk=Dv=128. */
static lasp_op_desc lasp2_desc(void) {
  lasp_op_desc desc;
  memset(&desc, 0, sizeof desc);
  desc.struct_size = sizeof desc;
  desc.abi_version = LASP_SHMEM_ABI_VERSION;
  desc.family = LASP_FAMILY_SCALAR_DECAY;
  desc.kind = LASP_KIND_LASP2;
  desc.schedule = LASP_SCHEDULE_ALL_GATHER;
  desc.mode = LASP_MODE_OVERLAPPED;
  desc.batch = 4, desc.heads = 16, desc.dk = 128, desc.dv = 128;
  return desc;
}

static lasp_tensor tensor(uint64_t data, int64_t numel, int32_t dtype) {
  lasp_tensor t = {data, numel, dtype, 0};
  return t;
}

/* The forward's tensors of one call of lasp2_desc with T tokens, at made-up device addresses
 * (lasp_op_check_call never dereferences them). */
static lasp_tensors forward_tensors(int64_t t) {
  lasp_tensors tensors;
  memset(&tensors, 0, sizeof tensors);
  tensors.struct_size = sizeof tensors;
  int64_t qk = 4 * t * 16 * 128, gates = 4 * t * 16;
  tensors.slot[LASP_SLOT_Q] = tensor(0x10000000, qk, LASP_DTYPE_BF16);
  tensors.slot[LASP_SLOT_K] = tensor(0x20000000, qk, LASP_DTYPE_BF16);
  tensors.slot[LASP_SLOT_V] = tensor(0x30000000, qk, LASP_DTYPE_BF16);
  tensors.slot[LASP_SLOT_G] = tensor(0x40000000, gates, LASP_DTYPE_F32);
  tensors.slot[LASP_SLOT_O] = tensor(0x50000000, qk, LASP_DTYPE_BF16);
  return tensors;
}

static void descriptors(void) {
  uint64_t bytes = 0;
  lasp_op_desc desc = lasp2_desc();
  expect("symmetric bytes", lasp_op_symmetric_bytes(&desc, 4, &bytes), LASP_OK, NULL);
  /* 2 parities x 4 PEs x 128 tiles of (128 x 64 + 4) floats, one PE's staging block, the
   * signals and credits, 64 KiB of slack. */
  uint64_t slots = 2ull * 4 * 128 * (128 * 64 + 4) * 4, staging = 128ull * (128 * 64 + 4) * 4;
  uint64_t want = slots + staging + 8ull * (2 * 4 * 128 + 4) + (64u << 10);
  expect_true("symmetric bytes of the forward", bytes == want);
  desc.flags = LASP_OP_WITH_BACKWARD;
  expect("with backward", lasp_op_symmetric_bytes(&desc, 4, &bytes), LASP_OK, NULL);
  expect_true("the backward's chain doubles the bytes", bytes == 2 * want);
  desc.kind = LASP_KIND_SINGLE_GPU, desc.schedule = 0, desc.mode = 0;
  expect("one GPU", lasp_op_symmetric_bytes(&desc, 4, &bytes), LASP_OK, NULL);
  expect_true("one GPU needs no symmetric memory", bytes == 0);

  desc = lasp2_desc();
  desc.struct_size = sizeof desc - 8;
  expect("desc size", lasp_op_symmetric_bytes(&desc, 4, &bytes), LASP_ERROR_INVALID_ARGUMENT,
         "desc.struct_size is 128 but");
  desc = lasp2_desc();
  desc.reserved[7] = 1;
  expect("desc reserved", lasp_op_symmetric_bytes(&desc, 4, &bytes),
         LASP_ERROR_INVALID_ARGUMENT, "desc.reserved[7] is 0x1; reserved fields must be 0");
  desc = lasp2_desc();
  desc.abi_version = 1;
  expect("desc ABI", lasp_op_symmetric_bytes(&desc, 4, &bytes), LASP_ERROR_INVALID_ARGUMENT,
         "desc.abi_version is 1");
  desc = lasp2_desc();
  desc.family = 99;
  expect("unknown family", lasp_op_symmetric_bytes(&desc, 4, &bytes),
         LASP_ERROR_INVALID_ARGUMENT, "desc.family 99 is not a LASP_FAMILY_* value");
  desc.family = LASP_FAMILY_MLSTM;
  bytes = 0;
  expect_true("mLSTM's LASP-2 takes symmetric memory",
              lasp_op_symmetric_bytes(&desc, 4, &bytes) == LASP_OK && bytes > 0);
  desc.family = LASP_FAMILY_GATED_DELTA;
  bytes = 0;
  expect_true("Gated DeltaNet's LASP-2 takes symmetric memory",
              lasp_op_symmetric_bytes(&desc, 4, &bytes) == LASP_OK && bytes > 0);
  desc = lasp2_desc();
  desc.kind = 0;
  expect("no kind", lasp_op_symmetric_bytes(&desc, 4, &bytes), LASP_ERROR_INVALID_ARGUMENT,
         "desc.kind is 0");
  desc = lasp2_desc();
  desc.schedule = LASP_SCHEDULE_PIPELINED_CHAIN;
  expect("reserved schedule", lasp_op_symmetric_bytes(&desc, 4, &bytes),
         LASP_ERROR_INVALID_ARGUMENT, "LASP_SCHEDULE_PIPELINED_CHAIN is not available");
  desc = lasp2_desc();
  desc.mode = 7;
  expect("unknown mode", lasp_op_symmetric_bytes(&desc, 4, &bytes), LASP_ERROR_INVALID_ARGUMENT,
         "exchange mode 7 is not one of");
  desc = lasp2_desc();
  desc.flags = 8;
  expect("unknown flag", lasp_op_symmetric_bytes(&desc, 4, &bytes), LASP_ERROR_INVALID_ARGUMENT,
         "desc.flags has bits 0x8");
  desc = lasp2_desc();
  desc.dk = 96;
  expect("Dk 96", lasp_op_symmetric_bytes(&desc, 2, &bytes), LASP_ERROR_INVALID_ARGUMENT,
         "Dk = 96 is not supported");
  desc = lasp2_desc();
  desc.heads = -2;
  expect("negative heads", lasp_op_symmetric_bytes(&desc, 2, &bytes),
         LASP_ERROR_INVALID_ARGUMENT, "desc.heads = -2 is negative");
  desc = lasp2_desc();
  expect("no ranks", lasp_op_symmetric_bytes(&desc, 0, &bytes), LASP_ERROR_INVALID_ARGUMENT,
         "npes = 0 must be at least 1");
  expect("NULL out", lasp_op_symmetric_bytes(&desc, 1, NULL), LASP_ERROR_INVALID_ARGUMENT,
         "bytes is NULL");
  expect("NULL desc", lasp_op_symmetric_bytes(NULL, 1, &bytes), LASP_ERROR_INVALID_ARGUMENT,
         "desc is NULL");
}

static void calls(void) {
  lasp_op_desc desc = lasp2_desc();
  lasp_call call;
  memset(&call, 0, sizeof call);
  call.struct_size = sizeof call;
  call.tokens = 100;
  lasp_tensors tensors = forward_tensors(100), bad;
  const int fwd = LASP_DIRECTION_FORWARD;
  expect("a good call", lasp_op_check_call(&desc, fwd, &call, &tensors), LASP_OK, NULL);

  bad = tensors;
  bad.slot[LASP_SLOT_COUNT] = tensor(0x60000000, 1, LASP_DTYPE_F32);
  expect("unknown slot", lasp_op_check_call(&desc, fwd, &call, &bad), LASP_ERROR_INVALID_ARGUMENT,
         "is filled but lasp-shmem");
  bad = tensors;
  memset(&bad.slot[LASP_SLOT_K], 0, sizeof bad.slot[0]);
  expect("missing tensor", lasp_op_check_call(&desc, fwd, &call, &bad),
         LASP_ERROR_INVALID_ARGUMENT, "LASP_SLOT_K is empty but lasp_op_forward");
  bad = tensors;
  bad.slot[LASP_SLOT_G].dtype = LASP_DTYPE_BF16;
  expect("wrong dtype", lasp_op_check_call(&desc, fwd, &call, &bad), LASP_ERROR_INVALID_ARGUMENT,
         "LASP_SLOT_G is LASP_DTYPE_BF16 but must be LASP_DTYPE_F32");
  bad = tensors;
  bad.slot[LASP_SLOT_V].numel -= 1;
  expect("wrong numel", lasp_op_check_call(&desc, fwd, &call, &bad), LASP_ERROR_INVALID_ARGUMENT,
         "LASP_SLOT_V has 819199 elements but [B, T, H, Dv]");
  bad = tensors;
  bad.slot[LASP_SLOT_DQ] = tensors.slot[LASP_SLOT_Q];
  expect("unused slot", lasp_op_check_call(&desc, fwd, &call, &bad), LASP_ERROR_INVALID_ARGUMENT,
         "LASP_SLOT_DQ is filled but lasp_op_forward");
  bad = tensors;
  bad.slot[LASP_SLOT_CU_SEQLENS] = tensor(0x60000000, 5, LASP_DTYPE_F32);
  expect("offsets' type", lasp_op_check_call(&desc, fwd, &call, &bad),
         LASP_ERROR_INVALID_ARGUMENT, "LASP_SLOT_CU_SEQLENS is LASP_DTYPE_F32 but");
  bad.slot[LASP_SLOT_CU_SEQLENS] = tensor(0x60000000, 5, LASP_DTYPE_I32);
  lasp_call packed = call;
  packed.shard_start = 320;
  expect("packed documents", lasp_op_check_call(&desc, fwd, &packed, &bad), LASP_OK, NULL);
  expect("shard start alone", lasp_op_check_call(&desc, fwd, &packed, &tensors),
         LASP_ERROR_INVALID_ARGUMENT, "LASP_SLOT_CU_SEQLENS is empty");
  bad = tensors;
  bad.struct_size = 8;
  expect("tensors size", lasp_op_check_call(&desc, fwd, &call, &bad),
         LASP_ERROR_INVALID_ARGUMENT, "tensors.struct_size is 8 but");

  lasp_call other = call;
  other.struct_size = 0;
  expect("call size", lasp_op_check_call(&desc, fwd, &other, &tensors),
         LASP_ERROR_INVALID_ARGUMENT, "call.struct_size is 0; set it to sizeof(lasp_call)");
  other = call;
  other.reserved[0] = 2;
  expect("call reserved", lasp_op_check_call(&desc, fwd, &other, &tensors),
         LASP_ERROR_INVALID_ARGUMENT, "call.reserved[0] is 0x2");
  other = call;
  other.tokens = 0;
  expect("no tokens", lasp_op_check_call(&desc, fwd, &other, &tensors),
         LASP_ERROR_INVALID_ARGUMENT, "call.tokens is 0 and so is desc.tokens");
  desc.tokens = 100;
  expect("tokens of the descriptor", lasp_op_check_call(&desc, fwd, &other, &tensors), LASP_OK,
         NULL);
  desc.tokens = 0;
  expect("backward without the flag",
         lasp_op_check_call(&desc, LASP_DIRECTION_BACKWARD, &call, &tensors),
         LASP_ERROR_INVALID_ARGUMENT, "created without LASP_OP_WITH_BACKWARD");
  expect("NULL call", lasp_op_check_call(&desc, fwd, NULL, &tensors), LASP_ERROR_INVALID_ARGUMENT,
         "call is NULL");
}

static void runtime_and_handles(void) {
  lasp_runtime_options options = {sizeof(lasp_runtime_options), LASP_SHMEM_ABI_VERSION + 1, 0, 0,
                                  NULL};
  lasp_place place = {0, 2, 0, 2};
  lasp_unique_id id;
  lasp_runtime *rt = NULL;
  expect("ABI mismatch", lasp_unique_id_create(&options, &place, &id), LASP_ERROR_INVALID_ARGUMENT,
         "abi_version is 4 but this library is lasp-shmem");
  options.abi_version = LASP_SHMEM_ABI_VERSION;
  options.struct_size = 24;
  expect("options size", lasp_unique_id_create(&options, &place, &id),
         LASP_ERROR_INVALID_ARGUMENT, "options.struct_size is 24 but");
  options.struct_size = sizeof options;
  place.rank = 1;
  expect("id on rank 1", lasp_unique_id_create(&options, &place, &id), LASP_ERROR_LAUNCH,
         "only rank 0 makes it");
  place.rank = 2;
  memset(&id, 0, sizeof id);
  expect("rank beyond world", lasp_runtime_init(&options, &place, &id, &rt), LASP_ERROR_LAUNCH,
         "rank 2 is not below the world size 2");
  place.rank = 0;
  place.local_world_size = 3;
  expect("local world > world", lasp_runtime_init(&options, &place, &id, &rt), LASP_ERROR_LAUNCH,
         "local rank 0 of 3");
  expect("NULL id", lasp_runtime_init(&options, &place, NULL, &rt), LASP_ERROR_INVALID_ARGUMENT,
         "id is NULL");
  expect("NULL out handle", lasp_runtime_init(NULL, &place, &id, NULL),
         LASP_ERROR_INVALID_ARGUMENT, "runtime is NULL");
  expect_true("a failed init stores no handle", rt == NULL);

  lasp_op *op = NULL;
  lasp_op_desc desc = lasp2_desc();
  expect("NULL runtime", lasp_op_create(NULL, &desc, &op), LASP_ERROR_INVALID_ARGUMENT,
         "runtime is NULL");
  desc.family = LASP_FAMILY_MLSTM;
  desc.dv = 256;
  expect("the descriptor before the runtime", lasp_op_create(NULL, &desc, &op),
         LASP_ERROR_INVALID_ARGUMENT, "Dv = 256 is not supported");
  expect_true("a failed create stores no handle", op == NULL);
  lasp_call call;
  memset(&call, 0, sizeof call);
  lasp_tensors tensors = forward_tensors(1);
  expect("NULL op", lasp_op_forward(NULL, NULL, &call, &tensors), LASP_ERROR_INVALID_ARGUMENT,
         "op is NULL");
  expect("NULL op backward", lasp_op_backward(NULL, NULL, &call, &tensors),
         LASP_ERROR_INVALID_ARGUMENT, "op is NULL");
  expect("NULL op mode", lasp_op_set_mode(NULL, LASP_MODE_NO_COMM), LASP_ERROR_INVALID_ARGUMENT,
         "op is NULL");
  int32_t planned = -1;
  expect("NULL op plan", lasp_op_plan(NULL, NULL, LASP_DIRECTION_FORWARD, &call, &tensors, &planned),
         LASP_ERROR_INVALID_ARGUMENT, "op is NULL");
  expect("NULL plan mode", lasp_op_plan(NULL, NULL, LASP_DIRECTION_FORWARD, &call, &tensors, NULL),
         LASP_ERROR_INVALID_ARGUMENT, "mode is NULL");
  expect("plan direction", lasp_op_plan(NULL, NULL, 7, &call, &tensors, &planned),
         LASP_ERROR_INVALID_ARGUMENT, "direction 7 is not");
  expect_true("a failed plan stores no mode", planned == -1);
  expect("NULL op finish", lasp_op_finish(NULL, NULL), LASP_ERROR_INVALID_ARGUMENT, "op is NULL");
  expect("NULL op replays", lasp_op_note_replayed_calls(NULL, 1, 1), LASP_ERROR_INVALID_ARGUMENT,
         "op is NULL");
  expect("free NULL", lasp_op_free(NULL), LASP_ERROR_INVALID_ARGUMENT, "op is NULL");
  expect("shutdown NULL", lasp_runtime_shutdown(NULL), LASP_ERROR_INVALID_ARGUMENT,
         "runtime is NULL");
}

int main(void) {
  if (lasp_abi_version() != LASP_SHMEM_ABI_VERSION) {
    fprintf(stderr, "FAIL header ABI %u, library ABI %u\n", LASP_SHMEM_ABI_VERSION,
            lasp_abi_version());
    return 1;
  }
  expect_true("a fresh thread has no error", strcmp(lasp_last_error(), "") == 0);
  descriptors();
  calls();
  runtime_and_handles();
  printf("abi_smoke: %d checks passed\n", checks);
  return 0;
}
