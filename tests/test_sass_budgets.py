"""The static SASS cost of the benchmark shapes' kernels stays within ``kernels/budgets.json``.

``fused_block.kernels.sass`` records what the ops launch at the benchmark's shapes on sm_90
(through the fake CUDA driver), compiles those specializations with Triton's ptxas and
counts, per loop of their SASS, instructions, HGMMA and the issue/tensor ratio. A change that
grows a hot loop (or the registers, or adds spills) fails here, on a machine without a GPU.
After an intended change: ``python -m fused_block.kernels.sass --update-budgets`` and commit
``kernels/budgets.json``. The analysis itself is tested on hand-written SASS below.
"""
import dataclasses
import json
import pathlib

import pytest

from fused_block.kernels import fake_driver, sass

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _measure(out):
    # In a child process: the suite's interpreter makes kernels that cannot be compiled.
    proc = fake_driver.run_without_interpreter(["-m", "fused_block.kernels.sass", "--json", str(out), "--jobs", "2"],
                                               cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


@pytest.fixture(scope="module")
def costs(run_once):
    out = run_once("sass-costs.json", _measure)  # once per run, whichever xdist workers ask
    return [sass.KernelCost(**{**c, "regions": tuple(sass.Region(**r) for r in c["regions"])})
            for c in json.loads(out.read_text())]


def test_benchmark_kernels_within_their_budgets(costs):
    problems = sass.check(costs, sass.load_budgets())
    assert not problems, "over budget:\n  " + "\n  ".join(problems) + "\n" + sass.UPDATE


def test_the_benchmark_kernels_have_their_hot_loops(costs):
    """What the budgets hold: the attention loops on wgmma, the GEMMs' K steps split from
    their epilogues, no spills. (The plain projection of the linear workload runs on cuBLAS
    since the GEMM dispatch (docs/dispatch.md): the fused GELU forward is ours.)"""
    by_label = {c.label: c for c in costs}
    for label in ("attention D64 causal: _attn_fwd", "attention D128: _attn_bwd"):
        loops = [r for r in by_label[label].regions if r.name.startswith("loop")]
        assert len(loops) >= 2 and all(r.hgmma and r.issue_tensor for r in loops), loops
    # (the gated product's K step runs its two products: 8 HGMMA)
    for label, hgmma in (("linear+bias+gelu gpt2-xl: _gemm_kernel", 4), ("swiglu llama-7b: _gemm_kernel", 8)):
        names = {r.name: r for r in by_label[label].regions}
        step = next(r for n, r in names.items() if n.endswith("K step"))
        epilogue = next(r for n, r in names.items() if n.endswith("epilogue"))
        assert step.hgmma == hgmma and epilogue.hgmma == 0 and step.instructions < epilogue.instructions
    assert {c.label.split(": ")[1] for c in costs} >= {
        "_attn_fwd", "_attn_bwd", "_gemm_kernel", "_add_norm_fwd_kernel", "_add_norm_bwd_kernel", "_rope_kernel"}
    assert all(c.spills == 0 for c in costs)
    # The opt-in Hopper kernels (issue 30) at D64 and D128, causal and not: the Gluon forwards
    # and the atomic-dQ backward, every loop doing arithmetic on wgmma (the warp-specialized
    # forwards' TMA loader loop does none); the ping-pong kernel twice (its OVERLAP builds).
    kernels = ("_attn_fwd_hopper", "_attn_fwd_hopper_ws", "_attn_fwd_hopper_persistent", "_attn_fwd_hopper_pp",
               "_attn_fwd_hopper_pp_persistent", "_attn_bwd_dq_atomic")
    hopper = [c for c in costs if c.label.split(": ")[1] in kernels]
    assert sorted(c.label.split(": ")[1] for c in hopper) == sorted(kernels * 4 + ("_attn_fwd_hopper_pp",) * 4)
    bad = [c.label for c in hopper if not sass.hot_loops_on_wgmma(c.regions)]
    assert not bad, bad


# ---------------------------------------------------------------------------------------------
# the analysis on hand-written SASS
# ---------------------------------------------------------------------------------------------

def _listing(lines) -> list:
    """Instr objects of ``(opcode and arguments)`` lines at addresses 0x0, 0x10, ..."""
    text = "\tcode for sm_90a\n\t\tFunction : k\n" + "\n".join(
        f"        /*{16 * i:04x}*/                   {line} ;   /* 0x0 */" for i, line in enumerate(lines))
    return sass._parse(text)["k"]


PROGRAM = [
    "S2R R0, SR_TID.X",                                      # 0x00
    "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24",         # 0x10  outer loop 0x10-0xc0
    "FFMA R1, R2, R3, R4",                                   # 0x20    inner loop 0x20-0x70
    "NOP",                                                   # 0x30
    "HGMMA.64x64x16.F32.BF16 R88, R120, gdesc[UR8], R88",    # 0x40
    "FADD R5, R5, R6",                                       # 0x50
    "IADD3 R7, R7, 0x1, RZ",                                 # 0x60
    "@P0 BRA 0x20",                                          # 0x70
    "SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR4], R2",          # 0x80    a wait: 2 instructions
    "@!P1 BRA 0x80",                                         # 0x90
    "ISETP.NE.AND P2, PT, R7, RZ, PT",                       # 0xa0
    "MOV R8, R9",                                            # 0xb0
    "@P2 BRA 0x10",                                          # 0xc0
    "EXIT",                                                  # 0xd0
    "SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR4], R2",          # 0xe0  retry stub after EXIT
    "@!P1 BRA 0xe0",                                         # 0xf0
    "BRA 0x80",                                              # 0x100
]


def test_loops_are_backward_branches_before_the_last_exit():
    ins = _listing(PROGRAM)
    rs = sass.regions(ins, num_warps=8)
    assert [(r.name, r.start, r.end, r.depth) for r in rs] == [
        ("kernel", 0x0, 0x100, 0), ("loop 0", 0x10, 0xc0, 0), ("loop 1", 0x20, 0x70, 1)]
    kernel, outer, inner = rs
    assert (kernel.instructions, kernel.hgmma) == (16, 2)  # the NOP is not counted
    assert (outer.instructions, outer.hgmma) == (11, 2)
    assert (inner.instructions, inner.hgmma) == (5, 1)
    # issue: 5 instructions x 8 warps / 4 schedulers = 10 cycles; tensor: 2 * 64 * 64 * 16
    # FLOPs x 2 warpgroups / 4096 per clock = 64 cycles.
    assert inner.issue_tensor == pytest.approx(10 / 64, abs=1e-3)
    # outer: 11 x 2 = 22 cycles against (2 * 64 * 128 * 16 + 2 * 64 * 64 * 16) x 2 / 4096 = 192
    assert outer.issue_tensor == pytest.approx(22 / 192, abs=1e-3)


def test_hot_loops_are_the_loops_with_arithmetic():
    rs = sass.regions(_listing(PROGRAM), num_warps=8)
    assert [r.fp for r in rs] == [2, 2, 2]  # the inner loop's FFMA and FADD (S2R, IADD3, MOV are not)
    assert sass.hot_loops_on_wgmma(rs)
    no_mma = [line.replace("HGMMA.64x64x16.F32.BF16 R88, R120, gdesc[UR8], R88", "FMUL R9, R9, R9")
              .replace("HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24", "NOP") for line in PROGRAM]
    assert not sass.hot_loops_on_wgmma(sass.regions(_listing(no_mma), num_warps=8))
    # A TMA producer's loop (no arithmetic) beside a loop on wgmma: fine.
    loader = ["S2R R0, SR_TID.X", "HGMMA.64x64x16.F32.BF16 R88, R120, gdesc[UR8], R88", "MUFU.EX2 R1, R2",
              "IADD3 R7, R7, 0x1, RZ", "UIADD3 UR4, UR4, 0x1, URZ", "@P0 BRA 0x10",
              "UTMALDG.4D [UR8], [UR4]", "IADD3 R7, R7, 0x1, RZ", "UIADD3 UR4, UR4, 0x1, URZ",
              "SYNCS.ARRIVE.TRANS64 RZ, [UR4], RZ", "UISETP.NE.AND UP0, UPT, UR4, URZ, UPT", "@P1 BRA 0x60", "EXIT"]
    rs = sass.regions(_listing(loader), num_warps=4)
    assert [(r.hgmma, r.fp) for r in rs[1:]] == [(1, 1), (0, 0)]
    assert sass.hot_loops_on_wgmma(rs)
    assert not sass.hot_loops_on_wgmma(rs[:1] + rs[2:])  # no loop on wgmma at all
    # A persistent loader's tile loop: unsigned divisions by runtime values (I2F.RP, MUFU.RCP of
    # its result, F2I) are no arithmetic; a reciprocal of a float is.
    division = ["I2F.RP R5, UR13", "MUFU.RCP R5, R5", "IADD3 R6, R5, 0xffffffe, RZ", "F2I.FTZ.U32.TRUNC.NTZ R7, R6"]
    rs = sass.regions(_listing(loader[:6] + division + loader[6:-2] + [f"@P1 BRA 0x{16 * 6:x}", "EXIT"]),
                      num_warps=4)
    assert [(r.hgmma, r.fp) for r in rs[1:]] == [(1, 1), (0, 0)] and sass.hot_loops_on_wgmma(rs)
    rcp = ["FADD R5, R4, R4", "MUFU.RCP R5, R5"]
    rs = sass.regions(_listing(loader[:6] + rcp + loader[6:-2] + [f"@P1 BRA 0x{16 * 6:x}", "EXIT"]), num_warps=4)
    assert [(r.hgmma, r.fp) for r in rs[1:]] == [(1, 1), (0, 2)] and not sass.hot_loops_on_wgmma(rs)


def test_a_loop_branching_over_its_epilogue_gives_the_k_step():
    epilogue = ["F2FP.BF16.F32.PACK_AB R10, R11, R12", "STS [R1], R10", "UTMASTG.2D [UR4], [UR6]"] * 3
    program = (["S2R R0, SR_TID.X",                                  # 0x00
                "HGMMA.64x256x16.F32.BF16 R24, gdesc[UR4], R24",     # 0x10  loop 0x10-...
                "IADD3 R7, R7, 0x1, RZ",                             # 0x20
                f"@P0 BRA 0x{16 * (4 + len(epilogue)):x}"]           # 0x30  over the epilogue
               + epilogue + ["ISETP.NE.AND P2, PT, R7, RZ, PT", "@P2 BRA 0x10", "EXIT"])
    rs = {r.name: r for r in sass.regions(_listing(program), num_warps=8)}
    assert set(rs) == {"kernel", "loop 0", "loop 0 K step", "loop 0 epilogue"}
    assert rs["loop 0"].instructions == 3 + len(epilogue) + 2
    assert (rs["loop 0 K step"].instructions, rs["loop 0 K step"].hgmma) == (5, 1)
    assert (rs["loop 0 epilogue"].instructions, rs["loop 0 epilogue"].hgmma) == (len(epilogue), 0)
    # 5 x 8 / 4 = 10 issue cycles against 2 * 64 * 256 * 16 FLOPs x 2 warpgroups / 4096 = 256
    assert rs["loop 0 K step"].issue_tensor == pytest.approx(10 / 256, abs=1e-3)


def _cost(label="w: k", registers=100, instructions=(1000, 300), hgmma=(8, 8), ratio=(2.0, 0.5)):
    regions = tuple(sass.Region(name, 0, 0, 0, n, h, t) for name, n, h, t in
                    zip(("kernel", "loop 0"), instructions, hgmma, ratio))
    return sass.KernelCost(label, "k", 8, 3, registers, 0, regions)


def test_budgets_are_todays_figures_plus_two_percent_and_hold():
    budgets = sass.budgets_of([_cost()])
    b = budgets["kernels"]["w: k"]
    assert b["registers"] == 102 and b["regions"]["loop 0"] == {"instructions": 306, "hgmma": 8, "issue_tensor": 0.51}
    assert sass.check([_cost()], budgets) == []
    assert sass.check([_cost(registers=102, instructions=(1020, 306), ratio=(2.04, 0.51))], budgets) == []


def test_a_grown_loop_fails_with_the_update_command(tmp_path):
    budgets = sass.budgets_of([_cost()])
    grown = sass.check([_cost(instructions=(1000, 320), ratio=(2.0, 0.54))], budgets)
    assert grown == ["w: k: loop 0: 320 instructions > budget 306", "w: k: loop 0: issue/tensor 0.540 > budget 0.510"]
    assert sass.check([_cost(registers=103)], budgets) == ["w: k: 103 registers > budget 102"]
    assert sass.check([_cost(hgmma=(8, 4))], budgets) == ["w: k: loop 0: 4 HGMMA, budgeted 8"]
    fewer_loops = dataclasses.replace(_cost(), regions=_cost().regions[:1])
    assert "the loops changed" in sass.check([fewer_loops], budgets)[0]
    assert sass.check([_cost("w: other")], budgets) == ["w: other: no budget (a new kernel or specialization)",
                                                        "w: k: budgeted, no longer launched by the benchmark shapes"]
    assert "--update-budgets" in sass.UPDATE
    path = tmp_path / "budgets.json"
    sass.write_budgets([_cost()], path)
    assert sass.load_budgets(path) == budgets
