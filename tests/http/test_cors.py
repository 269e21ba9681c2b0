"""CORS (SAKER_CORS_ORIGINS, flask-cors): closed by default; with an origin allowed, a browser's preflight is
answered without an API key, and answers (errors too) carry the origin and expose saker's headers."""

from __future__ import annotations

from conftest import make_settings

ORIGIN = "https://app.example.com"
PREFLIGHT = {
    "Origin": ORIGIN,
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type",
}
BODY = {"model": "tiny-gpt2", "prompt": "Hi", "max_tokens": 1}


def client_for(gpt2_dir, gpt2_worker, **settings):
    from app import create_app

    return create_app(
        make_settings(model=str(gpt2_dir), served_model_name="tiny-gpt2", **settings), worker=gpt2_worker
    ).test_client()


def test_closed_by_default(gpt2_client):
    resp = gpt2_client.options("/v1/completions", headers=PREFLIGHT)
    assert not any(h.lower().startswith("access-control-") for h in resp.headers.keys())
    post = gpt2_client.post("/v1/completions", json=BODY, headers={"Origin": ORIGIN})
    assert post.status_code == 200 and "Access-Control-Allow-Origin" not in post.headers


def test_an_allowed_origin(gpt2_dir, gpt2_worker):
    client = client_for(gpt2_dir, gpt2_worker, cors_origins=f"{ORIGIN}, http://localhost:3000", api_keys="cors-key")
    pre = client.options("/v1/completions", headers=PREFLIGHT)
    assert pre.status_code == 200, pre.get_data(as_text=True)
    assert pre.headers["Access-Control-Allow-Origin"] == ORIGIN
    assert "POST" in pre.headers["Access-Control-Allow-Methods"]
    assert "authorization" in pre.headers["Access-Control-Allow-Headers"].lower()
    assert pre.headers["Access-Control-Max-Age"] == "600"
    ok = client.post("/v1/completions", json=BODY, headers={"Origin": ORIGIN, "Authorization": "Bearer cors-key"})
    assert ok.status_code == 200 and ok.headers["Access-Control-Allow-Origin"] == ORIGIN
    exposed = ok.headers["Access-Control-Expose-Headers"]
    assert "X-Request-ID" in exposed and "X-Saker-Decode-Ms" in exposed
    denied = client.post("/v1/completions", json=BODY, headers={"Origin": ORIGIN})
    assert denied.status_code == 401 and denied.headers["Access-Control-Allow-Origin"] == ORIGIN
    other = client.options("/v1/completions", headers={**PREFLIGHT, "Origin": "https://evil.example"})
    assert "Access-Control-Allow-Origin" not in other.headers
    plain_options = client.options("/v1/completions")  # not a preflight: the key is still required
    assert plain_options.status_code == 401


def test_any_origin(gpt2_dir, gpt2_worker):
    client = client_for(gpt2_dir, gpt2_worker, cors_origins="*")
    pre = client.options("/v1/chat/completions", headers={**PREFLIGHT, "Origin": "http://localhost:5173"})
    assert pre.headers["Access-Control-Allow-Origin"] in ("*", "http://localhost:5173")
