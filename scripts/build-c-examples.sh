#!/usr/bin/env bash
# Builds liblasp_shmem.so (the C ABI, core/include/lasp_shmem.h) and the C example that uses it,
# both into target/release (the example finds the library next to itself):
#
#   bash scripts/build-c-examples.sh
#   target/release/lasp-run -n 4 target/release/lasp2_forward_c
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/toolchain.sh
cargo build --release -p lasp-shmem --lib
# Plain C, with the CUDA runtime linked statically: the example needs only the driver on the GPU
# node. The runtime's headers and archive sit beside nvcc (pip: nvidia/cu13/{include,lib}).
cuda_root="$(dirname "$(dirname "$NVCC")")"
cuda_lib="$cuda_root/lib64"; [ -e "$cuda_lib/libcudart_static.a" ] || cuda_lib="$cuda_root/lib"
"${CC:-cc}" -std=c11 -O2 -Wall -Wextra -Werror -Icore/include -I"$cuda_root/include" \
  examples/c/lasp2_forward.c -Ltarget/release -llasp_shmem -Wl,-rpath,'$ORIGIN' \
  "$cuda_lib/libcudart_static.a" -ldl -lpthread -lrt -lm -o target/release/lasp2_forward_c
echo "built target/release/liblasp_shmem.so and target/release/lasp2_forward_c"
