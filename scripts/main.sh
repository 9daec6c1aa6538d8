#!/usr/bin/env bash
# The main job: the LASP-2 forward on every GPU of this node, checked against the CPU reference and
# across exchange modes, then timed in every mode (examples/src/bin/lasp2_forward.rs).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu-env.sh
if [ -d .bundle/bin ]; then
  BIN="$PWD/.bundle/bin"
else
  source scripts/toolchain.sh
  cargo build --release -p lasp-shmem -p lasp-shmem-examples --bins
  BIN="$PWD/target/release"
fi
NGPU="$(nvidia-smi -L | wc -l)"
exec "$BIN/lasp-run" --timeout 600 -n "$NGPU" "$BIN/lasp2_forward" "$@"
