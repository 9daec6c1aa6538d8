#!/usr/bin/env bash
# The test command: installs the pinned CUDA toolchain if needed, builds every crate (kernels
# included) and runs every test and doctest, then the Python package's tests. The GPU tests
# (examples/tests/gpu) pass with a notice on a machine without a GPU; on a GPU node run them in a
# release build: see scripts/gpu-test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/toolchain.sh
cargo test --workspace --all-targets
# --all-targets leaves the doctests out.
cargo test --workspace --doc
python3 benches/exchange_report.py --self-test
python3 benches/port_report.py --self-test
python3 benches/gla_lasp2_report.py --self-test
python3 benches/gated_delta_report.py --self-test
# The Python package's tests (python/tests) against the library the tests above built; those that
# need a GPU skip with a notice. Only where torch and pytest import: CI installs neither.
if python3 -c "import torch, pytest" 2>/dev/null; then
  cargo build --workspace --lib # a no-op after the tests, that names target/debug/liblasp_shmem.so
  LASP_SHMEM_LIB="${CARGO_TARGET_DIR:-target}/debug/liblasp_shmem.so" PYTHONPATH=python \
    python3 -m pytest -q -rs python/tests
else
  echo "NOTICE: Python package tests skipped: python3 cannot import torch and pytest (pip install torch pytest)"
fi
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "NOTICE: GPUs found; run the GPU suite with: bash scripts/gpu-test.sh"
else
  echo "NOTICE: GPU tests skipped: no NVIDIA GPU on this machine. On a GPU node run: bash scripts/gpu-test.sh"
fi
