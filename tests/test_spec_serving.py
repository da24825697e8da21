"""Per-request speculation counts reach the client: the gRPC final message's Usage carries
the request's drafted and accepted tokens (tiny model, ngram, greedy), and the HTTP usage
object adds them when drafts were verified."""

import pytest

from configs.engine_config import EngineConfig
from serving.frontend.admission import AdmissionConfig
from serving.frontend.generation import FinalSummary
from serving.http.responses import usage
from serving.testing import running_server

pytestmark = pytest.mark.compile  # a speculative engine configuration of its own

PROMPT = "hello world hello world hello world hello world"
SPEC = {"num_speculative_tokens": 3, "disable_by_batch_size": None, "prompt_lookup_min": 1}


def test_grpc_final_message_carries_drafted_and_accepted_tokens(tiny_model):
    from engine.core import EngineCore

    config = EngineConfig(
        model="tiny",
        page_size=4,
        num_pages=64,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        prefill_chunk_size=32,
        max_model_len=128,
        speculative=SPEC,
    )
    engine = EngineCore(tiny_model, config)
    engine.spec.proposer = lambda req, k: [7] * k  # drafts on every step (mostly rejected)
    with running_server(engine, admission=AdmissionConfig(max_model_len=128)) as (_, client):
        before = engine.stats()
        res = client.generate(PROMPT, max_tokens=16, temperature=0.0, stream=True)
        assert res.ok, res.details
        after = engine.stats()  # one request in between: the difference is its counts
    drafted = after["spec_drafted_tokens"] - before.get("spec_drafted_tokens", 0)
    accepted = after["spec_accepted_tokens"] - before.get("spec_accepted_tokens", 0)
    assert res.spec_drafted_tokens == drafted > 0
    assert res.spec_accepted_tokens == accepted <= drafted
    assert res.versions["speculative"] == "ngram:k=3"


def test_http_usage_adds_speculation_only_when_drafts_were_verified():
    timings = dict.fromkeys(("queue_s", "ttft_s", "tpot_s", "e2e_s"))
    plain = FinalSummary("stop", 5, 0, 7, timings)
    spec = FinalSummary("stop", 5, 0, 7, timings, spec_drafted_tokens=9, spec_accepted_tokens=4)
    assert "speculative" not in usage([plain], 1, 1)
    got = usage([spec, spec], 1, 2)
    assert got["speculative"] == {"drafted_tokens": 18, "accepted_tokens": 8}
    assert got["completion_tokens"] == 14
