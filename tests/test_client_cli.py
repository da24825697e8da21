"""`pagedjax-client` against a live mock server: chat by default (`--raw` for text as is), and
the tokenize / models / info subcommands printing JSON."""

import json
import os
import subprocess
import sys

import pytest

from serving.testing import running_server

pytestmark = pytest.mark.subprocess  # the client runs as a subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def target():
    with running_server() as (server, _):
        yield f"127.0.0.1:{server.port}"


def client(target, *args):
    proc = subprocess.run(
        [sys.executable, "-m", "serving.client", f"--target={target}", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_generate_chats_by_default_and_raw_sends_text(target):
    raw = client(target, "--prompt=abc", "--raw", "--max_tokens=3", "--timeout_s=30")
    chat = client(target, "--prompt=abc", "--max_tokens=3", "--request_timeout_s=30")
    assert raw.startswith("def\n") and "prompt=3 " in raw
    prompt_tokens = int(chat.split("prompt=")[1].split()[0])
    assert prompt_tokens > 3  # the chat template wrapped the one user message


def test_tokenize_models_info(target):
    tok = json.loads(client(target, "tokenize", "--prompt=hello"))
    assert tok == {"text": "hello", "token_ids": [104, 101, 108, 108, 111], "num_tokens": 5}
    models = json.loads(client(target, "models"))
    assert models["models"][0]["versions"]["name"] == "mock"
    info = json.loads(client(target, "info"))
    assert info["model"]["versions"]["revision"] and "limits" in info
