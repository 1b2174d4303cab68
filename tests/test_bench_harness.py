"""The benchmark harness's logic on synthetic measurements: rates, speedups, tables, files.

Nothing here is timed; GPU timing itself (do_bench, ceilings, peak memory) needs CUDA and is
exercised by ``python -m bench`` on a GPU.
"""
import json
import pathlib
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # bench/ is a top-level folder of the checkout, not installed
    sys.path.insert(0, str(ROOT))

from bench import harness, specs  # noqa: E402
from bench.harness import Case, Measurement  # noqa: E402
from bench.specs import norm  # noqa: E402

ENV = {"date": "2026-11-30T12:00:00+00:00", "torch": "2.11.0", "triton": "3.6.0", "python": "3.12.3",
       "cuda": "13.0", "gpu": "NVIDIA H200", "driver": "580.159.04"}
CEILINGS = {"copy_gbps": 4000.0, "matmul_bf16_tflops": 800.0, "matmul_shape": [8192] * 3}


def _case(**kw):
    args = dict(op="op", shape={"rows": 4, "hidden": 8}, dtype=torch.bfloat16, mode="fwd",
                providers={"fused_block": None, "eager": None})
    args.update(kw)
    return Case(**args)


def test_case_rejects_unknown_mode():
    with pytest.raises(ValueError, match="mode"):
        _case(mode="forward")


def test_rates_and_ceiling_fraction():
    case = _case(bytes=2_000_000_000, flops=None)
    m = Measurement("op", case.shape, "bfloat16", "fwd", "fused_block", ms=1.0)
    harness.fill_rates(m, case, CEILINGS)
    assert m.gbps == pytest.approx(2000.0)
    assert m.pct_of_ceiling == pytest.approx(50.0)
    assert m.tflops is None

    # With both counts, the binding ceiling (the larger fraction) is reported.
    case = _case(bytes=1_000_000_000, flops=400 * 10**9)
    m = Measurement("op", case.shape, "bfloat16", "fwd", "fused_block", ms=1.0)
    harness.fill_rates(m, case, CEILINGS)
    assert m.tflops == pytest.approx(400.0)
    assert m.pct_of_ceiling == pytest.approx(50.0)


def test_unavailable_measurement_gets_no_rates():
    m = Measurement("op", {}, "bfloat16", "fwd", "sdpa-flash", unavailable="RuntimeError: no kernel")
    harness.fill_rates(m, _case(bytes=10), CEILINGS)
    assert m.gbps is None and m.pct_of_ceiling is None


def test_speedups_are_relative_to_ours():
    ms = [Measurement("op", {}, "bf16", "fwd", "fused_block", ms=2.0),
          Measurement("op", {}, "bf16", "fwd", "eager", ms=3.0),
          Measurement("op", {}, "bf16", "fwd", "liger", unavailable="ImportError: no liger")]
    harness.fill_speedups(ms, "fused_block")
    assert [m.speedup_of_ours for m in ms] == [1.0, 1.5, None]


def _measurements():
    rows = []
    for hidden, ours_ms in ((1024, 0.1), (4096, 0.4)):
        case = _case(shape={"rows": 16384, "hidden": hidden}, bytes=16384 * hidden * 8)
        group = [Measurement(case.op, case.shape, "bfloat16", "fwd", "fused_block", ms=ours_ms, peak_mem_bytes=2**20),
                 Measurement(case.op, case.shape, "bfloat16", "fwd", "eager", ms=ours_ms * 1.5),
                 Measurement(case.op, case.shape, "bfloat16", "fwd", "liger", unavailable="ModuleNotFoundError: x|y")]
        for m in group:
            harness.fill_rates(m, case, CEILINGS)
        harness.fill_speedups(group, "fused_block")
        rows += group
    return rows


def test_markdown_table():
    text = harness.format_markdown(ENV, CEILINGS, _measurements())
    assert "## op" in text and "copy 4000 GB/s" in text
    assert "| 16384x4096 | bfloat16 | fwd | eager | 0.6000 |" in text
    assert "1.50 |" in text
    assert "unavailable: ModuleNotFoundError: x/y" in text  # a '|' would break the table


