"""llm-d's prefill/decode flow (serving/gateway/http_kv_transfer.py), played the way its routing
sidecar plays it against two pagedjax servers on the tiny model: call 1 to the prefill
server with kv_transfer_params {do_remote_decode: true} (max_tokens=1, not streamed) returns
the parameters; call 2 to the decode server with them pulls the prompt's K/V over our
KVTransfer and generates. The tokens equal one engine's; bad parameters are 400, a server
that cannot serve its side 409."""

import httpx
import pytest

from configs.engine_config import EngineConfig
from engine.api_types import EngineRequest
from engine.sampling.params import SamplingParams
from serving.disagg.service import wrap_engine
from serving.frontend.admission import AdmissionConfig
from serving.testing import running_server

OPTS = dict(
    page_size=4,
    num_pages=64,
    max_num_seqs=4,
    max_num_batched_tokens=64,
    prefill_chunk_size=32,
    max_model_len=128,
)
ADMISSION = AdmissionConfig(max_model_len=128)
PROMPT = "the quick brown fox jumps over the lazy dog"


def engine(tiny_model):
    from engine.core import EngineCore

    return wrap_engine(EngineCore(tiny_model, EngineConfig(model="tiny", **OPTS)))


def direct(eng, prompt_ids, max_tokens):
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    eng.add_request(EngineRequest("direct", prompt_ids, sp))
    ids = []
    while eng.has_unfinished():
        for out in eng.step():
            ids += out.new_token_ids
    return ids


@pytest.fixture(scope="module")
def servers(tiny_model):
    p, d = engine(tiny_model), engine(tiny_model)
    common = dict(admission=ADMISSION, capacity_probe=False, http_port=0)
    with (
        running_server(p, role="prefill", **common) as (ps, _),
        running_server(d, role="decode", **common) as (ds, _),
    ):
        ps.http_api.kv_transfer.host = "127.0.0.1"  # what $POD_IP gives in a pod
        yield ps, ds


def post(server, body, path="/v1/completions"):
    return httpx.post(f"http://127.0.0.1:{server.http_port}{path}", json=body, timeout=120)


@pytest.mark.compile
def test_the_sidecars_two_calls_equal_one_engine(servers, tiny_model):
    ps, ds = servers
    ids = ps.engine.tokenizer.encode(PROMPT)
    want = direct(engine(tiny_model), ids, 8)
    request = {
        "prompt": ids,
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "skip_special_tokens": False,
    }
    # one server alone (same detokenizer): the text the tokens `want` make over HTTP
    alone = post(ps, request).json()["choices"][0]["text"]
    assert alone.startswith(ps.engine.tokenizer.decode(want[:1]))
    # call 1, as the sidecar sends it to the prefill pod
    r = post(ps, {**request, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_host"] == "127.0.0.1"
    assert params["remote_port"] == ps.port
    assert r.json()["usage"]["completion_tokens"] == 1
    # call 2, to the decode server with the parameters: it pulls the K/V and decodes
    imports = ds.engine.counters["kv_imports"]
    r = post(ds, {**request, "kv_transfer_params": params})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == alone
    assert r.json()["usage"]["completion_tokens"] == len(want) == 8
    assert ds.engine.counters["kv_imports"] == imports + 1  # from the pulled K/V, not recomputed
    # streamed decode works too (the sidecar streams call 2 when the client does)
    r = post(ds, {**request, "stream": True, "kv_transfer_params": params})
    assert r.status_code == 200 and "[DONE]" in r.text


@pytest.mark.compile
@pytest.mark.parametrize(
    "params,status,fragment",
    [
        ({"do_remote_decode": True, "do_remote_prefill": True}, 400, "one of do_remote"),
        ({"do_remote_prefill": True, "remote_host": "x"}, 400, "remote_port"),
        ({"do_remote_decode": "yes"}, 400, "a boolean"),
        ({"bogus": 1}, 400, "known fields"),
    ],
)
def test_bad_kv_transfer_params_are_400(servers, params, status, fragment):
    ps, _ = servers
    r = post(ps, {"prompt": "hi", "max_tokens": 1, "kv_transfer_params": params})
    assert r.status_code == status and fragment in r.text, r.text


@pytest.mark.compile
def test_each_side_refuses_the_other_role(servers):
    ps, ds = servers
    body = {"prompt": "hi", "max_tokens": 1}
    r = post(ds, {**body, "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 409 and "role is 'decode'" in r.text, r.text
    remote = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": ps.port}
    r = post(ps, {**body, "kv_transfer_params": remote})
    assert r.status_code == 409 and "role is 'prefill'" in r.text, r.text


def test_the_mock_server_moves_no_kv():
    with running_server(http_port=0) as (server, _):
        r = post(
            server,
            {"prompt": "hi", "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
        )
    assert r.status_code == 409 and "cannot move K/V" in r.text, r.text


def test_the_nixlv2_connectors_null_filled_params_parse():
    from serving.gateway.http_kv_transfer import parse

    # what llm-d's sidecar (connector nixlv2) sends with call 1
    first = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    assert parse(first, stream=False, n=1) == first
    assert parse({"do_remote_decode": False}, stream=True, n=3) is None
