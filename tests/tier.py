"""Which test cases `make test-fast` (pytest --fast-tier) leaves out, from recorded times.

The inner-loop tier must take about a minute on 2 cores, and the suite's cost is a long tail
of 1-6 s cases (each builds or compiles something), not a few slow files. So the tier is cut
by measurement, not by hand: `python -m tests.lanes --record` (a full `make test` run) keeps
in tests/case_times.json, per case, its setup and run seconds, whether it has a marker of
SLOW_MARKERS (pyproject.toml), and which fixtures it asks for that took over FAST_CASE_S to
set up (timed one by one: tests/conftest.py). The tier leaves out every case that
- has a slow marker (`-m` leaves those out anyway; the plan of the tier's lanes counts only
  what it runs), or
- took over FAST_CASE_S, setup included, or
- asks for a costly fixture: a module (or session) fixture is built for whichever of its
  cases runs first, so leaving out only the case that paid for it would hand the bill to the
  next one.
Cases with no record (a test written since the last --record) stay in: a new test runs in the
inner loop until a full run measures it.
"""

from __future__ import annotations

import json
import os

# `make test-fast` leaves out the cases with these markers (pyproject.toml) first
SLOW_MARKERS = ("slow", "interpret", "subprocess", "compile")
FAST_MARKERS = " and ".join(f"not {m}" for m in SLOW_MARKERS)
CASE_TIMES_PATH = os.path.join(os.path.dirname(__file__), "case_times.json")
PHASE_TIMES_ENV = "PAGEDJAX_TEST_PHASE_TIMES"  # a file tests/conftest.py writes phases to
# Seconds, as recorded by a full `make test` (two lanes compiling at once: about twice a
# quiet machine's time for the same case). Measured 2026-12-08, one after the other on two
# lanes: 0.4 s kept 702 cases, 67 s wall; 0.3 s 666 cases, 53 s (the machine slow that hour:
# 0.4 s took 46 s in a quiet one).
FAST_CASE_S = 0.3
# What a file costs the tier beyond its cases' recorded times (collection, its imports, first
# uses): a lane of 50 files took 52 s for 20 s of recorded cases, one of 7 files 27 s for
# 20 s (2026-12-08, quiet machine); the lanes' plan counts it.
FILE_OVERHEAD_S = 0.6


def case_key(nodeid: str) -> str:
    """The record key of a pytest node id: "tests/test_x.py::name[p]" -> "test_x.py::name[p]"."""
    path, sep, rest = nodeid.partition("::")
    return os.path.basename(path) + sep + rest


def load_case_times(path: str = CASE_TIMES_PATH) -> dict[str, list]:
    """{case: [setup seconds, run + teardown seconds, 1 if it has a SLOW_MARKERS marker
    else 0, [the costly fixtures it asks for]]}; {} when nothing is recorded."""
    try:
        with open(path) as f:
            raw = json.load(f)
    except FileNotFoundError:
        return {}
    out = {}
    for case, fields in raw.items():
        setup_s, run_s, *rest = fields
        marked, costly = [*rest, *[0, []][len(rest) :]]  # older records: no marker, fixture
        out[case] = [float(setup_s), float(run_s), int(marked), list(costly)]
    return out


def left_out(cases: list[str], times: dict[str, list], limit_s: float = FAST_CASE_S) -> set:
    """The subset of `cases` the fast tier leaves out (see the module docstring)."""
    out = set()
    for case in cases:
        recorded = times.get(case)
        if recorded and (recorded[2] or recorded[0] + recorded[1] > limit_s or recorded[3]):
            out.add(case)
    return out


def fast_file_times(
    files: list[str], times: dict[str, list], limit_s: float = FAST_CASE_S
) -> dict[str, float]:
    """Estimated seconds of each file's fast-tier cases (FILE_OVERHEAD_S more), for the files
    that keep at least one recorded case or have none recorded (a new file); the others are
    left out whole. NOTE: a case added to a file the tier leaves out whole since the last
    --record does not run in the tier (the file is not collected): run it by name."""
    by_file: dict[str, list[str]] = {}
    for case in times:
        by_file.setdefault(case.split("::")[0], []).append(case)
    out = {}
    for f in files:
        cases = by_file.get(os.path.basename(f))
        if not cases:
            out[f] = FILE_OVERHEAD_S + limit_s  # nothing recorded: a new file, kept whole
            continue
        kept = set(cases) - left_out(cases, times, limit_s)
        if kept:
            out[f] = FILE_OVERHEAD_S + sum(times[c][0] + times[c][1] for c in kept)
    return out


def record(phases: dict[str, list], path: str = CASE_TIMES_PATH) -> None:
    """Merge measured phases per case into `path` (rounded to 10 ms)."""
    measured = load_case_times(path)
    measured.update(
        {k: [round(v[0], 2), round(v[1], 2), int(v[2]), list(v[3])] for k, v in phases.items()}
    )
    lines = [f"{json.dumps(k)}: {json.dumps(v)}" for k, v in sorted(measured.items())]
    with open(path, "w") as f:
        f.write("{\n" + ",\n".join(lines) + "\n}\n")  # one case per line