def test_results_files_round_trip(tmp_path):
    pytest.importorskip("matplotlib")
    numerics = [{"op": "op", "case": "4x8", "dtype": "bfloat16", "tensor": "out", "err": 1e-3,
                 "torch_err": 1e-3, "atol": 1.6e-2, "ok": True}]
    paths = harness.write_results(str(tmp_path), ENV, CEILINGS, _measurements(), numerics, quick=True)
    names = sorted(pathlib.Path(p).name for p in paths)
    assert names == ["nvidia-h200-2026-11-30-quick-op.png", "nvidia-h200-2026-11-30-quick.json",
                     "nvidia-h200-2026-11-30-quick.md"]
    data = json.loads((tmp_path / "nvidia-h200-2026-11-30-quick.json").read_text())
    assert data["environment"]["gpu"] == "NVIDIA H200" and data["ceilings"] == CEILINGS
    assert data["numerics"] == numerics
    back = harness.load_measurements(str(tmp_path / "nvidia-h200-2026-11-30-quick.json"))
    assert back == _measurements()


def test_numerics_rule_and_table():
    ref = torch.zeros(4, dtype=torch.float64)
    good = harness.compare("op", "4", "out", torch.full((4,), 0.01, dtype=torch.bfloat16), ref,
                           torch.full((4,), 0.01, dtype=torch.bfloat16))
    bad = harness.compare("op", "4", "out", torch.full((4,), 0.5, dtype=torch.bfloat16), ref,
                          torch.full((4,), 0.01, dtype=torch.bfloat16))
    nan = harness.compare("op", "4", "out", torch.full((4,), float("nan"), dtype=torch.bfloat16), ref,
                          torch.zeros(4, dtype=torch.bfloat16))
    assert good["ok"] and not bad["ok"] and not nan["ok"]
    # Torch's error is floored at the rounding error of the output dtype.
    exact = torch.full((4,), 1 / 3, dtype=torch.float64)
    rounded = harness.compare("op", "4", "out", exact.to(torch.bfloat16), exact, exact)
    assert rounded["ok"] and rounded["torch_err"] > 0
    text = harness.format_numerics([good, bad, harness.unavailable_row("attention", "ImportError: not yet")])
    assert "pass" in text and "FAIL" in text and "unavailable: ImportError: not yet" in text
    # A bf16 case's fp32 tensor (the loss) is labelled with the case's dtype; a long op name
    # widens the op column instead of shifting its row.
    loss = harness.compare("linear_cross_entropy", "4", "loss", torch.full((4,), 0.01), ref, torch.full((4,), 0.01),
                           dtype=torch.bfloat16)
    assert loss["dtype"] == harness.dtype_name(torch.bfloat16)
    lines = harness.format_numerics([good, loss]).splitlines()
    assert len({line.index(" out ") if " out " in line else line.index(" loss ") for line in lines[2:]}) == 1


def test_rotating_cycles_through_enough_sets():
    made = []

    def make():
        made.append(len(made))
        return made[-1]

    call = harness.rotating(make, lambda s: s, set_bytes=harness.l2_bytes())
    assert len(made) == 2  # together the sets reach twice the L2 size
    assert [call() for _ in range(5)] == [0, 1, 0, 1, 0]
    made.clear()
    harness.rotating(make, lambda s: s, set_bytes=1)
    assert len(made) == 8  # capped


def test_backward_fn_does_not_accumulate():
    x = torch.randn(5, requires_grad=True)
    y = (x * x).sum()
    bwd = harness.backward_fn([y], [torch.ones(())], [x])
    (g1,), (g2,) = bwd(), bwd()
    assert torch.equal(g1, 2 * x.detach()) and torch.equal(g1, g2) and x.grad is None


def test_compiled_can_be_called_repeatedly():
    # torch.compile is lazy: nothing compiles until the result is called.
    f1, f2 = harness.compiled(torch.sin), harness.compiled(torch.cos)
    assert callable(f1) and callable(f2)
    import torch._dynamo as dynamo
    limit = getattr(dynamo.config, "recompile_limit", getattr(dynamo.config, "cache_size_limit", None))
    assert limit >= 1024


def test_results_stem_slug():
    assert harness.results_stem(ENV, quick=False) == "nvidia-h200-2026-11-30"
    assert harness.slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"


def test_broken_spec_is_reported_not_raised(tmp_path, monkeypatch):
    (tmp_path / "zz_broken.py").write_text("import fused_block.no_such_module\n")
    monkeypatch.setattr(specs, "__path__", list(specs.__path__) + [str(tmp_path)])
    found = specs.discover()
    sys.modules.pop("bench.specs.zz_broken", None)
    assert "norm" in found and not isinstance(found["norm"], str)
    assert isinstance(found["zz_broken"], str) and "ModuleNotFoundError" in found["zz_broken"]


