"""Builds liblasp_shmem.so into the package with cargo (setuptools-rust, no Python bindings: the
package loads it with ctypes). Its CUDA kernels need the pinned toolchain: scripts/toolchain.sh
takes NVCC or CUDA_HOME, NVSHMEM_HOME, CUTLASS_HOME and LIBCLANG_PATH from the environment and
installs whatever is missing from PyPI into the repository's .toolchain/ once."""

import os
import subprocess
from pathlib import Path

from setuptools import setup
from setuptools_rust import Binding, RustExtension, Strip
from setuptools_rust.build import build_rust

REPO = Path(__file__).resolve().parent.parent
TOOLCHAIN_VARS = ("NVCC", "NVSHMEM_HOME", "CUTLASS_HOME", "LIBCLANG_PATH")


class BuildRust(build_rust):
    def run(self):
        script = 'source scripts/toolchain.sh >&2 && printf "%s\\0" ' + " ".join(
            f'"${name}"' for name in TOOLCHAIN_VARS)
        values = subprocess.run(["bash", "-c", script], cwd=REPO, check=True,
                                stdout=subprocess.PIPE, text=True).stdout.split("\0")
        os.environ.update(zip(TOOLCHAIN_VARS, values))
        super().run()

    def get_dylib_ext_path(self, ext, target_fname):
        # A plain shared library, not a Python extension: keep the name the C ABI documents.
        return str(Path(super().get_dylib_ext_path(ext, target_fname)).with_name(
            "liblasp_shmem.so"))


setup(
    rust_extensions=[RustExtension("lasp_shmem.liblasp_shmem", str(REPO / "core/Cargo.toml"),
                                   binding=Binding.NoBinding, strip=Strip.Debug)],
    cmdclass={"build_rust": BuildRust},
    # The library uses no Python API: one wheel serves every CPython >= 3.10.
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
