"""scripts/junit_summary.py: every collected test is reported once, as passed, failed, error,
skipped or not run (no JUnit case, or skipped past FUSED_BLOCK_DEADLINE), per file."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import junit_summary  # noqa: E402

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="7">
<testcase classname="tests.test_a" name="test_ok[fp16-128]" time="0.1"/>
<testcase classname="tests.test_a" name="test_bad" time="0.2"><failure message="AssertionError: max error 3e-3 &gt; 2x">long
traceback</failure></testcase>
<testcase classname="tests.test_a.TestGroup" name="test_in_class" time="0.1"><error message="teardown: boom"/></testcase>
<testcase classname="tests.test_b" name="test_skip" time="0"><skipped type="pytest.skip" message="needs two GPUs"/></testcase>
<testcase classname="tests.test_b" name="test_late" time="0"><skipped type="pytest.skip" message="not run: FUSED_BLOCK_DEADLINE passed"/></testcase>
<testcase classname="tests.sub.test_c" name="test_esc[a#x1Bb]" time="0.1"/>
<testcase classname="tests.test_b" name="test_twice" time="0.1"/>
<testcase classname="tests.test_b" name="test_twice" time="0.1"><error message="teardown failed"/></testcase>
<testcase classname="" name="tests.test_gone" time="0"><skipped message="collection skipped"/></testcase>
</testsuite></testsuites>
"""
COLLECTED = ["tests/test_a.py::test_ok[fp16-128]", "tests/test_a.py::test_bad", "tests/test_a.py::TestGroup::test_in_class",
             "tests/test_b.py::test_skip", "tests/test_b.py::test_late", "tests/test_b.py::test_never",
             "tests/sub/test_c.py::test_esc[a\x1bb]", "tests/test_b.py::test_twice"]


def _files(tmp_path):
    junit, collected, first = tmp_path / "junit.xml", tmp_path / "collected.txt", tmp_path / "first.txt"
    junit.write_text(JUNIT)
    collected.write_text("".join(n + "\n" for n in COLLECTED) + "\n3 tests collected in 0.1s\n")
    first.write_text("# comment\ntests/test_a.py::test_bad\ntests/test_a.py::test_renamed\n"
                     "tests/test_other.py::test_of_a_file_not_run\n")
    return junit, collected, first


def test_junit_names_follow_pytest():
    assert junit_summary.junit_name("tests/test_a.py::test_ok[fp16-128]") == ("tests.test_a", "test_ok[fp16-128]")
    assert junit_summary.junit_name("tests/test_a.py::TestGroup::test_x") == ("tests.test_a.TestGroup", "test_x")
    assert junit_summary.junit_name("tests/sub/test_c.py::test_esc[a\x1bb]") == ("tests.sub.test_c", "test_esc[a#x1Bb]")


def test_every_collected_test_has_one_outcome(tmp_path):
    junit, collected, first = _files(tmp_path)
    cases, notes = junit_summary.read_cases([str(junit)])
    outcome, unmatched, missing_first = junit_summary.summarize(junit_summary.read_node_ids(collected), cases,
                                                                junit_summary.read_node_ids(first))
    assert {n: s for n, (s, _) in outcome.items()} == {
        "tests/test_a.py::test_ok[fp16-128]": "passed", "tests/test_a.py::test_bad": "failed",
        "tests/test_a.py::TestGroup::test_in_class": "error", "tests/test_b.py::test_skip": "skipped",
        "tests/test_b.py::test_late": "not run", "tests/test_b.py::test_never": "not run",
        "tests/sub/test_c.py::test_esc[a\x1bb]": "passed", "tests/test_b.py::test_twice": "error"}
    assert outcome["tests/test_a.py::test_bad"][1].startswith("AssertionError: max error 3e-3 > 2x")
    assert list(unmatched) == [("", "tests.test_gone")] and missing_first == ["tests/test_a.py::test_renamed"]
    assert not notes


def test_the_script_writes_the_summary_and_the_failures(tmp_path):
    junit, collected, first = _files(tmp_path)
    header, out, failures, not_run = (tmp_path / name for name in ("versions.txt", "summary.txt", "failures.txt",
                                                                    "not-run.txt"))
    header.write_text("gpu NVIDIA H200 driver 570\n")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "junit_summary.py"), "--collected",
                           str(collected), "--junit", str(junit), "--junit", str(tmp_path / "killed.xml"), "--first",
                           str(first), "--header", str(header), "--out", str(out), "--failures", str(failures),
                           "--not-run", str(not_run)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    assert text.startswith("gpu NVIDIA H200 driver 570\n")
    assert "collected 8: ran 6 (passed 2, failed 1, errors 2, skipped 1), not run 2" in text
    table = {line.split()[0]: line.split()[1:] for line in text.splitlines() if line.startswith("tests/") and
             len(line.split()) == 7}
    assert table == {"tests/sub/test_c.py": ["1", "1", "0", "0", "0", "0"],
                     "tests/test_a.py": ["3", "1", "1", "1", "0", "0"],
                     "tests/test_b.py": ["4", "0", "0", "1", "1", "2"]}
    assert "killed.xml: no JUnit report" in text
    assert "  tests/test_b.py::test_never\n" in text and "  tests/test_b.py::test_late\n" in text
    assert "listed first but not in this run (1; " in text and "):\n  tests/test_a.py::test_renamed\n" in text
    # Standard output: the table and the failures, the not-run tests counted, not named.
    assert "tests/test_b.py::test_never" not in proc.stdout and "not run (2)" in proc.stdout
    assert "tests/test_a.py::test_bad: AssertionError" in proc.stdout
    assert failures.read_text().splitlines() == ["tests/test_a.py::test_bad", "tests/test_a.py::TestGroup::test_in_class",
                                                 "tests/test_b.py::test_twice"]
    assert not_run.read_text().splitlines() == ["tests/test_b.py::test_late", "tests/test_b.py::test_never"]


def test_without_a_collected_list_the_script_says_so(tmp_path):
    assert junit_summary.main(["--collected", str(tmp_path / "none.txt")]) == 2