def test_norm_spec_cases_and_bytes():
    quick, full = norm.cases(True), norm.cases(False)
    assert len(full) == 2 * 2 * 3 * 6 and len(quick) == 2 * 1 * 3 * 2
    assert all(set(c.providers) == {"fused_block", "fused_block[triton]", "eager", "torch.compile", "liger"} for c in full)
    n, h = 16384, 4096
    # fwd: x, residual in; out, residual_out out; weight and bias.
    assert norm.min_bytes("add_layer_norm", "fwd", n, h, 2) == 4 * n * h * 2 + 2 * h * 2
    # bwd: dout, dresidual_out, residual_out in; one gradient out; weight in, dweight out; rstd.
    assert norm.min_bytes("add_rms_norm", "bwd", n, h, 2) == 4 * n * h * 2 + 2 * h * 2 + 4 * n
    assert norm.min_bytes("add_rms_norm", "fwd+bwd", n, h, 2) == (
        norm.min_bytes("add_rms_norm", "fwd", n, h, 2) + norm.min_bytes("add_rms_norm", "bwd", n, h, 2) + 4 * n)


def test_norm_spec_numerics_rows(monkeypatch):
    # The report python -m bench prints on a CPU: every row passes or names why it can't run.
    # bf16 only, to keep the interpreter's time down; the norm tests cover every dtype.
    monkeypatch.setattr(norm, "NUMERICS_DTYPES", (torch.bfloat16,))
    rows = norm.numerics()
    assert len(rows) == 6 + 5 or all("unavailable" in r for r in rows)
    assert all(r.get("ok") is True or "unavailable" in r for r in rows), harness.format_numerics(rows)


@pytest.fixture
def fake_cuda(monkeypatch):
    """The CUDA-only calls of the timing path, faked so its logic runs on a CPU: every timed
    call takes 2 ms and allocates nothing."""
    import triton.testing

    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: (fn(), 2.0)[1])
    for name, value in (("synchronize", None), ("reset_peak_memory_stats", None),
                        ("memory_allocated", 1000), ("max_memory_allocated", 1000 + 2**20)):
        monkeypatch.setattr(torch.cuda, name, lambda *a, _v=value, **k: _v)
    monkeypatch.setattr(harness, "measure_ceilings", lambda: dict(CEILINGS))
    monkeypatch.setattr(harness, "environment", lambda: dict(ENV))


def _fake_spec():
    def ours():
        x = torch.ones(8)
        return lambda: x * 2

    def missing_backend():
        raise RuntimeError("No available kernel.\nsecond line")

    def fails_when_called():
        return lambda: torch.ones(2) @ torch.ones(3)

    case = Case(op="fake", shape={"n": 8}, dtype=torch.bfloat16, mode="fwd", bytes=8_000_000_000,
                providers={"fused_block": ours, "sdpa-flash": missing_backend, "broken": fails_when_called})
    return type("FakeSpec", (), {"cases": staticmethod(lambda quick: [case]),
                                 "numerics": staticmethod(lambda: [harness.unavailable_row("fake", "later")])})


def test_timing_path_records_unavailable_providers(fake_cuda):
    (ours, flash, broken), = [harness.run_case(c, CEILINGS) for c in _fake_spec().cases(True)]
    assert ours.ms == 2.0 and ours.gbps == pytest.approx(4000.0) and ours.pct_of_ceiling == pytest.approx(100.0)
    assert ours.peak_mem_bytes == 2**20 and ours.speedup_of_ours == 1.0
    assert flash.ms is None and flash.unavailable == "RuntimeError: No available kernel."
    assert broken.ms is None and broken.unavailable.startswith("RuntimeError")


def test_main_cuda_path_writes_results(fake_cuda, tmp_path):
    pytest.importorskip("matplotlib")
    import bench.__main__ as main

    args = main.parse_args(["--quick", "--out", str(tmp_path)])
    assert main.run_cuda(args, {"fake": _fake_spec(), "broken_import": "ImportError: x"}) == 0
    stem = tmp_path / "nvidia-h200-2026-11-30-quick"
    data = json.loads(stem.with_suffix(".json").read_text())
    assert [m["provider"] for m in data["measurements"]] == ["fused_block", "sdpa-flash", "broken"]
    assert "later" in stem.with_suffix(".md").read_text()
    assert (tmp_path / "nvidia-h200-2026-11-30-quick-fake.png").exists()


def test_only_rejects_unknown_spec():
    import bench.__main__ as main

    with pytest.raises(SystemExit):
        main.parse_args(["--only", "no_such_op"])
    for bad in (["--only", ","], ["--only", ""], ["--profile", " "], ["--spec-budget", "-5"],
                ["--spec-budget", "nan"], ["--spec-budget", "0"]):
        with pytest.raises(SystemExit):  # an empty list ran every spec; budgets were not checked
            main.parse_args(bad)


