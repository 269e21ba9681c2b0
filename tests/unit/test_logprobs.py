"""Logprob keys and values (app/engine/output/token_text.py, app/engine/sampling/logprobs.py): a token's bytes on a
byte-level tokenizer, the ``bytes:`` key format, and the raw float32 log-softmax. The keys of candidates on
sentencepiece are in test_detokenize.py."""

from __future__ import annotations

import codecs
import math

import pytest
import torch

from app.engine.output.detokenize import IncrementalDetokenizer
from app.engine.output.token_text import bytes_key, is_byte_level, token_bytes
from app.engine.sampling.logprobs import raw_logprobs
from test_detokenize import TEXTS


@pytest.fixture(scope="module")
def gpt2_tok(gpt2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gpt2_dir))


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
