"""The web page at / (app/ui/) in a real browser: Debian's ``chromium``, headless, driven by Playwright (with the
system browser: ``playwright install`` is never run), against a real gunicorn serving the embedded SmolLM2 with an
API key, under the page's own strict Content-Security-Policy.

- a greedy completion on the page shows the API's text and, token by token, its exact logprobs and top
  alternatives (read from the token details that hover and keyboard focus open);
- a stream renders while it is generated: decode steps are held by the gate of tests/stepped_wsgi.py and let
  through one, so the page is seen with the first tokens and the stream still open, then the rest arrives (a
  MutationObserver records every state the answer went through), and nothing below the answer moves;
- the live view moves while requests run (held by the same gate, then let go);
- a wrong key shows the server's 401 message; echo scoring and the phone layout;
- every request the page makes goes to the server's own origin, no script error, no policy violation.

Waits are on conditions in the page, never on time. Each state is saved as a PNG: into a temporary folder, or
into ``docs/ui/`` (the screenshots the docs show) with ``UI_SCREENSHOTS=docs/ui``. Without chromium (``apt-get
install chromium``; .ci/run installs it) or Playwright (requirements-dev.txt) the module is skipped, saying so.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pytest
import requests

from conftest import make_settings
from servers import ROOT, Gunicorn

# slow: a real server; the first test also waits for its start (the embedded model loads in minutes on a busy
# machine, converted and packed at the first start)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None:
    pytest.skip(
        "Debian's chromium is not installed (apt-get install chromium; .ci/run installs it): "
        "the web page's browser tests need it",
        allow_module_level=True,
    )
sync_api = pytest.importorskip(
    "playwright.sync_api", reason="playwright is not installed (pip install -r requirements-dev.txt)"
)

KEY = "page-test-key"
MODEL = "SmolLM2-135M-Instruct"
AUTH = {"Authorization": f"Bearer {KEY}"}
WAIT_MS = 300_000  # conditions, not sleeps: this only bounds a hang (a busy 2-core machine decodes slowly)
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name three colours of the rainbow."}]


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    """Where the screenshots go: docs/ui/ with UI_SCREENSHOTS=docs/ui, else a temporary folder."""
    chosen = os.environ.get("UI_SCREENSHOTS")
    folder = (ROOT / chosen) if chosen else tmp_path_factory.mktemp("page-screenshots")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture(scope="module")
def gate(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("page-step-gate")


@pytest.fixture(scope="module")
def server(saker_cache, gate):
    from app.engine.model.loader import ensure_default_model

    ensure_default_model(make_settings(cache_dir=str(saker_cache)))
    srv = Gunicorn(
        {
            "SAKER_CACHE_DIR": str(saker_cache),
            "SAKER_THREADS": "12",
            "SAKER_API_KEYS": KEY,
            "TEST_STEP_GATE": str(gate),
        },
        args=("--pythonpath", "tests"),
        app="stepped_wsgi:app",
    )
    try:
        srv.wait_ready(timeout=900)  # the first start converts and packs the model (minutes on a busy machine)
        yield srv
    finally:
        (gate / "hold").unlink(missing_ok=True)
        srv.stop()


@pytest.fixture()
def steps(gate):
    """The decode steps of the server (tests/stepped_wsgi.py): ``hold()`` makes each wait for a permit,
    ``permit()`` lets one through, ``release()`` lets them all run."""

    class Steps:
        given = 0

        def hold(self):
            (gate / "hold").touch()

        def permit(self):
            self.given += 1
            (gate / f"permit-{self.given:06d}").touch()

        def release(self):
            (gate / "hold").unlink(missing_ok=True)
            for permit in gate.glob("permit-*"):
                permit.unlink(missing_ok=True)

    steps = Steps()
    yield steps
    steps.release()


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as playwright:
        # chromium's sandbox refuses root and needs user namespaces a container may lack; the page is our own.
        # A container's small /dev/shm is not enough for its renderer.
        args = ["--no-sandbox", "--disable-dev-shm-usage"]
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=args)
        yield launched
        launched.close()


class Watched:
    """A page and what it did: every request's URL, error answers, console errors, script errors, policy
    violations."""

    def __init__(self, page, origin: str):
        self.page, self.origin = page, origin
        self.urls: list[str] = []
        self.failed: list[tuple[str, int]] = []
        self.console_errors: list[str] = []
        self.page_errors: list[str] = []
        page.on("request", lambda request: self.urls.append(request.url))
        page.on(
            "response",
            lambda response: response.status >= 400
            and self.failed.append((response.url.removeprefix(origin), response.status)),
        )
        # an error answer is also a console line ("Failed to load resource"): those are checked as self.failed
        page.on(
            "console",
            lambda message: message.type == "error"
            and not message.text.startswith("Failed to load resource")
            and self.console_errors.append(message.text),
        )
        page.on("pageerror", lambda error: self.page_errors.append(str(error)))
        # runs before the page's own script, outside its policy (DevTools), to record the policy's violations
        page.add_init_script(
            "window.__violations = [];"
            "document.addEventListener('securitypolicyviolation',"
            " (e) => window.__violations.push(e.violatedDirective + ' ' + e.blockedURI));"
        )

    def assert_clean(self, expected_failures: set[tuple[str, int]] = frozenset()) -> None:
        assert self.urls, "the page made no request"
        foreign = [url for url in self.urls if not url.startswith(self.origin + "/")]
        assert foreign == [], f"requests to another host: {foreign}"
        assert set(self.failed) <= expected_failures, self.failed
        assert self.page_errors == [] and self.console_errors == []
        assert self.page.evaluate("() => window.__violations") == []


def open_page(browser, server, **context) -> Watched:
    options = {"viewport": {"width": 1280, "height": 1000}, **context}
    page = browser.new_context(**options).new_page()
    page.set_default_timeout(WAIT_MS)
    watched = Watched(page, server.url)
    page.goto(server.url + "/")
    return watched


def wait_for(page, condition: str, arg=None) -> None:
    """A JavaScript function of the page (``() => ...``), polled until it is true. The function form, not an
    expression: the page's policy forbids eval, which Playwright uses for expressions."""
    page.wait_for_function(condition, arg=arg, timeout=WAIT_MS)


