"""The ngram proposer (engine/spec/ngram.py) and the drafting backoff (engine/spec/decode.py):
plain Python, no device."""

from engine.sched.request import Request
from engine.spec.decode import MAX_BACKOFF_TOKENS, back_off
from engine.spec.ngram import propose_ngram


def test_proposes_what_followed_the_last_ngram():
    assert propose_ngram([1, 2, 3, 4, 1, 2], k=3, min_n=1, max_n=4) == [3, 4, 1]


def test_longest_suffix_first_then_shorter():
    # "9 2" never occurred before; "2" did (followed by 3, 4)
    assert propose_ngram([1, 2, 3, 4, 9, 2], k=2, min_n=1, max_n=3) == [3, 4]
    assert propose_ngram([1, 2, 3, 4, 9, 2], k=2, min_n=2, max_n=3) == []


def test_prefers_an_occurrence_followed_by_k_known_tokens():
    # the 2-gram "1 2" occurs at 0, 3 and 6 (the suffix); the one at 3 has only 1 token after
    assert propose_ngram([1, 2, 3, 1, 2, 3, 1, 2], k=4, min_n=1, max_n=2) == [3, 1, 2, 3]
    assert propose_ngram([3, 3, 3, 3, 3, 3], k=3, min_n=1, max_n=2) == [3, 3, 3]


def test_no_match_and_too_short_give_no_draft():
    assert propose_ngram([5, 6, 7], k=2, min_n=1, max_n=3) == []
    assert propose_ngram([7], k=3, min_n=1, max_n=4) == []


def test_backoff_doubles_per_miss_and_resets_on_an_accept():
    req = Request("r", [1, 2, 3])
    waits = []
    for _ in range(7):
        back_off(req, num_accepted=0)
        waits.append(req.spec_resume_at - req.num_output_tokens - 1)
    assert waits == [2, 4, 8, 16, 32, MAX_BACKOFF_TOKENS, MAX_BACKOFF_TOKENS]
    back_off(req, num_accepted=2)
    assert (req.spec_misses, req.spec_resume_at) == (0, 0)
