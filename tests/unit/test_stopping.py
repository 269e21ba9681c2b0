"""Stop strings (``StopStrings``: spanning chunks, the earliest match, holdback), the engine's token-level rules
(``StoppingCriteria.ended_by``: EOS, stop tokens, min_tokens, max_tokens, max_length, a completed output) and the
output side's decision on the text (``text_decision``) of app/engine/output/stopping.py, without a model."""

from __future__ import annotations

import pytest

from app.engine.output.stopping import StopDecision, StoppingCriteria, StopStrings, text_decision


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


class TestEngineRules:
    """The engine's token-level rules: why a token ends its row, on ids alone."""

    def test_continue(self):
        assert criteria(max_tokens=10).ended_by(5, 1, 10) is None

    def test_eos_and_stop_tokens(self):
        c = criteria(stop_token_ids=(7, 9), max_tokens=10)
        assert c.ended_by(2, 4, 10) == "eos" and c.ended_by(9, 3, 10) == "stop_token"

    def test_eos_wins_over_length_and_completion_on_the_last_token(self):
        assert criteria(max_tokens=4).ended_by(2, 4, 10, complete=True) == "eos"

    def test_a_completed_output_is_complete_even_on_its_max_tokens_th_token(self):
        assert criteria(max_tokens=4).ended_by(5, 4, 10, complete=True) == "complete"

    def test_ignore_eos(self):
        assert criteria(ignore_eos=True, max_tokens=10).ended_by(2, 4, 10) is None
        assert criteria(ignore_eos=True, max_tokens=4).ended_by(2, 4, 10) == "length"

    def test_min_tokens_defers_eos_and_stop_tokens(self):
        c = criteria(min_tokens=3, stop_token_ids=(7,), max_tokens=10)
        assert c.ended_by(2, 1, 10) is None and c.ended_by(7, 2, 11) is None
        assert c.ended_by(2, 3, 12) == "eos"

    def test_max_tokens_and_context(self):
        assert criteria(max_tokens=3).ended_by(5, 2, 10) is None
        assert criteria(max_tokens=3).ended_by(5, 3, 11) == "length"
        assert criteria(max_tokens=None).ended_by(5, 1000, 1010) is None
        assert criteria(max_tokens=None, max_length=256).ended_by(5, 1, 255) is None
        assert criteria(max_tokens=None, max_length=256).ended_by(5, 2, 256) == "length"


class TestTextDecision:
    """The output side's decision: the engine's reason and the stop strings, on the text."""

    NONE = StopStrings(())

    def test_continue(self):
        decision = text_decision(None, "abc", 2, 1, self.NONE)
        assert decision == StopDecision(False) and not decision.stop

    def test_eos_stops_before_its_text(self):
        assert text_decision("eos", "abc</s>", 3, 4, self.NONE) == StopDecision(True, "stop", 3)

    def test_stop_token_text_kept_only_when_included(self):
        assert text_decision("stop_token", "hello.", 5, 3, self.NONE) == StopDecision(True, "stop", 5)
        included = StopStrings((), include_in_output=True)
        assert text_decision("stop_token", "hello.", 5, 3, included) == StopDecision(True, "stop", 6)

    def test_stop_string_cuts_and_wins_over_length_and_completion(self):
        stops = StopStrings(("\n",))
        assert text_decision(None, "one\ntwo", 2, 2, stops) == StopDecision(True, "stop", 3)
        assert text_decision("length", "one\ntwo", 2, 2, stops) == StopDecision(True, "stop", 3)
        assert text_decision("complete", "one\ntwo", 2, 2, stops) == StopDecision(True, "stop", 3)

    def test_length_and_complete(self):
        assert text_decision("length", "abc", 2, 3, self.NONE) == StopDecision(True, "length")
        assert text_decision("complete", "{}", 1, 2, self.NONE) == StopDecision(True, "stop")

    def test_stop_strings_wait_for_min_tokens_and_old_text_is_not_found_again(self):
        stops = StopStrings(("a", "xyz"))
        assert not text_decision(None, "a", 0, 1, stops, min_tokens=3).stop  # ignored: before min_tokens
        assert not text_decision(None, "ab", 1, 2, stops, min_tokens=3).stop
        assert not text_decision(None, "abc", 2, 3, stops, min_tokens=3).stop  # "a" is old text, not a new stop
        assert text_decision(None, "abcxyz", 3, 4, stops, min_tokens=3) == StopDecision(True, "stop", 3)
