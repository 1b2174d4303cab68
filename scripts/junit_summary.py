"""Which tests of a run passed, failed, were skipped, and which never ran, per file.

    python scripts/junit_summary.py --collected COLLECTED --junit JUNIT.xml [--junit ...]
        [--first FIRST] [--header FILE] [--out SUMMARY] [--failures FAILURES] [--not-run NOT_RUN]

``COLLECTED``: the run's selected tests, one node id a line (FUSED_BLOCK_COLLECTED,
tests/conftest.py, or the ``::`` lines of ``pytest --collect-only -q``). Each JUnit file's test
cases are matched to them by pytest's own naming (module as dotted path, then class and
test name); a collected test with no case, or skipped because ``FUSED_BLOCK_DEADLINE``
passed, did not run. A missing or unreadable JUnit file counts as no case at all (the step
was killed before pytest wrote it).

Prints, and writes to ``SUMMARY`` (``--out``): ``--header``'s text (versions, GPU, date), the
totals, a table per file (collected, passed, failed, errors, skipped, not run), the failures
and errors with their messages, the skips with their reasons, every test that did not run,
the ``--first`` ids (scripts/gpu_first.txt) that name no collected test of a file the run
collected (renamed tests, or ones a selection left out), and cases that match no collected
test. Standard output shows the not-run tests per file only; ``SUMMARY`` names
each. ``--failures``: the failed and erroring node ids, one a line (a FUSED_BLOCK_FIRST file
for the next run); ``--not-run``: the tests that did not run, one a line (``pytest
@NOT_RUN`` runs them). Exit status 0 when the summary was written, whatever the tests did.
"""
import argparse
import collections
import datetime
import re
import sys
import xml.etree.ElementTree as ET

