"""tool_choice=auto is valid by construction for every parser: a lazy grammar leaves the text
free until the model opens a call (hermes `<tool_call>`, llama3_json `<|python_tag|>` or a
'{' opening the output, mistral `[TOOL_CALLS]`), then holds it to a valid call
(engine/chat/tool_parsers.py `lazy_grammar`).

The model is planted (the tiny architecture, hand-set weights): token t embeds as a one-hot,
the layers add nothing (wo = w_down = 0), and the LM head maps each planted token to the next
one of a chain, so the greedy output after a prompt is the chain its last character starts.
Each chain writes free text, the format's trigger, then a call that breaks (`{"city": }}`).
Without the constraint (tool_choice=none, the same prompt) that output does not parse; under
auto the text before the trigger and the trigger are the model's own, the call the grammar's
valid one. A chain of plain text comes out identical under auto.

The tokenizer is the tiny byte tokenizer plus the chains' phrases as single tokens and the
Llama / Mistral tags as special tokens, as their real tokenizers hold them (the grammars then
ask for the special token: ChatOptions.tag_token), while hermes' `<tool_call>` is an ordinary
token, as in Qwen's."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from configs.model_config import from_name
from engine import LLM, SamplingParams
from engine.chat.call_stream import parse
from engine.chat.setup import ChatOptions
from engine.chat.tool_parsers import get_format
from models.chat_template import ChatTemplate
from models.identity import ModelIdentity, engine_version
from models.llama import init_params
from models.registry import LoadedModel
from models.tokenizer import Tokenizer, bytes_to_unicode

pytestmark = pytest.mark.compile  # a tiny engine (the engine options of test_llm_tools.py)

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
SPECIALS = ["<unk>", "<s>", "</s>", "<|python_tag|>", "[TOOL_CALLS]"]
EOS = "</s>"
PHRASES = [
    '{"name": "get_weather", "parameters": {"city": ',
    '[{"name": "get_weather", "arguments": {"city": ',
    '\n{"name": "get_weather", "arguments": {"city": ',
    "}}",
    "}}]",
    "}}\n</tool_call>",
    "<tool_call>",
    "Let me check. ",
    "I will look it up. ",
    "One moment. ",
    "It is sunny.",
]
# the prompt's last character -> the chain the model writes after it
CHAINS = {
    "1": ['{"name": "get_weather", "parameters": {"city": ', "}}", EOS],
    "2": ["Let me check. ", "<|python_tag|>", '{"name": "get_weather", "parameters": {"city": '],
    # (chain 2 then goes on as chain 1)
    "3": ["I will look it up. ", "[TOOL_CALLS]", '[{"name": "get_weather", "arguments": {"city": '],
    "4": ["One moment. ", "<tool_call>", '\n{"name": "get_weather", "arguments": {"city": '],
    "5": ["It is sunny.", EOS],
}
NEXT = {  # the rest of each chain's links
    '[{"name": "get_weather", "arguments": {"city": ': "}}]",
    "}}]": EOS,
    '\n{"name": "get_weather", "arguments": {"city": ': "}}\n</tool_call>",
    "}}\n</tool_call>": EOS,
}


def byte_piece(text: str) -> str:
    """`text` as a byte-level BPE vocabulary piece."""
    to_unicode = bytes_to_unicode()
    return "".join(to_unicode[b] for b in text.encode())


def planted_tokenizer() -> Tokenizer:
    """Bytes 3-258 (as the tiny tokenizer), then PHRASES, then the Llama / Mistral tags as
    special tokens; the template writes the messages' contents only, so a prompt ends with
    its last message's last character."""
    to_unicode = bytes_to_unicode()
    vocab = {s: i for i, s in enumerate(SPECIALS[:3])}
    for b, ch in sorted(to_unicode.items()):
        vocab[ch] = 3 + b
    for p in PHRASES:  # pieces no merge builds: only the model writes them
        vocab[byte_piece(p)] = len(vocab)
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIALS)
    return Tokenizer(
        backend,
        bos_token_id=1,
        eos_token_ids=(2,),
        chat_template=ChatTemplate("{% for m in messages %}{{ m['content'] }}{% endfor %}"),
        source="planted",
    )


