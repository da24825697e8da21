"""The suite runner's plan (tests/lanes.py): every file exactly once, big files alone,
groups longest first, per-file and per-case times read back from pytest's JUnit report, one
compilation cache named to every process of a run."""

from tests import tier
from tests.lanes import (
    CACHE_ENV,
    FUSION_ENV,
    TOGETHER,
    UNKNOWN_FILE_S,
    WAITING,
    balanced_groups,
    case_times,
    deselected_any,
    file_times,
    group_runs,
    plan_groups,
    shared_cache_env,
    split_waiting,
)


def test_plan_covers_every_file_once_longest_first():
    durations = {"test_a.py": 300.0, "test_b.py": 50.0, "test_c.py": 60.0, "test_d.py": 10.0}
    files = [f"tests/{n}" for n in ("test_a.py", "test_b.py", "test_c.py", "test_d.py")]
    files.append("tests/test_new.py")  # not recorded yet: estimated UNKNOWN_FILE_S
    groups = plan_groups(files, durations, group_s=100.0)
    flat = [f for g in groups for f in g]
    assert sorted(flat) == sorted(files)
    assert groups[0] == ["tests/test_a.py"]  # over group_s: alone, and the longest first
    est = {**durations, "test_new.py": UNKNOWN_FILE_S}
    sizes = [sum(est[f.split("/")[-1]] for f in g) for g in groups]
    assert sizes == sorted(sizes, reverse=True)
    assert all(s < 100.0 + 60.0 for s in sizes[1:])  # packed up to about group_s


def test_files_that_must_not_overlap_share_one_group_in_order():
    durations = {"test_a.py": 300.0, "test_r.py": 200.0, "test_s.py": 50.0, "test_d.py": 10.0}
    files = [f"tests/{n}" for n in ("test_a.py", "test_d.py", "test_r.py", "test_s.py")]
    together = (("test_r.py", "test_s.py"), ("test_x.py", "test_d.py"))
    groups = plan_groups(files, durations, group_s=100.0, together=together)
    assert groups[0] == ["tests/test_a.py"]
    assert groups[1] == ["tests/test_r.py", "tests/test_s.py"]  # 250 s as one, in order
    assert sorted(f for g in groups for f in g) == sorted(files)  # a set member absent: fine
    assert ("test_ray_routing.py", "test_ray_serve.py") in TOGETHER


def test_file_times_sums_cases_per_module(tmp_path):
    report = tmp_path / "junit.xml"
    report.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_x" name="a" time="1.5"/>'
        '<testcase classname="tests.test_x.TestK" name="b" time="2.0"/>'
        '<testcase classname="tests.test_y" name="c" time="0.25"/>'
        "</testsuite></testsuites>"
    )
    assert file_times(str(report)) == {"test_x.py": 3.5, "test_y.py": 0.25}
    assert case_times(str(report)) == {
        "test_x.py::a": 1.5,
        "test_x.py::b": 2.0,
        "test_y.py::c": 0.25,
    }
    assert file_times(str(tmp_path / "missing.xml")) == {}


def test_shared_cache_env_names_the_directory_or_none(tmp_path):
    env = shared_cache_env(str(tmp_path), environ={"PATH": "/bin", CACHE_ENV: "/elsewhere"})
    assert env == {"PATH": "/bin", CACHE_ENV: str(tmp_path)}
    assert shared_cache_env(None, environ={"PATH": "/bin", CACHE_ENV: "/elsewhere"}) == {
        "PATH": "/bin"
    }


def test_waiting_groups_get_a_lane_of_their_own():
    groups = [["tests/test_a.py"], ["tests/test_r.py", "tests/test_s.py"], ["tests/test_d.py"]]
    held, rest = split_waiting(groups, waiting=("test_s.py",))
    assert held == [["tests/test_r.py", "tests/test_s.py"]]
    assert rest == [["tests/test_a.py"], ["tests/test_d.py"]]
    assert split_waiting(groups, waiting=()) == ([], groups)
    assert set(WAITING) <= {name for pair in TOGETHER for name in pair}  # never two clusters


def test_real_model_tests_run_apart_with_the_fusion_emitters(tmp_path):
    tiny, real = tmp_path / "test_tiny.py", tmp_path / "test_real.py"
    tiny.write_text("def test_a(tiny_model): pass\n")
    real.write_text("def test_b(smollm2): pass\n")
    assert group_runs([str(tiny)], []) == [([], {})]
    runs = group_runs([str(tiny), str(real)], ["-x"])
    assert runs == [(["-m", "not smollm2"], {}), (["-m", "smollm2"], {FUSION_ENV: "1"})]
    assert group_runs([str(real)], ["-m", "slow"]) == [([], {})]  # the caller's selection


