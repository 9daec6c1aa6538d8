"""The ctypes layer: the struct mirrors, loading the library, and the library's own checks of
descriptors (no GPU needed)."""

import ctypes
import ctypes.util
import re
from pathlib import Path

import pytest

from lasp_shmem import _abi

HEADER = Path(__file__).resolve().parents[2] / "core" / "include" / "lasp_shmem.h"


def test_structs_have_the_sizes_of_the_header():
    for struct, size in _abi.STRUCT_SIZES.items():
        assert ctypes.sizeof(struct) == size, struct.__name__


def test_the_constants_are_the_headers():
    """Every LASP_* code the mirror spells out (slots included) has the header's value."""
    if not HEADER.exists():
        pytest.skip(f"NOTICE: no {HEADER} (the tests run outside a checkout)")
    defines = {name: int(value) for name, value in
               re.findall(r"^#define LASP_(\w+) (\d+)u?\b", HEADER.read_text(), re.M)}
    mirrored = {name: value for name, value in vars(_abi).items()
                if name.isupper() and type(value) is int}
    mirrored["SHMEM_ABI_VERSION"] = mirrored.pop("ABI_VERSION")
    assert {name: defines.get(name) for name in mirrored} == mirrored


def test_a_missing_library_says_where_it_looked_and_what_to_do(monkeypatch, tmp_path):
    monkeypatch.setenv(_abi.LIBRARY_ENV, str(tmp_path / "liblasp_shmem.so"))
    with pytest.raises(OSError, match=r"cannot load .*liblasp_shmem.so.*LASP_SHMEM_LIB"):
        _abi.Library(_abi.library_path())
    monkeypatch.delenv(_abi.LIBRARY_ENV)
    monkeypatch.setattr(_abi, "PACKAGED_LIBRARY", tmp_path / "liblasp_shmem.so")
    with pytest.raises(OSError, match="was not built by pip.*pip install"):
        _abi.library_path()


def test_another_library_is_refused():
    libc = ctypes.util.find_library("c")
    with pytest.raises(OSError, match="is not lasp-shmem's library"):
        _abi.Library(libc)


def test_the_library_implements_this_abi(library):
    assert library.lib.lasp_abi_version() == _abi.ABI_VERSION


def test_symmetric_memory_of_a_layout(library):
    def symmetric_bytes(kind, npes):
        out = ctypes.c_uint64()
        desc = _abi.scalar_decay_desc(kind, 2, 4, 128, 128)
        library.op_symmetric_bytes(ctypes.byref(desc), npes, ctypes.byref(out))
        return out.value

    assert symmetric_bytes(_abi.KIND_SINGLE_GPU, 4) == 0
    assert 0 < symmetric_bytes(_abi.KIND_LASP2, 2) < symmetric_bytes(_abi.KIND_LASP2, 4)


def test_the_library_rejects_an_unsupported_layout_with_its_message(library):
    desc = _abi.scalar_decay_desc(_abi.KIND_SINGLE_GPU, 2, 4, 96, 128)
    with pytest.raises(_abi.LaspError, match="Dk = 96 is not supported") as e:
        library.op_check_call(ctypes.byref(desc), _abi.DIRECTION_FORWARD,
                              ctypes.byref(_abi.Call(tokens=8)), ctypes.byref(_abi.Tensors()))
    assert e.value.status == _abi.ERROR_INVALID_ARGUMENT


def test_gla_across_the_ranks_has_a_backward_of_its_own_chain(library):
    """A LASP-2 GLA op with the backward, as lasp_shmem.torch makes it, is accepted and takes
    the symmetric memory of two chains (forward and backward), as scalar decay's does."""
    def symmetric_bytes(with_backward):
        out = ctypes.c_uint64()
        desc = _abi.op_desc(_abi.FAMILY_GLA, _abi.KIND_LASP2, 2, 4, 128, 128, with_backward)
        library.op_symmetric_bytes(ctypes.byref(desc), 4, ctypes.byref(out))
        return out.value

    assert 0 < symmetric_bytes(False) and symmetric_bytes(True) == 2 * symmetric_bytes(False)
