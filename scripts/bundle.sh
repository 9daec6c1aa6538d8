#!/usr/bin/env bash
# Builds the release programs and copies what a GPU node without a Rust toolchain needs into
# .bundle/ (git-ignored): the binaries and the commit they were built from.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/toolchain.sh
cargo build --release --workspace --bins
rm -rf .bundle && mkdir -p .bundle/bin
for bin in lasp-run exchange exchange_bench forward_check forward_bench lasp2_forward; do
  cp "target/release/$bin" .bundle/bin/
done
# Without their debug info (function names stay) the binaries are ~3 MB instead of ~15 MB each,
# which keeps the bundle well inside the 64 MiB a device run may carry.
if command -v strip >/dev/null; then strip --strip-debug .bundle/bin/*; fi
git rev-parse HEAD >.bundle/commit
if ! git diff --quiet HEAD -- . ':!benches/results'; then echo "+uncommitted" >>.bundle/commit; fi
echo "bundle: $(du -sh .bundle | cut -f1) in .bundle/ (commit $(tr '\n' ' ' <.bundle/commit))"
