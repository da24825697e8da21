"""StopChecker: EOS, stop ids, stop strings (spanning tokens, inside a token), max/min tokens."""

import pytest

from engine.sampling.params import SamplingParams
from engine.sched.stop_checker import RequestFinishedError, StopChecker

EOS = 2
VOCAB = {
    EOS: "",
    10: "Hello",
    11: " wor",
    12: "ld",
    13: "!",
    14: " <",
    15: "/s",
    16: "top>",
    17: " tail",
    18: "xx<END>yy",
    19: "<",
    20: "EN",
    21: "D>",
    22: "abc",
    23: "</",
}


class FakeDetokenizer:
    def __init__(self, vocab=VOCAB):
        self.vocab = vocab
        self.seen = []

    def add_token(self, token_id: int) -> str:
        self.seen.append(token_id)
        return self.vocab[token_id]


def run(params, tokens, eos=(EOS,)):
    """Feed tokens until finished; returns (emitted text, finish reason, tokens consumed)."""
    checker = StopChecker(params, eos, FakeDetokenizer())
    out, reason, n = [], None, 0
    for t in tokens:
        text, reason = checker.add_token(t)
        out.append(text)
        n += 1
        if reason:
            break
    return "".join(out), reason, n


def test_plain_text_runs_to_max_tokens():
    assert run(SamplingParams(max_tokens=3), [10, 11, 12, 13]) == ("Hello world", "length", 3)


def test_eos_stops_and_is_not_emitted():
    assert run(SamplingParams(max_tokens=10), [10, EOS, 11]) == ("Hello", "stop", 2)


def test_ignore_eos_continues_past_eos():
    text, reason, n = run(SamplingParams(max_tokens=4, ignore_eos=True), [10, EOS, 11, 12])
    assert (text, reason, n) == ("Hello world", "length", 4)


def test_eos_before_min_tokens_is_an_ordinary_token():
    text, reason, n = run(SamplingParams(max_tokens=10, min_tokens=2), [10, EOS, EOS])
    # EOS at index 1 < min_tokens is ignored; at index 2 it stops.
    assert (text, reason, n) == ("Hello", "stop", 3)


def test_stop_token_ids_respect_min_tokens():
    p = SamplingParams(max_tokens=10, min_tokens=2, stop_token_ids=(13,))
    assert run(p, [13, 10, 13, 11]) == ("!Hello", "stop", 3)


def test_stop_token_id_at_max_tokens_is_stop_not_length():
    assert run(SamplingParams(max_tokens=2, stop_token_ids=(13,)), [10, 13]) == ("Hello", "stop", 2)


def test_stop_string_spanning_three_tokens_is_never_emitted():
    p = SamplingParams(max_tokens=20, stop=("</stop>",))
    checker = StopChecker(p, [EOS], FakeDetokenizer())
    steps = [checker.add_token(t) for t in [10, 14, 15, 16]]
    # " <" is held (could start "</stop>"), "/s" keeps it held, "top>" completes the stop.
    assert steps == [("Hello", None), (" ", None), ("", None), ("", "stop")]


def test_held_text_released_when_it_stops_matching():
    p = SamplingParams(max_tokens=20, stop=("</stop>",))
    checker = StopChecker(p, [EOS], FakeDetokenizer())
    steps = [checker.add_token(t) for t in [14, 15, 17]]
    assert steps == [(" ", None), ("", None), ("</s tail", None)]


def test_held_text_is_flushed_at_length_and_at_eos():
    p = SamplingParams(max_tokens=2, stop=("</stop>",))
    assert run(p, [10, 14]) == ("Hello <", "length", 2)
    p = SamplingParams(max_tokens=9, stop=("</stop>",))
    assert run(p, [10, 14, 15, EOS]) == ("Hello </s", "stop", 4)


def test_stop_string_inside_one_token_cuts_the_token_text():
    p = SamplingParams(max_tokens=20, stop=("<END>",))
    assert run(p, [10, 18, 17]) == ("Helloxx", "stop", 2)


def test_stop_string_completed_by_the_last_allowed_token_is_stop():
    p = SamplingParams(max_tokens=3, stop=("<END>",))
    assert run(p, [19, 20, 21]) == ("", "stop", 3)


def test_earliest_of_several_stop_strings_wins():
    p = SamplingParams(max_tokens=20, stop=("yy", "<END>"))
    assert run(p, [18]) == ("xx", "stop", 1)


def test_shorter_stop_inside_a_held_prefix_of_a_longer_one():
    # "</" is held as a prefix of "</stop>" and itself contains the stop string "<".
    p = SamplingParams(max_tokens=20, stop=("</stop>", "/"))
    assert run(p, [22, 23]) == ("abc<", "stop", 2)


def test_stop_strings_ignored_before_min_tokens():
    p = SamplingParams(max_tokens=20, min_tokens=2, stop=("<END>",))
    # token 0 carries a full "<END>" but is before min_tokens: emitted as it is.
    assert run(p, [18, 10, 19, 20, 21]) == ("xx<END>yyHello", "stop", 5)


def test_stop_string_ending_after_min_tokens_counts_even_if_it_began_before():
    p = SamplingParams(max_tokens=20, min_tokens=2, stop=("<END>",))
    assert run(p, [19, 20, 21, 10]) == ("", "stop", 3)


def test_adding_after_finish_raises():
    checker = StopChecker(SamplingParams(max_tokens=1), [EOS], FakeDetokenizer())
    assert checker.add_token(10) == ("Hello", "length")
    with pytest.raises(RequestFinishedError):
        checker.add_token(11)


def test_stopping_token_is_not_sent_to_the_detokenizer():
    detok = FakeDetokenizer()
    checker = StopChecker(SamplingParams(max_tokens=5), [EOS], detok)
    checker.add_token(10)
    checker.add_token(EOS)
    assert detok.seen == [10]
    assert checker.finish_reason == "stop" and checker.num_output_tokens == 2
