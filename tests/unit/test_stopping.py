"""Stop strings (``StopStrings``: spanning chunks, the earliest match, holdback) and the stopping criteria
(``StoppingCriteria``: EOS, stop tokens and strings, min_tokens, max_tokens, max_length) of
app/engine/stopping.py, without a model."""

from __future__ import annotations

import pytest

from app.engine.stopping import StopDecision, StoppingCriteria, StopStrings


# ====================================================================================== stop strings ===
class TestStopStrings:
    def test_no_stops(self):
        stops = StopStrings(())
        assert stops.find("anything at all", 0) is None
        assert stops.holdback("anything") == 0

    def test_empty_stop_strings_are_dropped(self):
        assert StopStrings(("", "")).find("abc", 0) is None

    def test_stop_spanning_chunks(self):
        stops = StopStrings(("world",))
        text = "Hello wor"
        assert stops.find(text, 0) is None
        assert stops.holdback(text) == 3  # "wor" may still become "world"
        text += "ld!"  # the chunk that completes it
        assert stops.find(text, 9) == 6  # the text ends before "world"
        assert text[:6] == "Hello "

    def test_stop_split_over_three_chunks(self):
        stops = StopStrings(("\n\nQ:",))
        text = ""
        ends = []
        for chunk in ["Answer", ": 4\n", "\n", "Q", ": next"]:
            before = len(text)
            text += chunk
            ends.append(stops.find(text, before))
        assert ends == [None, None, None, None, 9]
        assert text[:9] == "Answer: 4"

    def test_include_in_output(self):
        stops = StopStrings(("world",), include_in_output=True)
        assert stops.find("Hello world!", 9) == 11  # "Hello world"

    def test_earliest_of_several(self):
        stops = StopStrings(("lazy", "fox", "the"))
        text = "The quick brown fox jumps over the lazy dog"
        assert stops.find(text, 0) == text.index("fox")
        # with include: the end of the earliest match, not of the first listed or the longest
        assert StopStrings(("lazy", "fox", "the"), True).find(text, 0) == text.index("fox") + 3

    def test_earliest_when_both_complete_in_one_chunk(self):
        stops = StopStrings(("cd", "bcdef"))
        assert stops.find("abcdefg", 1) == 1  # "bcdef" starts before "cd"

    def test_only_new_occurrences(self):
        stops = StopStrings(("ab",))
        assert stops.find("ab then more", 6) is None  # already seen before new_from
        assert stops.find("xyzab", 4) == 3  # ends in the new text

    def test_short_stop_in_old_text_is_not_found_again(self):
        stops = StopStrings(("a", "xyz"))
        assert stops.find("abc", 2) is None

    @pytest.mark.parametrize(
        "text,expected",
        [
            ("Hello", 0),
            ("Hello ", 0),
            ("Hello w", 1),
            ("Hello wo", 2),
            ("Hello worl", 4),
            ("w", 1),
            ("", 0),
            ("Hello x", 1),
            ("Hello xyz", 3),
            ("Hello xz", 0),
        ],
    )
    def test_holdback(self, text, expected):
        assert StopStrings(("world", "xyz!")).holdback(text) == expected

    def test_holdback_longest_prefix_of_any_stop(self):
        stops = StopStrings(("abcd", "cdx"))
        assert stops.holdback("..abc") == 3  # "abc" starts "abcd"
        assert stops.holdback("..cd") == 2  # "cd" starts "cdx" (and not "abcd")
        assert stops.holdback("..d") == 0


# ================================================================================ stopping criteria ===
EOS = frozenset({2})


def criteria(**kw) -> StoppingCriteria:
    return StoppingCriteria(eos_token_ids=kw.pop("eos_token_ids", EOS), **kw)


class TestStoppingCriteria:
    def test_continue(self):
        decision = criteria(max_tokens=10)(5, "abc", 2, 1, 10)
        assert decision == StopDecision(False) and not decision.stop

    def test_eos_stops_before_its_text(self):
        decision = criteria(max_tokens=10)(2, "abc</s>", 3, 4, 10)
        assert decision == StopDecision(True, "stop", 3)

    def test_eos_wins_over_length_on_the_last_token(self):
        assert criteria(max_tokens=4)(2, "abc", 3, 4, 10).reason == "stop"

    def test_ignore_eos(self):
        assert not criteria(ignore_eos=True, max_tokens=10)(2, "abc", 3, 4, 10).stop
        assert criteria(ignore_eos=True, max_tokens=4)(2, "abc", 3, 4, 10) == StopDecision(True, "length")

    def test_min_tokens_defers_eos_stop_tokens_and_stop_strings(self):
        c = criteria(min_tokens=3, stop_token_ids=(7,), stop_strings=StopStrings(("zz",)), max_tokens=10)
        assert not c(2, "a", 0, 1, 10).stop
        assert not c(7, "ab", 1, 2, 11).stop
        assert not c(5, "abzz", 2, 2, 11).stop
        assert c(2, "abc", 2, 3, 12) == StopDecision(True, "stop", 2)

    def test_stop_token_ids(self):
        c = criteria(stop_token_ids=(7, 9), max_tokens=10)
        assert c(9, "hello.", 5, 3, 10) == StopDecision(True, "stop", 5)
        included = criteria(stop_token_ids=(7,), stop_strings=StopStrings((), include_in_output=True))
        assert included(7, "hello.", 5, 3, 10) == StopDecision(True, "stop", 6)

    def test_stop_string(self):
        c = criteria(stop_strings=StopStrings(("\n",)), max_tokens=10)
        assert c(5, "one\ntwo", 2, 2, 10) == StopDecision(True, "stop", 3)

    def test_max_tokens(self):
        c = criteria(max_tokens=3)
        assert not c(5, "ab", 1, 2, 10).stop
        assert c(5, "abc", 2, 3, 11) == StopDecision(True, "length")

    def test_max_tokens_zero_or_none(self):
        assert criteria(max_tokens=None)(5, "a", 0, 1000, 1010).stop is False

    def test_max_length(self):
        c = criteria(max_tokens=None, max_length=256)
        assert not c(5, "a", 0, 1, 255).stop
        assert c(5, "ab", 1, 2, 256) == StopDecision(True, "length")

    def test_stop_string_before_min_tokens_does_not_cut_later(self):
        c = criteria(min_tokens=3, stop_strings=StopStrings(("a", "xyz")), max_tokens=10)
        assert not c(5, "a", 0, 1, 10).stop  # ignored: before min_tokens
        assert not c(5, "ab", 1, 2, 10).stop
        assert not c(5, "abc", 2, 3, 10).stop  # "a" is old text, not a new stop
