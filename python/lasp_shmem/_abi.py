"""The C ABI of liblasp_shmem.so (core/include/lasp_shmem.h) through ctypes: its constants, its
structs, and the library with every status turned into a `LaspError` carrying the library's own
message. Nothing here imports torch or needs a GPU."""

import ctypes
import os
from pathlib import Path

ABI_VERSION = 3
OK, ERROR_INVALID_ARGUMENT = 0, 1
FAMILY_SCALAR_DECAY = 1
FAMILY_GLA = 2
FAMILY_GATED_DELTA = 3
FAMILY_MLSTM = 4
KIND_SINGLE_GPU, KIND_LASP2 = 1, 2
SCHEDULE_ALL_GATHER = 1
MODE_OVERLAPPED, MODE_SEQUENTIAL_NCCL, MODE_SEQUENTIAL_NVSHMEM = 0, 1, 2
MODE_PIPELINED_CHAIN = 4
OP_WITH_BACKWARD = 1
DIRECTION_FORWARD, DIRECTION_BACKWARD = 0, 1
# LASP_SLOT_*: where each tensor of a call goes in Tensors.slot.
(SLOT_Q, SLOT_K, SLOT_V, SLOT_G, SLOT_BETA, SLOT_H0, SLOT_O, SLOT_HT, SLOT_START_STATE, SLOT_DO,
 SLOT_DHT, SLOT_DQ, SLOT_DK, SLOT_DV, SLOT_DG, SLOT_DBETA, SLOT_DH0, SLOT_CHUNK_STATES,
 SLOT_I_GATE, SLOT_DI_GATE, SLOT_SAVED_ROWS, SLOT_EXIT_STATE, SLOT_CU_SEQLENS,
 SLOT_DOCUMENT_HT) = (
    0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 18, 19, 20, 21, 22, 17, 23)
SLOT_CAPACITY = 32
# LASP_DTYPE_* by torch's name of the type (torch.bfloat16 is "torch.bfloat16").
DTYPES = {"torch.bfloat16": 1, "torch.float16": 2, "torch.float32": 3, "torch.int32": 4,
          "torch.int64": 5}
# The library in an installed package; LASP_SHMEM_LIB names another (a build of a checkout).
LIBRARY_ENV = "LASP_SHMEM_LIB"
PACKAGED_LIBRARY = Path(__file__).with_name("liblasp_shmem.so")


class SizedStruct(ctypes.Structure):
    """A struct that begins with struct_size: filled in with this mirror's size; every other
    field is zero unless given (the reserved ones must stay so)."""

    def __init__(self, **fields):
        super().__init__(struct_size=ctypes.sizeof(type(self)), **fields)


class RuntimeOptions(SizedStruct):
    _fields_ = [("struct_size", ctypes.c_uint32), ("abi_version", ctypes.c_uint32),
                ("symmetric_heap_bytes", ctypes.c_uint64), ("wait_timeout_ms", ctypes.c_uint64),
                ("nvshmem_library", ctypes.c_char_p)]


class Place(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int32)
                for name in ("rank", "world_size", "local_rank", "local_world_size")]


class UniqueId(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_uint8 * 128)]


class OpDesc(SizedStruct):
    _fields_ = ([("struct_size", ctypes.c_uint32), ("abi_version", ctypes.c_uint32)]
                + [(n, ctypes.c_int32) for n in ("family", "kind", "schedule", "mode")]
                + [(n, ctypes.c_int64) for n in ("batch", "heads", "dk", "dv", "tokens")]
                + [("flags", ctypes.c_uint64), ("reserved", ctypes.c_uint64 * 8)])


class Call(SizedStruct):
    _fields_ = [("struct_size", ctypes.c_uint32), ("scale", ctypes.c_float),
                ("tokens", ctypes.c_int64), ("shard_start", ctypes.c_int64),
                ("reserved", ctypes.c_uint64 * 5)]


class Tensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64), ("numel", ctypes.c_int64), ("dtype", ctypes.c_int32),
                ("reserved", ctypes.c_int32)]


class Tensors(SizedStruct):
    _fields_ = [("struct_size", ctypes.c_uint32), ("reserved", ctypes.c_uint32),
                ("slot", Tensor * SLOT_CAPACITY)]


# The sizes lasp_shmem.h asserts.
STRUCT_SIZES = {RuntimeOptions: 32, Place: 16, UniqueId: 128, OpDesc: 136, Call: 64, Tensor: 24,
                Tensors: 776}

