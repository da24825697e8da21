"""User mistakes on every command line: one line on stderr naming the flag, the value and what
is allowed, exit status 2, no traceback, and nothing slow started first (no "loading" line:
every check runs before a model loads or a request is sent)."""

import os
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.subprocess  # each command runs as a subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLI = ["-m", "serving.cli", "generate"]
SERVER = ["-m", "serving.server"]
CLIENT = ["-m", "serving.client"]
LOADGEN = ["-m", "serving.capacity.loadgen"]
PLANNER = ["-m", "serving.capacity.planner"]


def run(args, timeout=60):
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def assert_usage_error(proc, *fragments):
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr
    assert "loading" not in proc.stderr + proc.stdout  # failed before any model load
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ")
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    (d / "notes.txt").write_text("just some text\n")
    (d / "fake.gguf").write_bytes(b"PK\x03\x04 a zip file, not a GGUF")
    (d / "empty_dir").mkdir()
    return d


@pytest.fixture
def busy_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        yield s.getsockname()[1]


def dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed on exit: nothing listens there


@pytest.mark.parametrize("command", [CLI, SERVER], ids=["cli", "server"])
def test_model_paths(command, files):
    assert_usage_error(
        run([*command, "--model=/no/such/model.gguf"]),
        "--model='/no/such/model.gguf'",
        "no such file or directory",
        "smollm2-135m",
    )
    assert_usage_error(
        run([*command, f"--model={files / 'notes.txt'}"]),
        "not a GGUF file (starts with b'just som'",
    )
    assert_usage_error(run([*command, f"--model={files / 'fake.gguf'}"]), "not a GGUF file")
    assert_usage_error(run([*command, f"--model={files / 'empty_dir'}"]), "no config.json")


@pytest.mark.parametrize(
    "flag, message",
    [
        ("--max_tokens=-5", "--max_tokens=-5: must be >= 1"),
        ("--temperature=-1", "--temperature=-1.0: must be 0 <= x <= 100"),
        ("--top_p=0", "--top_p=0.0: must be 0 < x <= 1"),
        ("--max_tokens=abc", "--max_tokens=abc"),
        ("--no_such_flag=1", "Unknown command line flag 'no_such_flag'"),
        ("--mesh=model:64", "--mesh=model:64: needs 64 devices, 1 available"),
        ("--mesh=rows:2", "bad entry 'rows:2'"),
        ("--prompt=", "--prompt='': must not be empty"),
    ],
)
def test_cli_sampling_flags(flag, message):
    assert_usage_error(run([*CLI, flag]), message)


def test_cli_needs_a_command():
    assert_usage_error(run(["-m", "serving.cli"]), "expected one of ['generate']")


def test_server_flags_and_busy_ports(busy_port):
    assert_usage_error(
        run([*SERVER, f"--metrics_port={busy_port}"]),
        f"--metrics_port={busy_port}: port already in use",
        "-1 for none",
    )
    assert_usage_error(run([*SERVER, f"--port={busy_port}"]), f"--port={busy_port}: port already")
    assert_usage_error(run([*SERVER, "--port=70000"]), "--port=70000: must be 0 <= port <= 65535")
    assert_usage_error(run([*SERVER, "--max_num_seqs=0"]), "--max_num_seqs=0: must be >= 1")
    assert_usage_error(run([*SERVER, "--host=no.such.host.invalid"]), "cannot resolve")
    assert_usage_error(run([*SERVER, "--tenants_config=/nope.json"]), "no such file")


def test_server_refuses_a_compilation_cache_it_cannot_create(tmp_path):
    """A link to a missing directory (what benchmarks/burst_capacity.py made on a fresh
    machine) was a FileExistsError traceback; now one line naming the flag."""
    link = tmp_path / "xla"
    link.symlink_to(tmp_path / "missing")
    assert_usage_error(
        run([*SERVER, f"--compilation_cache_dir={link}"]),
        f"--compilation_cache_dir={link}: cannot be used as a directory",
    )


def test_client_flags_and_dead_target():
    assert_usage_error(run([*CLIENT, "--max_tokens=-5"]), "--max_tokens=-5: must be >= 1")
    assert_usage_error(run([*CLIENT, "--target=nohost"]), "--target=nohost: expected HOST:PORT")
    assert_usage_error(run([*CLIENT, "frobnicate"]), "one of ['generate', 'tokenize'")
    port = dead_port()
    assert_usage_error(
        run([*CLIENT, f"--target=127.0.0.1:{port}", "info"]),
        f"--target=127.0.0.1:{port}: no server answers there",
    )


def test_loadgen_refuses_a_dead_target(tmp_path):
    port = dead_port()
    out = tmp_path / "out"
    proc = run([*LOADGEN, f"--target=127.0.0.1:{port}", "--duration_s=1", f"--out={out}"])
    assert_usage_error(proc, f"--target=127.0.0.1:{port}: no server answers there")
    assert not out.exists()  # no report of a run that never happened
    proc = run([*LOADGEN, f"--target=127.0.0.1:{port}", "--protocol=http", f"--out={out}"])
    assert_usage_error(proc, f"--target=127.0.0.1:{port}: no HTTP server answers there")


