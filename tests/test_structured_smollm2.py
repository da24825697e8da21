"""Structured output on the real SmolLM2-135M (slow: loads the model): every JSON Schema of
tests/structured_schemas.py (every third one in `make test`) at temperature 0 and at
temperature 1 with seeds; each finished output parses and validates with jsonschema, and
most finish within max_tokens."""

import json
import os
import re

import pytest

from engine import LLM, SamplingParams
from tests.shared_configs import SMOLLM2_SERVED
from tests.structured_schemas import SCHEMAS, validate

MAX_TOKENS = 96
# `make test` validates every third schema; `make test-full-sizes` (PAGEDJAX_FULL_SIZES=1) all.
FULL_SIZES = os.environ.get("PAGEDJAX_FULL_SIZES") == "1"


@pytest.fixture(scope="module")
def llm(smollm2):
    # scan layers (unrolled SmolLM2 compiles ~5x slower; masks are layout-free), the config
    # of tests/test_tools_smollm2.py (one set of compiled programs)
    return LLM(smollm2, **SMOLLM2_SERVED)


def _prompt(schema: dict) -> list[dict]:
    ask = "Reply with one JSON value that follows this JSON Schema:\n"
    return [{"role": "user", "content": ask + json.dumps(schema)}]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_schema_validates(llm, temperature):
    names = sorted(SCHEMAS) if FULL_SIZES else sorted(SCHEMAS)[::3]
    params = [
        SamplingParams(
            temperature=temperature,
            seed=i,
            max_tokens=MAX_TOKENS,
            structured={"json_schema": SCHEMAS[n]},
        )
        for i, n in enumerate(names)
    ]
    outs = llm.generate([_prompt(SCHEMAS[n]) for n in names], params)
    unfinished = []
    for name, o in zip(names, outs):
        c = o.outputs[0]
        if c.finish_reason == "length":  # an incomplete document: excluded, counted
            unfinished.append(name)
            continue
        assert c.finish_reason == "stop", (name, c.finish_reason)
        validate(json.loads(c.text), SCHEMAS[name])
    assert len(unfinished) <= 0.2 * len(names), unfinished


def test_regex_and_choice(llm):
    ask = [{"role": "user", "content": "What is the capital of France? One word."}]
    choices = ["Paris", "London", "Berlin", "Madrid"]
    (out,) = llm.generate(
        [ask],
        SamplingParams(temperature=1.0, seed=0, n=16, max_tokens=8, structured={"choice": choices}),
    )
    texts = [c.text for c in out.outputs]
    assert set(texts) <= set(choices) and "Paris" in texts
    # NOTE: [0-9], not \d: llguidance's \d is Unicode's (it allows digits such as U+1FBF8).
    phone = r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"
    ask = [{"role": "user", "content": "Give me a US phone number."}]
    (out,) = llm.generate(
        [ask],
        SamplingParams(temperature=1.0, seed=1, n=8, max_tokens=24, structured={"regex": phone}),
    )
    for c in out.outputs:
        assert re.fullmatch(phone, c.text) and c.finish_reason == "stop", c.text
