"""Every shipped kernel config compiles for sm_80 and sm_90: no errors, no spills, wgmma on sm_90.

The interpreter accepts code the GPU compiler rejects, so this is the CPU suite's check of
the GPU build. The default run builds every config on each arch and data path, with the flag
combinations of a config list taken in turn (``KernelSpec.ci``); the heavy check
(``FUSED_BLOCK_HEAVY=1`` or ``-m heavy``) builds the rest of the product, which a kernel
change must pass too. Compiled kernels are cached by Triton, so reruns are fast.
"""
import importlib.util
import json
import pathlib
import re

import pytest

from fused_block.kernels import aot, fake_driver

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODULES = [m for m in aot.MODULES if importlib.util.find_spec(f"fused_block.kernels.{m}") is not None]

def _problems(reports) -> str:
    messages = []
    for what, bad in (("register spills", [r for r in reports if r.spills and not r.spills_ok]),
                      ("no wgmma on sm_90", [r for r in reports if r.wgmma_required and not r.wgmma_found]),
                      ("no TMA (cp.async.bulk.tensor) on sm_90", [r for r in reports if r.tma_required and not r.tma_found]),
                      ("hot loops without wgmma on sm_90",
                       [r for r in reports if r.hot_loops_required and not r.hot_loops_found])):
        if bad:
            messages.append(f"{what}:\n" + aot.format_table(bad))
    return "\n".join(messages)


@pytest.fixture(scope="module")
def reports(run_once):
    # In a subprocess: the suite runs with TRITON_INTERPRET=1, whose kernels cannot be compiled.
    # Once per run: every xdist worker that runs a test of this module reads the same reports.
    path = run_once("compile-ci.json", lambda p: aot.compile_all_subprocess(tuple(MODULES), subset="ci", path=p))
    return aot.load_reports(path)


def test_every_kernel_module_ships_specs(reports):
    assert set(MODULES) == set(aot.MODULES), "a kernel module is missing"
    for m in MODULES:
        assert {r.arch for r in reports if r.module == m} == set(aot.ARCHS), f"no specs compiled for {m} on every arch"


def test_compiles_without_spills(reports):
    assert {r.arch for r in reports} == set(aot.ARCHS)
    spilled = [r for r in reports if r.spills and not r.spills_ok]
    assert not spilled, "register spills:\n" + aot.format_table(spilled)


def test_only_the_tf32_attention_configs_may_spill(reports):
    """The one class allowed to spill (``KernelSpec.spills_ok``): fp32 attention under TF32,
    whose operands go through registers to be rounded to nearest TF32
    (``attention.specs.TF32_SPILLS``); every other config is held to no spills (the heavy
    check's too: ``_problems``)."""
    allowed = [r for r in reports if r.spills_ok]
    assert allowed and all(r.module == "attention" and " tf32" in r.name for r in allowed)


def test_sm90_products_use_wgmma(reports):
    missing = [r for r in reports if r.wgmma_required and not r.wgmma_found]
    assert not missing, "no wgmma on sm_90:\n" + aot.format_table(missing)


def test_sm90_tma_paths_use_tma(reports):
    missing = [r for r in reports if r.tma_required and not r.tma_found]
    assert not missing, "no TMA (cp.async.bulk.tensor) on sm_90:\n" + aot.format_table(missing)


def test_sm90_hopper_kernels_run_their_hot_loops_on_wgmma(reports):
    """The Hopper-only kernels (the Gluon forwards, the atomic-dQ backward: ``KernelSpec.hot_loops``)
    are disassembled: every loop of theirs that does floating-point arithmetic holds HGMMA
    (``sass.hot_loops_on_wgmma``), and none spills."""
    hopper = [r for r in reports if r.hot_loops_required]
    names = {r.name.split(" ")[0] for r in hopper}
    assert names >= {"attention_fwd_hopper", "attention_fwd_hopper_ws", "attention_fwd_hopper_persistent",
                     "attention_fwd_hopper_pp", "attention_bwd_dq_atomic"}, names
    bad = [r for r in hopper if not r.hot_loops_found or r.spills]
    assert not bad, "hot loops without wgmma, or spills:\n" + aot.format_table(bad) + "\n" + aot.format_costs(bad)


@pytest.mark.heavy
def test_the_rest_of_the_flag_product_compiles_clean():
    reports = aot.compile_all_subprocess(tuple(MODULES), subset="rest")
    assert reports, "the heavy check compiled nothing"
    problems = _problems(reports)
    assert not problems, problems


_LIST_SPECS = """
import json, sys
from fused_block.kernels import aot
json.dump({m: [(s.archs, s.name, s.ci) for s in aot.specs_of(m)] for m in ("attention", "matmul")}, sys.stdout)
"""


def _config(archs, name) -> tuple:
    """A spec's config and data path without its flag combination (attention: after the colon;
    a GEMM: its variant and the epilogue split that follows from it) or its whole-tile twin."""
    name = re.sub(r"^matmul\[\S+ (\d+x\d+x\d+)/\d+", r"matmul[\1", name.split(":")[0])
    return tuple(archs), name.replace(" even_mn", "")


def test_the_default_check_builds_every_config():
    # The specs are built where the kernels are JITFunctions (not under the suite's interpreter).
    proc = fake_driver.run_without_interpreter(["-c", _LIST_SPECS], cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for module, specs in json.loads(proc.stdout).items():
        # Split-KV decoding's row blocks (part of its names) take turns: a launch-time choice.
        everything = {_config(a, n) for a, n, _ in specs if "attention_decode " not in n}
        built = {_config(a, n) for a, n, ci in specs if ci}
        assert everything <= built, f"{module} configs left to the heavy check: {sorted(everything - built)[:5]}"
        assert not all(ci for _, _, ci in specs), f"{module}: the default check builds the whole product"


def test_the_default_check_takes_every_combination_in_turn():
    specs = [f"spec{i}" for i in range(10)]
    # A group of three configs with two combinations each, a one-config group of three, and a
    # spec of no group.
    items = {"a": [[0, 1], [2, 3], [4, 5]], "b": [[6, 7, 8]]}
    marked = aot.take_turns([aot.KernelSpec(n, None, {}, {}, 4) for n in specs], items)
    assert [s.name for s in marked if s.ci] == ["spec0", "spec3", "spec4", "spec6", "spec7", "spec8", "spec9"]


def test_the_norms_default_check_takes_every_variant_in_turn():
    from fused_block.kernels import norm

    specs = [aot.KernelSpec(f"spec{i}", None, {}, {}, 4) for i in range(8)]
    # Three configs of one kernel: the first with variants a, b, c, the second a, b, the third
    # a only; a second kernel's config with variant d; spec7 of no config.
    families = {(90, "fwd"): {"c1": [("a", 0), ("b", 1), ("c", 2)], "c2": [("a", 3), ("b", 4)], "c3": [("a", 5)]},
                (90, "bwd"): {"c1": [("d", 6)]}}
    marked = norm._thin(specs, families)
    assert [s.name for s in marked if s.ci] == ["spec0", "spec2", "spec4", "spec5", "spec6", "spec7"]
