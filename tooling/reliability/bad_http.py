"""The bad-input corpus, part two: HTTP itself (content types and encodings, bombs, chunked bodies, bodies
shorter or longer than announced, protocol errors gunicorn answers itself, routes and methods)."""

from __future__ import annotations

import gzip
import json
import os
import zlib

from tooling.reliability.bad_bodies import Case
from tooling.reliability.wire import build


def http_cases(model: str) -> list[Case]:
    """Malformed requests at the HTTP level (each a Case of raw bytes)."""
    cases: list[Case] = []
    ct = {"Content-Type": "application/json"}
    payload = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 2}).encode()
    # -- HTTP: content types and encodings ------------------------------------------------------------------
    for name, ctype in [
        ("text-plain", "text/plain"),
        ("form", "application/x-www-form-urlencoded"),
        ("multipart", "multipart/form-data; boundary=x"),
        ("xml", "application/xml"),
        ("latin1-charset", "application/json; charset=latin-1"),
        ("garbage", "\x7f/\x01"),
    ]:
        cases.append(
            Case(
                f"http.content-type.{name}",
                "HTTP bodies",
                build("POST", "/v1/completions", payload, {"Content-Type": ctype}),
            )
        )
    limit = 4 * 2**20
    bombs = {
        "gzip-bomb-64MiB": ("gzip", gzip.compress(b" " * (64 * 2**20) + payload, 9)),
        "gzip-bomb-just-over": ("gzip", gzip.compress(b" " * (limit + 1) + payload, 9)),
        "deflate-bomb": ("deflate", zlib.compress(b" " * (64 * 2**20) + payload, 9)),
        "gzip-nested": ("gzip", gzip.compress(gzip.compress(b" " * (16 * 2**20) + payload, 9), 9)),
        "gzip-twice-declared": ("gzip, gzip", gzip.compress(gzip.compress(payload))),
        "gzip-invalid": ("gzip", b"\x1f\x8b not gzip at all"),
        "gzip-truncated": ("gzip", gzip.compress(payload)[:-12]),
        "gzip-empty": ("gzip", b""),
        "deflate-raw": ("deflate", zlib.compress(payload)[2:-4]),
        "br": ("br", payload),
        "compress": ("compress", payload),
        "zstd": ("zstd", payload),
        "identity-garbage": ("identity, gzip", payload),
        "encoding-nonascii": ("gzip\xff", payload),
    }
    for name, (encoding, body) in bombs.items():
        cases.append(
            Case(
                f"http.encoding.{name}",
                "HTTP bodies",
                build("POST", "/v1/completions", body, {**ct, "Content-Encoding": encoding}),
            )
        )
    head_chunked = build("POST", "/v1/completions", None, {**ct, "Transfer-Encoding": "chunked"})
    small = payload
    chunked = {
        "not-hex": [b"ZZ\r\nabc\r\n0\r\n\r\n"],
        "negative": [b"-1\r\nabc\r\n0\r\n\r\n"],
        "short-chunk": [b"10\r\nabc\r\n0\r\n\r\n"],
        "huge-size": [b"ffffffffffffffffffff\r\nabc\r\n0\r\n\r\n"],
        "no-crlf-after-data": [b"%x\r\n%s0\r\n\r\n" % (len(small), small)],
        "extension": [b"%x;name=value\r\n%s\r\n0\r\n\r\n" % (len(small), small)],
        "trailer": [b"%x\r\n%s\r\n0\r\nX-Trailer: 1\r\n\r\n" % (len(small), small)],
        "no-final-chunk": [b"%x\r\n%s\r\n" % (len(small), small)],
        "bare-lf": [b"%x\n%s\n0\n\n" % (len(small), small)],
        "over-limit": [b"%x\r\n%s\r\n" % (65536, b" " * 65536)] * (limit // 65536 + 2),
    }
    for name, parts in chunked.items():
        cases.append(
            Case(
                f"http.chunked.{name}",
                "HTTP bodies",
                [head_chunked, *parts],
                shut=True,
                may_close=name in ("no-final-chunk",),
            )
        )
    cases.append(
        Case(
            "http.gzip-chunked-bomb",
            "HTTP bodies",
            [
                build(
                    "POST", "/v1/completions", None, {**ct, "Transfer-Encoding": "chunked", "Content-Encoding": "gzip"}
                ),
                *(b"%x\r\n%s\r\n" % (len(p), p) for p in [gzip.compress(b" " * (32 * 2**20) + payload, 9)]),
                b"0\r\n\r\n",
            ],
        )
    )
    # body shorter than announced, then the client half-closes: nothing to answer (the client is gone)
    cases.append(
        Case(
            "http.body-shorter-than-length",
            "HTTP bodies",
            build("POST", "/v1/completions", None, {**ct, "Content-Length": "100"}) + b'{"prompt"',
            shut=True,
            may_close=True,
        )
    )
    cases.append(
        Case(
            "http.413-from-content-length",
            "HTTP bodies",
            build("POST", "/v1/completions", None, {**ct, "Content-Length": "100000000"}) + b"{",
        )
    )
    cases.append(
        Case(
            "http.expect-continue-then-silence",
            "HTTP bodies",
            build("POST", "/v1/completions", None, {**ct, "Content-Length": "40", "Expect": "100-continue"}),
            shut=True,
            may_close=True,
        )
    )

    # -- HTTP: protocol errors (gunicorn answers them itself) --------------------------------------------------
    protocol = {
        "http-0.9": b"GET /health\r\n\r\n",
        "http-2.0-version": b"GET /health HTTP/2.0\r\nHost: x\r\n\r\n",
        "http-1.2-version": b"GET /health HTTP/1.2\r\nHost: x\r\n\r\n",
        "version-garbage": b"GET /health HTTP/x.y\r\nHost: x\r\n\r\n",
        "lowercase-method": b"get /health HTTP/1.1\r\nHost: x\r\n\r\n",
        "unknown-method": b"FROB /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        "method-with-nonascii": b"G\xc9T /health HTTP/1.1\r\nHost: x\r\n\r\n",
        "garbage-line": b"GARBAGE\r\n\r\n",
        "empty-line-only": b"\r\n\r\n",
        "tls-client-hello": bytes.fromhex("16030100a5010000a10303") + os.urandom(64),
        "binary": bytes(range(256)),
        "bad-content-length": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
        "negative-content-length": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
        "plus-content-length": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: +5\r\n\r\n{}   ",
        "huge-content-length": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999999999999"
        b"\r\n\r\n{}",
        "two-content-lengths": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3"
        b"\r\n\r\n{}",
        "content-length-list": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2, 2\r\n\r\n{}",
        "cl-and-te": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nTransfer-Encoding: chunked"
        b"\r\n\r\n0\r\n\r\n",
        "te-gzip-chunked": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"
        b"0\r\n\r\n",
        "te-chunked-gzip": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked, gzip\r\n\r\n"
        b"0\r\n\r\n",
        "te-identity": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: identity\r\n\r\n",
        "te-xchunked": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: xchunked\r\n\r\n0\r\n\r\n",
        "te-twice": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: "
        b"chunked\r\n\r\n0\r\n\r\n",
        "te-in-http-1.0": b"POST /v1/completions HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        "long-request-line": b"GET /" + b"a" * 5000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
        "too-many-headers": b"GET /health HTTP/1.1\r\n" + b"".join(b"X-H%d: 1\r\n" % i for i in range(120)) + b"\r\n",
        "header-too-large": b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n",
        "headers-64KiB": b"GET /health HTTP/1.1\r\n"
        + b"".join(b"X-H%d: %s\r\n" % (i, b"a" * 8000) for i in range(8))
        + b"\r\n",
        "header-no-colon": b"GET /health HTTP/1.1\r\nHost: x\r\nNoColonHere\r\n\r\n",
        "header-name-space": b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header: 1\r\n\r\n",
        "header-obs-fold": b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\r\n b\r\n\r\n",
        "header-nul": b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n",
        "header-nonascii": b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: \xff\xfe\r\nConnection: close\r\n\r\n",
        "header-bare-lf": b"GET /health HTTP/1.1\nHost: x\n\n",
        "header-bare-cr": b"GET /health HTTP/1.1\rHost: x\r\r\n\r\n",
        "absolute-uri": b"GET http://127.0.0.1/health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        "path-bad-percent": b"GET /health?%zz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        "path-nul": b"GET /v1/models/%00 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        "path-dotdot": b"GET /v1/../../etc/passwd HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        "path-no-slash": b"GET health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        "path-star": b"OPTIONS * HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        "path-nonascii": b"GET /v1/models/\xff\xfe HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        "path-long-model-id": b"GET /v1/models/" + b"m" * 4000 + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        "no-host-1.1": b"GET /health HTTP/1.1\r\nConnection: close\r\n\r\n",
        "expect-unknown": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: teapot\r\nContent-Type: "
        b"application/json\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}",
        "smuggle-cl-te": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 6\r\nTransfer-Encoding: "
        b"chunked\r\n\r\n0\r\n\r\nG",
        "smuggle-te-space": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding : chunked\r\n\r\n0\r\n\r\n",
        "pipelined-bad-then-good": b"GARBAGE\r\n\r\nGET /health HTTP/1.1\r\nHost: x\r\n\r\n",
        "proxy-protocol": b"PROXY TCP4 1.2.3.4 5.6.7.8 1 2\r\nGET /health HTTP/1.1\r\nHost: x\r\n\r\n",
        "h2-preface": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    }
    # The client half-closes after each: a head that can never complete (no CRLF CRLF: binary, TLS, bare LFs) is
    # then dropped without an answer (kept open instead, it would be answered 408 after 10 s).
    never_complete = ("empty-line-only", "h2-preface", "tls-client-hello", "binary", "header-bare-lf")
    for name, data in protocol.items():
        cases.append(
            Case(
                f"protocol.{name}",
                "protocol",
                data,
                shut=True,
                timeout=30,
                may_close=name in never_complete,
                allowed=(501,) if name == "te-xchunked" else (),
            )
        )

    # -- routes and methods -----------------------------------------------------------------------------------
    for method, path in [
        ("GET", "/v1/completions"),
        ("PUT", "/v1/completions"),
        ("DELETE", "/v1/completions"),
        ("PATCH", "/v1/chat/completions"),
        ("POST", "/health"),
        ("POST", "/v1/models"),
        ("GET", "/nope"),
        ("GET", "/v1"),
        ("GET", "/v1/models/no-such-model"),
        ("TRACE", "/v1/completions"),
        ("OPTIONS", "/v1/completions"),
        ("CONNECT", "127.0.0.1:80"),
    ]:
        cases.append(Case(f"route.{method} {path}", "routes", build(method, path, None)))
    return cases
