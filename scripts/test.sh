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
python3 benches/schedules_report.py --self-test
python3 benches/schedules_model.py --self-test
python3 benches/gated_delta_report.py --self-test
python3 benches/tfla_mlstm.py --self-test
python3 benches/mlstm_lasp2_report.py --self-test
# The Python package's tests (python/tests) against the library the tests above built; those that
# need a GPU skip with a notice. Where torch does not import (CI installs none) only the files that
# need no torch run: the C ABI's mirror and the training report. pytest comes from the machine, or
# once from PyPI at a pinned version into .toolchain/pytest (git-ignored).
cargo build --workspace --lib # a no-op after the tests, that names target/debug/liblasp_shmem.so
python_tests() {
  LASP_SHMEM_LIB="${CARGO_TARGET_DIR:-target}/debug/liblasp_shmem.so" PYTHONPATH="python${1:+:$1}" \
    python3 -m pytest -q -rs -p no:cacheprovider "${@:2}"
}
pytest_dir=.toolchain/pytest
if ! python3 -c "import pytest" 2>/dev/null && [ ! -f "$pytest_dir/.done" ]; then
  rm -rf "$pytest_dir"
  python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore \
    --target "$pytest_dir" pytest==9.2.0 &&
    touch "$pytest_dir/.done" || echo "NOTICE: pip could not install pytest; the Python tests are skipped"
fi
extra=""
if ! python3 -c "import pytest" 2>/dev/null && [ -f "$pytest_dir/.done" ]; then extra="$pytest_dir"; fi
if ! PYTHONPATH="$extra" python3 -c "import pytest" 2>/dev/null; then
  echo "NOTICE: Python package tests skipped: python3 cannot import pytest (pip install pytest)"
elif PYTHONPATH="$extra" python3 -c "import torch" 2>/dev/null; then
  python_tests "$extra" python/tests
else
  echo "NOTICE: torch does not import: only the Python tests that need no torch run (pip install torch for the rest)"
  python_tests "$extra" python/tests/test_abi.py python/tests/test_training_report.py
fi
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "NOTICE: GPUs found; run the GPU suite with: bash scripts/gpu-test.sh"
else
  echo "NOTICE: GPU tests skipped: no NVIDIA GPU on this machine. On a GPU node run: bash scripts/gpu-test.sh"
fi
