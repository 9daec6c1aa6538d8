"""lasp-shmem: device-initiated GPU communication over NVSHMEM and LASP-2 sequence parallelism
for linear attention. `lasp_shmem.torch` is the PyTorch API; the package's liblasp_shmem.so (the C
ABI of core/include/lasp_shmem.h) is loaded through ctypes on first use."""

from ._abi import ABI_VERSION, LaspError

__all__ = ["ABI_VERSION", "LaspError"]
