"""Every shipped kernel config compiles for sm_80 and sm_90: no errors, no spills, wgmma on sm_90.

The interpreter accepts code the GPU compiler rejects, so this is the CPU suite's check of
the GPU build. Compiled kernels are cached by Triton, so reruns are fast.
"""
import importlib.util

import pytest

from fused_block.kernels import aot

MODULES = [m for m in aot.MODULES if importlib.util.find_spec(f"fused_block.kernels.{m}") is not None]


@pytest.fixture(scope="module")
def reports():
    # In a subprocess: the suite runs with TRITON_INTERPRET=1, whose kernels cannot be compiled.
    return aot.compile_all_subprocess(tuple(MODULES))


def test_every_kernel_module_ships_specs(reports):
    assert set(MODULES) == set(aot.MODULES), "a kernel module is missing"
    for m in MODULES:
        assert {r.arch for r in reports if r.module == m} == set(aot.ARCHS), f"no specs compiled for {m} on every arch"


def test_compiles_without_spills(reports):
    assert {r.arch for r in reports} == set(aot.ARCHS)
    spilled = [r for r in reports if r.spills]
    assert not spilled, "register spills:\n" + aot.format_table(spilled)


def test_sm90_products_use_wgmma(reports):
    missing = [r for r in reports if r.wgmma_required and not r.wgmma_found]
    assert not missing, "no wgmma on sm_90:\n" + aot.format_table(missing)


def test_sm90_tma_paths_use_tma(reports):
    missing = [r for r in reports if r.tma_required and not r.tma_found]
    assert not missing, "no TMA (cp.async.bulk.tensor) on sm_90:\n" + aot.format_table(missing)
