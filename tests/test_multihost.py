"""Multi-host (engine/parallel/distributed.py): two processes on localhost, `jax.distributed` over
CPU (gloo collectives), 2 virtual devices each, one mesh model:4 spanning both. Process 0
schedules and broadcasts every step; both run it. The tokens must equal one process on one
device."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from configs.engine_config import EngineConfig
from engine.core import EngineCore
from engine.parallel.distributed import DistributedConfig, StepChannel, generate_ids, initialize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = "1,2,3;72,101,108,108,111,32,119"
MAX_TOKENS = 6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(num_processes: int, mesh: str) -> list[subprocess.Popen]:
    addr = f"127.0.0.1:{_free_port()}"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "engine.parallel.distributed",
                "--model=tiny",
                f"--mesh={mesh}",
                f"--prompts={PROMPTS}",
                f"--max_tokens={MAX_TOKENS}",
                "--cpu_devices=2",
                f"--coordinator_address={addr}",
                f"--num_processes={num_processes}",
                f"--process_id={i}",
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(num_processes)
    ]


def _tagged(stdout: str, tag: str) -> dict:
    lines = [ln for ln in stdout.splitlines() if ln.startswith(tag + " ")]
    assert lines, f"no {tag} line in output"
    return json.loads(lines[-1][len(tag) + 1 :])


@pytest.mark.subprocess
def test_two_processes_generate_like_one(tiny_model):
    procs = _launch(2, "model:4")
    try:
        outs = [p.communicate(timeout=900) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (_out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    leader, follower = _tagged(outs[0][0], "RESULT"), _tagged(outs[1][0], "FOLLOWER")
    assert leader["processes"] == 2 and leader["devices"] == 4
    assert follower["steps"] == leader["steps"] > 0  # the follower ran every step

    config = EngineConfig(
        model="tiny", num_pages=32, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128
    )
    prompts = [[int(t) for t in s.split(",")] for s in PROMPTS.split(";")]
    expected = generate_ids(EngineCore(tiny_model, config), prompts, MAX_TOKENS)
    assert leader["tokens"] == expected


def test_single_process_needs_no_initialize():
    assert initialize(DistributedConfig()) is False
    assert StepChannel().is_leader


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"num_processes": 0}, "num_processes"),
        ({"num_processes": 2, "process_id": 2}, "process_id"),
    ],
)
def test_bad_distributed_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        DistributedConfig(**kwargs)