def enter_key(page, key: str) -> None:
    page.fill("#api-key", key)
    page.press("#api-key", "Tab")  # the change event, as a person leaving the field


def set_fields(page, **values) -> None:
    for name, value in values.items():
        page.fill(f"#{name}", str(value))


def generate(page) -> None:
    page.click("#send")
    wait_for(page, "() => ['done', 'error'].includes(document.querySelector('#answer').dataset.state)")
    assert page.get_attribute("#answer", "data-state") == "done", page.inner_text("#error")


def page_tokens(page, choice: int = 0) -> list[tuple[str, str]]:
    return page.eval_on_selector_all(
        f".choice[data-index='{choice}'] .tok", "spans => spans.map((s) => [s.textContent, s.dataset.logprob])"
    )


def shown_details(page) -> dict:
    """What the token details panel shows now: the token's logprob and the alternatives' rows."""
    return page.evaluate(
        """() => {
            const info = document.querySelector('#token-info');
            const numbers = info.querySelector('.numbers');
            return {
                i: info.dataset.i,
                logprob: numbers ? numbers.dataset.logprob : null,
                text: info.innerText,
                rows: [...info.querySelectorAll('tbody tr')].map((r) => [r.dataset.token, Number(r.dataset.logprob)]),
            };
        }"""
    )


# the page's first call, before the key is typed: its answer (401) is how the page learns it needs one
NO_KEY_YET = frozenset({("/v1/models", 401)})


@pytest.fixture()
def page(browser, server):
    watched = open_page(browser, server)
    enter_key(watched.page, KEY)
    wait_for(watched.page, "() => document.querySelector('#model').value !== ''")
    yield watched
    watched.page.context.close()


