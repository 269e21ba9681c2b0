"""JSON grammars' layout (the whitespace they allow) and the bound on runs of digits, checked with llguidance's own
matcher over the tiny GPT-2 tokenizer: no model."""

from __future__ import annotations

import json

import pytest
import torch

from app.engine.sampling.grammar import DIGIT_RUN, Grammars
from app.engine.params import Constraint

OBJECT = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "array", "items": {"type": "string"}}},
}
VALUE = {"a": 1, "b": ["x", "y"]}


@pytest.fixture(scope="module")
def grammars(gpt2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gpt2_dir))
    return tok, Grammars(tok, len(tok), (tok.eos_token_id,))


def accepts(grammars, text: str, schema=OBJECT, whitespace=None) -> bool:
    tok, compiled = grammars
    matcher = compiled.matcher(Constraint("json_schema", json.dumps(schema), whitespace))
    ids = tok.encode(text, add_special_tokens=False)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


@pytest.mark.parametrize(
    "text",
    [
        json.dumps(VALUE, separators=(",", ":")),
        json.dumps(VALUE),
        json.dumps(VALUE, indent=2),
        json.dumps(VALUE, indent=4),
        json.dumps(VALUE, indent="\t"),
        json.dumps({"a": 1, "b": [json.dumps(VALUE)]}, indent=2),  # whitespace inside a string is the string's
        '{\r\n  "a" : 1 ,\r\n  "b" : []\r\n}',
    ],
)
def test_the_layouts_models_write_are_json_the_grammar_allows(grammars, text):
    assert accepts(grammars, text)


@pytest.mark.parametrize(
    "text",
    [
        '{"a":  1, "b": []}',  # two spaces
        '{\n\n  "a": 1, "b": []}',  # a blank line
        "{\n" + " " * 33 + '"a": 1, "b": []}',  # deeper than 32 spaces
        '{\n\t \t"a": 1, "b": []}',  # tabs and spaces mixed
        ' {"a": 1, "b": []}',  # before the value
    ],
)
def test_runs_of_whitespace_are_bounded(grammars, text):
    assert not accepts(grammars, text)


def test_an_empty_whitespace_setting_is_json_dumps_layout(grammars):
    assert accepts(grammars, json.dumps(VALUE), whitespace="")
    assert not accepts(grammars, json.dumps(VALUE, separators=(",", ":")), whitespace="")
    assert not accepts(grammars, json.dumps(VALUE, indent=2), whitespace="")
    assert accepts(grammars, json.dumps(VALUE, indent=2), whitespace=r"\s*")  # a pattern of one's own


def allowed(row, tok) -> set[int]:
    bits = row.current_mask()
    flags = ((bits.view(-1, 1) >> torch.arange(32, dtype=torch.int32)) & 1).view(-1)[: len(tok)]
    return set(torch.nonzero(flags).view(-1).tolist())


def test_a_long_run_of_digits_ends_where_the_grammar_allows_something_else(grammars):
    tok, compiled = grammars
    row = compiled.row(
        Constraint("json_schema", json.dumps({"type": "object", "properties": {"t": {"type": "number"}}}))
    )
    digit = tok.convert_tokens_to_ids("1")
    for token in tok.encode('{"t": 25.', add_special_tokens=False):
        row.advance(token)
    written = 0  # digits since the point
    while written < DIGIT_RUN:  # the grammar allows digits, and so does the bound so far
        assert digit in allowed(row, tok)
        row.advance(digit)
        written += 1
    left = allowed(row, tok)
    assert left and not any(tok.decode([t])[:1].isdigit() for t in left)
    assert tok.convert_tokens_to_ids("}") in left  # the number may end, and must
    for token in tok.encode("}", add_special_tokens=False):
        row.advance(token)
    assert row.ended


def test_digits_a_grammar_requires_are_kept(grammars):
    tok, compiled = grammars
    row = compiled.row(Constraint("regex", "[0-9]{40}x"))
    digit = tok.convert_tokens_to_ids("7")
    for _ in range(DIGIT_RUN + 4):
        row.advance(digit)
    left = allowed(row, tok)
    assert digit in left and all(tok.decode([t])[:1].isdigit() for t in left)


def test_grammar_work_off_the_model_thread_starts_no_openmp_team(grammars):
    """Making a grammar's tables, a row's matcher and its masks (the digit rule included) happens on request threads
    and the grammar thread. A torch operation large enough to run in parallel would give such a thread an OpenMP
    team of its own (more OS threads), and the model thread's forwards then ran 2x slower on 2 cores. Counted here
    as the process's native threads (its OS threads less its Python threads) while a fresh thread holds the work's
    result: no more than before."""
    import os
    import threading

    from app.engine.sampling.grammar import DigitTokens

    tok, compiled = grammars
    torch.zeros(1 << 16).sum()  # this thread's own team exists before counting

    def native() -> int:
        return len(os.listdir("/proc/self/task")) - threading.active_count()

    counts, done, release = [], threading.Event(), threading.Event()

    def work():
        pieces = [str(t).encode() if t % 3 else b"ab" for t in range(1 << 16)]
        DigitTokens(pieces, (1 << 16) // 32)  # a vocabulary as large as SmolLM2's, built anew
        row = compiled.row(Constraint("regex", "[0-9]{40}x"))
        for _ in range(DIGIT_RUN + 2):
            row.current_mask()
            row.advance(tok.convert_tokens_to_ids("7"))
        row.current_mask()  # past DIGIT_RUN: the digit rule's mask
        done.set()
        release.wait()

    before = native()
    worker = threading.Thread(target=work)
    worker.start()
    done.wait()
    counts.append(native())
    release.set()
    worker.join()
    assert counts == [before]
