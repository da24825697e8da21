"""The server over the real EngineCore on the tiny random model: what the stream carries
equals what the engine produces when driven directly, and the final message carries the
engine's resolved versions."""

import pytest

from configs.engine_config import EngineConfig
from engine.api_types import EngineRequest
from engine.sampling.params import SamplingParams
from serving.frontend.admission import AdmissionConfig
from serving.testing import outcome_counts, running_server, wait_for

PROMPT = "hello world"


@pytest.fixture(scope="module")
def tiny_engine(tiny_model):
    from engine.core import EngineCore

    config = EngineConfig(
        model="tiny",
        page_size=4,
        num_pages=64,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        prefill_chunk_size=32,
        max_model_len=128,
        prefix_caching=False,
    )
    return EngineCore(tiny_model, config)


def _direct(engine, prompt_ids, max_tokens):
    engine.add_request(
        EngineRequest("direct", prompt_ids, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    )
    ids, text = [], ""
    while engine.has_unfinished():
        for out in engine.step():
            ids += out.new_token_ids
            text += out.new_text
    return ids, text


def test_stream_equals_engine_output_and_carries_versions(tiny_engine):
    prompt_ids = tiny_engine.tokenizer.encode(PROMPT)
    ids, text = _direct(tiny_engine, prompt_ids, max_tokens=12)  # also compiles the step
    admission = AdmissionConfig(max_model_len=128)
    with running_server(tiny_engine, admission=admission) as (server, client):
        res = client.generate(PROMPT, max_tokens=12, temperature=0.0, stream=True)
        assert res.ok, res.details
        assert res.token_ids == ids and res.text == text
        assert res.completion_tokens == len(ids) and res.prompt_tokens == len(prompt_ids)
        ident = tiny_engine.identity
        assert res.versions == {
            "name": ident.name,
            "revision": ident.revision,
            "tokenizer_hash": ident.tokenizer_hash,
            "chat_template_hash": ident.chat_template_hash,
            "engine_version": ident.engine_version,
            "speculative": "off",
        }
        pinned = client.generate(
            PROMPT, max_tokens=12, temperature=0.0, stream=False, revision=ident.revision
        )
        assert pinned.ok and pinned.token_ids == ids
        wait_for(lambda: server.loop.last_stats.get("kv_pages_used") == 0, what="pages freed")
        assert outcome_counts(server) == {("success", ""): 2}


def test_client_cancel_frees_pages_and_others_continue(tiny_engine, monkeypatch):
    import time

    from serving.client import build_request

    # 20 ms per step: the tiny model's steps take ~1 ms, so 100 tokens could finish (and free
    # their pages) before the loop's stats (every 0.1 s) ever showed them held
    step = tiny_engine.step
    monkeypatch.setattr(tiny_engine, "step", lambda *a, **kw: (time.sleep(0.02), step(*a, **kw))[1])
    admission = AdmissionConfig(max_model_len=128)
    with running_server(tiny_engine, admission=admission) as (server, client):
        call = client.stream(
            build_request(PROMPT, max_tokens=100, temperature=0.0, ignore_eos=True, stream=True)
        )
        next(iter(call))  # the first token arrived: the request holds KV pages now
        wait_for(lambda: server.loop.last_stats.get("kv_pages_used", 0) > 0, what="pages held")
        other = client.generate("another prompt", max_tokens=8, temperature=0.0)
        call.cancel()
        wait_for(
            lambda: (
                server.loop.last_stats.get("kv_pages_used") == 0
                and server.loop.last_stats.get("num_running") == 0
            ),
            timeout_s=60,
            what="pages freed",
        )
        assert other.ok and other.completion_tokens == 8
        wait_for(
            lambda: outcome_counts(server).get(("cancelled", "client")) == 1, what="cancel recorded"
        )
        assert outcome_counts(server)[("success", "")] == 1


@pytest.mark.slow
def test_smollm2_chat_over_grpc_matches_engine(smollm2):
    from engine.core import EngineCore

    engine = EngineCore(
        smollm2,
        EngineConfig(
            max_num_seqs=4,
            max_num_batched_tokens=128,
            prefill_chunk_size=64,
            max_model_len=512,
            num_pages=128,
            layer_loop="scan",  # NOTE: the server's default; unrolled SmolLM2 compiles ~5x slower
        ),
    )
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ids, direct_text = _direct(engine, engine.tokenizer.encode(text, add_special_tokens=False), 16)
    with running_server(engine, admission=AdmissionConfig(max_model_len=512)) as (server, client):
        res = client.generate(messages=messages, max_tokens=16, temperature=0.0, stream=True)
        assert res.ok, res.details
        assert res.token_ids == ids and res.text == direct_text
        assert "Paris" in res.text
        assert res.versions["revision"] == smollm2.identity.revision
