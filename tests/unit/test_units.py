"""Unit tests without a model: stop strings and stopping criteria, the incremental detokenizer (a fake tokenizer
and the real tiny Llama sentencepiece tokenizer with byte fallback) and the top_logprobs keys. The sampler's
tests are in test_sampler.py."""

from __future__ import annotations

import codecs
import math

import pytest
import torch

from app.engine.detokenize import IncrementalDetokenizer
from app.engine.logprobs import bytes_key, candidate_keys, is_byte_level, raw_logprobs, token_bytes
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


# ================================================================================= detokenizer (fake) ===
class ByteTokenizer:
    """Each id stands for fixed bytes; decode like a byte-level BPE (invalid UTF-8 -> U+FFFD)."""

    PIECES = {
        0: b"Hello",
        1: b" ",
        2: b"\xe6",
        3: b"\x9d",
        4: b"\xb1",
        5: b"!",
        6: b"\xf0",
        7: b"\x9f",
        8: b"\x99",
        9: b"\x82",
        10: b" world",
        11: b"<eos>",
    }
    SPECIAL = {11}

    def decode(self, ids, skip_special_tokens=True):
        data = b"".join(self.PIECES[i] for i in ids if not (skip_special_tokens and i in self.SPECIAL))
        return data.decode("utf-8", errors="replace")


class SentencePieceLike:
    """Decoding drops the leading space of the first piece, as sentencepiece decoders do."""

    PIECES = {0: "\u2581Hello", 1: "\u2581world", 2: "!", 3: "\u2581again"}

    def decode(self, ids, skip_special_tokens=True):
        text = "".join(self.PIECES[i] for i in ids).replace("\u2581", " ")
        return text[1:] if text.startswith(" ") else text


class TestIncrementalDetokenizerFake:
    def test_multibyte_held_until_complete(self):
        detok = IncrementalDetokenizer(ByteTokenizer(), [0])
        deltas = [detok.add(i) for i in [1, 2, 3, 4, 5, 1, 6, 7, 8, 9]]
        assert deltas == [" ", "", "", "\u6771", "!", " ", "", "", "", "\U0001f642"]  # 東, 🙂
        assert detok.flush() == ""

    def test_leading_space_kept_in_context(self):
        tok = SentencePieceLike()
        detok = IncrementalDetokenizer(tok, [0])
        deltas = [detok.add(i) for i in [1, 2, 3]]
        assert deltas == [" world", "!", " again"]
        assert "".join(deltas) == tok.decode([0, 1, 2, 3])[len(tok.decode([0])) :]
        assert tok.decode([1]) == "world"  # why decoding new ids alone would be wrong

    def test_no_prompt(self):
        detok = IncrementalDetokenizer(SentencePieceLike())
        assert [detok.add(i) for i in [0, 1]] == ["Hello", " world"]

    def test_flush_releases_an_incomplete_character(self):
        detok = IncrementalDetokenizer(ByteTokenizer(), [0])
        assert [detok.add(i) for i in [6, 7]] == ["", ""]
        tail = detok.flush()
        assert tail and set(tail) == {"\ufffd"}
        assert detok.flush() == ""

    def test_special_tokens(self):
        skipping = IncrementalDetokenizer(ByteTokenizer(), [0])
        assert skipping.add(11) == "" and skipping.add(10) == " world"
        keeping = IncrementalDetokenizer(ByteTokenizer(), [0], skip_special_tokens=False)
        assert keeping.add(11) == "<eos>"

    def test_long_sequences_keep_context_window(self):
        tok = ByteTokenizer()
        ids = [0] + [1, 10, 5, 2, 3, 4] * 10
        detok = IncrementalDetokenizer(tok, ids[:1])
        out = "".join(detok.add(i) for i in ids[1:]) + detok.flush()
        assert out == tok.decode(ids)[len(tok.decode(ids[:1])) :]

    def test_candidate_text(self):
        detok = IncrementalDetokenizer(ByteTokenizer(), [0])
        assert detok.candidate_text(5) == "!"
        assert detok.candidate_text(2) is None  # would start an incomplete character
        detok.add(2)
        detok.add(3)
        assert detok.candidate_text(4) == "\u6771"  # completes 東
        assert detok.candidate_text(2) is None  # E6 9D E6: still no complete character
        assert detok.add(4) == "\u6771"
        assert detok.candidate_text(10) == " world"

    def test_candidate_text_in_context(self):
        detok = IncrementalDetokenizer(SentencePieceLike(), [0])
        assert detok.candidate_text(1) == " world"
        assert detok.ids == [0]  # looking does not add


# ============================================================ detokenizer and keys (real tokenizers) ===
@pytest.fixture(scope="module")
def llama_tok(llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(llama_dir))


