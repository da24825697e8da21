"""One request script through the real EngineCore and through serving's MockEngine: the
outcomes must be identical, step by step.

The real engine runs its whole step (Scheduler, PagePool, build_batch, the jitted model
forward and sampler, OutputProcessor with the StopChecker) on a hand-built model whose greedy
choice IS the mock's rule: token t embeds as the one-hot of (t - 32) % 95, the layers add
nothing (wo = w_down = 0), and the LM head maps that one-hot to next_token(t) (logit ~11)
and, second best, next_token(next_token(t)) (logit ~5.7), which is what the sampler falls
back to when min_tokens bans the first. So given the same token rule, any difference in
scheduling, preemption, prefix caching, stop handling, aborts, deadlines or output deltas
between the engine and the mock fails this test.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.engine_config import EngineConfig
from configs.model_config import from_name
from engine.api_types import EngineRequest
from engine.core import EngineCore
from engine.interface import Engine
from engine.sampling.params import SamplingParams
from models.llama import init_params
from models.registry import LoadedModel
from serving.engine_host.mock_engine import ByteTokenizer, MockEngine, MockIdentity, next_token

NUM_PRINTABLE = 95
# NOTE: the mock steps synchronously. An engine with overlapped steps emits each token one
# step() later and computes one discarded token after a stop, so the comparison runs the
# engine synchronously where it has the option (overlapped == synchronous is the overlap
# tests' claim, not this one's).
SYNC = (
    {"async_scheduling": False}
    if "async_scheduling" in {f.name for f in dataclasses.fields(EngineConfig)}
    else {}
)


def rule_model() -> LoadedModel:
    """The tiny architecture (D widened to 128 > 95) with the mock's rule as its argmax."""
    cfg = dataclasses.replace(from_name("tiny"), name="tiny-rule", hidden_size=128)
    params = init_params(cfg, jax.random.key(0), jnp.float32, scale=0.2)
    V, D = cfg.vocab_size, cfg.hidden_size
    embed = np.zeros((V, D), np.float32)
    head = np.zeros((D, V), np.float32)
    for t in range(V):
        embed[t, (t - 32) % NUM_PRINTABLE] = 1.0
    for u in range(32, 32 + NUM_PRINTABLE):  # one row per printable class
        head[u - 32, next_token(u)] = 1.0
        head[u - 32, next_token(next_token(u))] = 0.5
    layers = dataclasses.replace(
        params.layers,
        wo=jnp.zeros_like(params.layers.wo),
        w_down=jnp.zeros_like(params.layers.w_down),
    )
    params = dataclasses.replace(
        params, embed=jnp.asarray(embed), lm_head=jnp.asarray(head), layers=layers
    )
    params = jax.device_put(params, jax.devices()[0])
    return LoadedModel(cfg, params, ByteTokenizer(), MockIdentity(), "rule", {})


def _req(rid, text, priority=0, deadline_s=None, **sp):
    sampling = SamplingParams(temperature=0.0, **sp)
    return EngineRequest(rid, list(text.encode()), sampling, priority, deadline_s=deadline_s)


# step index -> requests added / ids aborted before that step
SCRIPT_ADD = {
    0: [
        _req("hello", "hello", max_tokens=12),
        _req("min_tokens", "a", max_tokens=8, min_tokens=5, stop=("bc",)),  # -> length
        _req("stop_str", "abc", max_tokens=20, stop=("fgh",)),  # -> "de", stop
        _req("stop_id", "xyz", max_tokens=10, stop_token_ids=(ord("}"),)),
        _req("banned_id", "a", max_tokens=5, min_tokens=2, stop_token_ids=(ord("c"),)),
    ],
    1: [_req("hello_again", "hello", max_tokens=3)],  # prefix cache hit: "hell", one page
    2: [
        _req("long_high", "The quick brown fox jumps", priority=1, max_tokens=6),
        _req("aborted", "q", priority=2, max_tokens=30),
        _req("late", "zzz", deadline_s=0.0, max_tokens=4),  # deadline already passed
    ],
}
SCRIPT_ABORT = {10: ["aborted"], 9: ["no_such_request"]}


def run_script(engine, max_steps=400):
    """Per step: sorted (request_id, new ids, new text, finish reason) of its outputs."""
    trace = []
    for step in range(max_steps):
        for er in SCRIPT_ADD.get(step, []):
            engine.add_request(dataclasses.replace(er))
        for rid in SCRIPT_ABORT.get(step, []):
            engine.abort_request(rid)
        if step > max(SCRIPT_ADD) and not engine.has_unfinished():
            return trace
        outs = engine.step()
        trace.append(
            sorted(
                (
                    o.request_id,
                    tuple(o.new_token_ids),
                    o.new_text,
                    o.finish_reason,
                    o.num_cached_tokens,
                    None if o.metrics is None else o.metrics.num_preemptions,
                )
                for o in outs
            )
        )
    raise AssertionError("the script did not finish")


def outcomes(trace):
    out = {}
    for step in trace:
        for rid, ids, text, reason, cached, preemptions in step:
            o = out.setdefault(rid, {"ids": [], "text": ""})
            o["ids"] += ids
            o["text"] += text
            if reason is not None:
                o.update(reason=reason, cached=cached, preemptions=preemptions)
    return out


@pytest.fixture(scope="module")
def config():
    # 10 usable pages of 4 tokens for up to 3 running requests: preemptions happen.
    return EngineConfig(
        model="tiny-rule",
        page_size=4,
        num_pages=11,
        max_num_seqs=3,
        max_num_batched_tokens=16,
        prefill_chunk_size=8,
        max_model_len=64,
        priority_aging_per_s=0.0,
        prefix_cache_ttl_s=None,
        **SYNC,
    )


@pytest.mark.compile
def test_engine_and_mock_produce_the_same_outcomes(config):
    model = rule_model()
    engines = EngineCore(model, config), MockEngine(config=config.scheduler_config(model.config))
    assert all(isinstance(e, Engine) for e in engines)
    real, mock = (run_script(e) for e in engines)
    assert real == mock

    got = outcomes(mock)
    assert got["min_tokens"]["reason"] == "length" and len(got["min_tokens"]["ids"]) == 8
    assert (got["stop_str"]["text"], got["stop_str"]["reason"]) == ("de", "stop")
    assert (got["stop_id"]["text"], got["stop_id"]["reason"]) == ("{|", "stop")
    assert got["banned_id"]["text"] == "bdefg"  # "c" banned before min_tokens
    assert got["hello"]["text"] == "pqrstuvwxyz{"
    assert got["aborted"]["reason"] == "cancelled" and 0 < len(got["aborted"]["ids"]) < 30
    assert got["late"]["reason"] == "timed_out"
    assert got["late"]["ids"] == [] and got["long_high"]["reason"] == "length"
    assert got["hello_again"]["cached"] == 4
    assert sum(o["preemptions"] for o in got.values()) > 0
    assert len(got) == sum(len(v) for v in SCRIPT_ADD.values())