def _numerics_spec(rows=None, error=None):
    def numerics():
        if error:
            raise error
        return rows

    return type("NumericsSpec", (), {"cases": staticmethod(lambda quick: []), "numerics": staticmethod(numerics)})


def test_cpu_path_prints_numerics_and_compiles_only_on_request(monkeypatch, capsys):
    # Without a GPU the main job answers with the numerics report; the resource table (minutes of
    # compiling every config for two architectures) only with --compile-report.
    import bench.__main__ as main

    calls = []
    monkeypatch.setattr(main, "compile_table", lambda only: calls.append(only) or "TABLE")
    row = {"op": "op", "case": "4", "dtype": "bfloat16", "tensor": "out", "err": 0.0, "torch_err": 0.0,
           "atol": 0.0, "ok": True}
    found = {"fake": _numerics_spec([row])}
    assert main.run_cpu(main.parse_args([]), found) == 0
    out = capsys.readouterr().out
    assert not calls and "TABLE" not in out and "--compile-report" in out
    assert "numerics time: fake " in out and "1 pass, 0 fail" in out

    assert main.run_cpu(main.parse_args(["--compile-report", "--only", "norm"]), found) == 0
    assert calls == [["norm"]] and "TABLE" in capsys.readouterr().out


def test_cpu_path_exits_1_on_a_failing_row(monkeypatch, capsys):
    import bench.__main__ as main

    row = {"op": "op", "case": "4", "dtype": "bfloat16", "tensor": "out", "err": 1.0, "torch_err": 0.0,
           "atol": 0.0, "ok": False}
    assert main.run_cpu(main.parse_args([]), {"fake": _numerics_spec([row])}) == 1
    assert "FAIL" in capsys.readouterr().out


def test_timed_numerics_reports_broken_specs_and_times_the_rest():
    ok = {"op": "op", "case": "4", "dtype": "bfloat16", "tensor": "out", "err": 0.0, "torch_err": 0.0,
          "atol": 0.0, "ok": True}
    found = {"good": _numerics_spec([ok]), "raises": _numerics_spec(error=RuntimeError("boom\nmore")),
             "unimportable": "ImportError: no module"}
    rows, seconds = harness.timed_numerics(found)
    assert rows[0] == ok
    assert rows[1]["unavailable"] == "numerics() failed: RuntimeError: boom"
    assert rows[2]["unavailable"] == "spec import failed: ImportError: no module"
    assert set(seconds) == {"good", "raises"} and all(s >= 0 for s in seconds.values())


def test_numerics_times_name_the_specs_over_budget():
    text = harness.format_numerics_times({"norm": 4.0, "block": 41.5}, budget=30)
    assert text.splitlines()[0] == "numerics time: norm 4.0 s, block 41.5 s"
    assert "over the 30 s budget of one spec: block" in text and "norm (" not in text
    assert "\n" not in harness.format_numerics_times({"norm": 4.0}, budget=30)


def test_quick_uses_torch_compiles_default_mode(monkeypatch):
    seen = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.append(kw) or fn)
    monkeypatch.setattr(harness, "QUICK", True)
    harness.compiled(abs, mode="max-autotune")
    monkeypatch.setattr(harness, "QUICK", False)
    harness.compiled(abs, mode="max-autotune")
    assert seen == [{"dynamic": False}, {"mode": "max-autotune", "dynamic": False}]


def test_main_sets_quick_from_the_flag(monkeypatch, capsys):
    import bench.__main__ as main

    monkeypatch.setattr(harness, "QUICK", False)
    monkeypatch.setattr(specs, "discover", lambda only: {"fake": _numerics_spec([])})
    # The CPU path on a GPU machine too: the CUDA one would measure the ceilings and write
    # empty results files into bench/results/.
    monkeypatch.setattr(main, "CUDA", False)
    assert main.main(["--quick"]) == 0 and harness.QUICK is True
    assert main.main([]) == 0 and harness.QUICK is False


def _run_with_spec_budget(monkeypatch, tmp_path, clock, spec_cases):
    """``run_cuda`` with ``--spec-budget 15``, the clock reading ``clock`` in turn, and specs
    named as ``spec_cases`` with that many copies of the fake case each; every results write
    recorded as (environment, measurements)."""
    import bench.__main__ as main

    readings = iter(clock)
    monkeypatch.setattr(main, "time", type("Clock", (), {"monotonic": staticmethod(lambda: next(readings))}))
    (case,) = _fake_spec().cases(True)
    found = {name: type(name, (), {"cases": staticmethod(lambda quick, n=n: [case] * n),
                                   "numerics": staticmethod(lambda: [])})
             for name, n in spec_cases.items()}
    args = main.parse_args(["--quick", "--out", str(tmp_path), "--spec-budget", "15"])
    written = []
    monkeypatch.setattr(harness, "write_results", lambda out, env, ceilings, ms, *a, **k: written.append(
        (env, list(ms))) or [])
    assert main.run_cuda(args, found) == 0
    return written


