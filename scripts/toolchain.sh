# Source this file: it makes nvcc, NVSHMEM, CUTLASS/CuTe and libclang available and exports where
# they are.
#
# A user's own installs win: NVCC or CUDA_HOME (nvcc), NVSHMEM_HOME, CUTLASS_HOME, LIBCLANG_PATH.
# Whatever is not given is installed once from PyPI, at the pinned versions, into .toolchain/python
# in this repository (git-ignored) and reused on later calls.

lasp_repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LASP_TOOLCHAIN_DIR="${LASP_TOOLCHAIN_DIR:-$lasp_repo_root/.toolchain/python}"

# The device archive linked into our cubins and the node's host library must be the same NVSHMEM;
# nvidia-nvvm is pinned because pip otherwise pulls one that does not match nvcc 13.0. libclang
# (clang/native/libclang.so) is what bindgen reads the kernels' parameter headers with at build
# time (kernels/build.rs).
LASP_TOOLCHAIN_PINS=(
  nvidia-cuda-nvcc==13.0.88
  nvidia-cuda-runtime==13.0.96
  nvidia-cuda-crt==13.0.88
  nvidia-cuda-cccl==13.0.85
  nvidia-nvvm==13.0.88
  nvidia-nvshmem-cu13==3.4.5
  nvidia-cutlass==4.2.0.0
  libclang==18.1.1
)

lasp_install_toolchain() {
  local stamp="$LASP_TOOLCHAIN_DIR/.pins"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "${LASP_TOOLCHAIN_PINS[*]}" ]; then
    return 0
  fi
  echo "lasp-shmem: installing the pinned CUDA toolchain into $LASP_TOOLCHAIN_DIR" >&2
  local python="${PYTHON:-python3}"
  rm -rf "$LASP_TOOLCHAIN_DIR"
  # --no-deps: the wheels above are the whole toolchain; nvidia-cutlass's Python extras
  # (numpy, scipy, cuda-python) are not needed for its headers.
  "$python" -m pip install --quiet --disable-pip-version-check --no-deps \
    --target "$LASP_TOOLCHAIN_DIR" "${LASP_TOOLCHAIN_PINS[@]}" || {
    echo "lasp-shmem: pip could not install the CUDA toolchain; install nvcc, NVSHMEM and libclang yourself and set CUDA_HOME, NVSHMEM_HOME and LIBCLANG_PATH" >&2
    return 1
  }
  echo "${LASP_TOOLCHAIN_PINS[*]}" >"$stamp"
}

if [ -z "${NVCC:-}" ] && [ -z "${CUDA_HOME:-}" ] || [ -z "${NVSHMEM_HOME:-}" ] || [ -z "${CUTLASS_HOME:-}" ] ||
  [ -z "${LIBCLANG_PATH:-}" ]; then
  lasp_install_toolchain || return 1
fi
if [ -z "${NVCC:-}" ]; then
  if [ -n "${CUDA_HOME:-}" ]; then
    export NVCC="$CUDA_HOME/bin/nvcc"
  else
    export NVCC="$LASP_TOOLCHAIN_DIR/nvidia/cu13/bin/nvcc"
  fi
fi
export NVSHMEM_HOME="${NVSHMEM_HOME:-$LASP_TOOLCHAIN_DIR/nvidia/nvshmem}"
export CUTLASS_HOME="${CUTLASS_HOME:-$LASP_TOOLCHAIN_DIR/cutlass_library/source}"
export LIBCLANG_PATH="${LIBCLANG_PATH:-$LASP_TOOLCHAIN_DIR/clang/native}"
