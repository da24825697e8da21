"""Valid by construction: SmolLM2-135M (no tool training; its template has no tool support,
so the fallback rendering shows it the tools) with tool_choice required / named, sampled at
T=1, through the openai SDK: every call parses and validates against its tool's schema,
because decoding is constrained to the call grammar (engine/chat/setup.py). The same
requests unconstrained (tool_choice=none, output parsed here) give far fewer valid calls;
with tool_choice=auto (lazy grammar) every call made is valid. `make test` samples 16
choices in one batch; the issue's 50 forced calls run in `make test-full-sizes`."""

import concurrent.futures
import contextlib
import json

import jsonschema
import openai
import pytest

from configs.engine_config import EngineConfig
from engine.chat.call_stream import parse
from engine.chat.tool_parsers import get_format
from serving.frontend.admission import AdmissionConfig
from serving.testing import running_server
from tests.conftest import FULL_SIZES_ONLY
from tests.shared_configs import SMOLLM2_SERVED

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"tz": {"type": "string", "enum": ["UTC", "Europe/Paris"]}},
    "required": ["tz"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What will the weather be in Paris this week?"}]
SPLIT = (13, 13, 12, 12)  # 50 choices in four concurrent requests (n <= 16 each)


@pytest.fixture(scope="module")
def sdk(smollm2):
    from engine.core import EngineCore

    # the config of tests/test_structured_smollm2.py (one set of compiled programs)
    config = EngineConfig(model=smollm2.config.name, **SMOLLM2_SERVED)
    engine = EngineCore(smollm2, config)
    admission = AdmissionConfig(max_model_len=1024, queue_timeout_s=900.0)  # a loaded CPU
    with running_server(engine, admission=admission, http_port=0, capacity_probe=False) as (
        server,
        _,
    ):
        yield openai.OpenAI(  # the SDK's timeout is the server's deadline: a loaded CPU
            base_url=f"http://127.0.0.1:{server.http_port}/v1",
            api_key="x",
            max_retries=0,
            timeout=1800.0,
        )


def _sample(sdk, split=SPLIT, **kwargs) -> list:
    return _sample_all(sdk, {"one": (split, kwargs)})["one"]


def _sample_all(sdk, asks: dict[str, tuple[tuple[int, ...], dict]]) -> dict[str, list]:
    """All asks' requests at once (they share the engine's decode steps): per ask, the
    choices of its requests (n each, seeded 100 * i), in order."""

    def one(n, seed, kwargs):
        return sdk.chat.completions.create(
            model="smollm2-135m",
            messages=ASK,
            tools=TOOLS,
            temperature=1.0,
            max_tokens=64,
            n=n,
            seed=seed,
            **kwargs,
        ).choices

    jobs = [(key, n, 100 * i, kw) for key, (split, kw) in asks.items() for i, n in enumerate(split)]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        futures = [(key, pool.submit(one, n, seed, kw)) for key, n, seed, kw in jobs]
        out: dict[str, list] = {key: [] for key in asks}
        for key, f in futures:
            out[key] += f.result()
        return out


def _valid_calls(choice) -> int:
    calls = choice.message.tool_calls or []
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return len(calls)


GET_TIME = {"type": "function", "function": {"name": "get_time"}}


def _check(out: dict[str, list]) -> None:
    """forced (required) and named: every choice one call that parses and validates; free
    (tool_choice=none: the same prompt, output parsed here): the model's attempts at the
    syntax rarely do; auto: free text until <tool_call>, then a valid call, no malformed
    call leaks."""
    for choice in out["forced"] + out["named"]:
        assert choice.finish_reason == "tool_calls", (choice.finish_reason, choice.message)
        assert _valid_calls(choice) == 1
    for choice in out["named"]:
        assert {c.function.name for c in choice.message.tool_calls} == {"get_time"}
    valid_free = 0
    for choice in out["free"]:
        _, calls = parse(get_format("hermes"), choice.message.content)
        with contextlib.suppress(jsonschema.ValidationError, json.JSONDecodeError, KeyError):
            valid_free += bool(calls) and all(_valid(c.name, c.arguments) for c in calls)
    assert valid_free < len(out["free"]) // 2, valid_free
    for choice in out["auto"]:
        if choice.finish_reason == "tool_calls":
            assert _valid_calls(choice) >= 1
        elif choice.finish_reason == "stop":
            assert "<tool_call>" not in choice.message.content


ONE_CALL = {"parallel_tool_calls": False}


def test_forced_calls_all_parse_and_validate_and_free_text_does_not(sdk):
    """`make test`'s size: 16 choices, all four kinds in one batch of 16 (one pass of decode
    steps); the issue's 50 calls are the full-size test below."""
    out = _sample_all(
        sdk,
        {
            "forced": ((6,), {"tool_choice": "required", **ONE_CALL}),
            "named": ((2,), {"tool_choice": GET_TIME, **ONE_CALL}),
            "free": ((4,), {"tool_choice": "none"}),
            "auto": ((4,), {"tool_choice": "auto"}),
        },
    )
    assert [len(out[k]) for k in ("forced", "named", "free", "auto")] == [6, 2, 4, 4]
    _check(out)


@FULL_SIZES_ONLY  # the 50 sampled calls (~4 min on 2 cores): make test-full-sizes
def test_smollm2_50_forced_calls_all_parse_and_validate(sdk):
    out = {
        "forced": _sample(sdk, tool_choice="required", **ONE_CALL),
        "named": _sample(sdk, (8,), tool_choice=GET_TIME, **ONE_CALL),
        "free": _sample(sdk, (16,), tool_choice="none"),
        "auto": _sample(sdk, (16,), tool_choice="auto"),
    }
    assert len(out["forced"]) == 50
    _check(out)


def _valid(name: str, arguments: str) -> bool:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    return True
