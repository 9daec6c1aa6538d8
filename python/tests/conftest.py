import pytest

from lasp_shmem import _abi


@pytest.fixture(scope="session")
def library():
    """liblasp_shmem.so (the package's, or $LASP_SHMEM_LIB); the test is skipped without it."""
    try:
        return _abi.library()
    except OSError as e:
        pytest.skip(f"NOTICE: no liblasp_shmem.so to test against: {e}")
