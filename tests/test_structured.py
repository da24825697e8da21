"""Structured output (engine/structured/) on the random `tiny` model: a random model is a
good stress test of the constraint, since only the mask keeps its output well-formed.

Every finished ("stop") output must parse and validate; "length" outputs (max_tokens came
first: an incomplete document) are counted and must be a minority."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine import LLM, SamplingParams
from engine.api_types import EngineRequest
from engine.errors import InvalidRequestError
from engine.sampling.sampler import FULL_FLAGS, GREEDY_FLAGS, SamplingTensors, sample
from engine.structured.mask import allowed_ids, apply_token_bitmask
from engine.structured.matcher import StructuredRequests, bitmask_width
from engine.structured.output import StructuredOutput
from engine.structured.vocab import token_vocab
from models.registry import tiny_tokenizer
from tests.structured_schemas import SCHEMAS, validate

TINY_OPTS = dict(
    page_size=8, max_num_seqs=8, max_num_batched_tokens=64, prefill_chunk_size=32, max_model_len=256
)


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", num_pages=200, **TINY_OPTS)


# ---- validation at request time ----------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, field, message",
    [
        ({"json_schema": {"type": "objekt"}}, "structured.json_schema", "Invalid type: objekt"),
        ({"json_schema": "{not json"}, "structured.json_schema", "not valid JSON"),
        ({"json_schema": {"$ref": "#/$defs/nope"}}, "structured.json_schema", "does not exist"),
        (
            {"json_schema": {"type": "string", "format": "hostname-ish"}},
            "structured.json_schema",
            "Unknown format",
        ),
        ({"regex": "a(b"}, "structured.regex", "unclosed group"),
        ({"grammar": "start: foo"}, "structured.grammar", "unknown name"),
        ({"choice": []}, "structured.choice", "1 to"),
        ({"choice": "yes"}, "structured.choice", "list of strings"),
        ({"choice": ["a", ""]}, "structured.choice", "non-empty"),
        ({}, "structured", "exactly one"),
        ({"regex": "a", "choice": ["a"]}, "structured", "exactly one"),
    ],
)
def test_invalid_constraint_names_field_and_library_message(kw, field, message):
    with pytest.raises(InvalidRequestError) as e:
        StructuredOutput(**kw)
    assert e.value.field == field
    assert message in str(e.value)


def test_sampling_params_accepts_dict_and_refuses_min_tokens():
    p = SamplingParams(structured={"json_schema": '{"type": "integer"}'})
    assert p.structured == StructuredOutput(json_schema={"type": "integer"})  # canonical
    hash(p)  # stays hashable
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured={"regex": "a+"})
    with pytest.raises(InvalidRequestError, match="fields are"):
        SamplingParams(structured={"jsonschema": {}})


def test_every_schema_compiles():
    for schema in SCHEMAS.values():
        StructuredOutput(json_schema=schema)  # raises with the schema's problem
    assert len(SCHEMAS) >= 30


# ---- host side: vocabulary, cache, bitmask -------------------------------------------------------


def test_token_vocab_bytes_spell_the_text():
    tok = tiny_tokenizer()
    vocab = token_vocab(tok, 512)
    text = 'héllo {"a": [1, 2]}'
    ids = tok.encode(text, add_special_tokens=False)
    assert b"".join(vocab.token_bytes[i] for i in ids) == text.encode()
    assert vocab.token_bytes[2].startswith(b"\xff")  # EOS is special, never text
    assert vocab.token_bytes[300] == b""  # past the tokenizer: padding ids


def test_bitmask_allows_exactly_the_grammar_and_eos_at_the_end():
    tok = tiny_tokenizer()
    reqs = StructuredRequests(tok, 512)
    reqs.track("r", reqs.compile(StructuredOutput(choice=["ab", "ac"])))
    ids_a, ids_b, ids_c = (tok.encode(c, add_special_tokens=False)[0] for c in "abc")
    mask = reqs.bitmask(["r", None], 3)
    assert mask.shape == (3, bitmask_width(512)) == (3, 16)
    assert allowed_ids(mask[0], 512).tolist() == [ids_a]
    assert (mask[1:] == -1).all()  # unconstrained and padding rows: all ones
    assert not reqs.accept("r", ids_a)
    assert sorted(allowed_ids(reqs.bitmask(["r"], 1)[0], 512).tolist()) == [ids_b, ids_c]
    assert reqs.accept("r", ids_c)  # "ac": complete, nothing can follow -> stop
    assert allowed_ids(reqs.bitmask(["r"], 1)[0], 512).tolist() == [2]  # only EOS


def test_refused_token_ends_the_request_and_a_broken_matcher_allows_only_eos():
    tok = tiny_tokenizer()
    reqs = StructuredRequests(tok, 512)
    reqs.track("r", reqs.compile(StructuredOutput(regex="[0-9]+")))
    letter = tok.encode("x", add_special_tokens=False)[0]
    assert reqs.accept("r", letter)  # refused (cannot happen behind the mask): stop
    assert allowed_ids(reqs.bitmask(["r"], 1)[0], 512).tolist() == [2]  # matcher in error


def test_compiled_grammar_is_cached_per_constraint():
    reqs = StructuredRequests(tiny_tokenizer(), 512)
    c = StructuredOutput(json_schema=SCHEMAS["nested_object"])
    m1, m2 = reqs.compile(c), reqs.compile(StructuredOutput(json_schema=SCHEMAS["nested_object"]))
    assert (reqs.cache.misses, reqs.cache.hits) == (1, 1)
    assert m1 is not m2  # each request its own matcher state


# ---- device side: the sampler sees only allowed tokens -------------------------------------


def _random_bitmask(rng, S, V):
    allowed = rng.random((S, V)) < 0.05
    allowed[:, 7] = True  # at least one token per row
    padded = np.zeros((S, bitmask_width(V) * 32), bool)
    padded[:, :V] = allowed
    words = np.packbits(padded.reshape(S, -1, 32), axis=-1, bitorder="little")
    return allowed, words.view(np.int32).reshape(S, -1)


@pytest.mark.parametrize("flags", [GREEDY_FLAGS, FULL_FLAGS])
def test_sample_picks_only_allowed_tokens_and_logprobs_are_masked(flags):
    rng = np.random.default_rng(0)
    S, V = 8, 300
    allowed, bitmask = _random_bitmask(rng, S, V)
    logits = jnp.asarray(rng.normal(size=(S, V)) * 3, jnp.float32)
    masked = np.asarray(apply_token_bitmask(logits, jnp.asarray(bitmask)))
    assert np.isneginf(masked[~allowed]).all() and np.isfinite(masked[allowed]).all()
    temperature = 0.0 if flags is GREEDY_FLAGS else 1.0
    for seed in range(4):
        params = [SamplingParams(temperature=temperature, seed=seed, top_p=0.9)] * S
        t = SamplingTensors.from_params(params, [0] * S, [seed] * S, S)
        res = jax.jit(sample, static_argnames="flags")(
            logits, t, flags=flags, token_bitmask=jnp.asarray(bitmask)
        )
        tokens = np.asarray(res.tokens)
        assert allowed[np.arange(S), tokens].all()
        if flags is FULL_FLAGS:  # logprobs of the masked distribution: allowed mass is 1
            top_ids, top_lp = np.asarray(res.top_ids), np.asarray(res.top_logprobs)
            finite = np.isfinite(top_lp)
            assert allowed[np.nonzero(finite)[0], top_ids[finite]].all()
        else:
            want = np.where(allowed, np.asarray(logits), -np.inf).argmax(-1)
            assert (tokens == want).all()


# ---- end to end on the tiny model ----------------------------------------------------------


def _finished_texts(outs):
    done = [c for o in outs for c in o.outputs if c.finish_reason == "stop"]
    length = [c for o in outs for c in o.outputs if c.finish_reason == "length"]
    return done, length


def test_json_schemas_on_random_model_always_validate(llm):
    names = sorted(SCHEMAS)
    params = [
        SamplingParams(
            temperature=1.0, seed=i, max_tokens=96, structured={"json_schema": SCHEMAS[n]}
        )
        for i, n in enumerate(names)
    ]
    outs = llm.generate(["{"] * len(names), params)
    finished = 0
    for name, o in zip(names, outs):
        c = o.outputs[0]
        if c.finish_reason == "length":
            continue
        assert c.finish_reason == "stop", (name, c.finish_reason)
        validate(json.loads(c.text), SCHEMAS[name])
        finished += 1
    assert finished >= 0.8 * len(names), f"only {finished}/{len(names)} finished"
    assert not llm.engine.structured.active  # every matcher freed


def test_greedy_json_object_and_regex(llm):
    outs = llm.generate(
        ["a", "b", "c"],
        [
            SamplingParams(temperature=0, max_tokens=64, structured={"json_object": True}),
            SamplingParams(
                temperature=0, max_tokens=32, structured={"regex": r"[a-z]{1,6}@[a-z]{1,4}\.com"}
            ),
            SamplingParams(
                temperature=1.0, seed=5, max_tokens=32, structured={"regex": r"[0-9]{3}"}
            ),
        ],
    )
    if outs[0].outputs[0].finish_reason == "stop":
        assert isinstance(json.loads(outs[0].text), dict)
    assert re.fullmatch(r"[a-z]{1,6}@[a-z]{1,4}\.com", outs[1].text), outs[1].text
    assert re.fullmatch(r"[0-9]{3}", outs[2].text) and outs[2].outputs[0].finish_reason == "stop"


def test_regex_outputs_all_match(llm):
    pattern = r"(cat|dog)-[0-9]{2}(!|\?)?"
    params = SamplingParams(
        temperature=1.0, seed=11, max_tokens=16, n=12, structured={"regex": pattern}
    )
    (out,) = llm.generate(["x"], params)
    texts = [c.text for c in out.outputs]
    assert all(re.fullmatch(pattern, t) for t in texts), texts


def test_choice_puts_probability_only_on_allowed_strings(llm):
    choices = ["yes", "no", "maybe", "nope"]
    params = SamplingParams(
        temperature=1.0, seed=0, max_tokens=8, n=24, logprobs=5, structured={"choice": choices}
    )
    (out,) = llm.generate(["q"], params)
    tok = llm.tokenizer
    firsts = {tok.encode(c, add_special_tokens=False)[0] for c in choices}
    for c in out.outputs:
        assert c.text in choices and c.finish_reason == "stop"
        first = c.logprobs[0]
        mass = sum(np.exp(lp) for i, lp in first.top if np.isfinite(lp) and i in firsts)
        assert {i for i, lp in first.top if np.isfinite(lp)} <= firsts
        assert mass == pytest.approx(1.0, abs=1e-4)  # the whole distribution is on them


def test_grammar_lark_and_gbnf(llm):
    lark = 'start: item ("," item)*\nitem: /[0-9]/ | "x"'
    gbnf = 'root ::= "(" [a-c]+ ")"'
    outs = llm.generate(
        ["g", "h"],
        [
            SamplingParams(temperature=1.0, seed=1, max_tokens=24, structured={"grammar": lark}),
            SamplingParams(temperature=1.0, seed=2, max_tokens=24, structured={"grammar": gbnf}),
        ],
    )
    if outs[0].outputs[0].finish_reason == "stop":
        assert re.fullmatch(r"([0-9]|x)(,([0-9]|x))*", outs[0].text), outs[0].text
    else:
        assert re.fullmatch(r"([0-9]|x)(,([0-9]|x))*,?", outs[0].text), outs[0].text
    assert re.fullmatch(r"\([a-c]+\)?", outs[1].text), outs[1].text


def _free_params():
    return [
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=4, top_k=20, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=9, max_tokens=20, logprobs=2, ignore_eos=True),
    ]


def test_free_requests_in_a_mixed_batch_get_their_tokens_alone(llm):
    prompts = ["free one", "free two", "free three"]
    alone = [o.token_ids for o in llm.generate(prompts, _free_params())]
    constrained = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=40, structured={"json_schema": s})
        for i, s in enumerate([SCHEMAS["nested_object"], SCHEMAS["array_of_objects"]])
    ]
    mixed = llm.generate(["c1", *prompts, "c2"], [constrained[0], *_free_params(), constrained[1]])
    assert [o.token_ids for o in mixed[1:4]] == alone


def test_overlap_resumes_after_constrained_requests_end(llm):
    core = llm.engine
    core.add_request(
        EngineRequest("s", [1, 5], SamplingParams(max_tokens=4, structured={"regex": "ab+"}))
    )
    core.add_request(
        EngineRequest("f", [1, 6], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    )
    saw_overlap = False
    while core.has_unfinished():
        core.step()
        saw_overlap |= core._in_flight is not None
        if core._in_flight is not None:
            assert "s" not in core.structured  # overlapped only once no constraint is left
    assert saw_overlap


@pytest.mark.compile  # a second engine (another page pool size): its own step programs
def test_preemption_keeps_matcher_state(llm):
    """A small page pool preempts requests mid-document; with seeds, outputs equal those of
    the roomy engine (the matcher state survives the preemption)."""
    schema = SCHEMAS["array_of_objects"]
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=40, structured={"json_schema": schema})
        for i in range(6)
    ]
    prompts = [[1] + list(range(10 + i, 40 + i)) for i in range(6)]
    roomy = llm.generate(prompts, params)
    tight_llm = LLM("tiny", num_pages=12, **TINY_OPTS)
    tight = tight_llm.generate(prompts, params)
    assert tight_llm.engine.scheduler.stats()["num_preemptions"] > 0
    assert [o.token_ids for o in tight] == [o.token_ids for o in roomy]
    for o in tight:
        if o.outputs[0].finish_reason == "stop":
            validate(json.loads(o.text), schema)


def test_cancel_and_prefix_cache_and_n(llm):
    core = llm.engine
    params = SamplingParams(
        temperature=1.0, seed=3, max_tokens=50, structured={"json_object": True}
    )
    core.add_request(EngineRequest("cancel-me", [1, 2, 3], params))
    core.step()
    core.abort_request("cancel-me")
    while core.has_unfinished():
        core.step()
    assert "cancel-me" not in core.structured
    prompt = [1] + list(range(50, 90))  # long enough to fill cached pages
    first = llm.generate([prompt], params)[0]
    again = llm.generate([prompt], params)[0]
    assert again.metrics.cached_tokens > 0  # the prefix cache served the prompt
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    (multi,) = llm.generate(
        [prompt],
        SamplingParams(
            n=4, temperature=1.0, seed=8, max_tokens=50, structured={"choice": ["alpha", "beta"]}
        ),
    )
    assert [c.text in ("alpha", "beta") for c in multi.outputs] == [True] * 4


def test_engine_refuses_bad_constraint_and_keeps_nothing(llm):
    with pytest.raises(InvalidRequestError, match="structured.regex"):
        SamplingParams(structured={"regex": "(("})
    assert not llm.engine.structured.active