P, HANDLE, OUT = ctypes.POINTER, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)
# Every entry point used, with the argument types of lasp_shmem.h (ctypes would otherwise pass
# Python ints as 32-bit C ints).
SIGNATURES = {
    "unique_id_create": [P(RuntimeOptions), P(Place), P(UniqueId)],
    "runtime_init": [P(RuntimeOptions), P(Place), P(UniqueId), OUT],
    "runtime_attach": [P(RuntimeOptions), ctypes.c_int32, OUT],
    "runtime_place": [HANDLE, P(Place)],
    "runtime_shutdown": [HANDLE],
    "op_symmetric_bytes": [P(OpDesc), ctypes.c_int32, P(ctypes.c_uint64)],
    "op_create": [HANDLE, P(OpDesc), OUT],
    "op_forward": [HANDLE, HANDLE, P(Call), P(Tensors)],
    "op_backward": [HANDLE, HANDLE, P(Call), P(Tensors)],
    "op_check_call": [P(OpDesc), ctypes.c_int32, P(Call), P(Tensors)],
    "op_set_mode": [HANDLE, ctypes.c_int32],
    "op_plan": [HANDLE, HANDLE, ctypes.c_int32, P(Call), P(Tensors), P(ctypes.c_int32)],
    "op_finish": [HANDLE, HANDLE],
    "op_free": [HANDLE],
}


class LaspError(RuntimeError):
    """A call of liblasp_shmem.so failed: `status` is its LASP_ERROR_* code, the message the
    library's own (what went wrong and what to do)."""

    def __init__(self, status, message):
        super().__init__(f"lasp-shmem status {status}: {message}")
        self.status = status


class Library:
    """liblasp_shmem.so: `lib.op_create(...)` calls lasp_op_create and raises `LaspError` unless
    it returns LASP_OK."""

    def __init__(self, path):
        try:
            self.lib = ctypes.CDLL(str(path))
        except OSError as e:
            raise OSError(f"cannot load {path}: {e}; {how_to_get_the_library()}") from e
        try:
            self.lib.lasp_abi_version.restype = ctypes.c_uint32
            self.lib.lasp_last_error.restype = ctypes.c_char_p
            for name, argtypes in SIGNATURES.items():
                fn = getattr(self.lib, "lasp_" + name)
                fn.argtypes, fn.restype = argtypes, ctypes.c_int32
        except AttributeError as e:
            raise OSError(f"{path} is not lasp-shmem's library ({e}); "
                          f"{how_to_get_the_library()}") from e
        version = self.lib.lasp_abi_version()
        if version != ABI_VERSION:
            raise OSError(f"{path} implements lasp-shmem's C ABI {version}, this package ABI "
                          f"{ABI_VERSION}; install the package and the library from the same "
                          "checkout")
        self.path = path

    def __getattr__(self, name):
        fn = getattr(self.lib, "lasp_" + name)

        def call(*args):
            status = fn(*args)
            if status != OK:
                raise LaspError(status, self.lib.lasp_last_error().decode())
        return call


def how_to_get_the_library():
    return (f"pip install the lasp-shmem wheel, which holds {PACKAGED_LIBRARY.name}, or set "
            f"{LIBRARY_ENV} to one built by `cargo build --release -p lasp-shmem`")


def library_path():
    """Where the library is: $LASP_SHMEM_LIB, else the one in this package."""
    path = os.environ.get(LIBRARY_ENV)
    if path:
        return Path(path)
    if not PACKAGED_LIBRARY.exists():
        raise OSError(f"{PACKAGED_LIBRARY} is missing (this lasp_shmem package was not built by "
                      f"pip); {how_to_get_the_library()}")
    return PACKAGED_LIBRARY


_library = None


def library():
    """The library, loaded on first use."""
    global _library
    if _library is None:
        _library = Library(library_path())
    return _library


def op_desc(family, kind, b, h, dk, dv, with_backward, mode=MODE_OVERLAPPED):
    """The descriptor of one family's op of one layout, tokens given per call (LASP-2: the
    all-gather exchange in `mode`, a LASP_MODE_*; an op of one GPU has no mode, and the library
    refuses one other than 0)."""
    lasp2 = kind == KIND_LASP2
    return OpDesc(abi_version=ABI_VERSION, family=family, kind=kind,
                  schedule=SCHEDULE_ALL_GATHER if lasp2 else 0, mode=mode,
                  batch=b, heads=h, dk=dk, dv=dv, flags=OP_WITH_BACKWARD if with_backward else 0)


def scalar_decay_desc(kind, b, h, dk, dv):
    """The descriptor of scalar decay's forward and backward of one layout."""
    return op_desc(FAMILY_SCALAR_DECAY, kind, b, h, dk, dv, with_backward=True)


def tensors(slots):
    """The lasp_tensors of {LASP_SLOT_*: (data address, element count, torch dtype name)}, an
    empty slot for None."""
    out = Tensors()
    for slot, tensor in slots.items():
        if tensor is not None:
            data, numel, dtype = tensor
            out.slot[slot] = Tensor(data, numel, DTYPES[dtype], 0)
    return out


def nvshmem_initialized():
    """Whether NVSHMEM's host library is loaded in this process and initialised (by anyone)."""
    try:
        nvshmem = ctypes.CDLL("libnvshmem_host.so.3", mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL)
    except OSError:
        return False
    # NVSHMEM_STATUS_IS_INITIALIZED, _LIMITED_MPG, _FULL_MPG of nvshmem_constants.h.
    return nvshmem.nvshmemx_init_status() in (2, 3, 4)