def test_a_greedy_completion_shows_the_apis_text_and_logprobs(page, server, shots):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 5}
    api = requests.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=600).json()["choices"][0]
    p = page.page
    assert p.input_value("#model") == MODEL
    p.fill("#prompt", PROMPT)
    set_fields(p, max_tokens=12, temperature=0, top_k_alts=5)
    p.uncheck("#stream")
    generate(p)

    assert p.inner_text(".choice[data-index='0'] .text") == api["text"]
    shown = page_tokens(p)
    assert [text for text, _ in shown] == api["logprobs"]["tokens"]
    assert [float(logprob) for _, logprob in shown] == api["logprobs"]["token_logprobs"]  # exact, not rounded
    assert p.get_attribute(".choice[data-index='0']", "data-finish") == "length"
    for key in ("queue_ms", "prefill_ms", "decode_ms", "tokens_per_second", "usage", "speculative"):
        assert p.inner_text(f"#timing dd[data-key='{key}']") != "–", key

    # the keyboard: Tab reaches the answer's one tab stop, the arrow keys walk the tokens
    p.focus("#send")
    p.keyboard.press("Tab")  # the Stop button is disabled: the next stop is the first token
    assert p.evaluate("() => document.activeElement.dataset.i") == "0"
    for i, logprob in enumerate(api["logprobs"]["token_logprobs"]):
        if i:
            p.keyboard.press("ArrowRight")
        details = shown_details(p)
        assert details["i"] == str(i)
        assert float(details["logprob"]) == logprob
        assert f"logprob {logprob:.4f}" in details["text"]
        top = api["logprobs"]["top_logprobs"][i]
        assert len(details["rows"]) == len(top) and dict(map(tuple, details["rows"])) == top
        assert details["rows"] == sorted(details["rows"], key=lambda r: -r[1])  # most likely first
    p.keyboard.press("Home")
    assert shown_details(p)["i"] == "0"
    # pointing opens the same details
    p.hover(".tok[data-i='3']")
    assert shown_details(p)["i"] == "3"
    p.focus(".tok[data-i='1']")
    p.screenshot(path=str(shots / "completion.png"), full_page=True)
    page.assert_clean(NO_KEY_YET)


def test_a_stream_renders_while_it_is_generated(page, server, steps, shots):
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 24,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 3,
    }
    api = requests.post(server.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=600).json()
    expected = api["choices"][0]["logprobs"]["content"]
    p = page.page
    p.check("input[name=mode][value=chat]")
    p.fill("#messages .content", MESSAGES[0]["content"])
    set_fields(p, max_tokens=24, temperature=0, top_k_alts=3)
    assert p.is_checked("#stream")
    boxes = {name: p.locator(name).bounding_box() for name in ("#token-info", "#timing", "#live")}
    p.evaluate(
        """() => {
            window.__states = [];
            const record = () => window.__states.push([
                document.querySelectorAll(".choice[data-index='0'] .tok").length,
                document.querySelector('#answer').dataset.state,
            ]);
            new MutationObserver(record).observe(document.querySelector('#output'), {childList: true, subtree: true});
        }"""
    )
    steps.hold()
    p.click("#send")
    # one decode step: the iteration that ends the prompt's prefill lets its tokens out, the next step waits, and the
    # page shows them with the stream still open
    steps.permit()
    wait_for(p, "() => document.querySelectorAll(\".choice[data-index='0'] .tok\").length > 0")
    first = page_tokens(p)
    assert p.get_attribute("#answer", "data-state") == "streaming"
    assert 0 < len(first) < len(expected)
    assert [(t, float(lp)) for t, lp in first] == [(e["token"], e["logprob"]) for e in expected[: len(first)]]
    p.screenshot(path=str(shots / "stream.png"), full_page=True)
    steps.release()
    wait_for(p, "() => document.querySelector('#answer').dataset.state !== 'streaming'")
    assert p.get_attribute("#answer", "data-state") == "done", p.inner_text("#error")

    shown = page_tokens(p)
    assert [(t, float(lp)) for t, lp in shown] == [(e["token"], e["logprob"]) for e in expected]
    assert p.inner_text(".choice[data-index='0'] .text") == api["choices"][0]["message"]["content"]
    states = p.evaluate("() => window.__states")
    counts = [count for count, _ in states]
    assert counts == sorted(counts)  # tokens are only ever added
    assert any(0 < count < len(expected) and state == "streaming" for count, state in states)
    assert counts[-1] == len(expected)
    # nothing below the answer moved while it grew
    assert {name: p.locator(name).bounding_box() for name in boxes} == boxes
    assert p.inner_text("#timing dd[data-key='usage']") == f"{api['usage']['prompt_tokens']} / {len(expected)}"
    page.assert_clean(NO_KEY_YET)