def planted_model() -> LoadedModel:
    tok = planted_tokenizer()
    cfg = from_name("tiny")
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    ids.update({p: tok.token_to_id(byte_piece(p)) for p in PHRASES})
    ids.update({c: tok.encode(c, add_special_tokens=False)[0] for c in CHAINS})
    links = {ids[a]: ids[b] for a, b in NEXT.items()}
    for start, chain in CHAINS.items():
        links.update({ids[a]: ids[b] for a, b in zip([start, *chain], chain)})
    V, D = cfg.vocab_size, cfg.hidden_size
    assert len(links) < D
    embed = np.zeros((V, D), np.float32)
    embed[:, 0] = 1.0  # every other token: row 0
    head = np.zeros((D, V), np.float32)
    head[0, ids[EOS]] = 1.0  # row 0: end where the grammar allows it, else the lowest id
    head[0, tok.encode("]", add_special_tokens=False)[0]] = 0.5  # (one call per list)
    for dim, (token, nxt) in enumerate(sorted(links.items()), start=1):
        embed[token] = 0.0
        embed[token, dim] = 1.0
        head[dim, nxt] = 1.0
    params = init_params(cfg, jax.random.key(0), jnp.float32, scale=0.2)
    layers = dataclasses.replace(
        params.layers,
        wo=jnp.zeros_like(params.layers.wo),
        w_down=jnp.zeros_like(params.layers.w_down),
    )
    params = dataclasses.replace(
        params, embed=jnp.asarray(embed), lm_head=jnp.asarray(head), layers=layers
    )
    identity = ModelIdentity(
        name=cfg.name,
        revision="planted-tool-chains",
        tokenizer_hash=tok.sha256,
        chat_template_hash=tok.chat_template_sha256 or "",
        engine_version=engine_version(),
    )
    return LoadedModel(cfg, params, tok, identity, "planted", {})


@pytest.fixture(scope="module")
def llm():
    return LLM(planted_model(), num_pages=512, page_size=16, max_num_seqs=8, max_model_len=2048)


# NOTE: where the grammar forces bytes (the opening `{"name": "get_weather", ...` after a
# trigger), llguidance allows only the tokenizer's canonical tokens for them, here single
# bytes: the planted phrase is the model's choice only where the call opens the output.
GREEDY = SamplingParams(temperature=0, max_tokens=96)


def _chat(llm, parser: str, prompt_end: str, tool_choice: str):
    llm.chat_options = ChatOptions.for_tokenizer(llm.tokenizer, tool_call_parser=parser)
    params = (
        GREEDY if tool_choice != "none" else dataclasses.replace(GREEDY, skip_special_tokens=False)
    )
    (out,) = llm.chat(
        [{"role": "user", "content": f"Weather in Paris? {prompt_end}"}],
        params,
        tools=TOOLS,
        tool_choice=tool_choice,
    )
    return out.outputs[0]


@pytest.mark.parametrize(
    "parser, prompt_end, text_before",
    [
        ("llama3_json", "1", ""),  # '{' opening the output
        ("llama3_json", "2", "Let me check."),  # <|python_tag|> after text
        ("mistral", "3", "I will look it up."),
        ("hermes", "4", "One moment."),
    ],
)
def test_auto_turns_the_models_malformed_call_into_a_valid_one(
    llm, parser, prompt_end, text_before
):
    fmt = get_format(parser)
    free = _chat(llm, parser, prompt_end, "none")
    content, calls = parse(fmt, free.text)
    assert calls == [] and '{"city": }}' in free.text, free.text  # the model's own: malformed
    assert content.startswith(text_before)

    auto = _chat(llm, parser, prompt_end, "auto")
    assert auto.finish_reason == "tool_calls", auto.text
    (call,) = auto.tool_calls
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    assert (auto.content or "") == text_before  # the text before the trigger is untouched
    assert auto.text.startswith(free.text[: free.text.index("{")])  # and the trigger


@pytest.mark.parametrize("parser", ["llama3_json", "mistral", "hermes"])
def test_free_text_is_untouched_under_auto(llm, parser):
    free = _chat(llm, parser, "5", "none")
    auto = _chat(llm, parser, "5", "auto")
    assert free.text == auto.text == "It is sunny."
    assert auto.content == "It is sunny." and auto.tool_calls == []
    assert auto.finish_reason == "stop"


def test_the_tags_are_special_tokens_the_grammar_asks_for(llm):
    tok = llm.tokenizer
    assert ChatOptions.for_tokenizer(tok, "llama3_json").tag_token == tok.token_to_id(
        "<|python_tag|>"
    )
    assert ChatOptions.for_tokenizer(tok, "mistral").tag_token == tok.token_to_id("[TOOL_CALLS]")
    assert ChatOptions.for_tokenizer(tok, "hermes").tag_token is None  # an ordinary token
