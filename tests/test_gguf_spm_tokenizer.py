"""The SentencePiece-style GGUF tokenizer (models/loaders/gguf_spm_tokenizer.py) against
transformers' own GGUF conversion of the same vocabulary (its `gemma_tokenizer` builder), on
a small Gemma-shaped vocabulary: byte fallback, whitespace runs stored as real spaces,
control and user-defined tokens. The real 262k vocabulary: tests/test_gemma3_gguf.py."""

import pytest

from models.loaders.gguf_spm_tokenizer import SPACE, cached_merges, derive_merges, spm_backend

mapping = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
BYTES = [f"<0x{b:02X}>" for b in range(256)]
PIECES = [
    "\n", "  ", "   ", "a", "b", "c", "d", "e", "h", "i", "l", "o", "r", "t", "w", " ",
    SPACE, "he", "ll", "hell", "hello", SPACE + "w", SPACE + "wo", SPACE + "world", "or",
    "ld", "wor", "th", "the", SPACE + "the", "ab", "abc", "<think>",
]  # fmt: skip
TOKENS = SPECIALS + BYTES + PIECES
TYPES = [3] * len(SPECIALS) + [6] * len(BYTES) + [1] * (len(PIECES) - 1) + [4]
TEXTS = ["hello world", "the  world\n  abc", "héllo ☃ wörld", "<start_of_turn>hi<think>", "   "]


def test_ids_and_text_match_transformers_conversion(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDJAX_CACHE_DIR", str(tmp_path / "orbax"))
    ours = spm_backend(TOKENS, TYPES, "<unk>")
    ref = mapping.gemma_tokenizer(
        {"tokens": TOKENS, "token_type": TYPES, "tokenizer_type": "llama"}
    )
    ref = mapping.add_gguf_special_tokens(ref, {"tokens": TOKENS, "token_type": TYPES})
    for text in TEXTS:
        want = ref(text, add_special_tokens=False)["input_ids"]
        got = ours.encode(text, add_special_tokens=False).ids
        assert got == want, text
        assert ours.decode(got, skip_special_tokens=False) == ref.decode(want)


def test_merges_are_cached_by_vocabulary(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDJAX_CACHE_DIR", str(tmp_path / "orbax"))
    vocab = {t: i for i, t in enumerate(TOKENS)}
    first = cached_merges(vocab)
    assert list((tmp_path / "spm_merges").iterdir())  # written once
    assert cached_merges(vocab) == first == derive_merges(vocab)
