"""The SentencePiece-style tokenizer a GGUF stores as `tokenizer.ggml.model = "llama"` (Gemma's
262k vocabulary with byte fallback), built with the `tokenizers` library the way transformers'
GGUF conversion builds it (transformers/integrations/gguf/gguf_tokenizer_mapping.py
`gemma_tokenizer` + `GemmaTokenizer`), so ids equal `AutoTokenizer.from_pretrained(folder,
gguf_file=...)`'s (tests/test_gemma3_gguf.py checks it):

- a BPE model over the file's vocabulary with byte fallback (`<0x41>` tokens) and fused unk,
- merges: the file has none, so they are derived from the vocabulary: every split of a token
  into two tokens of the vocabulary, ranked by the merged token's position in the file
  (Gemma's scores do not follow its merge order; the file order does),
- spaces as "▁" (a normalizer), split before each space (merged with the previous piece),
- tokens of two or more spaces, stored as real spaces, respelled as "▁"s,
- control tokens (type 3) special and user-defined ones (type 4) matched whole.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Sequence

import tokenizers
from tokenizers import AddedToken, decoders, normalizers, pre_tokenizers

log = logging.getLogger(__name__)

_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4
SPACE = "\u2581"


def derive_merges(vocab: dict[str, int]) -> list[tuple[str, str]]:
    """(left, right) pairs whose concatenation is a token, best (earliest token) first; ties
    by the pieces' ids, then shorter left piece first (transformers' `generate_merges`)."""
    ranked = []
    for merged, rank in vocab.items():
        local = [
            (merged[:i], merged[i:])
            for i in range(1, len(merged))
            if merged[:i] in vocab and merged[i:] in vocab
        ]
        local.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        ranked.extend((rank, len(left), len(right), left, right) for left, right in local)
    ranked.sort(key=lambda m: (m[0], -m[1], -m[2]))
    return [(left, right) for _, _, _, left, right in ranked]


def cached_merges(vocab: dict[str, int]) -> list[tuple[str, str]]:
    """`derive_merges(vocab)`, cached as JSON beside the Orbax cache, keyed by the vocabulary's
    hash (deriving them takes ~10 s of CPU for Gemma's 262k tokens; reading them back <1 s)."""
    from models.loaders.orbax_cache import cache_dir

    key = hashlib.sha256("\0".join(vocab).encode()).hexdigest()[:32]
    path = os.path.join(os.path.dirname(cache_dir()), "spm_merges", f"{key}.json")
    try:
        with open(path) as f:
            return [tuple(pair) for pair in json.load(f)]
    except (OSError, ValueError):
        pass
    merges = derive_merges(vocab)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(merges, f)
        os.replace(tmp, path)
    except OSError as e:  # a read-only cache dir must not stop serving
        log.warning("could not cache SentencePiece merges at %s: %s", path, e)
    return merges


def spm_backend(
    tokens: Sequence[str], token_types: Sequence[int], unk_token: str
) -> tokenizers.Tokenizer:
    """The `tokenizers.Tokenizer` for a GGUF SentencePiece vocabulary (see module doc)."""
    tokens = [SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {tok: i for i, tok in enumerate(tokens)}  # a repeated spelling: its last id
    model = tokenizers.models.BPE(
        vocab=vocab,
        merges=cached_merges(vocab),
        dropout=None,
        unk_token=unk_token,
        fuse_unk=True,
        byte_fallback=True,
    )
    backend = tokenizers.Tokenizer(model)
    backend.normalizer = normalizers.Replace(" ", SPACE)
    backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    backend.decoder = decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    control = [
        AddedToken(tok, normalized=False, special=True)
        for tok, kind in zip(tokens, token_types)
        if kind == _TOKEN_TYPE_CONTROL
    ]
    user_defined = [
        AddedToken(tok, normalized=False, special=False)
        for tok, kind in zip(tokens, token_types)
        if kind == _TOKEN_TYPE_USER_DEFINED
    ]
    backend.add_special_tokens(control)
    backend.add_tokens(user_defined)
    return backend