def test_the_live_view_moves_while_requests_run(page, server, steps, shots):
    p = page.page
    p.select_option("#live-window", "60")  # the last minute: the charts' x axis
    wait_for(p, "() => Number(document.querySelector('#charts').dataset.polls || 0) >= 2")
    running = "() => Number(document.querySelector(\"[data-metric='running']\").dataset.value || 0)"
    assert p.evaluate(running) == 0
    line_before = p.get_attribute("[data-metric='running'] path.line", "d")
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
    answers: list[int] = []

    def one():
        answers.append(requests.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=600).status_code)

    threads = [threading.Thread(target=one) for _ in range(3)]
    steps.hold()
    for thread in threads:
        thread.start()
    try:
        # held in their decode steps, the three requests show up as running (or waiting)
        wait_for(
            p,
            "() => ['running', 'waiting'].reduce((sum, m) =>"
            " sum + Number(document.querySelector(`[data-metric='${m}']`).dataset.value || 0), 0) === 3",
        )
        assert p.evaluate(running) >= 1
        assert float(p.get_attribute("[data-metric='kv']", "data-value")) > 0
        assert p.get_attribute("[data-metric='running'] path.line", "d") != line_before
    finally:
        steps.release()
        for thread in threads:
            thread.join()
    assert answers == [200, 200, 200]
    # once they are done: tokens/s, time to first token and inter-token latency have values, nothing runs
    wait_for(
        p,
        "() => ['tps', 'ttft', 'itl'].every((m) =>"
        " Number(document.querySelector(`[data-metric='${m}']`).dataset.max) > 0)"
        " && Number(document.querySelector(\"[data-metric='running']\").dataset.value) === 0",
    )
    p.evaluate("() => document.activeElement.blur()")
    p.locator("#live").screenshot(path=str(shots / "live.png"))
    page.assert_clean(NO_KEY_YET)


def test_a_wrong_key_shows_the_401_message(browser, server, shots):
    api = requests.post(
        server.url + "/v1/completions", json={"prompt": PROMPT}, headers={"Authorization": "Bearer wrong"}, timeout=60
    )
    assert api.status_code == 401
    message = api.json()["error"]["message"]
    watched = open_page(browser, server)
    p = watched.page
    try:
        enter_key(p, "wrong")
        wait_for(p, "() => document.querySelector('#models-status').textContent.includes('401')")
        assert message in p.inner_text("#models-status")
        p.click("#send")
        wait_for(p, "() => document.querySelector('#answer').dataset.state === 'error'")
        error = p.inner_text("#error")
        assert error.startswith("401") and message in error and "invalid_api_key" in error
        assert p.evaluate("() => sessionStorage.getItem('saker.apiKey')") == "wrong"
        assert p.evaluate("() => localStorage.length") == 0 and p.context.cookies() == []
        p.screenshot(path=str(shots / "wrong-key.png"))
        # the right key, and the same page works; "Forget key" leaves nothing behind
        enter_key(p, KEY)
        wait_for(p, "() => document.querySelector('#model').value !== ''")
        p.click("#forget-key")
        assert p.evaluate("() => sessionStorage.length") == 0 and p.input_value("#api-key") == ""
        watched.assert_clean({("/v1/models", 401), ("/v1/completions", 401)})
    finally:
        p.context.close()


def test_echo_scoring_on_a_phone(browser, server, shots):
    """A phone's screen: nothing wider than it; echo colours the prompt's tokens too (the first has no logprob)."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 2, "echo": True}
    api = requests.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=600).json()
    watched = open_page(
        browser, server, viewport={"width": 390, "height": 844}, device_scale_factor=2, is_mobile=True, has_touch=True
    )
    p = watched.page
    try:
        enter_key(p, KEY)
        wait_for(p, "() => document.querySelector('#model').value !== ''")
        p.fill("#prompt", PROMPT)
        p.check("#echo")
        set_fields(p, max_tokens=4, temperature=0, top_k_alts=2)
        generate(p)
        shown = page_tokens(p)
        logprobs = api["choices"][0]["logprobs"]
        assert [t for t, _ in shown] == logprobs["tokens"]
        assert [None if lp == "" else float(lp) for _, lp in shown] == logprobs["token_logprobs"]
        prompt_tokens = p.eval_on_selector_all(".tok.prompt[data-i]", "spans => spans.length")
        assert prompt_tokens == api["usage"]["prompt_tokens"]
        assert p.get_attribute(".tok[data-i='0']", "class").split()[1] == "pnull"
        assert p.evaluate("() => document.documentElement.scrollWidth <= window.innerWidth")
        p.tap(".tok[data-i='2']")
        assert shown_details(p)["i"] == "2"
        p.locator("#answer").scroll_into_view_if_needed()
        p.screenshot(path=str(shots / "phone.png"))
        watched.assert_clean(NO_KEY_YET)
    finally:
        p.context.close()
