"""Fixtures the engine's CPU kernel tests share."""

import shutil

import pytest

from specfleet_engine.kernels import cpu_gemm


@pytest.fixture(scope="module")
def ops():
    if cpu_gemm.kernel_disabled():
        pytest.skip(f"{cpu_gemm.KERNEL_ENV}=torch: the kernel is switched off in this environment")
    if shutil.which(cpu_gemm._compiler()) is None:
        pytest.skip(f"no C++ compiler ({cpu_gemm._compiler()}) to build the CPU kernel with")
    ops = cpu_gemm.int8_kernel()
    assert ops is not None, f"a compiler is here but the kernel did not build: {cpu_gemm._KernelState.error}"
    return ops


@pytest.fixture
def restore_isa(ops):
    """Puts back the path the ops ran before the test (whatever SPECFLEET_CPU_ISA the test left)."""
    before = cpu_gemm.active_isa()
    yield
    cpu_gemm._KernelState.isa = ops.set_isa(before)
