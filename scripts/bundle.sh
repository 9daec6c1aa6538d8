#!/usr/bin/env bash
# Builds the release programs and the GPU test executable and copies what a GPU node without a
# Rust toolchain needs into .bundle/ (git-ignored): the binaries in bin/, the test executable in
# tests/ (scripts/gpu-test.sh runs it; it finds the programs in ../bin), and the commit they were
# built from.
#
#   bash scripts/bundle.sh                          # .bundle/{bin,tests} from the working tree
#   BUNDLE_BASELINE=a2ceb13 bash scripts/bundle.sh  # also .bundle/baseline/{forward_bench,
#                                                   # lasp2_forward, lasp2_backward, digest} built from
#                                                   # that commit, for scripts/forward-ab.sh and
#                                                   # side-by-side LASP-2 timings
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/toolchain.sh
cargo build --release --workspace --bins
gpu_tests="$(bash scripts/gpu-test-executables.sh)"
bash scripts/build-c-examples.sh
rm -rf .bundle && mkdir -p .bundle/bin .bundle/tests
for bin in lasp-run exchange exchange_bench forward_bench lasp2_forward lasp2_backward gla_lasp2 gla_bench mlstm_bench mlstm_lasp2 \
  gated_delta_lasp2 gated_delta_bench short_conv packed_lasp2 \
  digest liblasp_shmem.so lasp2_forward_c; do
  cp "target/release/$bin" .bundle/bin/
done
# Without cargo's hash (gpu-<hash> -> gpu): the name scripts/sanitize.sh and people type.
while read -r exe; do cp "$exe" ".bundle/tests/$(basename "$exe" | sed -E 's/-[0-9a-f]+$//')"; done <<<"$gpu_tests"
git rev-parse HEAD >.bundle/commit
if ! git diff --quiet HEAD -- . ':!benches/results'; then echo "+uncommitted" >>.bundle/commit; fi

if [ -n "${BUNDLE_BASELINE:-}" ]; then
  # A detached worktree of the baseline commit with a target folder of its own, so neither build
  # invalidates the other's; the toolchain exported above is reused.
  baseline_src=target/baseline/src
  git worktree remove --force "$baseline_src" 2>/dev/null || rm -rf "$baseline_src"
  git worktree prune
  git worktree add --quiet --detach "$baseline_src" "$BUNDLE_BASELINE"
  (cd "$baseline_src" && CARGO_TARGET_DIR="$PWD/../target" cargo build --release \
    -p lasp-shmem-benches --bin forward_bench -p lasp-shmem-examples --bin lasp2_forward --bin lasp2_backward --bin digest)
  mkdir -p .bundle/baseline
  for bin in forward_bench lasp2_forward lasp2_backward digest; do cp "target/baseline/target/release/$bin" .bundle/baseline/; done
  git -C "$baseline_src" rev-parse HEAD >.bundle/baseline/commit
  git worktree remove --force "$baseline_src"
fi

# Without their debug info (function names stay) the binaries are ~3 MB instead of ~15 MB each,
# which keeps the bundle well inside the 64 MiB a device run may carry.
if command -v strip >/dev/null; then
  strip --strip-debug .bundle/bin/* .bundle/tests/*
  if [ -d .bundle/baseline ]; then strip --strip-debug .bundle/baseline/{forward_bench,lasp2_forward,lasp2_backward,digest}; fi
fi
echo "bundle: $(du -sh .bundle | cut -f1) in .bundle/ (commit $(tr '\n' ' ' <.bundle/commit)$(
  [ -f .bundle/baseline/commit ] && echo "; baseline $(head -c 12 .bundle/baseline/commit)"))"
