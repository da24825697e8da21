"""The HTTP API over the real EngineCore, driven by the official `openai` SDK: the tiny
random model (what HTTP returns equals the engine driven directly; logprobs; seeds) and, in
the slow tier, SmolLM2 answering a chat question."""

import openai
import pytest

from configs.engine_config import EngineConfig
from engine.api_types import EngineRequest
from engine.sampling.params import SamplingParams
from serving.frontend.admission import AdmissionConfig
from serving.testing import outcome_counts, running_server, wait_for
from tests.conftest import FULL_SIZES_ONLY

PROMPT = "hello world"


def _engine(model, **overrides):
    from engine.core import EngineCore

    config = dict(
        model=model.config.name,
        page_size=4,
        num_pages=128,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        prefill_chunk_size=32,
        max_model_len=128,
    )
    return EngineCore(model, EngineConfig(**{**config, **overrides}))


@pytest.fixture(scope="module")
def tiny_engine(tiny_model):
    return _engine(tiny_model)


def _direct(engine, prompt_ids, sp: SamplingParams):
    engine.add_request(EngineRequest("direct", prompt_ids, sp))
    ids, text = [], ""
    while engine.has_unfinished():
        for out in engine.step():
            ids += out.new_token_ids
            text += out.new_text
    return ids, text


def _seeded(seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=8)


def _sdk(server):
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="none", max_retries=0
    )


@pytest.mark.compile
def test_http_equals_engine_with_logprobs_and_seeds(tiny_engine):
    tok = tiny_engine.tokenizer
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    ids, text = _direct(tiny_engine, tok.encode(PROMPT), greedy)  # also compiles the step
    seeded = [_direct(tiny_engine, tok.encode(PROMPT), _seeded(s)) for s in (7, 8)]
    admission = AdmissionConfig(max_model_len=128)
    with running_server(tiny_engine, admission=admission, http_port=0) as (server, _):
        sdk = _sdk(server)
        name = tiny_engine.identity.name
        full = sdk.completions.create(model=name, prompt=PROMPT, max_tokens=8, temperature=0)
        assert full.choices[0].text == text and full.usage.completion_tokens == len(ids)
        assert tiny_engine.identity.revision in full.system_fingerprint
        streamed = sdk.completions.create(
            model=name, prompt=PROMPT, max_tokens=8, temperature=0, stream=True
        )
        assert "".join(c.choices[0].text for c in streamed) == text

        # Seeds: choice i of a seeded request samples with seed + i, reproducibly.
        r = sdk.completions.create(
            model=name, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=7, n=2
        )
        assert [c.text for c in r.choices] == [seeded[0][1], seeded[1][1]]
        again = sdk.completions.create(
            model=name, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=7
        )
        assert again.choices[0].text == seeded[0][1]

        # Completions logprobs: the sampled token (greedy: the top one) and 3 alternatives.
        r = sdk.completions.create(
            model=name, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3
        )
        lp = r.choices[0].logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids)
        assert lp.tokens == [tok.decode([i]) for i in ids]
        for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
            assert len(top) <= 3 and chosen == pytest.approx(max(top.values()), abs=1e-5)
            assert chosen <= 0
        assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0

        # Chat logprobs, streamed and not: same tokens, top_logprobs sorted, 2 each.
        msgs = [{"role": "user", "content": "hi"}]
        chat = sdk.chat.completions.create(
            model=name, messages=msgs, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
        )
        content = chat.choices[0].logprobs.content
        assert len(content) == chat.usage.completion_tokens
        for entry in content:
            assert len(entry.top_logprobs) == 2
            assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
            assert entry.token == entry.top_logprobs[0].token
            assert entry.bytes == list(entry.token.encode())
        chunks = list(
            sdk.chat.completions.create(
                model=name,
                messages=msgs,
                max_tokens=6,
                temperature=0,
                logprobs=True,
                top_logprobs=2,
                stream=True,
            )
        )
        streamed_lp = [e for c in chunks for e in (c.choices[0].logprobs.content or [])]
        assert [e.token for e in streamed_lp] == [e.token for e in content]
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == (
            chat.choices[0].message.content
        )
        wait_for(lambda: server.loop.last_stats.get("kv_pages_used", 0) == 0, what="pages")
        assert set(outcome_counts(server)) == {("success", "")}


@pytest.mark.compile
def test_structured_output_over_http_and_grpc(tiny_engine):
    """response_format / guided_* (HTTP) and the structured oneof (gRPC) reach the engine's
    sampler: outputs follow the constraint, and equal the engine driven directly."""
    import json
    import re

    import jsonschema

    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    tok = tiny_engine.tokenizer
    direct = SamplingParams(
        temperature=1.0, seed=3, max_tokens=40, structured={"json_schema": schema}
    )
    _, want = _direct(tiny_engine, tok.encode(PROMPT), direct)
    with running_server(tiny_engine, admission=AdmissionConfig(max_model_len=128), http_port=0) as (
        server,
        client,
    ):
        sdk, name = _sdk(server), tiny_engine.identity.name
        fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
        r = sdk.completions.create(
            model=name,
            prompt=PROMPT,
            max_tokens=40,
            temperature=1.0,
            seed=3,
            extra_body={"response_format": fmt},
        )
        assert r.choices[0].text == want
        if r.choices[0].finish_reason == "stop":
            jsonschema.validate(json.loads(want), schema)
        r = sdk.completions.create(
            model=name, prompt=PROMPT, max_tokens=12, extra_body={"guided_regex": "[xyz]{2,4}!"}
        )
        assert re.fullmatch("[xyz]{2,4}!", r.choices[0].text), r.choices[0].text
        res = client.generate(
            PROMPT, max_tokens=8, temperature=1.0, structured={"choice": ["left", "right"]}
        )
        assert res.ok and res.text in ("left", "right"), (res.code, res.text)
        res = client.generate(PROMPT, max_tokens=8, structured={"regex": "(("})
        assert res.code == "INVALID_ARGUMENT" and "structured.regex" in res.details


# SmolLM2 over HTTP via the openai SDK stays in `make test` as tests/test_entry_points.py's
# README server test (defaults, Paris); this in-process twin runs in `make test-full-sizes`.
@pytest.mark.slow
@FULL_SIZES_ONLY
def test_smollm2_chat_over_http_answers_paris(smollm2):
    engine = _engine(
        smollm2, page_size=16, num_pages=64, max_model_len=512, layer_loop="scan"
    )  # NOTE: scan is the server's default; unrolled SmolLM2 compiles ~5x slower
    with running_server(engine, admission=AdmissionConfig(max_model_len=512), http_port=0) as (
        server,
        _,
    ):
        chat = _sdk(server).chat.completions.create(
            model=engine.identity.name,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=24,
            temperature=0,
        )
        assert "Paris" in chat.choices[0].message.content
        assert chat.choices[0].finish_reason in ("stop", "length")
        assert engine.identity.chat_template_hash in chat.system_fingerprint
