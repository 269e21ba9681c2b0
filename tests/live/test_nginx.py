"""deploy/nginx/saker.conf in front of a real gunicorn, both on 127.0.0.1: a completion, a stream (unbuffered
SSE), X-Forwarded-For reaching the access log through ProxyFix, JSON errors from nginx itself."""

from __future__ import annotations

import json
import re

import pytest
import requests

from tooling.sse import read_stream
from servers import ROOT, Gunicorn, Nginx, nginx_binary

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        nginx_binary() is None,
        reason="nginx is not installed (apt-get install nginx; .ci/run installs it when it runs as root)",
    ),
]

SITE = ROOT / "deploy" / "nginx" / "saker.conf"
BODY = {"model": "tiny-gpt2", "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def stack(gpt2_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("nginx")
    access_log = root / "saker-access.log"
    # two trusted hops: a load balancer in front of nginx (the test client plays it) and nginx itself
    app = Gunicorn(
        {
            "SAKER_MODEL": str(gpt2_dir),
            "SAKER_SERVED_MODEL_NAME": "tiny-gpt2",
            "SAKER_THREADS": "8",
            "SAKER_PROXY_HOPS": "2",
            "SAKER_ACCESS_LOG": str(access_log),
        }
    )
    proxy = None
    try:
        app.wait_ready()
        proxy = Nginx(root / "nginx", f"127.0.0.1:{app.port}")
        proxy.wait_ready()
        yield app, proxy, access_log
    finally:
        if proxy is not None:
            proxy.stop()
        app.stop()


def access_lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_config_passes_nginx_t(stack):
    _, proxy, _ = stack
    result = proxy.check_config()
    assert result.returncode == 0, result.stderr
    assert "syntax is ok" in result.stderr


def test_completion_through_nginx_equals_direct(stack):
    app, proxy, _ = stack
    direct = requests.post(app.url + "/v1/completions", json=BODY, timeout=60)
    proxied = requests.post(proxy.url + "/v1/completions", json=BODY, timeout=60)
    assert proxied.status_code == 200, proxied.text
    assert proxied.headers["Server"].startswith("nginx")
    assert proxied.json()["choices"][0]["text"] == direct.json()["choices"][0]["text"]
    assert float(proxied.headers["X-Saker-Decode-Ms"]) >= 0
    assert requests.get(proxy.url + "/health", timeout=10).json() == {"status": "ok"}


def test_stream_through_nginx(stack):
    app, proxy, _ = stack
    plain = requests.post(app.url + "/v1/completions", json=BODY, timeout=60).json()["choices"][0]["text"]
    with requests.post(proxy.url + "/v1/completions", json={**BODY, "stream": True}, stream=True, timeout=60) as resp:
        assert resp.status_code == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        assert "Content-Length" not in resp.headers  # passed on as it comes, not buffered whole
        assert resp.headers.get("Transfer-Encoding") == "chunked"
        stream = read_stream(resp.iter_content(None))
    assert stream.done
    chunks = stream.chunks
    assert len(chunks) > 1 and all("error" not in c for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == plain


def test_chat_route_is_unbuffered_too():
    conf = SITE.read_text()
    block = re.search(r"location ~ \^/v1/\(chat/\)\?completions\$ \{(.*?)\}", conf, re.S)
    assert block, "the completions location is missing"
    for directive in ("proxy_buffering off;", "proxy_cache off;", "gzip off;", "proxy_read_timeout"):
        assert directive in block.group(1), directive
    assert re.fullmatch(r"^/v1/(chat/)?completions$", "/v1/chat/completions")


def test_forwarded_for_and_request_id_reach_the_access_log(stack):
    _, proxy, access_log = stack
    resp = requests.post(
        proxy.url + "/v1/completions",
        json=BODY,
        timeout=60,
        headers={"X-Forwarded-For": "198.51.100.7", "X-Request-ID": "via-nginx-1"},
    )
    assert resp.status_code == 200 and resp.headers["X-Request-ID"] == "via-nginx-1"
    line = next(x for x in access_lines(access_log) if x["request_id"] == "via-nginx-1")
    assert line["client"] == "198.51.100.7"
    assert line["route"] == "/v1/completions" and line["status"] == 200 and line["completion_tokens"] == 12
    # nginx makes a request id when the client sends none; saker keeps it
    resp = requests.get(proxy.url + "/health", timeout=10)
    generated = resp.headers["X-Request-ID"]
    assert re.fullmatch(r"[0-9a-f]{32}", generated)
    assert any(x["request_id"] == generated for x in access_lines(access_log))


def test_errors_from_nginx_are_openai_json(stack):
    _, proxy, _ = stack
    too_big = requests.post(
        proxy.url + "/v1/completions",
        data=b"x" * (5 * 1024 * 1024),
        headers={"Content-Type": "application/json"},
        timeout=60,
    )
    assert too_big.status_code == 413
    assert too_big.json()["error"]["code"] == "request_too_large"
    bad = requests.post(proxy.url + "/v1/completions", json={**BODY, "temperature": 9}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"
