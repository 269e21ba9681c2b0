"""The incremental detokenizer (app/engine/output/detokenize.py): fake tokenizers (byte-level pieces, a
sentencepiece-like decoder), then the real tiny GPT-2 byte-level BPE and the tiny Llama sentencepiece with byte
fallback, against the tokenizers' own decode; the top_logprobs keys of candidates (app/engine/output/token_text.py)
with the Llama one."""

from __future__ import annotations

import codecs

import pytest

from app.engine.output.detokenize import IncrementalDetokenizer
from app.engine.output.token_text import candidate_keys, is_byte_level, token_bytes


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
        candidate texts (one by one and all at once) are the same with the table and without it."""
        import random

        rng = random.Random(seed)
        tok = gpt2_tok
        vocab = len(tok)
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 6))]
        fast, slow = IncrementalDetokenizer(tok, prompt), IncrementalDetokenizer(tok, prompt)
        slow._pieces = None
        for _ in range(40):
            candidates = [rng.randrange(vocab) for _ in range(4)]
            expected = [slow.candidate_text(c) for c in candidates]
            assert [fast.candidate_text(c) for c in candidates] == expected
            assert fast.candidate_texts(candidates) == expected  # all at once (the table's one lookup per id)
            assert slow.candidate_texts(candidates) == expected
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
