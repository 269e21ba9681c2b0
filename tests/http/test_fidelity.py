"""Fidelity against independent references: ``model.generate()`` for greedy text, one plain float32 forward's
log-softmax for every logprob, the tokenizer itself for text, offsets and counts. Both tiny models.

The tiny workers are the session's, with the prefix cache on: each test starts with it emptied (``cold``), so its
requests compute their prompts in full whatever ran before; the cached path has a test of its own."""

from __future__ import annotations

import pytest
import torch

from references import continuation, ref_greedy, ref_logprobs

TOL = 1e-4
PROMPTS = ["The capital of France is", "Once upon a time", "Hello world! 東京は 🙂"]


def empty_prefix_cache(client) -> None:
    """Forget the kept prompts of ``client``'s worker (between requests the engine is idle: nothing is held)."""
    cache = client.application.extensions["saker.service"].worker.prefix_cache
    assert cache is not None and cache.held_blocks == 0
    cache.clear_cached()
    assert cache.cached_tokens == 0


@pytest.fixture(autouse=True)
def cold(gpt2_app, llama_app):
    """Each test's path does not depend on which tests ran before: no prompt of an earlier one is kept."""
    for app in (gpt2_app, llama_app):
        empty_prefix_cache(app.test_client())


def post(client, **body):
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.get_json()
    return response.get_json()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_text_and_logprobs_match_references(tiny, reference, prompt):
    client, path, name = tiny
    model, tok = reference(path)
    prompt_ids = tok(prompt).input_ids
    body = post(client, model=name, prompt=prompt, max_tokens=12, temperature=0, logprobs=3)
    assert body["timing"]["cached_prompt_tokens"] == 0  # the whole prompt computed by this request
    choice = body["choices"][0]
    ref_ids = ref_greedy(model, tok, prompt_ids, 12)
    gen_ids = ref_ids[len(prompt_ids) :]
    assert choice["text"] == continuation(tok, prompt_ids, ref_ids)
    assert body["usage"] == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": len(gen_ids),
        "total_tokens": len(prompt_ids) + len(gen_ids),
    }

    lp = ref_logprobs(model, ref_ids)
    logprobs = choice["logprobs"]
    assert len(logprobs["token_logprobs"]) == len(gen_ids)
    for i, token_id in enumerate(gen_ids):
        row = lp[len(prompt_ids) + i - 1]
        assert logprobs["token_logprobs"][i] == pytest.approx(row[token_id].item(), abs=TOL)
        top = logprobs["top_logprobs"][i]
        expected_top = torch.topk(row, 3).values.tolist()
        got = sorted(top.values(), reverse=True)
        assert len(top) in (3, 4)
        assert got[:3] == pytest.approx(expected_top, abs=TOL)
        assert max(top.values()) == pytest.approx(row.max().item(), abs=TOL)
        # greedy: the chosen token is the most likely one
        assert logprobs["token_logprobs"][i] == pytest.approx(row.max().item(), abs=TOL)
    assert "".join(logprobs["tokens"]) == choice["text"]
    offsets = logprobs["text_offset"]
    assert offsets == [sum(len(t) for t in logprobs["tokens"][:i]) for i in range(len(offsets))]


def test_a_prompt_from_the_prefix_cache_answers_as_the_references(tiny, reference):
    """The cached path, explicitly: a prompt of several blocks answered cold (nothing kept), then again with its
    full blocks (all but the one holding its last token) taken from the prefix cache, and then a longer prompt that
    shares them. Every answer equals ``model.generate()`` (tokens) and a plain forward's log-softmax (logprobs)."""
    from app.engine.core.blocks import BLOCK

    client, path, name = tiny
    model, tok = reference(path)
    prompt = "Passage: the office is north of the hallway and the bathroom is east of the bedroom. Question:"
    ids = tok(prompt).input_ids
    assert len(ids) > 2 * BLOCK
    cached = []
    for text in (prompt, prompt, prompt + " where is the office?"):
        text_ids = tok(text).input_ids
        body = post(client, model=name, prompt=text, max_tokens=8, temperature=0, logprobs=1)
        cached.append(body["timing"]["cached_prompt_tokens"])
        want = ref_greedy(model, tok, text_ids, 8)
        choice = body["choices"][0]
        assert choice["text"] == continuation(tok, text_ids, want)
        lp = ref_logprobs(model, want)
        made = want[len(text_ids) :]
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(
            [lp[len(text_ids) - 1 + i, t].item() for i, t in enumerate(made)], abs=TOL
        )
    full = (len(ids) - 1) // BLOCK * BLOCK
    assert cached[0] == 0 and cached[1] == full > 0 and cached[2] >= full


