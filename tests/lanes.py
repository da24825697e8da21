"""Run the test suite as a few parallel lanes of pytest processes, longest files first.

`make test` calls `python -m tests.lanes`. Why not one pytest process: a test module builds
many XLA:CPU executables, and one process running the whole suite once crashed inside
XLA's compiler about 300 tests in (see tests/conftest.py), so the suite runs as groups of
files, each group a fresh process. Why not fixed lanes: files differ in cost by 100x, and
a lane split by file name was 4 minutes longer than its twin. So each lane takes the next
group from one queue, ordered by the time its files took last time (`tests/durations.json`,
seconds of wall time per file, rewritten with `--record`): longest-processing-time-first,
which ends the lanes within about one group of each other. Groups of files that mostly
wait (`WAITING`: the Ray cluster tests) take one extra lane of their own from the start, so
the `--lanes` lanes keep both cores compiling meanwhile. A group whose files may use the
real model runs as two processes: its SmolLM2 tests apart, with XLA:CPU's fusion emitters
kept (they compile SmolLM2's programs 2x faster than the older emitters the rest of the
suite uses; tests/conftest.py).

Groups: a file estimated over `--group_s` runs alone; smaller ones are packed together up
to that size (one interpreter start and JAX import per group, not per file).
Each group's output is held back and printed whole when it ends, so lanes never interleave
lines; a failing group's output is printed in full, a passing one as its summary line.
Exit status: 0 when every group passed, 1 otherwise.

Compiled programs are shared: every pytest process of a run (and every server it starts)
reads and writes one persistent compilation cache, named in $PAGEDJAX_TEST_COMPILATION_CACHE_DIR
(tests/conftest.py turns it on), so a step program that two files build compiles once. By
default it is a temporary directory removed at the end; `--compilation_cache_dir=DIR` keeps
one between runs (a second run loads most programs), `none` turns sharing off. No lock: JAX
writes an entry in place, but an entry is one zlib stream with a checksum, so a half-written
file (read while another process writes it) fails to decompress and JAX compiles the
program instead, and two processes writing one entry leave one whole stream first (the
file is truncated on open; zlib ignores what follows the stream). JAX's own lock comes
with a size limit whose eviction scan reads every entry on each write (0.24 s per write at
3,000 entries under load), too slow for a run that writes thousands.
The slowest test cases of the run are printed at the end (`--slowest`).

`--fast` (make test-fast) runs the inner-loop tier instead (tests/tier.py: the cases that a
`--record` run measured cheap), as one process per lane, files balanced by those times.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET

from tests import tier

DURATIONS_PATH = os.path.join(os.path.dirname(__file__), "durations.json")
UNKNOWN_FILE_S = 30.0  # estimate for a file with no recorded time (a new test file)
CACHE_ENV = "PAGEDJAX_TEST_COMPILATION_CACHE_DIR"  # read by tests/conftest.py
FUSION_ENV = "PAGEDJAX_TEST_FUSION_EMITTERS"  # read by tests/conftest.py
REAL_MODEL_MARK = "smollm2"  # the marker tests/conftest.py gives the real model's tests


def load_durations(path: str = DURATIONS_PATH) -> dict[str, float]:
    try:
        with open(path) as f:
            return {k: float(v) for k, v in json.load(f).items()}
    except FileNotFoundError:
        return {}


# Files that must never run at the same time as each other: they share one group (one
# pytest process, in this order). The Ray files each start a local Ray cluster with Serve;
# two clusters on two cores starved each other, and a driver attaching to "its" cluster could
# find the other one (a run of 2026-12-06 read the other file's Serve status as it shut down).
TOGETHER = (("test_ray_routing.py", "test_ray_serve.py"),)

# Files that mostly wait (on a Ray cluster's actors, on mock steps that sleep, on replies):
# a group holding one runs on a lane of its own beside the `--lanes` lanes, from the start.
# Measured 2026-12-07: the Ray pair took 205 s wall alone with ~150 CPU s of the machine's,
# 452 s on one of the two lanes beside compiling files, and the machine sat ~30% idle for
# those minutes (vmstat) with one lane waiting.
WAITING = ("test_ray_routing.py", "test_ray_serve.py")


def split_waiting(groups: list[list[str]], waiting=WAITING) -> tuple[list, list]:
    """(groups with a `waiting` file, the others), each in the order given."""
    names = set(waiting)
    held = [g for g in groups if any(os.path.basename(f) in names for f in g)]
    return held, [g for g in groups if g not in held]


def plan_groups(
    files: list[str], durations: dict[str, float], group_s: float, together=TOGETHER
) -> list[list[str]]:
    """Files packed into groups of about `group_s` estimated seconds, longest group first;
    the files of one `together` set always in one group."""
    est = {f: durations.get(os.path.basename(f), UNKNOWN_FILE_S) for f in files}
    by_name = {os.path.basename(f): f for f in files}
    units: list[list[str]] = []  # files that go into a group as one
    paired: set[str] = set()
    for names in together:
        unit = [by_name[n] for n in names if n in by_name]
        if unit:
            units.append(unit)
            paired.update(unit)
    units += [[f] for f in files if f not in paired]
    groups: list[list[str]] = []
    current: list[str] = []
    current_s = 0.0
    for unit in sorted(units, key=lambda u: -sum(est[f] for f in u)):
        unit_s = sum(est[f] for f in unit)
        if unit_s >= group_s:
            groups.append(unit)
            continue
        current += unit
        current_s += unit_s
        if current_s >= group_s:
            groups.append(current)
            current, current_s = [], 0.0
    if current:
        groups.append(current)
    return sorted(groups, key=lambda g: -sum(est[f] for f in g))


def balanced_groups(estimates: dict[str, float], n: int) -> list[list[str]]:
    """The files of `estimates` (seconds each) in `n` groups of about equal total: each file,
    longest first, to the group with the least so far (longest-processing-time-first)."""
    groups: list[list[str]] = [[] for _ in range(max(1, n))]
    totals = [0.0] * len(groups)
    for f in sorted(estimates, key=lambda f: -estimates[f]):
        i = totals.index(min(totals))
        groups[i].append(f)
        totals[i] += estimates[f]
    return [g for g in groups if g]


def case_times(junit_path: str) -> dict[str, float]:
    """Seconds per test case ("test_x.py::name") from a pytest JUnit XML report."""
    out: dict[str, float] = {}
    try:
        root = ET.parse(junit_path).getroot()
    except (ET.ParseError, FileNotFoundError):
        return out
    for case in root.iter("testcase"):
        module = case.get("classname", "").split(".")
        name = next((m for m in module if m.startswith("test_")), None)
        if name:
            key = f"{name}.py::{case.get('name', '?')}"
            out[key] = out.get(key, 0.0) + float(case.get("time", 0.0))
    return out


def per_file(cases: dict[str, float]) -> dict[str, float]:
    """Seconds per test file ("test_x.py") from seconds per case ("test_x.py::name")."""
    out: dict[str, float] = {}
    for case, seconds in cases.items():
        key = case.split("::")[0]
        out[key] = out.get(key, 0.0) + seconds
    return out


def file_times(junit_path: str) -> dict[str, float]:
    """Seconds per test file from a pytest JUnit XML report (sum of its test cases)."""
    return per_file(case_times(junit_path))


def shared_cache_env(cache_dir: str | None, environ=os.environ) -> dict[str, str]:
    """The environment of a run's pytest processes: `cache_dir` named for tests/conftest.py
    (None: no sharing)."""
    env = dict(environ)
    env.pop(CACHE_ENV, None)
    if cache_dir is not None:
        env[CACHE_ENV] = os.path.abspath(cache_dir)
    return env


class Lane(threading.Thread):
    def __init__(self, index, work, results, pytest_args, lock, record, env):
        super().__init__(daemon=True)
        self.index, self.work, self.results = index, work, results
        self.pytest_args, self.lock, self.record, self.env = pytest_args, lock, record, env

    def run(self):
        while True:
            try:
                group = self.work.get_nowait()
            except queue.Empty:
                return
            try:
                result = self._run_group(group)
                if self.record:
                    with self.lock:
                        record(result["times"])
                        tier.record(result["phases"])
            except Exception as e:  # the group counts as failed; the lane goes on
                # NOTE: a lane that died here ended the run early and still said "0 failed"
                # (a record of an older layout failed to load, 2026-12-08)
                with self.lock:
                    print(f"[lane {self.index}] error running {group}: {e!r}", flush=True)
                result = {"group": group, "ok": False, "cases": {}}
            self.results.append(result)

    def _run_group(self, group: list[str]) -> dict:
        start = time.monotonic()
        cases: dict[str, float] = {}
        phases: dict[str, list] = {}  # per case: what tests/tier.py cuts the fast tier by
        outputs, ok = [], True
        for selection, extra_env in group_runs(group, self.pytest_args):
            if outputs and not deselected_any(outputs[0].stdout):
                break  # the first process left out no test: the group has no SmolLM2 test
            with tempfile.TemporaryDirectory() as tmp:
                junit = os.path.join(tmp, "junit.xml")
                phases_path = os.path.join(tmp, "phases.json")
                cmd = [sys.executable, "-m", "pytest", "-q", f"--junitxml={junit}"]
                cmd += selection + self.pytest_args + group
                proc = subprocess.run(
                    cmd,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    env={**self.env, **extra_env, tier.PHASE_TIMES_ENV: phases_path},
                )
                for case, seconds in case_times(junit).items():
                    cases[case] = cases.get(case, 0.0) + seconds
                phases.update(tier.load_case_times(phases_path))
            ok &= proc.returncode in (0, 5)  # 5: nothing collected (every test deselected)
            outputs.append(proc)
        wall_s = time.monotonic() - start
        times = per_file(cases)
        with self.lock:
            names = " ".join(os.path.basename(f) for f in group)
            print(f"[lane {self.index}] {wall_s:6.0f} s  {names}", flush=True)
            for proc in outputs:
                lines = proc.stdout.rstrip().splitlines()
                failed = proc.returncode not in (0, 5)
                print(proc.stdout if failed else "    " + (lines[-1] if lines else ""), flush=True)
        return {
            "group": group,
            "ok": ok,
            "wall_s": wall_s,
            "times": times,
            "cases": cases,
            "phases": phases,
        }


def mentions_real_model(path: str) -> bool:
    """Whether a test file may ask for the real model (the `smollm2` fixture): a cheap text
    check, erring towards yes (a wrong yes costs nothing: `deselected_any` then skips the
    SmolLM2 process)."""
    try:
        with open(path) as f:
            return REAL_MODEL_MARK in f.read()
    except OSError:
        return True


def deselected_any(output: str) -> bool:
    """Whether a pytest run's summary line (its last) counts deselected tests: when the run
    that selects `not smollm2` left none out, the group's SmolLM2 process would select none
    (make test, 2026-12-08: six such processes, 2-12 s each)."""
    lines = output.rstrip().splitlines()
    return bool(lines) and " deselected" in lines[-1]


def group_runs(group: list[str], pytest_args: list[str]) -> list[tuple[list[str], dict]]:
    """(pytest selection, extra environment) of each process a group runs as: the tests of the
    real model (marker `smollm2`, tests/conftest.py) in a process of their own that keeps
    XLA:CPU's fusion emitters (FUSION_ENV; tests/conftest.py says why), the rest with the
    suite's flags. One process when the caller selects with -m itself or no file of the group
    mentions the real model."""
    if "-m" in pytest_args or not any(mentions_real_model(f) for f in group):
        return [([], {})]
    return [(["-m", f"not {REAL_MODEL_MARK}"], {}), (["-m", REAL_MODEL_MARK], {FUSION_ENV: "1"})]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lanes", type=int, default=2, help="parallel pytest processes")
    ap.add_argument("--group_s", type=float, default=120.0, help="target seconds per group")
    ap.add_argument(
        "--record",
        action="store_true",
        help=f"rewrite {DURATIONS_PATH} and {tier.CASE_TIMES_PATH}",
    )
    ap.add_argument(
        "--compilation_cache_dir",
        default=None,
        help="compilation cache shared by the run's processes and kept (default: a temporary "
        "directory removed at the end; none: no sharing)",
    )
    ap.add_argument(
        "--fast",
        action="store_true",
        help="make test-fast: the fast tier only (tests/tier.py), planned by its recorded times",
    )
    ap.add_argument("--slowest", type=int, default=20, help="test cases listed at the end")
    ap.add_argument("files", nargs="*", help="test files (default: tests/test_*.py)")
    args, pytest_args = ap.parse_known_args(argv)
    here = os.path.dirname(os.path.abspath(__file__))
    files = args.files or sorted(glob.glob(os.path.join(here, "test_*.py")))
    files = [os.path.relpath(f) for f in files]
    if args.fast:  # its files, as one group per lane (a process costs ~8 s of imports)
        groups = balanced_groups(tier.fast_file_times(files, tier.load_case_times()), args.lanes)
        pytest_args += ["--fast-tier", "-m", tier.FAST_MARKERS]
    else:
        groups = plan_groups(files, load_durations(), args.group_s)
    work: queue.Queue = queue.Queue()
    waiting_work: queue.Queue = queue.Queue()
    waiting, compiling = split_waiting(groups)
    for group in compiling:
        work.put(group)
    for group in waiting:
        waiting_work.put(group)
    results: list[dict] = []
    lock = threading.Lock()
    start = time.monotonic()
    cache_dir = args.compilation_cache_dir
    temporary = None
    if cache_dir is None:  # in a folder of its own: a set-aside `xla.crashed-*` goes with it
        temporary = tempfile.mkdtemp(prefix="pagedjax-test-xla-")
        cache_dir = os.path.join(temporary, "xla")
    elif cache_dir.strip().lower() in ("", "none", "off"):
        cache_dir = None
    env = shared_cache_env(cache_dir)
    try:
        lanes = [
            Lane(i, work, results, pytest_args, lock, args.record, env)
            for i in range(max(1, args.lanes))
        ]
        if waiting:  # one more lane, for the waiting groups only
            lanes.append(Lane("w", waiting_work, results, pytest_args, lock, args.record, env))
        for lane in lanes:
            lane.start()
        for lane in lanes:
            lane.join()
    finally:
        if temporary:
            shutil.rmtree(temporary, ignore_errors=True)
    cases = sorted(((s, c) for r in results for c, s in r["cases"].items()), key=lambda sc: -sc[0])
    if args.slowest > 0 and cases:
        print(f"---- slowest {min(args.slowest, len(cases))} test cases")
        for seconds, case in cases[: args.slowest]:
            print(f"{seconds:8.1f} s  {case}")
    failed = [r for r in results if not r["ok"]]
    ran = {tuple(r["group"]) for r in results}
    failed += [{"group": g} for g in groups if tuple(g) not in ran]  # a lane that never ended
    print(
        f"---- {len(results)} groups on {len(lanes)} lanes ({len(waiting)} waiting) in "
        f"{time.monotonic() - start:.0f} s; "
        f"{len(failed)} failed: {' '.join(' '.join(r['group']) for r in failed) or '-'}"
    )
    return 1 if failed else 0


def record(times: dict[str, float], path: str = DURATIONS_PATH) -> None:
    """Merge measured seconds per file into `path` (called after each group, so a run
    stopped halfway keeps what it measured)."""
    measured = load_durations(path)
    measured.update({k: round(v, 1) for k, v in times.items()})
    with open(path, "w") as f:
        json.dump(dict(sorted(measured.items())), f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    sys.exit(main())
