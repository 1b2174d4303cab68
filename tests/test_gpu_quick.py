"""The GPU check's test plumbing in ``tests/conftest.py``: the ``gpu_quick`` subset covers
every test function, every dtype and every parameter value, and ``FUSED_BLOCK_DEADLINE``
stops a run in time with its report.

The whole suite is collected (not run) in a subprocess, as ``scripts/gpu_check.sh`` collects
it, with a small plugin that records each case's function, parameters and whether
``tests/conftest.py`` marked it ``gpu_quick``.
"""
import collections
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from conftest import breadth_first, gpu_quick_selection

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RECORDER = '''
import json, os, torch

def pytest_collection_finish(session):
    rows = []
    for item in session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        rows.append({"function": item.nodeid.split("[", 1)[0],
                     "quick": item.get_closest_marker("gpu_quick") is not None,
                     "params": sorted([name, repr(v)] for name, v in params.items()),
                     "dtypes": sorted(str(v) for v in params.values() if isinstance(v, torch.dtype))})
    with open(os.environ["GPU_QUICK_REPORT"], "w") as f:
        json.dump(rows, f)
'''


@pytest.fixture(scope="module")
def collected(tmp_path_factory):
    folder = tmp_path_factory.mktemp("collect")
    (folder / "gpu_quick_recorder.py").write_text(RECORDER)
    report = folder / "report.json"
    env = dict(os.environ, GPU_QUICK_REPORT=str(report),
               PYTHONPATH=os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-p", "gpu_quick_recorder", "tests"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(report.read_text())


def _by_function(rows):
    out = collections.defaultdict(list)
    for r in rows:
        out[r["function"]].append(r)
    return out


def test_every_test_function_has_a_gpu_quick_case(collected):
    functions = _by_function(collected)
    missing = [f for f, rows in functions.items() if not any(r["quick"] for r in rows)]
    assert not missing, f"no gpu_quick case: {missing}"
    assert "tests/test_gpu_quick.py::test_every_test_function_has_a_gpu_quick_case" in functions


def test_gpu_quick_meets_every_dtype_and_parameter_value_of_each_function(collected):
    for function, rows in _by_function(collected).items():
        quick = [r for r in rows if r["quick"]]
        dtypes = {d for r in rows for d in r["dtypes"]}
        assert dtypes == {d for r in quick for d in r["dtypes"]}, f"{function}: a dtype has no gpu_quick case"
        values = {tuple(p) for r in rows for p in r["params"]}
        assert values == {tuple(p) for r in quick for p in r["params"]}, f"{function}: a parameter value is missing"
    # The parametrized suites are run with fp32, fp16 and bf16.
    assert {d for r in collected if r["quick"] for d in r["dtypes"]} >= {str(t) for t in
                                                                         (torch.float32, torch.float16, torch.bfloat16)}


def test_gpu_quick_is_a_proper_subset(collected):
    quick = sum(r["quick"] for r in collected)
    assert 0 < quick < len(collected)


class _Item:
    def __init__(self, nodeid, **params):
        self.nodeid = nodeid
        if params:
            self.callspec = type("CallSpec", (), {"params": params})()


def test_selection_rule():
    f32, f16 = torch.float32, torch.float16
    shape = [4, 8]  # unhashable: the same object in every case that uses it
    items = [_Item("t.py::plain"),
             _Item("t.py::op[a-f32-s]", act="a", dtype=f32, shape=shape),
             _Item("t.py::op[a-f16-s]", act="a", dtype=f16, shape=shape),
             _Item("t.py::op[b-f32-s]", act="b", dtype=f32, shape=shape),
             _Item("t.py::op[b-f16-s]", act="b", dtype=f16, shape=shape),
             _Item("t.py::other[f32]", dtype=f32),
             _Item("t.py::other[f16]", dtype=f16)]
    chosen = [i.nodeid for i in gpu_quick_selection(items)]
    assert chosen == ["t.py::plain", "t.py::op[a-f32-s]", "t.py::op[a-f16-s]", "t.py::op[b-f32-s]",
                      "t.py::other[f32]", "t.py::other[f16]"]


def test_breadth_first_runs_every_function_once_before_any_twice():
    f32, f16 = torch.float32, torch.float16
    items = [_Item("a.py::op[a-f32]", act="a", dtype=f32), _Item("a.py::op[b-f32]", act="b", dtype=f32),
             _Item("a.py::op[a-f16]", act="a", dtype=f16), _Item("b.py::late[f32]", dtype=f32),
             _Item("b.py::late[f16]", dtype=f16), _Item("b.py::plain")]
    chosen = gpu_quick_selection(items)
    # op's chosen cases are a-f32, b-f32, a-f16 (all of them); late's f32 and f16.
    order = [i.nodeid for i in breadth_first(items, chosen)]
    assert order == ["a.py::op[a-f32]", "b.py::late[f32]", "b.py::plain", "a.py::op[b-f32]", "b.py::late[f16]",
                     "a.py::op[a-f16]"]
    # A case outside the quick subset comes after its function's quick cases.
    assert [i.nodeid for i in breadth_first(items[:3], items[2:3])] == ["a.py::op[a-f16]", "a.py::op[a-f32]",
                                                                          "a.py::op[b-f32]"]


def test_breadth_first_takes_the_quick_subset_before_the_rest():
    f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
    items = [_Item("a.py::op[f32]", dtype=f32), _Item("a.py::op[f16]", dtype=f16), _Item("a.py::op[bf16]", dtype=bf16),
             _Item("b.py::late[x-f32]", act="x", dtype=f32), _Item("b.py::late[y-f32]", act="y", dtype=f32),
             _Item("b.py::late[x-f16]", act="x", dtype=f16)]
    chosen = items[:4]  # late's other cases left out of the quick subset
    order = [i.nodeid for i in breadth_first(items, chosen)]
    assert order == ["a.py::op[f32]", "b.py::late[x-f32]", "a.py::op[f16]", "a.py::op[bf16]", "b.py::late[y-f32]",
                     "b.py::late[x-f16]"]


def test_first_listed_tests_run_first_and_the_run_writes_its_tests(tmp_path):
    """FUSED_BLOCK_FIRST's ids first, in its order (an id naming no test passed over), then the
    deadline's order; FUSED_BLOCK_COLLECTED gets the selected tests in that order."""
    first, collected = tmp_path / "first.txt", tmp_path / "collected.txt"
    first.write_text("# the second case first\ntests/test_rope.py::test_no_such_test\n"
                     "tests/test_gpu_quick.py::test_breadth_first_takes_the_quick_subset_before_the_rest\n"
                     "tests/test_gpu_quick.py::test_selection_rule\n")
    env = dict(os.environ, FUSED_BLOCK_DEADLINE=str(time.time() + 3600), FUSED_BLOCK_FIRST=str(first),
               FUSED_BLOCK_COLLECTED=str(collected))
    env.pop("PYTEST_XDIST_WORKER", None)  # an xdist worker's id (gw1, ...) would stop the child writing its list
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "tests/test_gpu_quick.py", "-k", "selection_rule or breadth_first"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    listed = [line for line in proc.stdout.splitlines() if "::" in line]
    assert collected.read_text().splitlines() == listed
    assert [n.split("::")[1] for n in listed] == [
        "test_breadth_first_takes_the_quick_subset_before_the_rest", "test_selection_rule",
        "test_breadth_first_runs_every_function_once_before_any_twice", "test_a_deadline_run_collects_breadth_first"]


def test_only_listed_tests_run(tmp_path):
    """FUSED_BLOCK_ONLY: the listed ids alone (an id naming no test passed over, where pytest
    would stop on it as an argument: the GPU scripts' list holds ids of the GPU's parameters)."""
    only = tmp_path / "only.txt"
    only.write_text("# a comment\ntests/test_rope.py::test_no_such_test\n"
                    "tests/test_gpu_quick.py::test_selection_rule\n")
    env = dict(os.environ, FUSED_BLOCK_ONLY=str(only))
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "tests/test_gpu_quick.py"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [line for line in proc.stdout.splitlines() if "::" in line] == ["tests/test_gpu_quick.py::test_selection_rule"]


def test_a_deadline_run_collects_breadth_first():
    env = dict(os.environ, FUSED_BLOCK_DEADLINE=str(time.time() + 3600))
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-m", "gpu_quick", "tests/test_norm.py", "tests/test_rope.py"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    functions = [line.split("[", 1)[0] for line in proc.stdout.splitlines() if "::" in line]
    seen = collections.Counter()
    ranks = []
    for f in functions:
        ranks.append(seen[f])
        seen[f] += 1
    assert max(ranks) > 0 and ranks == sorted(ranks)  # every function's n-th case before any (n+1)-th
    assert {f.split("::")[0] for f in functions[:len(seen)]} == {"tests/test_norm.py", "tests/test_rope.py"}


def test_a_passed_deadline_stops_starting_tests_and_fails_the_run(tmp_path):
    env = dict(os.environ, FUSED_BLOCK_DEADLINE=str(time.time() - 60))
    junit = tmp_path / "junit.xml"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
                           "tests/test_gpu_quick.py::test_selection_rule"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "1 tests not run: FUSED_BLOCK_DEADLINE passed: the run is incomplete" in proc.stdout
    assert 'skipped="1"' in junit.read_text()
