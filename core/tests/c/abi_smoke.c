/* The C ABI from plain C, on a machine with or without a GPU: the header compiles as strict
 * C11, the library links and loads, and every argument check that needs no GPU answers with
 * its status and message. Run by core/tests/c_abi.rs; prints "abi_smoke: N checks passed". */
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

int main(void) {
  if (lasp_abi_version() != LASP_SHMEM_ABI_VERSION) {
    fprintf(stderr, "FAIL header ABI %u, library ABI %u\n", LASP_SHMEM_ABI_VERSION,
            lasp_abi_version());
    return 1;
  }
  if (strcmp(lasp_last_error(), "") != 0) {
    fprintf(stderr, "FAIL a fresh thread has the error \"%s\"\n", lasp_last_error());
    return 1;
  }
  checks++;

  uint64_t bytes = 0;
  expect("symmetric bytes", lasp_lasp2_symmetric_bytes(4, 16, 128, 128, 4, &bytes), LASP_OK, NULL);
  /* 2 parities x 4 PEs x 128 tiles of (128 x 64 + 4) floats, one PE's staging block, the
   * signals and credits, 64 KiB of slack. */
  uint64_t slots = 2ull * 4 * 128 * (128 * 64 + 4) * 4, staging = 128ull * (128 * 64 + 4) * 4;
  uint64_t want = slots + staging + 8ull * (2 * 4 * 128 + 4) + (64u << 10);
  if (bytes != want) {
    fprintf(stderr, "FAIL symmetric bytes %llu, want %llu\n", (unsigned long long)bytes,
            (unsigned long long)want);
    return 1;
  }
  checks++;
  expect("Dk 96", lasp_lasp2_symmetric_bytes(1, 1, 96, 64, 2, &bytes),
         LASP_ERROR_INVALID_ARGUMENT, "Dk = 96 is not supported");
  expect("negative heads", lasp_lasp2_symmetric_bytes(1, -2, 64, 64, 2, &bytes),
         LASP_ERROR_INVALID_ARGUMENT, "heads = -2 is negative");
  expect("no world", lasp_lasp2_symmetric_bytes(1, 1, 64, 64, 0, &bytes),
         LASP_ERROR_INVALID_ARGUMENT, "world_size = 0 must be at least 1");
  expect("NULL out", lasp_lasp2_symmetric_bytes(1, 1, 64, 64, 1, NULL),
         LASP_ERROR_INVALID_ARGUMENT, "bytes is NULL");

  lasp_runtime_options options = {LASP_SHMEM_ABI_VERSION + 1, 0, 0, 0, NULL};
  lasp_place place = {0, 2, 0, 2};
  lasp_unique_id id;
  lasp_runtime *rt = NULL;
  expect("ABI mismatch", lasp_unique_id_create(&options, &place, &id),
         LASP_ERROR_INVALID_ARGUMENT, "abi_version is 2 but this library implements ABI 1");
  options.abi_version = LASP_SHMEM_ABI_VERSION;
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
  if (rt != NULL) {
    fprintf(stderr, "FAIL a failed init stored a handle\n");
    return 1;
  }

  lasp_lasp2 *op = NULL;
  expect("NULL runtime", lasp_lasp2_create(NULL, 1, 1, 64, 64, LASP_MODE_OVERLAPPED, &op),
         LASP_ERROR_INVALID_ARGUMENT, "runtime is NULL");
  lasp_forward_args args;
  memset(&args, 0, sizeof args);
  expect("NULL op", lasp_lasp2_forward(NULL, NULL, &args), LASP_ERROR_INVALID_ARGUMENT,
         "op is NULL");
  expect("NULL op finish", lasp_lasp2_finish(NULL, NULL), LASP_ERROR_INVALID_ARGUMENT,
         "op is NULL");
  expect("free NULL", lasp_lasp2_free(NULL), LASP_ERROR_INVALID_ARGUMENT, "op is NULL");
  expect("shutdown NULL", lasp_runtime_shutdown(NULL), LASP_ERROR_INVALID_ARGUMENT,
         "runtime is NULL");
  printf("abi_smoke: %d checks passed\n", checks);
  return 0;
}