@pytest.mark.parametrize("prompt", PROMPTS)
def test_echo_scoring_of_token_id_prompts(tiny, reference, prompt):
    client, path, name = tiny
    model, tok = reference(path)
    ids = tok(prompt).input_ids
    body = post(client, model=name, prompt=ids, echo=True, max_tokens=0, logprobs=2, temperature=0)
    choice = body["choices"][0]
    lp = ref_logprobs(model, ids)
    logprobs = choice["logprobs"]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert len(logprobs["token_logprobs"]) == len(ids)
    for i in range(1, len(ids)):
        assert logprobs["token_logprobs"][i] == pytest.approx(lp[i - 1, ids[i]].item(), abs=TOL)
        top = logprobs["top_logprobs"][i]
        assert sorted(top.values(), reverse=True)[:2] == pytest.approx(
            torch.topk(lp[i - 1], 2).values.tolist(), abs=TOL
        )
        # the 2 best and the prompt's own token when it is not among them, each under a key of its own: a candidate
        # whose key another took would be missing (a dict holds distinct keys, so counting them is the check)
        best = torch.topk(lp[i - 1], 2).indices.tolist()
        assert len(top) == (2 if ids[i] in best else 3), (i, top)
    assert choice["text"] == tok.decode(ids, skip_special_tokens=True)
    assert "".join(logprobs["tokens"]) == choice["text"]
    assert "\ufffd" not in choice["text"]
    offsets = logprobs["text_offset"]
    for token, offset in zip(logprobs["tokens"], offsets):
        assert choice["text"][offset : offset + len(token)] == token
    assert body["usage"]["prompt_tokens"] == len(ids) and body["usage"]["completion_tokens"] == 0


