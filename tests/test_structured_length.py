"""Structured output cut by the length limit: a `length`-terminated JSON output must be a
valid prefix of some document its schema accepts; a `stop` one must be a whole document.

The judge is a fresh llguidance matcher over a BYTE-level tokenizer written here, fed the
output text byte by byte: nothing of the engine's tokenizer, vocabulary bytes, matcher
cache or masks is reused, and llguidance's default JSON options (flexible whitespace) are a
superset of what the engine allows, so only a real grammar violation fails."""

from __future__ import annotations

import json

import llguidance
import pytest

from engine import LLM, SamplingParams
from tests.structured_schemas import SCHEMAS, validate

EOS = 256


class _ByteTokenizer:
    """256 one-byte tokens and an EOS: what llguidance's TokenizerWrapper reads."""

    tokens = [bytes([b]) for b in range(256)] + [b"<eos>"]
    eos_token_id = EOS
    bos_token_id = None
    special_token_ids = [EOS]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


def _judge(schema: dict) -> llguidance.LLMatcher:
    tok = llguidance.LLTokenizer(
        llguidance.TokenizerWrapper(_ByteTokenizer()), n_vocab=EOS + 1, eos_token=[EOS]
    )
    # NOTE: llguidance emits properties in the schema's order; the engine canonicalises a
    # schema with sorted keys (engine/structured/output.py _canonical_schema), so its documents
    # list properties alphabetically. Either order is the same JSON document, so the judge
    # sorts too.
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        json.loads(json.dumps(schema, sort_keys=True))
    )
    return llguidance.LLMatcher(tok, grammar)


def is_valid_prefix(text: str, schema: dict) -> bool:
    """True when `text` can be continued into a document `schema` accepts (llguidance)."""
    data = text.encode("utf-8")
    m = _judge(schema)
    return m.try_consume_tokens(list(data)) == len(data) and not m.is_error()


def test_the_judge_tells_a_prefix_from_a_violation():
    schema = SCHEMAS["flat_required"]
    assert is_valid_prefix('{"age": 1', schema)
    assert is_valid_prefix('{"age":1,"name":"x', schema)
    assert not is_valid_prefix('{"nam": 1', schema)  # no such property
    assert not is_valid_prefix('{"name": 5', schema)  # wrong type
    assert not is_valid_prefix("[", schema)


@pytest.fixture(scope="module")
def llm():
    return LLM(
        "tiny",
        num_pages=128,
        page_size=8,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=128,
    )


def test_length_cut_json_is_a_valid_prefix(llm):
    """Every schema, sampled (temperature 1) with a max_tokens too small for most documents:
    each `length` output is a valid prefix, each `stop` one validates. Shown (2026-12-04) to
    catch a planted bug: the structured bitmask filled for even batch rows only
    (engine/structured/matcher.py `bitmask`: odd rows unconstrained) failed here on a
    length-cut output ('/' for schema any_of), the kind test_structured.py skips."""
    names = sorted(SCHEMAS)
    params = [
        SamplingParams(
            temperature=1.0, seed=i, max_tokens=6, structured={"json_schema": SCHEMAS[n]}
        )
        for i, n in enumerate(names)
    ]
    outs = llm.generate(["{"] * len(names), params)
    cut = 0
    for name, o in zip(names, outs):
        c = o.outputs[0]
        assert c.finish_reason in ("length", "stop"), (name, c.finish_reason)
        assert is_valid_prefix(c.text, SCHEMAS[name]), (name, c.text)
        if c.finish_reason == "stop":
            validate(json.loads(c.text), SCHEMAS[name])
        else:
            cut += 1
    assert cut >= len(names) // 2, f"only {cut}/{len(names)} outputs were cut by length"
    assert not llm.engine.structured.active
