#!/usr/bin/env bash
# Builds the GPU test executable (examples/tests/gpu, release profile) and prints its path, which
# only cargo's JSON messages tell (target/release/deps/gpu-<hash>). scripts/bundle.sh copies it
# into .bundle/tests/; scripts/gpu-test.sh runs it from here where there is no bundle.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/toolchain.sh
cargo test --release -p lasp-shmem-examples --test gpu --no-run --message-format=json | python3 -c '
import json, sys
paths = [m["executable"] for m in map(json.loads, sys.stdin)
         if m.get("reason") == "compiler-artifact" and m.get("executable")
         and m["target"]["name"] == "gpu" and "test" in m["target"]["kind"]]
if not paths:
    sys.exit("gpu-test-executables: cargo built no test executable named gpu")
print("\n".join(paths))
'