def test_echo_max_tokens_one_adds_exactly_one_token(tiny, reference):
    client, path, name = tiny
    model, tok = reference(path)
    ids = tok("The capital of France is").input_ids
    body = post(client, model=name, prompt=ids, echo=True, max_tokens=1, logprobs=0, temperature=0)
    logprobs = body["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(ids) + 1
    ref_ids = ref_greedy(model, tok, ids, 1)
    assert body["choices"][0]["text"] == tok.decode(ref_ids, skip_special_tokens=True)
    lp = ref_logprobs(model, ref_ids)
    assert logprobs["token_logprobs"][-1] == pytest.approx(lp[len(ids) - 1, ref_ids[-1]].item(), abs=TOL)
    # logprobs: 0 -> each top_logprobs entry holds just the chosen token
    assert all(len(t) == 1 for t in logprobs["top_logprobs"][1:])
    assert body["usage"]["completion_tokens"] == 1


def test_multibyte_characters_belong_to_the_token_that_completes_them(llama_client, reference, llama_dir):
    model, tok = reference(llama_dir)
    text = "東京 🙂"
    ids = tok(text).input_ids
    pieces = tok.convert_ids_to_tokens(ids)
    assert sum(p.startswith("<0x") for p in pieces) >= 6, "fixture must split these characters into bytes"
    body = post(llama_client, model="tiny-llama", prompt=text, echo=True, max_tokens=0, logprobs=1)
    tokens = body["choices"][0]["logprobs"]["tokens"]
    assert "".join(tokens) == body["choices"][0]["text"] == text
    assert all("\ufffd" not in t for t in tokens)
    # a byte token that does not complete its character contributes ""
    for piece, token in zip(pieces, tokens):
        if piece in ("<0xE6>", "<0x9D>", "<0xF0>", "<0x9F>", "<0x99>"):
            assert token == ""
    assert "東" in tokens and "🙂" in tokens
    # the chosen token is listed under its token string, or in bytes: form where that string is empty
    lps = body["choices"][0]["logprobs"]
    for piece, token, top in zip(pieces[1:], tokens[1:], lps["top_logprobs"][1:]):
        if token:
            assert token in top
        else:
            assert any(key.startswith("bytes:\\x") for key in top)
            if piece.startswith("<0x"):
                assert f"bytes:\\x{piece[3:5].lower()}" in top


def test_top_logprobs_keys_are_distinct_and_complete(tiny):
    client, path, name = tiny
    body = post(client, model=name, prompt="東京 Hello", max_tokens=8, temperature=0, logprobs=10, echo=True)
    for top in body["choices"][0]["logprobs"]["top_logprobs"][1:]:
        assert len(top) in (10, 11)  # dict keys are unique by construction: no candidate was lost


@pytest.mark.parametrize("model_kind", ["gpt2", "llama"])
def test_stop_string_spanning_tokens(request, reference, model_kind):
    client = request.getfixturevalue(f"{model_kind}_client")
    name = f"tiny-{model_kind}"
    base = post(client, model=name, prompt="Once upon a time", max_tokens=16, temperature=0, logprobs=0)
    tokens = base["choices"][0]["logprobs"]["tokens"]
    text = base["choices"][0]["text"]
    # a stop string made of the end of one token and the start of the next
    boundary = None
    for i in range(2, len(tokens) - 1):
        if (
            tokens[i]
            and tokens[i + 1]
            and text.find(tokens[i][-1] + tokens[i + 1][0]) == sum(len(t) for t in tokens[: i + 1]) - 1
        ):
            boundary = i
            break
    assert boundary is not None, tokens
    stop = tokens[boundary][-1] + tokens[boundary + 1][0]
    cut = text.find(stop)
    body = post(client, model=name, prompt="Once upon a time", max_tokens=16, temperature=0, logprobs=0, stop=[stop])
    choice = body["choices"][0]
    assert choice["text"] == text[:cut]
    assert choice["finish_reason"] == "stop"
    assert "".join(choice["logprobs"]["tokens"]) == choice["text"]
    assert body["usage"]["completion_tokens"] == boundary + 2
    inc = post(
        client,
        model=name,
        prompt="Once upon a time",
        max_tokens=16,
        temperature=0,
        stop=stop,
        include_stop_str_in_output=True,
    )
    assert inc["choices"][0]["text"] == text[: cut + len(stop)]


def test_stop_only_cuts_sampled_output(tiny):
    client, _, name = tiny
    free = post(client, model=name, prompt="Hello", max_tokens=20, temperature=1.0, seed=7, n=3)
    texts = [c["text"] for c in free["choices"]]
    stop = next((t[3:5] for t in texts if len(t) > 6 and t[3:5].strip()), None)
    assert stop
    stopped = post(client, model=name, prompt="Hello", max_tokens=20, temperature=1.0, seed=7, n=3, stop=stop)
    for full, choice in zip(texts, stopped["choices"]):
        at = full.find(stop)
        assert choice["text"] == (full if at < 0 else full[:at])


def test_seed_reproduces_and_differs(tiny):
    client, _, name = tiny
    a = post(client, model=name, prompt="Hello", max_tokens=10, temperature=1.0, seed=123, logprobs=1)
    b = post(client, model=name, prompt="Hello", max_tokens=10, temperature=1.0, seed=123, logprobs=1)
    c = post(client, model=name, prompt="Hello", max_tokens=10, temperature=1.0, seed=124, logprobs=1)
    assert a["choices"] == b["choices"]
    assert a["choices"][0]["text"] != c["choices"][0]["text"]


def test_n_best_of_counts_indexes_and_ordering(tiny):
    client, _, name = tiny
    prompts = ["Hello", "Once upon"]
    body = post(client, model=name, prompt=prompts, max_tokens=6, temperature=1.0, seed=5, n=2)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    every = post(client, model=name, prompt=prompts, max_tokens=6, temperature=1.0, seed=5, n=4, logprobs=0)
    best = post(client, model=name, prompt=prompts, max_tokens=6, temperature=1.0, seed=5, n=2, best_of=4, logprobs=0)
    assert [c["index"] for c in best["choices"]] == [0, 1, 2, 3]

    def mean(choice):
        lps = choice["logprobs"]["token_logprobs"]
        return sum(lps) / len(lps)

    for p in range(2):
        candidates = every["choices"][p * 4 : (p + 1) * 4]
        expected = sorted(candidates, key=lambda c: -mean(c))[:2]
        got = best["choices"][p * 2 : (p + 1) * 2]
        assert [c["text"] for c in got] == [c["text"] for c in expected]
        assert mean(got[0]) >= mean(got[1])
    # usage counts every candidate that was generated
    assert best["usage"]["completion_tokens"] == every["usage"]["completion_tokens"]


def test_eos_counts_and_contributes_empty_token(tiny, reference):
    client, path, name = tiny
    _, tok = reference(path)
    eos = tok.eos_token_id
    body = post(client, model=name, prompt="Hello", max_tokens=5, temperature=0, logprobs=1, logit_bias={str(eos): 100})
    choice = body["choices"][0]
    assert choice["text"] == "" and choice["finish_reason"] == "stop"
    assert choice["logprobs"]["tokens"] == [""]
    assert body["usage"]["completion_tokens"] == 1
    # the reported logprob is raw: the +100 bias shaped the choice, not the number
    assert choice["logprobs"]["token_logprobs"][0] < -0.5
    ignored = post(
        client, model=name, prompt="Hello", max_tokens=5, temperature=0, ignore_eos=True, logit_bias={str(eos): 100}
    )
    assert ignored["choices"][0]["finish_reason"] == "length"
    assert ignored["usage"]["completion_tokens"] == 5
    delayed = post(
        client, model=name, prompt="Hello", max_tokens=8, temperature=0, min_tokens=3, logit_bias={str(eos): 100}
    )
    assert delayed["usage"]["completion_tokens"] == 4
    assert delayed["choices"][0]["finish_reason"] == "stop"


def test_stop_token_ids(tiny, reference):
    client, path, name = tiny
    model, tok = reference(path)
    ids = tok("Once upon a time").input_ids
    gen = ref_greedy(model, tok, ids, 6)[len(ids) :]
    target = gen[2]
    first = gen.index(target)
    body = post(client, model=name, prompt="Once upon a time", max_tokens=6, temperature=0, stop_token_ids=[target])
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == first + 1
    assert body["choices"][0]["text"] == continuation(tok, ids, ids + gen[:first])


def test_bias_and_penalties_shape_sampling_but_not_logprobs(tiny, reference):
    client, path, name = tiny
    model, tok = reference(path)
    ids = tok("Hello").input_ids
    forced = tok(" the", add_special_tokens=False).input_ids[-1]
    body = post(
        client,
        model=name,
        prompt="Hello",
        max_tokens=4,
        temperature=0,
        logprobs=0,
        logit_bias={str(forced): 100},
        repetition_penalty=1.3,
        frequency_penalty=0.5,
        presence_penalty=0.5,
    )
    lps = body["choices"][0]["logprobs"]["token_logprobs"]
    all_ids = ids + [forced] * 4
    lp = ref_logprobs(model, all_ids)
    expected = [lp[len(ids) + i - 1, forced].item() for i in range(4)]
    assert lps == pytest.approx(expected, abs=TOL)
    assert body["choices"][0]["text"] == continuation(tok, ids, all_ids)


def test_allowed_token_ids_and_processed_logprobs_against_a_plain_forward(tiny, reference):
    """allowed_token_ids: greedy picks the argmax among the allowed ids of a plain forward's logits, and the
    reported logprobs stay the plain forward's (raw, the default). logprobs_mode processed_logprobs: they are
    log-softmax of what the row chose from (here the logits within the allowed ids)."""
    client, path, name = tiny
    model, tok = reference(path)
    ids = tok("Hello").input_ids
    allowed = [5, 17, 42, 99, 123]
    body = post(
        client,
        model=name,
        prompt=ids,
        max_tokens=5,
        temperature=0,
        logprobs=1,
        allowed_token_ids=allowed,
        ignore_eos=True,
    )
    got = body["choices"][0]["logprobs"]
    seq = list(ids)
    for step in range(5):
        logits = model(torch.tensor([seq])).logits[0, -1].float().detach()
        token = allowed[int(logits[allowed].argmax())]
        assert got["token_logprobs"][step] == pytest.approx(torch.log_softmax(logits, -1)[token].item(), abs=TOL)
        seq.append(token)
    assert body["choices"][0]["text"] == continuation(tok, ids, seq)
    processed = post(
        client,
        model=name,
        prompt=ids,
        max_tokens=5,
        temperature=0,
        logprobs=1,
        allowed_token_ids=allowed,
        logprobs_mode="processed_logprobs",
        ignore_eos=True,
    )
    assert processed["choices"][0]["text"] == body["choices"][0]["text"]  # the same tokens
    mask = torch.full((model.config.vocab_size,), float("-inf"))
    mask[allowed] = 0.0
    got = processed["choices"][0]["logprobs"]
    for step in range(5):
        logits = model(torch.tensor([seq[: len(ids) + step]])).logits[0, -1].float().detach()
        within = torch.log_softmax(logits + mask, -1)  # greedy: no temperature, only the mask
        assert got["token_logprobs"][step] == pytest.approx(within[seq[len(ids) + step]].item(), abs=TOL)
        assert sorted(got["top_logprobs"][step].values(), reverse=True) == pytest.approx(
            sorted({within[seq[len(ids) + step]].item(), within.max().item()}, reverse=True), abs=TOL
        )


def test_empty_prompt_is_conditioned_on_the_start_token(tiny, reference):
    """prompt "" continues from BOS (the tiny Llama) or <|endoftext|> (the tiny GPT-2, which has no BOS): the text
    is generate()'s from that one token, and usage counts it as the prompt."""
    client, path, name = tiny
    model, tok = reference(path)
    start = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    full = ref_greedy(model, tok, [start], 6)
    body = post(client, model=name, prompt="", max_tokens=6, temperature=0, ignore_eos=True)
    assert body["choices"][0]["text"] == continuation(tok, [start], full)
    assert body["usage"]["prompt_tokens"] == 1


def test_max_tokens_null_runs_to_the_context(tiny, reference):
    client, path, name = tiny
    _, tok = reference(path)
    ids = tok("Hello").input_ids
    body = post(client, model=name, prompt="Hello", max_tokens=None, temperature=0, ignore_eos=True)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["total_tokens"] == 256
    assert body["usage"]["prompt_tokens"] == len(ids)


def test_echo_without_logprobs_and_lists_of_prompts(tiny, reference):
    client, path, name = tiny
    _, tok = reference(path)
    body = post(client, model=name, prompt=["Hello", "Once"], max_tokens=0, echo=True)
    assert body["choices"][0]["text"] == tok.decode(tok("Hello").input_ids, skip_special_tokens=True)
    assert body["choices"][1]["text"] == tok.decode(tok("Once").input_ids, skip_special_tokens=True)
    assert body["choices"][0]["logprobs"] is None
    assert body["usage"]["prompt_tokens"] == len(tok("Hello").input_ids) + len(tok("Once").input_ids)
    ids = post(client, model=name, prompt=[[5, 6, 7], [8, 9]], max_tokens=0, echo=True)
    assert [c["text"] for c in ids["choices"]] == [tok.decode([5, 6, 7]), tok.decode([8, 9])]
    assert ids["usage"]["prompt_tokens"] == 5
