"""The web page at / (app/ui/, SAKER_UI) through the Flask test client: served without a key under a strict
Content-Security-Policy, off with ui=false, its files self-contained, and the routes and metric names its
script uses present in the app. The page in a real browser: tests/live/test_page.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import make_settings

STATIC = Path(__file__).resolve().parents[2] / "app" / "ui" / "static"
FILES = {"index.html": "text/html", "ui.js": "text/javascript", "ui.css": "text/css", "icon.svg": "image/svg+xml"}


def make_app(worker, **values):
    from app import create_app

    values.setdefault("model", "unused")
    values.setdefault("served_model_name", "tiny-gpt2")
    values.setdefault("access_log", "off")
    app = create_app(make_settings(**values), worker=worker)
    app.config["TESTING"] = True
    return app


@pytest.fixture(scope="module")
def keyed(gpt2_worker):
    return make_app(gpt2_worker, api_keys="secret-key-1").test_client()


def test_the_page_needs_no_key_and_holds_none(keyed):
    page = keyed.get("/", buffered=True)
    assert page.status_code == 200 and page.mimetype == "text/html"
    assert "secret-key-1" not in page.get_data(as_text=True)
    policy = page.headers["Content-Security-Policy"]
    for directive in ("default-src 'none'", "script-src 'self'", "style-src 'self'", "connect-src 'self'"):
        assert directive in policy
    assert "unsafe" not in policy and "http" not in policy
    assert page.headers["X-Content-Type-Options"] == "nosniff"
    for name, mimetype in FILES.items():
        response = keyed.get(f"/ui/{name}", buffered=True)
        assert response.status_code == 200, name
        assert response.mimetype == mimetype, name
        assert response.headers["Content-Security-Policy"] == policy
    # the API the page calls still wants the key
    assert keyed.get("/v1/models", buffered=True).status_code == 401
    assert keyed.get("/v1/models", headers={"Authorization": "Bearer secret-key-1"}, buffered=True).status_code == 200
    # API answers are not given the page's headers
    assert "Content-Security-Policy" not in keyed.get("/health", buffered=True).headers


def test_ui_false_leaves_no_page(gpt2_worker):
    client = make_app(gpt2_worker, ui=False).test_client()
    for path in ("/", "/ui/ui.js", "/ui/index.html"):
        response = client.get(path, buffered=True)
        assert response.status_code == 404, path
        assert response.get_json()["error"]["message"].startswith("Unknown route"), path


def test_a_missing_file_is_a_json_404(keyed):
    response = keyed.get("/ui/nope.js", buffered=True)
    assert response.status_code == 404
    assert "message" in response.get_json()["error"]


def test_the_files_fetch_nothing_from_another_host():
    """No URL of another host (the SVG namespace is a name, never fetched), no inline script, style or handler:
    the strict policy would block them."""
    for name in FILES:
        text = (STATIC / name).read_text()
        urls = set(re.findall(r"(?:https?:)?//[A-Za-z0-9.-]+\.[A-Za-z]{2,}[^\s\"')]*", text))
        assert urls <= {"http://www.w3.org/2000/svg"}, (name, urls)
        assert "@import" not in text and "url(" not in text, name
    assert sorted(p.name for p in STATIC.iterdir()) == sorted(FILES)
    html = (STATIC / "index.html").read_text()
    assert re.findall(r"<script\b[^>]*>", html) == ['<script src="ui/ui.js" defer>']
    assert "<style" not in html and not re.search(r"\sstyle=", html) and not re.search(r"\son[a-z]+=", html)
    for ref in re.findall(r'(?:src|href)="([^"#]+)"', html):
        assert ref.startswith("ui/") and (STATIC / ref.removeprefix("ui/")).is_file(), ref
    script = (STATIC / "ui.js").read_text()
    assert "eval(" not in script and "new Function" not in script and ".style." not in script


def test_the_routes_and_metrics_the_script_reads_exist(keyed):
    """A renamed route or metric breaks this test, not only the page."""
    script = (STATIC / "ui.js").read_text()
    paths = set(re.findall(r'"((?:v1/[a-z/]+)|metrics)"', script))
    assert paths == {"v1/models", "v1/completions", "v1/chat/completions", "metrics"}
    rules = {rule.rule for rule in keyed.application.url_map.iter_rules()}
    assert {"/" + path for path in paths} <= rules
    exposition = keyed.get("/metrics", buffered=True).get_data(as_text=True)
    names = set(re.findall(r"saker_[a-z_]+", script))
    assert len(names) >= 6
    for name in names:
        assert re.search(rf"^{name}(_count|_sum)?[ {{]", exposition, re.M), name
