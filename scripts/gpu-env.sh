# Source this on a GPU node: makes NVSHMEM's and NCCL's libraries (pip or system installs) findable
# and keeps NVLink multicast off. Idempotent.

# Prints the folder of Python package $1, or nothing (status 0 either way, for callers under set -e).
lasp_py_pkg_dir() {
  python3 -c "import $1 as m; print(list(m.__path__)[0])" 2>/dev/null || true
}

if [ -z "${NVSHMEM_HOME:-}" ] || [ ! -e "$NVSHMEM_HOME/lib/libnvshmem_host.so.3" ]; then
  lasp_nvshmem_dir="$(lasp_py_pkg_dir nvidia.nvshmem)"
  if [ -n "$lasp_nvshmem_dir" ]; then export NVSHMEM_HOME="$lasp_nvshmem_dir"; fi
fi
if [ -n "${NVSHMEM_HOME:-}" ]; then
  export LD_LIBRARY_PATH="$NVSHMEM_HOME/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi

# pip's nvidia-nccl ships only libnccl.so.2; cudarc opens libnccl.so.
lasp_nccl_dir="$(lasp_py_pkg_dir nvidia.nccl)"
if [ -n "$lasp_nccl_dir" ] && [ -e "$lasp_nccl_dir/lib/libnccl.so.2" ]; then
  lasp_nccl_link_dir="${TMPDIR:-/tmp}/lasp-nccl-$(id -u)"
  mkdir -p "$lasp_nccl_link_dir"
  ln -sf "$lasp_nccl_dir/lib/libnccl.so.2" "$lasp_nccl_link_dir/libnccl.so"
  export LD_LIBRARY_PATH="$lasp_nccl_link_dir:$lasp_nccl_dir/lib:$LD_LIBRARY_PATH"
fi

# NVLink multicast can take a shared host's GPUs out of service: keep it off everywhere.
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1

# lasp_binaries [cargo build arguments]: BIN = .bundle/bin when a bundle is present
# (scripts/bundle.sh), else target/release after `cargo build --release ARGS` (default: every
# binary of the workspace). Exports LASP_COMMIT (+dirty for a bundle built from uncommitted changes)
# and LASP_DATE for the result files, keeping values a calling script already exported.
lasp_binaries() {
  local commit
  if [ -d .bundle/bin ]; then
    BIN="$PWD/.bundle/bin"
    commit="$(head -c 12 .bundle/commit)"
    if grep -q uncommitted .bundle/commit; then commit="$commit+dirty"; fi
  else
    [ $# -gt 0 ] || set -- --workspace --bins
    source scripts/toolchain.sh && cargo build --release "$@" || return 1
    BIN="$PWD/target/release"
    commit="$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)"
  fi
  export LASP_COMMIT="${LASP_COMMIT:-$commit}"
  export LASP_DATE="${LASP_DATE:-$(date -u +%Y-%m-%dT%H:%M:%SZ)}"
}

# lasp_gpu_tests: GPU_TESTS = the GPU test executables (cargo test targets that skip without a GPU):
# .bundle/tests/* when a bundle is present, else built by scripts/gpu-test-executables.sh.
lasp_gpu_tests() {
  if [ -d .bundle/tests ]; then
    GPU_TESTS=("$PWD"/.bundle/tests/*)
  else
    local paths
    paths="$(bash scripts/gpu-test-executables.sh)" || return 1
    mapfile -t GPU_TESTS <<<"$paths"
  fi
}
