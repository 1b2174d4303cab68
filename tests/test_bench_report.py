"""``python -m bench.report`` and the run's console summary, on results files made here.

The results files are written in ``tmp_path`` by the harness's own ``write_results`` (the format
``python -m bench`` writes on a GPU), with made-up times: they test the renderer, never a page.
The README's committed table is checked against the committed results in ``tests/test_docs.py``.
"""
import json
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # bench/ is a top-level folder of the checkout, not installed
    sys.path.insert(0, str(ROOT))

from bench import harness, report  # noqa: E402
from bench.harness import Case, Measurement  # noqa: E402

CEILINGS = {"copy_gbps": 4000.0, "matmul_bf16_tflops": 800.0, "matmul_shape": [8192] * 3}


def _env(date, **kw):
    env = {"date": date, "torch": "2.13.0", "triton": "3.6.0", "python": "3.11", "cuda": "13.0",
           "gpu": "NVIDIA H200", "driver": "580.1", "commit": "abc123def456"}
    env.update(kw)
    return env


def _measurements(ours_ms=(0.1, 0.4), eager_factor=1.5, compile_factor=0.8):
    rows = []
    for hidden, ms in zip((1024, 4096), ours_ms):
        case = Case(op="add_layer_norm", shape={"rows": 16384, "hidden": hidden}, dtype=torch.bfloat16,
                    mode="fwd", providers={}, bytes=16384 * hidden * 8)
        group = [Measurement(case.op, case.shape, "bfloat16", "fwd", "fused_block", ms=ms),
                 Measurement(case.op, case.shape, "bfloat16", "fwd", "eager", ms=ms * eager_factor),
                 Measurement(case.op, case.shape, "bfloat16", "fwd", "torch.compile", ms=ms * compile_factor),
                 Measurement(case.op, case.shape, "bfloat16", "fwd", "liger", unavailable="ModuleNotFoundError: x")]
        for m in group:
            harness.fill_rates(m, case, CEILINGS)
        harness.fill_speedups(group, "fused_block")
        rows += group
    case = Case(op="attention", shape={"B": 4, "L": 2048}, dtype=torch.bfloat16, mode="fwd+bwd", providers={},
                flops=10**12)
    group = [Measurement("attention", case.shape, "bfloat16", "fwd+bwd", "fused_block", ms=2.5),
             Measurement("attention", case.shape, "bfloat16", "fwd+bwd", "sdpa_flash", ms=2.25)]
    for m in group:
        harness.fill_rates(m, case, CEILINGS)
    harness.fill_speedups(group, "fused_block")
    return rows + group


def _write(folder, env, quick=False, measurements=None):
    paths = harness.write_results(str(folder), env, CEILINGS, measurements or _measurements(), quick=quick,
                                  plots=False)
    return pathlib.Path(paths[0])


