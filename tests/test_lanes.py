"""The suite runner's plan (tests/lanes.py): every file exactly once, big files alone,
groups longest first, per-file and per-case times read back from pytest's JUnit report, one
compilation cache named to every process of a run."""

from tests.lanes import (
    CACHE_ENV,
    FUSION_ENV,
    TOGETHER,
    UNKNOWN_FILE_S,
    WAITING,
    case_times,
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