NOT_RUN = "FUSED_BLOCK_DEADLINE passed"  # tests/conftest.py's skip reason for a test past the deadline
# Worst first: a test with several cases (a call failure and a teardown error) takes the worst.
STATUSES = ("failed", "error", "passed", "skipped", "not run")
_ILLEGAL_XML = re.compile("[^\u0009\u000a\u000d\u0020-\u007e\u0080-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def _xml_escape(text):
    """pytest's ``bin_xml_escape``: characters XML cannot hold as ``#xAB``."""
    return _ILLEGAL_XML.sub(lambda m: f"#x{ord(m.group()):02X}" if ord(m.group()) <= 0xFF
                            else f"#x{ord(m.group()):04X}", text)


def junit_name(nodeid):
    """The (classname, name) pytest's JUnit report gives the test ``nodeid``."""
    head, bracket, params = nodeid.partition("[")
    names = head.split("::")
    names[0] = re.sub(r"\.py$", "", names[0].replace("/", "."))
    names[-1] += bracket + params
    return ".".join(names[:-1]), _xml_escape(names[-1])


def read_node_ids(path):
    """Node ids, one a line (``#`` comments and other lines without ``::`` ignored)."""
    with open(path) as f:
        return [line.strip() for line in f if "::" in line and not line.lstrip().startswith("#")]


def read_cases(paths):
    """{(classname, name): [(status, message), ...]} from JUnit files, and the notes on files
    that could not be read."""
    cases, notes = collections.defaultdict(list), []
    for path in paths:
        try:
            root = ET.parse(path).getroot()
        except (OSError, ET.ParseError) as e:
            notes.append(f"{path}: no JUnit report ({e}); its tests count as not run")
            continue
        for case in root.iter("testcase"):
            status, message = "passed", ""
            for child in case:
                text = (child.get("message") or child.text or "").strip()
                if child.tag == "failure":
                    status, message = "failed", text
                elif child.tag == "error" and status != "failed":
                    status, message = "error", text
                elif child.tag == "skipped" and status == "passed":
                    status, message = ("not run" if NOT_RUN in text else "skipped"), text
            key = (case.get("classname") or "", case.get("name") or "")
            if key != ("", ""):  # xdist writes an empty case beside a module's collection skip
                cases[key].append((status, message))
    return cases, notes


def summarize(collected, cases, first=()):
    """The outcome of every collected test, {nodeid: (status, message)} in collection order;
    the JUnit cases that match no collected test, {(classname, name): (status, message)}; the
    ``first`` ids that are not collected though their file is."""
    outcome, matched = {}, set()
    for nodeid in collected:
        key = junit_name(nodeid)
        found = cases.get(key)
        if found:
            matched.add(key)
            outcome[nodeid] = min(found, key=lambda sm: STATUSES.index(sm[0]))
        else:
            outcome[nodeid] = ("not run", "")
    unmatched = {k: min(v, key=lambda sm: STATUSES.index(sm[0])) for k, v in cases.items() if k not in matched}
    files = {nodeid.split("::")[0] for nodeid in collected}  # a run of some files lacks the others' ids
    return outcome, unmatched, [f for f in first if f not in outcome and f.split("::")[0] in files]


def _first_line(message, width=200):
    line = message.strip().splitlines()[0] if message.strip() else ""
    return line if len(line) <= width else line[:width - 3] + "..."


def report(outcome, unmatched, missing_first, header="", notes=()):
    """(the full summary, the shorter one for standard output)."""
    per_file = collections.defaultdict(collections.Counter)
    for nodeid, (status, _) in outcome.items():
        per_file[nodeid.split("::")[0]][status] += 1
    totals = collections.Counter(status for status, _ in outcome.values())
    ran = sum(totals[s] for s in ("passed", "failed", "error", "skipped"))
    lines = [header.rstrip()] if header.strip() else []
    lines.append(f"summary written {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}")
    lines += notes
    lines.append(f"collected {len(outcome)}: ran {ran} (passed {totals['passed']}, failed {totals['failed']}, "
                 f"errors {totals['error']}, skipped {totals['skipped']}), not run {totals['not run']}")
    width = max([len("file")] + [len(f) for f in per_file])
    lines.append(f"{'file':<{width}}  collected  passed  failed  errors  skipped  not run")
    for f in sorted(per_file):
        c = per_file[f]
        lines.append(f"{f:<{width}}  {sum(c.values()):>9}  {c['passed']:>6}  {c['failed']:>6}  {c['error']:>6}  "
                     f"{c['skipped']:>7}  {c['not run']:>7}")
    short = list(lines)
    for title, status in (("failed", "failed"), ("errors", "error"), ("skipped", "skipped")):
        rows = [f"  {n}: {_first_line(m)}" for n, (s, m) in outcome.items() if s == status]
        if rows:
            block = [f"{title} ({len(rows)}):"] + rows
            lines += block
            short += block
    not_run = [n for n, (s, _) in outcome.items() if s == "not run"]
    if not_run:
        lines += [f"not run ({len(not_run)}):"] + [f"  {n}" for n in not_run]
        short.append(f"not run ({len(not_run)}): per file in the table above, each named in the summary file")
    else:
        short.append("every collected test ran")
        lines.append("every collected test ran")
    for title, rows in ((f"listed first but not in this run ({len(missing_first)}; renamed, removed, or outside a "
                         f"selection of its file)", missing_first),
                        (f"JUnit cases matching no collected test ({len(unmatched)}; a module's collection "
                         f"error or skip is one)",
                         [f"{c}::{n}: {s} {_first_line(m)}" if c else f"{n}: {s} {_first_line(m)}"
                          for (c, n), (s, m) in unmatched.items()])):
        if rows:
            block = [title + ":"] + [f"  {r}" for r in rows]
            lines += block
            short += block
    return "\n".join(lines) + "\n", "\n".join(short) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--collected", required=True, help="the run's node ids, one a line")
    p.add_argument("--junit", action="append", default=[], help="a JUnit XML file (repeatable)")
    p.add_argument("--first", help="node ids meant to run first (FUSED_BLOCK_FIRST's file)")
    p.add_argument("--header", help="a text file printed at the top (versions, GPU)")
    p.add_argument("--out", help="write the full summary here")
    p.add_argument("--failures", help="write the failed and erroring node ids here, one a line")
    p.add_argument("--not-run", help="write the node ids of the tests that did not run here, one a line")
    args = p.parse_args(argv)
    try:
        collected = read_node_ids(args.collected)
    except OSError as e:
        print(f"junit_summary: no list of collected tests ({e}): pytest did not finish collecting", file=sys.stderr)
        return 2
    cases, notes = read_cases(args.junit)
    first = read_node_ids(args.first) if args.first else []
    header = ""
    if args.header:
        try:
            with open(args.header) as f:
                header = f.read()
        except OSError as e:
            notes.append(f"no header ({e})")
    outcome, unmatched, missing_first = summarize(collected, cases, first)
    full, short = report(outcome, unmatched, missing_first, header, notes)
    if args.out:
        with open(args.out, "w") as f:
            f.write(full)
    for path, statuses in ((args.failures, ("failed", "error")), (args.not_run, ("not run",))):
        if path:
            with open(path, "w") as f:
                f.writelines(n + "\n" for n, (s, _) in outcome.items() if s in statuses)
    sys.stdout.write(short)
    return 0


if __name__ == "__main__":
    sys.exit(main())