def _readme(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{report.BEGIN}\nold text\n{report.END}\n\nafter\n")
    return readme


def test_newest_takes_the_latest_date_and_a_full_run_over_a_quick_one(tmp_path):
    old = _write(tmp_path, _env("2026-12-01T10:00:00+00:00"))
    quick = _write(tmp_path, _env("2026-12-03T10:00:00+00:00"), quick=True)
    full = _write(tmp_path, _env("2026-12-03T10:00:00+00:00", gpu="NVIDIA H100 80GB HBM3"))
    assert report.newest([old, quick])[0] == quick
    assert report.newest([old, quick, full])[0] == full
    later_quick = _write(tmp_path, _env("2026-12-03T18:00:00+00:00", gpu="NVIDIA H100 PCIe"), quick=True)
    assert report.newest([old, quick, full, later_quick])[0] == full  # the same day: the full run, whatever the hour
    assert report.newest([]) == (None, None)


def test_files_without_any_timing_are_not_results_to_show(tmp_path):
    cut = _write(tmp_path, _env("2026-12-05T10:00:00+00:00"),
                 measurements=[Measurement("op", {"n": 1}, "bfloat16", "fwd", "fused_block", unavailable="not run")])
    assert report.newest([cut]) == (None, None)
    bad = tmp_path / "other.json"
    bad.write_text(json.dumps({"something": 1}))
    with pytest.raises(ValueError, match="not a results file"):
        report.newest([bad])


@pytest.mark.skipif(shutil.which("git") is None,
                    reason="needs the git command (where it is missing, every *.json counts)")
def test_only_files_git_tracks_count(tmp_path):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    tracked = _write(tmp_path, _env("2026-12-01T10:00:00+00:00"))
    _write(tmp_path, _env("2026-12-04T10:00:00+00:00"), quick=True)  # a local run, not committed
    subprocess.run(["git", "add", tracked.name], cwd=tmp_path, check=True)
    assert report.committed_results(tmp_path) == [tracked]


def test_readme_section_caption_and_summary(tmp_path):
    path = _write(tmp_path, _env("2026-12-03T10:00:00+00:00"))
    data = report.load(path)
    body = report.render_readme(data, path, report.plot_path_for(path))
    caption = body.splitlines()[0]
    for part in ("`python -m bench`", "**NVIDIA H200**", "driver 580.1", "CUDA 13.0", "torch 2.13.0",
                 "triton 3.6.0", "2026-12-03", "commit abc123def456", "copy 4000 GB/s",
                 "cuBLAS bf16 matmul 800 TFLOP/s"):
        assert part in caption
    assert "| op | mode | cases | ours, % of ceiling | ours' speedup over each peer |" in body
    # Norm: 1.5x over eager in both cases, 0.8x against torch.compile; % of ceiling: 16384 * h * 8
    # bytes in 0.1 ms (h 1024) is 1342 GB/s, 34% of 4000; h 4096 in 0.4 ms likewise.
    assert ("| add_layer_norm | fwd | 2 | 34% | eager 1.50x ▲ (1.50-1.50); "
            "torch.compile 0.80x ▼ (0.80-0.80) |") in body
    assert "| attention | fwd+bwd | 1 | 50% | sdpa_flash 0.90x ▼ |" in body
    assert "liger" not in body  # a peer that never ran is not listed
    plot = path.with_name(path.stem + "-speedup.png").name
    assert body.endswith(f"![ours' speedup over each peer, per case]({plot})")


def test_variants_of_ours_are_listed_after_the_peers(tmp_path):
    case = {"d": 1024}
    ms = [Measurement("block", case, "bfloat16", "fwd+bwd", p, ms=t)
          for p, t in (("fused_block", 2.0), ("fused_block+graph", 1.6), ("eager", 3.0))]
    harness.fill_speedups(ms, "fused_block")
    path = _write(tmp_path, _env("2026-12-03T10:00:00+00:00"), measurements=ms)
    body = report.render_readme(report.load(path), path)
    assert "| block | fwd+bwd | 1 | - | eager 1.50x ▲; ours' variants: fused_block+graph 0.80x ▼ |" in body


def test_full_page_has_every_case_with_peers_side_by_side(tmp_path):
    path = _write(tmp_path, _env("2026-12-03T10:00:00+00:00", commit=None), quick=True)
    text = report.render_full(report.load(path), path)
    assert "`python -m bench --quick`" in text and "commit not recorded in the results file" in text
    assert ("| shape | dtype | mode | ours ms | ours rate | % of ceiling | eager ms (speedup) "
            "| torch.compile ms (speedup) |") in text
    assert ("| 16384x4096 | bfloat16 | fwd | 0.4000 | 1342 GB/s | 34% | 0.6000 (1.50x ▲) "
            "| 0.3200 (0.80x ▼) |") in text
    assert "| 4x2048 | bfloat16 | fwd+bwd | 2.5000 | 400.0 TFLOP/s | 50% | 2.2500 (0.90x ▼) |" in text


def test_without_results_both_pages_say_so(tmp_path):
    readme = _readme(tmp_path)
    expected, (path, data) = report.render_all(tmp_path / "none", readme, tmp_path / "results.md")
    assert path is None and data is None
    text = expected[readme]
    assert "**No GPU results are committed yet**" in text
    assert text.startswith("# x\n\n" + report.BEGIN) and text.endswith(report.END + "\n\nafter\n")
    assert "No GPU results are committed yet" in expected[tmp_path / "results.md"]


def test_main_writes_then_check_passes_and_a_hand_edit_fails(tmp_path, monkeypatch, capsys):
    path = _write(tmp_path / "results", _env("2026-12-03T10:00:00+00:00"))
    readme, page = _readme(tmp_path), tmp_path / "docs" / "benchmark-results.md"
    monkeypatch.setattr(report, "README", readme)
    monkeypatch.setattr(report, "FULL_PAGE", page)
    monkeypatch.setattr(report, "plot_speedups", lambda data, out: str(out))
    assert report.main(["--check", "--results", str(path.parent)]) == 1
    assert report.main(["--results", str(path.parent)]) == 0
    assert "1.50x ▲" in readme.read_text() and "1.50x ▲" in page.read_text()
    assert report.main(["--check", "--results", str(path.parent)]) == 0
    readme.write_text(readme.read_text().replace("1.50x ▲", "1.60x ▲"))
    assert report.main(["--check", "--results", str(path.parent)]) == 1
    assert "differs from what python -m bench.report renders" in capsys.readouterr().out


def test_missing_markers_raise(tmp_path):
    with pytest.raises(ValueError, match="bench.report:begin"):
        report.replace_section("# no section\n", "body")


def test_speedup_plot_is_drawn(tmp_path):
    pytest.importorskip("matplotlib")
    path = _write(tmp_path, _env("2026-12-03T10:00:00+00:00"))
    out = report.plot_speedups(report.load(path), report.plot_path_for(path))
    assert pathlib.Path(out).stat().st_size > 1000


def test_console_summary_sorts_ops_and_marks_speedups():
    import bench.__main__ as main

    ms = _measurements()
    ms = ms[-2:] + ms[:-2]  # attention measured first: the summary still lists ops by name
    text = main.format_summary(ms)
    lines = text.splitlines()
    assert lines[1] == "add_layer_norm" and lines.index("attention") > 1
    assert ("  16384x1024 bfloat16 fwd: fused_block 0.1000 ms 1342 GB/s, 34% of ceiling; "
            "eager 1.50x ▲, torch.compile 0.80x ▼") in lines
    assert "sdpa_flash 0.90x ▼" in text and "liger" not in text
    colored = main.format_summary(ms, color=True)
    assert "\033[32m1.50x ▲\033[0m" in colored and "\033[31m0.80x ▼\033[0m" in colored


def test_progress_line_estimates_from_the_last_run_or_a_rough_rate(tmp_path):
    import bench.__main__ as main

    cases = [Case(op="x", shape={"n": 1}, dtype=torch.bfloat16, mode="fwd", providers={"a": None, "b": None})] * 3
    assert main.estimate_line("norm", cases, {}, None) == (
        f"spec norm: 3 cases, 6 provider timings, roughly {6 * main.EST_S_PER_PROVIDER:.0f} s "
        f"({main.EST_S_PER_PROVIDER:g} s per timing; torch.compile's compiles and autotuning add to it)")
    env = _env("2026-12-03T10:00:00+00:00", seconds={"specs": {"norm": 41.7}})
    _write(tmp_path, env, quick=True)
    previous = main.previous_seconds(str(tmp_path), quick=True)
    assert previous == {"norm": 41.7} and main.previous_seconds(str(tmp_path), quick=False) == {}
    assert main.estimate_line("norm", cases, previous, 60.0).endswith(
        "about 42 s (its time in the last results file here); budget 60 s")
