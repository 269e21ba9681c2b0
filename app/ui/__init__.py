"""The web page at ``/`` (``SAKER_UI``, on by default): a playground whose tokens are coloured by their probability,
and a live view of ``/metrics``.

Static files under ``/ui/`` (``index.html``, ``ui.js``, ``ui.css`` and ``icon.svg`` in ``app/ui/static/``), plain
HTML, CSS and JavaScript with nothing fetched from another host. The page is sent with a strict
``Content-Security-Policy`` (no inline script or style, connections to this origin only), so it also works behind a
proxy that enforces one. It
holds no secret and needs no API key: with keys configured the page asks the user for one, keeps it in the tab's
``sessionStorage`` and sends it on the API calls it makes (``/v1/*``, ``/metrics``), which ``app/auth.py`` guards as
for any other client. Relative URLs throughout, so the page also works under a path prefix (``SAKER_PROXY_HOPS``
with ``X-Forwarded-Prefix``).
"""

from __future__ import annotations

from pathlib import Path

from flask import Blueprint, Flask, Response, send_from_directory

STATIC = Path(__file__).resolve().parent / "static"

# Everything from this origin only; no inline script or style (the page has none), no frames, no plugins, no forms
# posted anywhere. 'self' in connect-src covers fetch() of the API and of /metrics.
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)

bp = Blueprint("ui", __name__, static_folder=str(STATIC), static_url_path="/ui")


@bp.get("/")
def page() -> Response:
    response = send_from_directory(STATIC, "index.html", max_age=0)
    response.headers["Cache-Control"] = "no-cache"
    return response


@bp.after_request
def _headers(response: Response) -> Response:
    """The page's own routes (``/`` and ``/ui/...``): the policy above and no sniffing; API answers are untouched."""
    response.headers["Content-Security-Policy"] = CONTENT_SECURITY_POLICY
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Referrer-Policy"] = "no-referrer"
    return response


def install_ui(app: Flask) -> None:
    """Register the page (``/`` and ``/ui/<file>``)."""
    app.register_blueprint(bp)
