"""The server over the real EngineCore on the tiny random model: what the stream carries
equals what the engine produces when driven directly, and the final message carries the
engine's resolved versions."""

import pytest

from configs.engine_config import EngineConfig
from engine.api_types import EngineRequest
from engine.sampling_params import SamplingParams
from serving.admission import AdmissionConfig
from serving.testing import outcome_counts, running_server, wait_for

PROMPT = "hello world"


@pytest.fixture(scope="module")
def tiny_engine(tiny_model):
    from engine.core import EngineCore

    config = EngineConfig(model="tiny", page_size=4, num_pages=64, max_num_seqs=4,
                          max_num_batched_tokens=64, prefill_chunk_size=32, max_model_len=128,
                          prefix_caching=False)
    return EngineCore(tiny_model, config)


def _direct(engine, prompt_ids, max_tokens):
    engine.add_request(EngineRequest("direct", prompt_ids,
                                     SamplingParams(temperature=0.0, max_tokens=max_tokens)))
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
        assert res.versions == {"name": ident.name, "revision": ident.revision,
                                "tokenizer_hash": ident.tokenizer_hash,
                                "chat_template_hash": ident.chat_template_hash,
                                "engine_version": ident.engine_version}
        pinned = client.generate(PROMPT, max_tokens=12, temperature=0.0, stream=False,
                                 revision=ident.revision)
        assert pinned.ok and pinned.token_ids == ids
        wait_for(lambda: server.loop.last_stats.get("kv_pages_used") == 0, what="pages freed")
        assert outcome_counts(server) == {("success", ""): 2}
