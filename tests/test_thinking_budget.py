"""The thinking budget (max_thinking_tokens): decoding is constrained so that after N thought
tokens the closing </think> is forced, then the answer continues. On the random `tiny`
model, whose thought would otherwise run until max_tokens."""

import pytest

from engine import LLM, SamplingParams
from engine.chat.reasoning import budget_grammar, get_reasoning_format
from engine.chat.setup import ChatOptions
from engine.errors import InvalidRequestError
from engine.structured.output import StructuredOutput
from serving.http.chat import chat_setup

BUDGET = 6


def _find(ids: list[int], sub: list[int]) -> int:
    return next(i for i in range(len(ids)) if ids[i : i + len(sub)] == sub)


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", num_pages=64, page_size=8, max_num_seqs=8, max_model_len=128)


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
def test_the_thought_ends_at_the_budget_and_the_answer_continues(llm, name):
    fmt = get_reasoning_format(name)
    grammar = StructuredOutput(grammar=budget_grammar(fmt, BUDGET))
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=40, n=8, structured=grammar)
    (out,) = llm.generate(["q"], params)
    tok = llm.tokenizer
    opener = [] if fmt.starts_inside else tok.encode(fmt.start, add_special_tokens=False)
    closer = tok.encode(fmt.end, add_special_tokens=False)
    for c in out.outputs:
        ids = list(c.token_ids)
        assert ids[: len(opener)] == opener
        thought = _find(ids, closer) - len(opener)
        assert 0 <= thought <= BUDGET, c.text
        assert len(ids) > len(opener) + thought + len(closer)  # the answer went on


class _Body:
    tools = tool_choice = parallel_tool_calls = None

    def __init__(self, **kw):
        self.__dict__.update(kw)


def test_budget_needs_a_reasoning_parser_and_no_other_constraint():
    plain = ChatOptions.for_tokenizer(object())
    with pytest.raises(InvalidRequestError, match="reasoning_parser"):
        chat_setup(plain, _Body(chat_template_kwargs=None, max_thinking_tokens=4))
    qwen = ChatOptions.for_tokenizer(object(), reasoning_parser="qwen3")
    setup = chat_setup(qwen, _Body(chat_template_kwargs=None, max_thinking_tokens=4))
    assert setup.sampling(SamplingParams()).structured.grammar == budget_grammar(qwen.reasoning, 4)
    with pytest.raises(InvalidRequestError, match="response_format"):
        setup.sampling(SamplingParams(structured=StructuredOutput(json_object=True)))
    off = _Body(chat_template_kwargs={"enable_thinking": False}, max_thinking_tokens=4)
    assert chat_setup(qwen, off).sampling(SamplingParams()).structured is None