@pytest.fixture(scope="module")
def gpt2_tok(gpt2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gpt2_dir))


def piece_bytes(tok, token_id: int) -> bytes:
    """Reference bytes of a sentencepiece piece, from the piece itself ('<0xNN>' or text with '▁' = space)."""
    piece = tok.convert_ids_to_tokens(token_id)
    if piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:
        return bytes([int(piece[3:5], 16)])
    return piece.replace("\u2581", " ").encode("utf-8")


def expected_deltas(tok, ids: list[int]) -> list[str]:
    """What each token completes, by a strict incremental UTF-8 decode of the pieces' bytes."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    return [decoder.decode(piece_bytes(tok, i)) for i in ids]


TEXTS = [
    "Hello \u6771\u4eac \U0001f642!",
    "\u6771\u4eac\u306f\u65e5\u672c",
    " \U0001f642\U0001f680 Paris.",
    "The capital of France is Paris.",
]


class TestIncrementalDetokenizerByteLevel:
    """GPT-2's byte-level decoder: a token after whole text adds its own text (the piece table); the general
    path (decode in context) must agree, and both must agree with the tokenizer's own decode."""

    @pytest.mark.parametrize("text", TEXTS)
    def test_deltas_match_full_decode(self, gpt2_tok, text):
        tok = gpt2_tok
        prompt = tok.encode("The capital")
        ids = tok.encode(text, add_special_tokens=False)
        detok = IncrementalDetokenizer(tok, prompt)
        assert detok._pieces is not None  # the table is in use for this tokenizer
        deltas = [detok.add(i) for i in ids]
        assert detok.flush() == ""
        full = tok.decode(prompt + ids, skip_special_tokens=True)
        assert "".join(deltas) == full[len(tok.decode(prompt, skip_special_tokens=True)) :]
        assert all("\ufffd" not in d for d in deltas)

    @pytest.mark.parametrize("seed", range(20))
    def test_piece_table_agrees_with_decoding_in_context(self, gpt2_tok, seed):
        """Random ids (stray bytes, special tokens, incomplete characters included): deltas, flushes and
        candidate texts are the same with the table and without it."""
        import random

        rng = random.Random(seed)
        tok = gpt2_tok
        vocab = len(tok)
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 6))]
        fast, slow = IncrementalDetokenizer(tok, prompt), IncrementalDetokenizer(tok, prompt)
        slow._pieces = None
        for _ in range(40):
            candidates = [rng.randrange(vocab) for _ in range(4)]
            assert [fast.candidate_text(c) for c in candidates] == [slow.candidate_text(c) for c in candidates]
            token = rng.randrange(vocab)
            assert fast.add(token) == slow.add(token)
            if rng.random() < 0.05:
                assert fast.flush() == slow.flush()