@pytest.mark.parametrize(
    "flag, message",
    [
        ("--rate=-1", "--rate=-1.0: must be > 0"),
        ("--cancel_fraction=2", "--cancel_fraction=2.0: must be 0 <= x <= 1"),
        ("--workload=bogus", "workload 'bogus': expected one of"),
        ("--slo=latency=1", "slo field 'latency'"),
        ("--target=8.8.8.8:443", "only loopback addresses"),
        ("--sweep_rates=1,x", "--sweep_rates=1,x: numbers"),
        ("--gate_percentile=p90", "one of p50, p95, p99"),
    ],
)
def test_loadgen_flags(flag, message):
    assert_usage_error(run([*LOADGEN, flag]), message)


@pytest.mark.parametrize(
    "flag, message",
    [
        ("--rate=-2", "--rate=-2.0: must be > 0"),
        ("--model=no-such-model", "--model=no-such-model: unknown model; one of"),
        ("--utilization=1.5", "--utilization=1.5: must be 0 < x <= 1"),
        ("--seq_lens=1024,abc", "--seq_lens=1024,abc: positive integers"),
        ("--device_memory_gib=1", "leaves no KV budget"),
        ("--kv_dtype=fp7", "--kv_dtype=fp7: one of"),
        ("--sessions=10", "--session_tokens=0.0: must be > 0 when --sessions is given"),
    ],
)
def test_planner_flags(flag, message):
    assert_usage_error(run([*PLANNER, "plan", flag]), message)


def test_planner_needs_the_plan_command():
    assert_usage_error(run(PLANNER), "expected the command 'plan'")


@pytest.mark.parametrize("execute", [False, True])
def test_server_prints_warmup_progress(monkeypatch, capsys, execute):
    import types

    import engine.runner.warmup
    from engine.batch.builder import BatchShape
    from engine.runner.programs import StepProgram
    from engine.sampling.sampler import FULL_FLAGS
    from serving.engine_host import build as engine_build

    compiled, marked, executed = [], [], []

    def fake_warmup(eng, shapes, stop=None, execute=False):
        compiled.append(shapes)
        executed.append(execute)

    monkeypatch.setattr(engine.runner.warmup, "warmup", fake_warmup)
    shapes = [BatchShape(n, 0, 0, 4, 1) for n in range(1, 11)]  # decode-only: 2 programs each
    eng = types.SimpleNamespace(
        shapes=types.SimpleNamespace(shapes=shapes),
        runner=types.SimpleNamespace(
            mark_warm=marked.append, full_program=lambda shape: StepProgram(FULL_FLAGS, True)
        ),
    )
    engine_build.warmup_with_progress(eng, num_reports=4, execute=execute)
    assert compiled == [shapes[0:3], shapes[3:6], shapes[6:9], shapes[9:]]
    assert executed == [execute] * 4  # --warmup_execute reaches every warm-up call
    lines = capsys.readouterr().err.splitlines()
    done = "compiled and run once" if execute else "compiled"
    assert [ln.split(" (")[0] for ln in lines] == [
        *(f"warm-up: {n}/10 step shapes {done}" for n in (3, 6, 9, 10)),
        "warm-up: 20 step programs",
    ]
    assert len(marked) == 1 and marked[0] >= 0


def test_console_scripts_resolve():
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    assert {"pagedjax", "pagedjax-server", "pagedjax-client", "pagedjax-loadgen"} <= set(scripts)
    for target in scripts.values():  # one process each: every command defines its own flags
        module, _, func = target.partition(":")
        code = f"import {module} as m; assert callable(m.{func})"
        assert run(["-c", code]).returncode == 0, target


ATTENTION_IMPL_PROBE = """
import sys
from absl import flags
import engine.factory
from serving import server
from serving.engine_host import build

built = []
engine.factory.create_engine = lambda *a, **kw: built.append(kw)
server.define_flags()
flags.FLAGS(["server", *sys.argv[1:]])
build.build_engine("tiny", server.engine_options_from_flags())
print("impl", built[-1]["impl"])
"""

ENGINE_OPTIONS_PROBE = """
import sys
from absl import flags
from serving import server

server.define_flags()
flags.FLAGS(["server", *sys.argv[1:]])
o = server.engine_options_from_flags()
print(o["kv_cache_bytes"], o["max_num_seqs"], o["num_pages"])
"""


@pytest.mark.parametrize(
    "argv, impl", [([], "auto"), (["--attention_impl=reference"], "reference")]
)
def test_attention_impl_flag_reaches_the_engine(argv, impl):
    """--attention_impl becomes the engine's `impl` (the attention every step program runs);
    the default leaves the engine's own choice; a bad value is a usage error."""
    proc = run(["-c", ATTENTION_IMPL_PROBE, *argv])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-1] == f"impl {impl}"


@pytest.mark.parametrize(
    "argv, want",
    [([], f"{3 * 2**29} 64 None"), (["--kv_cache_gib=0.25", "--num_pages=99"], f"{2**28} 64 99")],
)
def test_server_kv_pool_and_batch_defaults(argv, want):
    """The server sizes its KV pool by --kv_cache_gib (1.5 GiB) unless --num_pages is given
    (EngineConfig then ignores the bytes) and batches 64 requests by default."""
    proc = run(["-c", ENGINE_OPTIONS_PROBE, *argv])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-1] == want
    assert_usage_error(run([*SERVER, "--kv_cache_gib=0"]), "--kv_cache_gib=0", ">= 0.001")


def test_attention_impl_refusals():
    from serving.engine_host import build as engine_build

    with pytest.raises(ValueError, match="attention_impl='reference'"):
        engine_build.build_engine("mock", {"max_num_seqs": 2, "page_size": 4, "impl": "reference"})
    assert_usage_error(run([*SERVER, "--attention_impl=fast"]), "--attention_impl=fast")
