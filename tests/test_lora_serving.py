"""LoRA through the server on the tiny model: the gRPC `adapter` field and the HTTP `model`
field pick a loaded adapter, the response's resolved versions name it and its content hash,
and an unknown adapter is NOT_FOUND (gRPC) / 404 (HTTP). The flag parsing of --lora."""

import httpx
import pytest

from configs.engine_config import EngineConfig
from engine.api_types import EngineRequest
from engine.sampling.params import SamplingParams
from models.lora_random import write_peft_adapter
from serving import flags as shared
from serving.frontend.admission import AdmissionConfig
from serving.testing import running_server

PROMPT = "hello world"


@pytest.fixture(scope="module")
def lora_engine(tiny_model, tmp_path_factory):
    from engine.core import EngineCore

    config = EngineConfig(
        model="tiny",
        page_size=4,
        num_pages=64,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        prefill_chunk_size=32,
        max_model_len=128,
        max_loras=2,
        max_lora_rank=8,
    )
    engine = EngineCore(tiny_model, config)
    path = write_peft_adapter(tmp_path_factory.mktemp("a") / "a1", tiny_model.config, scale=0.3)
    engine.load_adapter("a1", path)
    return engine


def _direct(engine, prompt_ids, adapter):
    sp = SamplingParams(temperature=0.0, max_tokens=8)
    engine.add_request(EngineRequest("direct", prompt_ids, sp, adapter=adapter))
    ids, text = [], ""
    while engine.has_unfinished():
        for out in engine.step():
            ids += out.new_token_ids
            text += out.new_text
    return ids, text


@pytest.mark.compile
def test_grpc_and_http_serve_the_named_adapter(lora_engine):
    ids = lora_engine.tokenizer.encode(PROMPT)
    want, want_text = _direct(lora_engine, ids, "a1")
    base, _ = _direct(lora_engine, ids, None)
    assert want != base
    ref = lora_engine.adapters.loaded["a1"]
    with running_server(lora_engine, admission=AdmissionConfig(max_model_len=128), http_port=0) as (
        server,
        client,
    ):
        res = client.generate(PROMPT, max_tokens=8, temperature=0.0, adapter="a1")
        assert res.ok, res.details
        assert res.token_ids == want
        assert res.versions["adapter"] == "a1" and res.versions["adapter_hash"] == ref.content_hash
        # the gateway protocol's rule: a `model` naming a loaded adapter runs it (gRPC too)
        by_model = client.generate(PROMPT, max_tokens=8, temperature=0.0, model="a1")
        assert by_model.ok and by_model.token_ids == want, by_model.details
        assert by_model.versions["adapter"] == "a1"
        plain = client.generate(PROMPT, max_tokens=8, temperature=0.0)
        assert plain.token_ids == base and "adapter" not in plain.versions
        missing = client.generate(PROMPT, max_tokens=8, adapter="nope")
        assert missing.code == "NOT_FOUND" and "'nope' is not loaded" in missing.details

        url = f"http://127.0.0.1:{server.http_port}/v1/completions"
        body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "model": "a1"}
        r = httpx.post(url, json=body, timeout=60)
        assert r.status_code == 200, r.text
        versions = r.json()["pagedjax"]["versions"]
        assert versions["adapter"] == "a1" and versions["adapter_hash"] == ref.content_hash
        assert r.json()["choices"][0]["text"] == want_text
        r = httpx.post(url, json={**body, "model": "nope"}, timeout=60)
        assert r.status_code == 404, r.text
        chat = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4, "model": "a1"}
        r = httpx.post(url.replace("completions", "chat/completions"), json=chat, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["pagedjax"]["versions"]["adapter"] == "a1"


def test_lora_flags_parse_and_reject_bad_values(tmp_path):
    assert shared.parse_loras([f"a={tmp_path}", f"b={tmp_path}"], None) == {
        "a": str(tmp_path),
        "b": str(tmp_path),
    }
    with pytest.raises(shared.UsageError, match="NAME=DIR"):
        shared.parse_loras(["no-equals"], None)
    with pytest.raises(shared.UsageError, match="given twice"):
        shared.parse_loras([f"a={tmp_path}", f"a={tmp_path}"], None)
    with pytest.raises(shared.UsageError, match="no such directory"):
        shared.parse_loras([f"a={tmp_path}/missing"], None)
    with pytest.raises(shared.UsageError, match="--max_loras=1"):
        shared.parse_loras([f"a={tmp_path}", f"b={tmp_path}"], 1)


@pytest.mark.compile
def test_runtime_load_and_unload_over_http(lora_engine, tiny_model, tmp_path):
    a2 = write_peft_adapter(tmp_path / "a2", tiny_model.config, scale=0.3, seed=5)
    big = write_peft_adapter(tmp_path / "big", tiny_model.config, r=16)
    admission = AdmissionConfig(max_model_len=128)
    with running_server(lora_engine, admission=admission, http_port=0) as (server, _):
        base = f"http://127.0.0.1:{server.http_port}"
        r = httpx.post(f"{base}/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": a2})
        assert r.status_code == 403 and "--allow_runtime_lora" in r.text
    with running_server(lora_engine, admission=admission, http_port=0, allow_runtime_lora=True) as (
        server,
        _,
    ):
        base = f"http://127.0.0.1:{server.http_port}"
        load, unload = f"{base}/v1/load_lora_adapter", f"{base}/v1/unload_lora_adapter"
        r = httpx.post(load, json={"lora_name": "a2", "lora_path": a2}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["content_hash"] == lora_engine.adapters.loaded["a2"].content_hash
        body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "model": "a2"}
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["pagedjax"]["versions"]["adapter"] == "a2"
        models = httpx.get(f"{base}/v1/models", timeout=60).json()["data"]
        assert [m["id"] for m in models] == ["tiny", "a1", "a2"]
        assert models[2]["parent"] == "tiny"
        assert (
            models[2]["pagedjax"]["versions"]["adapter_hash"]
            == r.json()["pagedjax"]["versions"]["adapter_hash"]
        )
        r = httpx.post(load, json={"lora_name": "big", "lora_path": big}, timeout=60)
        assert r.status_code == 400 and "max_lora_rank=8" in r.text
        r = httpx.post(load, json={"lora_name": "x"}, timeout=60)
        assert r.status_code == 400 and "lora_path" in r.text
        assert httpx.post(unload, json={"lora_name": "a2"}, timeout=60).status_code == 200
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
        assert r.status_code == 404, r.text
        assert httpx.post(unload, json={"lora_name": "a2"}, timeout=60).status_code == 404