class TestIncrementalDetokenizerLlama:
    @pytest.mark.parametrize("text", TEXTS)
    def test_deltas_match_full_decode(self, llama_tok, text):
        tok = llama_tok
        prompt = tok.encode("The capital")  # BOS + pieces
        ids = tok.encode(text, add_special_tokens=False)
        detok = IncrementalDetokenizer(tok, prompt)
        deltas = [detok.add(i) for i in ids]
        assert detok.flush() == ""
        full = tok.decode(prompt + ids, skip_special_tokens=True)
        assert "".join(deltas) == full[len(tok.decode(prompt, skip_special_tokens=True)) :]
        assert deltas == expected_deltas(tok, ids)
        assert all("\ufffd" not in d for d in deltas)

    def test_multibyte_characters_span_byte_tokens(self, llama_tok):
        # the fixture's sentencepiece has no piece for these: they must come as <0xNN> byte tokens
        ids = llama_tok.encode("\u6771\u4eac\U0001f642", add_special_tokens=False)
        pieces = llama_tok.convert_ids_to_tokens(ids)
        assert sum(p.startswith("<0x") for p in pieces) == 3 + 3 + 4
        detok = IncrementalDetokenizer(llama_tok, llama_tok.encode("Hi"))
        deltas = [detok.add(i) for i in ids]
        assert [d for d in deltas if d and d != " "] == ["\u6771", "\u4eac", "\U0001f642"]
        assert deltas.count("") == 3 + 3 + 4 - 3  # every byte but the last of each character

    def test_candidate_text_incomplete_is_none(self, llama_tok):
        tok = llama_tok
        e6, x9d, xb1 = tok.convert_tokens_to_ids(["<0xE6>", "<0x9D>", "<0xB1>"])
        detok = IncrementalDetokenizer(tok, tok.encode("Hello"))
        assert detok.candidate_text(e6) is None
        assert detok.add(e6) == ""
        assert detok.candidate_text(x9d) is None
        detok.add(x9d)
        assert detok.candidate_text(xb1) == "\u6771"
        assert detok.add(xb1) == "\u6771"

    def test_stray_byte_after_a_character_reads_as_one_replacement(self, llama_tok):
        tok = llama_tok
        ids = tok.convert_tokens_to_ids(["<0xE6>", "<0x9D>", "<0xB1>", "<0xB1>"])
        detok = IncrementalDetokenizer(tok, tok.encode("Hello"))
        out = "".join(detok.add(i) for i in ids) + detok.flush()
        assert out == "\u6771\ufffd"

    def test_candidate_keys_distinct_and_bytes_form(self, llama_tok):
        tok = llama_tok
        a, byte_a, e6, eos = tok.convert_tokens_to_ids(["a", "<0x61>", "<0xE6>", "</s>"])
        hello = tok.convert_tokens_to_ids("\u2581Hello")
        detok = IncrementalDetokenizer(tok, tok.encode("The capital"))
        keys = candidate_keys(tok, detok, [a, byte_a, e6, hello, eos], byte_level=False)
        assert keys[0] == "a"
        assert keys[1] == "bytes:\\x61"  # same text as "a": its bytes keep it apart
        assert keys[2] == "bytes:\\xe6"  # an incomplete character
        assert keys[3] == " Hello"
        assert keys[4] and keys[4] not in keys[:4]  # EOS decodes to "" when skipped
        assert len(set(keys)) == len(keys)

    def test_candidate_keys_complete_a_held_character(self, llama_tok):
        tok = llama_tok
        e6, x9d, xb1, x9e = tok.convert_tokens_to_ids(["<0xE6>", "<0x9D>", "<0xB1>", "<0x9E>"])
        detok = IncrementalDetokenizer(tok, tok.encode("The capital"))
        detok.add(e6)
        detok.add(x9d)
        keys = candidate_keys(tok, detok, [xb1, x9e], byte_level=False)
        assert keys == [b"\xe6\x9d\xb1".decode(), b"\xe6\x9d\x9e".decode()]  # each completes its own character

    def test_token_bytes_sentencepiece(self, llama_tok):
        tok = llama_tok
        assert token_bytes(tok, tok.convert_tokens_to_ids("<0xE6>")) == b"\xe6"
        assert token_bytes(tok, tok.convert_tokens_to_ids("\u2581Hello")) == b" Hello"
        assert not is_byte_level(tok)


class TestByteLevelKeys:
    def test_token_bytes_byte_level(self, gpt2_tok):
        tok = gpt2_tok
        assert is_byte_level(tok)
        ids = tok.encode(" Paris")
        joined = b"".join(token_bytes(tok, i, byte_level=True) for i in ids)
        assert joined == " Paris".encode()
        ids = tok.encode("\u6771\u4eac")
        assert b"".join(token_bytes(tok, i, byte_level=True) for i in ids) == "\u6771\u4eac".encode()

    def test_detokenizer_byte_level(self, gpt2_tok):
        tok = gpt2_tok
        prompt = tok.encode("Hello")
        for text in TEXTS:
            ids = tok.encode(text)
            detok = IncrementalDetokenizer(tok, prompt)
            deltas = [detok.add(i) for i in ids]
            assert "".join(deltas) == text
            decoder = codecs.getincrementaldecoder("utf-8")()
            assert deltas == [decoder.decode(token_bytes(tok, i, byte_level=True)) for i in ids]


def test_bytes_key_format():
    assert bytes_key(b"\xe6\x9d") == "bytes:\\xe6\\x9d"
    assert bytes_key(b" a") == "bytes:\\x20\\x61"


def test_raw_logprobs_is_float32_log_softmax():
    logits = torch.tensor([[1.0, 2.0, 3.0]], dtype=torch.float16)
    out = raw_logprobs(logits)
    assert out.dtype == torch.float32
    denom = math.log(math.exp(1) + math.exp(2) + math.exp(3))
    assert torch.allclose(out, torch.tensor([[1 - denom, 2 - denom, 3 - denom]]), atol=1e-6)


def test_system_fingerprint_is_stable_and_follows_weights_and_settings():
    from types import SimpleNamespace

    from app.service import CompletionService
    from app.settings import Settings

    info = SimpleNamespace(source="/models/a", adapters=(), vocab_size=400, context_length=256)
    worker = SimpleNamespace(require_ready=lambda: info)

    def fingerprint(settings, source="/models/a"):
        info.source = source
        return CompletionService(settings, worker).system_fingerprint

    base = fingerprint(Settings(dtype="float32"))
    assert base.startswith("fp_") and base == fingerprint(Settings(dtype="float32"))
    assert fingerprint(Settings(dtype="bfloat16")) != base
    assert fingerprint(Settings(dtype="float32"), source="/models/b") != base