def test_fast_tier_leaves_out_slow_cases_and_cases_of_costly_fixtures(tmp_path):
    times = {  # [setup s, run s, has a slow marker, costly fixtures it asks for]
        "test_a.py::cheap": [0.0, 0.1, 0, []],
        "test_a.py::slow": [0.0, 2.0, 0, []],  # over FAST_CASE_S: out
        "test_a.py::marked": [0.0, 0.1, 1, []],  # `-m` leaves it out: so does the plan
        "test_b.py::first": [3.0, 0.1, 0, ["engine"]],  # paid the 3-s fixture: out
        "test_b.py::second": [0.0, 0.1, 0, ["engine"]],  # would pay it next: out
        "test_b.py::other": [0.0, 0.1, 0, []],  # no costly fixture: in
        "test_c.py::fine": [0.2, 0.2, 0, []],
        "test_d.py::only_marked": [0.0, 0.1, 1, []],
    }
    cases = [*times, "test_a.py::new_case"]  # not recorded: stays in
    assert tier.left_out(cases, times, limit_s=0.5) == {
        "test_a.py::slow",
        "test_a.py::marked",
        "test_b.py::first",
        "test_b.py::second",
        "test_d.py::only_marked",
    }
    files = [f"tests/test_{n}.py" for n in ("a", "b", "c", "d", "new")]
    estimates = tier.fast_file_times(files, times, limit_s=0.5)
    over = tier.FILE_OVERHEAD_S
    assert estimates == {
        "tests/test_a.py": over + 0.1,
        "tests/test_b.py": over + 0.1,
        "tests/test_c.py": over + 0.4,
        "tests/test_new.py": over + 0.5,  # a new file: kept whole
    }
    # the record round-trips, one case per line, merged into what was there
    path = tmp_path / "case_times.json"
    tier.record({"test_a.py::cheap": [0.001, 0.123, 0, []]}, path=str(path))
    tier.record({"test_b.py::first": [3.0, 0.1, 1, ["engine"]]}, path=str(path))
    assert tier.load_case_times(str(path)) == {
        "test_a.py::cheap": [0.0, 0.12, 0, []],
        "test_b.py::first": [3.0, 0.1, 1, ["engine"]],
    }
    assert len(path.read_text().splitlines()) == 4
    assert tier.load_case_times(str(tmp_path / "missing.json")) == {}
    assert tier.case_key("tests/test_x.py::K::name[1]") == "test_x.py::K::name[1]"
    assert tier.FAST_MARKERS == "not slow and not interpret and not subprocess and not compile"


def test_balanced_groups_even_out_the_estimates():
    estimates = {"a": 10.0, "b": 6.0, "c": 5.0, "d": 4.0, "e": 1.0}
    groups = balanced_groups(estimates, 2)
    assert sorted(f for g in groups for f in g) == sorted(estimates)
    # longest first, each to the lighter group: 10+4 and 6+5+1
    assert sorted(sum(estimates[f] for f in g) for g in groups) == [12.0, 14.0]
    assert balanced_groups({"a": 1.0}, 2) == [["a"]]  # no empty group


def test_a_group_that_cannot_run_fails_the_run_and_the_lane_goes_on(monkeypatch):
    import queue
    import threading

    from tests import lanes

    work = queue.Queue()
    for group in (["tests/test_a.py"], ["tests/test_b.py"]):
        work.put(group)

    def run_group(self, group):
        if group == ["tests/test_a.py"]:
            raise ValueError("a record that does not load")
        return {"group": group, "ok": True, "cases": {}, "times": {}, "phases": {}}

    monkeypatch.setattr(lanes.Lane, "_run_group", run_group)
    results: list = []
    lane = lanes.Lane(0, work, results, [], threading.Lock(), False, {})
    lane.run()
    assert [(r["group"], r["ok"]) for r in results] == [
        (["tests/test_a.py"], False),
        (["tests/test_b.py"], True),
    ]


def test_an_older_record_loads_with_no_marker_and_no_costly_fixture(tmp_path):
    path = tmp_path / "case_times.json"
    path.write_text('{"test_a.py::x": [0.1, 0.2], "test_a.py::y": [0.0, 0.1, 1]}')
    assert tier.load_case_times(str(path)) == {
        "test_a.py::x": [0.1, 0.2, 0, []],
        "test_a.py::y": [0.0, 0.1, 1, []],
    }


def test_the_smollm2_process_runs_only_when_the_first_left_tests_out():
    assert deselected_any("....\n22 passed, 2 deselected in 113.68s (0:01:53)\n")
    assert not deselected_any("....\n126 passed in 122.71s (0:02:02)\n")
    assert not deselected_any("")  # no summary (a crash): the group has failed anyway