def test_spec_budget_records_later_cases_as_not_run(fake_cuda, tmp_path, monkeypatch):
    # Every reading of the clock: 10 s later.
    written = _run_with_spec_budget(monkeypatch, tmp_path, range(0, 1000, 10), {"fake": 2})
    env, ms = written[-1]
    # The clock is read at the spec's start (0 s), before each case (10 s: run; 30 s: past the
    # 15 s budget, not run) and after each case (20 s, 40 s: the spec's time so far).
    assert [m.ms for m in ms] == [2.0, None, None, None, None, None]
    assert all(m.unavailable == "not run: spec fake used its 15 s budget (--spec-budget and what earlier "
               "specs left)" for m in ms[3:])
    assert [m.provider for m in ms[3:]] == ["fused_block", "sdpa-flash", "broken"]
    assert env["seconds"]["specs"] == {"fake": 40}
    assert len(written) == 3  # after each case, then once more with the plots


def test_results_carry_versions_date_and_compile_mode(tmp_path, monkeypatch):
    monkeypatch.setattr(harness, "QUICK", True)
    env = harness.environment()
    assert {"date", "torch", "triton", "cuda", "gpu", "driver", "python"} <= set(env)
    assert env["torch_compile_mode"] == "default (--quick)"
    paths = harness.write_results(str(tmp_path), {**env, "gpu": "NVIDIA H200"}, CEILINGS, [], quick=True,
                                  plots=False)
    data = json.loads(pathlib.Path(paths[0]).read_text())
    assert data["environment"]["torch"] == torch.__version__ and data["quick"] is True
    assert pathlib.Path(paths[0]).name.startswith("nvidia-h200-") and paths[0].endswith("-quick.json")


def test_spec_budget_left_unused_goes_to_the_next_spec(fake_cuda, tmp_path, monkeypatch):
    # Spec "empty" starts at 0 s and ends at 1 s, leaving 14 s of its 15; spec "two" starts at
    # 100 s, its first case ends at 125 s and the second starts at 126 s: 26 s into the spec,
    # past its own 15 s but within 15 + 14.
    written = _run_with_spec_budget(monkeypatch, tmp_path, [0, 1, 100, 101, 125, 126, 130, 131],
                                    {"empty": 0, "two": 2})
    env, ms = written[-1]
    assert [m.ms for m in ms] == [2.0, None, None, 2.0, None, None]
    assert not any(m.unavailable and m.unavailable.startswith("not run") for m in ms)


def test_attention_spec_has_the_issue_shapes_and_peers():
    # The attention issue's table: GQA 32:8 at L 4096 and B1 L16384 beside the dense shapes;
    # SDPA's default, cuDNN, flash and FlashAttention-3 as peers (FA3 unavailable, with the
    # import's reason, where flash_attn_interface is not installed).
    from bench.specs import attention

    cases = [c for c in attention.cases(quick=False) if c.op == "attention"]
    shapes = {(c.shape["batch"], c.shape["heads"], c.shape.get("kv_heads"), c.shape["seq"], c.shape["head_dim"])
              for c in cases}
    assert {(4, 32, 8, 4096, 128), (1, 16, None, 16384, 128), (8, 32, None, 2048, 64)} <= shapes
    assert {"sdpa_default", "sdpa_cudnn", "sdpa_flash", "fa3"} <= set(cases[0].providers)
    gqa = next(c for c in cases if c.shape.get("kv_heads") == 8 and c.mode == "fwd" and c.shape["causal"])
    assert gqa.flops == attention.flops(4, 32, 4096, 128, True, "fwd")
    try:
        import flash_attn_interface  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError):
            attention._attention_fn("fa3", True, 16)
    # The eager peer repeats k and v per group: equal to SDPA's GQA in float64.
    q = torch.randn(2, 4, 9, 16, dtype=torch.float64)
    k, v = torch.randn(2, 2, 9, 16, dtype=torch.float64), torch.randn(2, 2, 9, 16, dtype=torch.float64)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(attention.eager_attention(q, k, v, True), want, rtol=1e-6, atol=1e-6)
